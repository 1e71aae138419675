"""A worker's SLO series: jobs started (and within their tier's SLO), time per output
token, end-to-end latency. The worker calls these at three points of a run; what they
count is decided here.

SLO attainment is judged on the job's row, exactly as the database has it: a job counts
once, at the run whose claim set its `started_at` (its first delivery), as started within
its tier's SLO when `started_at - created_at` is at most the tier's SLO
(`Settings.tier_slo_s`). So the counters agree with the job rows they summarise.
"""

from __future__ import annotations

from tierq.core import clock, metrics
from tierq.core.settings import Settings
from tierq.core.tiers import Tier
from tierq.models.records import JobRecord


def started_within_slo(settings: Settings, job: JobRecord) -> bool | None:
    """Whether the job started within its tier's SLO; None when it has not started."""
    if job.started_at is None:
        return None
    waited = (job.started_at - job.created_at).total_seconds()
    return waited <= settings.tier_slo_s[job.tier.value]


def count_start(settings: Settings, job: JobRecord) -> None:
    """A run claimed the job: count its start if this claim was its first."""
    if job.deliveries != 1:
        return  # a re-run: the job started before, and was counted then
    within = started_within_slo(settings, job)
    if within is None:
        return
    metrics.JOBS_STARTED.labels(job.tier.value).inc()
    if within:
        metrics.JOBS_STARTED_WITHIN_SLO.labels(job.tier.value).inc()


def count_end(
    tier: Tier,
    enqueued_at: float,
    first_token_at: float | None,
    run_tokens: int,
    now: float | None = None,
) -> None:
    """A run ended the job (succeeded or failed): its end-to-end latency from admission,
    and, when it generated more than one token, its time per output token after the
    first (`run_tokens`: the tokens this run generated)."""
    now = clock.now() if now is None else now
    metrics.END_TO_END.labels(tier.value).observe(max(0.0, now - enqueued_at))
    if first_token_at is not None and run_tokens > 1:
        per_token = max(0.0, now - first_token_at) / (run_tokens - 1)
        metrics.TIME_PER_OUTPUT_TOKEN.labels(tier.value).observe(per_token)
