"""The job store in this process's memory: the rules of `SqlJobStore` over dicts, for tests
that exercise a worker's or a service's logic and not a database. Nothing is kept past the
process, and nothing is shared with another one.

Each method changes the store without awaiting in between, so on one event loop it is as
atomic as a transaction is on the database.

Admission needs what the database holds beside jobs: tenants and their keys, quotas and
prices. Here they are the store's own, set by its owner (`add_tenant`, `add_key`,
`set_quota`, `set_price` and the like), and the ledger keeps when each row was billed, for
budgets' periods.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from tierq.core import metrics
from tierq.core.ids import new_id
from tierq.core.messages import FAULT_UNIT, output_bound
from tierq.core.states import TERMINAL, JobStatus, TenantStatus, sources_for
from tierq.core.tiers import Tier
from tierq.models import prices
from tierq.models import quotas as quota_repo
from tierq.models.admission import Admission, Answer
from tierq.models.jobs import (
    IdempotencyConflict,
    NewJob,
    dead_letter_message,
    new_record,
    result_values,
)
from tierq.models.prices import cost_of
from tierq.models.quotas import ALL_TIERS, BILLING_GRACE, Figures, QuotaRecord
from tierq.models.records import JobHead, JobRecord, Progress, Result
from tierq.models.spend import period_key
from tierq.models.store.base import Usage
from tierq.models.tables import utcnow


class MemoryJobStore:
    def __init__(self) -> None:
        self._jobs: dict[str, JobRecord] = {}
        self._keys: dict[tuple[str, str], str] = {}  # (tenant, Idempotency-Key) -> job id
        self._history: dict[str, list[tuple[str, str | None]]] = {}
        self._ledger: dict[str, Usage] = {}
        self._billed_at: dict[str, datetime] = {}  # job id -> when its ledger row was written
        self._tenants: dict[str, str] = {}  # id -> status
        self._api_keys: dict[str, tuple[str, bool]] = {}  # id -> (tenant, revoked)
        self._quotas: dict[tuple[str, str], QuotaRecord] = {}  # (tenant, tier or "*")
        self._prices: dict[tuple[str, str], _Price] = {}  # (model, tier)

    # --- what admission reads beside jobs ---------------------------------------------

    def add_tenant(self, tenant_id: str, status: str = TenantStatus.ACTIVE.value) -> str:
        self._tenants[tenant_id] = status
        return tenant_id

    def set_tenant_status(self, tenant_id: str, status: str) -> None:
        self._tenants[tenant_id] = status

    def add_key(self, tenant_id: str) -> str:
        key_id = new_id("key")
        self._api_keys[key_id] = (tenant_id, False)
        return key_id

    def revoke_key(self, key_id: str) -> None:
        tenant_id, _revoked = self._api_keys[key_id]
        self._api_keys[key_id] = (tenant_id, True)

    def set_quota(self, tenant_id: str, tier: str, **limits: Any) -> QuotaRecord:
        """`models.quotas.set_quota`: the limits given replace those of the tenant's quota
        for `tier` ("*": every tier), the others stay."""
        unset = QuotaRecord(tenant_id, tier, None, None, None, None, None, None, "month")
        quota = dataclasses.replace(self._quotas.get((tenant_id, tier), unset), **limits)
        self._quotas[(tenant_id, tier)] = quota
        return quota

    def set_price(
        self, model: str, tier: Tier, input_per_million: Decimal, output_per_million: Decimal
    ) -> None:
        self._prices[(model, tier.value)] = _Price(
            model, tier.value, input_per_million, output_per_million, utcnow()
        )

    # --- admission --------------------------------------------------------------------

    async def admit(self, request: Admission, *, counted: bool) -> Answer:
        """The rule `tierq_admit` states on PostgreSQL, in the same order, over this
        store's dicts (tierq/models/admission.py's `Answer`)."""
        new, now, tier = request.new, request.created_at, request.new.tier.value
        if new.idempotency_key is not None:
            made = self._keys.get((new.tenant_id, new.idempotency_key))
            if made is not None:
                same = self._jobs[made].request_hash == new.request_hash
                return Answer(None, replay=made, same_request=same)
        status = self._tenants.get(new.tenant_id)
        key_ok = True
        if request.key_id is not None:
            key = self._api_keys.get(request.key_id)
            key_ok = key is not None and key == (new.tenant_id, False)
        if status != TenantStatus.ACTIVE.value or not key_ok:
            return Answer(None, tenant_status=status, key_ok=key_ok)
        quotas = sorted(
            (
                q
                for (tenant_id, scope), q in self._quotas.items()
                if tenant_id == new.tenant_id
                and scope in (ALL_TIERS, tier)
                and any(getattr(q, f) is not None for f in quota_repo.ADMISSION_FIELDS)
            ),
            key=lambda q: q.tier,
        )
        if quotas and not counted:
            return Answer(None, tenant_status=status, count_first=True)
        queued = None
        cap = request.default_max_queued
        if quota_repo.default_bound_applies(cap, quotas):
            queued = min(cap, self._figures_of(new.tenant_id, ALL_TIERS, now).queued)
            if queued >= cap:
                return Answer(None, tenant_status=status, queued=queued)
        price = prices.in_force(
            new.model,
            new.tier,
            self._prices.get((new.model, tier)),
            self._prices.get((new.model, Tier.STANDARD.value)),
            request.batch_discount,
        )
        price_in = price.input_per_million if price else Decimal(0)
        price_out = price.output_per_million if price else Decimal(0)
        cost = quota_repo.reservation_cost(
            new.reserved_tokens, output_bound(new.params), price_in, price_out
        )
        checked = []
        for quota in quotas:
            figures = self._figures_of(new.tenant_id, quota.tier, now, quota.budget_period)
            refusal = quota_repo.decide(quota, figures, tier, new.reserved_tokens, cost, now)
            checked.append((quota, figures, refusal is None))
            if refusal is not None:
                return Answer(
                    None, tenant_status=status, queued=queued, quotas=checked, reserved_cost=cost
                )
        priced = dataclasses.replace(new, input_price=price_in, output_price=price_out)
        job = self._insert(priced, request.job_id, now)
        return Answer(job, tenant_status=status, queued=queued, quotas=checked, reserved_cost=cost)

    def _figures_of(
        self, tenant_id: str, scope: str, now: datetime, period: str = "total"
    ) -> Figures:
        """`models.quotas.figures`, every one of them, over the dicts: the tenant's jobs in
        `scope` (a tier, or every tier: "*")."""
        mine = [
            j
            for j in self._jobs.values()
            if j.tenant_id == tenant_id and scope in (ALL_TIERS, j.tier.value)
        ]
        online = [j for j in mine if j.batch_id is None]
        minute = [j for j in online if j.created_at >= now - timedelta(seconds=60)]
        held = [
            j
            for j in mine
            if j.status in (JobStatus.QUEUED, JobStatus.RUNNING)
            or (
                j.status == JobStatus.CANCELLED
                and j.started_at is not None
                and j.prompt_tokens is None
                and j.finished_at is not None
                and j.finished_at > now - BILLING_GRACE
            )
        ]
        period_now = period_key(period, now)
        spent = [
            row
            for row in self._ledger.values()
            if row.tenant_id == tenant_id
            and scope in (ALL_TIERS, self._jobs[row.job_id].tier.value)
            and period_key(period, self._billed_at[row.job_id]) == period_now
        ]
        return Figures(
            minute_requests=len(minute),
            minute_tokens=sum(_minute_tokens(j) for j in minute),
            minute_oldest=min((j.created_at for j in minute), default=None),
            queued=sum(1 for j in online if j.status == JobStatus.QUEUED),
            held_tokens=sum(j.reserved_tokens for j in held),
            held_cost=sum(
                (
                    quota_repo.reservation_cost(
                        j.reserved_tokens, output_bound(j.params), j.input_price, j.output_price
                    )
                    for j in held
                ),
                Decimal(0),
            ),
            spent_tokens=sum(row.prompt_tokens + row.completion_tokens for row in spent),
            spent_cost=sum((row.cost for row in spent), Decimal(0)),
        )

    async def create(self, new: NewJob) -> tuple[JobRecord, bool]:
        if new.idempotency_key is not None:
            found = self._keys.get((new.tenant_id, new.idempotency_key))
            if found is not None:
                existing = self._jobs[found]
                if existing.request_hash != new.request_hash:
                    raise IdempotencyConflict(new.idempotency_key)
                return existing, False
        return self._insert(new, new_id("job"), utcnow()), True

    async def get(self, job_id: str, tenant_id: str | None = None) -> JobRecord | None:
        job = self._jobs.get(job_id)
        if job is None or (tenant_id is not None and job.tenant_id != tenant_id):
            return None
        return job

    async def head(self, job_id: str, tenant_id: str) -> JobHead | None:
        job = await self.get(job_id, tenant_id)
        return None if job is None else JobHead(job.id, job.tenant_id, job.status)

    async def statuses(self, job_ids: Sequence[str]) -> dict[str, JobStatus]:
        return {i: self._jobs[i].status for i in job_ids if i in self._jobs}

    async def unfinished(
        self, older_than: datetime, limit: int = 1000, after: tuple[datetime, str] | None = None
    ) -> list[JobRecord]:
        found = sorted(
            (
                job
                for job in self._jobs.values()
                if job.status in (JobStatus.QUEUED, JobStatus.RUNNING)
                and job.created_at < older_than
                and (after is None or (job.created_at, job.id) > after)
            ),
            key=lambda job: (job.created_at, job.id),
        )
        return found[:limit]

    async def usage(self, job_id: str) -> list[Usage]:
        row = self._ledger.get(job_id)
        return [] if row is None else [row]

    async def transitions(self, job_id: str) -> list[tuple[str, str | None]]:
        return list(self._history.get(job_id, []))

    async def claim(
        self,
        job_id: str,
        worker_id: str,
        max_deliveries: int,
        unsettled_charge: int = FAULT_UNIT,
    ) -> JobRecord | None:
        current = self._jobs.get(job_id)
        if current is None or current.status not in (JobStatus.QUEUED, JobStatus.RUNNING):
            return None
        charge = current.fault_charge
        if current.status == JobStatus.RUNNING:
            charge += max(0, unsettled_charge)
        if charge >= max_deliveries * FAULT_UNIT:
            self._move(
                current,
                JobStatus.FAILED,
                "dead-lettered",
                finished_at=utcnow(),
                fault_charge=charge,
                error_code="max_deliveries_exceeded",
                error_message=dead_letter_message(max_deliveries),
            )
            metrics.DEAD_LETTERS.labels(current.tier.value).inc()
            return None
        return self._move(
            current,
            JobStatus.RUNNING,
            worker_id,
            deliveries=current.deliveries + 1,
            worker_id=worker_id,
            fault_charge=charge,
            started_at=current.started_at or utcnow(),
        )

    async def finish(
        self, job_id: str, result: Result, delivery: int | None = None
    ) -> JobRecord | None:
        job = self._transition(
            job_id,
            JobStatus.SUCCEEDED,
            (JobStatus.RUNNING,),
            delivery=delivery,
            **result_values(result),
        )
        usage = (result.prompt_tokens, result.completion_tokens)
        if job is not None and usage[0] is not None and usage[1] is not None:
            self._bill(job, usage[0], usage[1])
        return job

    async def fail(
        self,
        job_id: str,
        code: str,
        message: str,
        *,
        delivery: int | None = None,
        from_queued: bool = False,
    ) -> JobRecord | None:
        sources = (JobStatus.RUNNING, JobStatus.QUEUED) if from_queued else (JobStatus.RUNNING,)
        return self._transition(
            job_id,
            JobStatus.FAILED,
            sources,
            delivery=delivery,
            finished_at=utcnow(),
            error_code=code,
            error_message=message,
        )

    async def requeue(
        self,
        job_id: str,
        detail: str,
        delivery: int | None = None,
        *,
        preempted: bool = False,
        progress: Progress | None = None,
        charge: int = 0,
    ) -> JobRecord | None:
        current = self._jobs.get(job_id)
        if current is None:
            return None
        values: dict[str, Any] = {}
        if preempted:
            values["preemptions"] = current.preemptions + 1
        if charge > 0:
            values["fault_charge"] = current.fault_charge + charge
        if progress is not None:
            values["progress"] = progress
        return self._transition(
            job_id,
            JobStatus.QUEUED,
            (JobStatus.RUNNING,),
            detail=detail,
            delivery=delivery,
            **values,
        )

    async def cancel(self, job_id: str, tenant_id: str | None = None) -> JobRecord | None:
        current = await self.get(job_id, tenant_id)
        if current is None:
            return None
        return self._cancel(current, "cancelled", "the job was cancelled by its tenant", None)

    async def cancel_all(self, tenant_id: str, code: str, message: str) -> list[JobRecord]:
        mine = sorted(
            (
                j
                for j in self._jobs.values()
                if j.tenant_id == tenant_id and j.status in (JobStatus.QUEUED, JobStatus.RUNNING)
            ),
            key=lambda j: j.id,
        )
        return [job for j in mine if (job := self._cancel(j, code, message, code)) is not None]

    def _cancel(
        self, current: JobRecord, code: str, message: str, detail: str | None
    ) -> JobRecord | None:
        """queued or running -> cancelled; a queued job's kept progress billed (no run
        will bill it now)."""
        kept = current.progress if current.status == JobStatus.QUEUED else None
        job = self._transition(
            current.id,
            JobStatus.CANCELLED,
            (JobStatus.QUEUED, JobStatus.RUNNING),
            detail=detail,
            finished_at=utcnow(),
            error_code=code,
            error_message=message,
        )
        if job is not None and kept is not None and current.deliveries > 0:
            return self._bill_cancelled(job.id, kept.prompt_tokens, len(kept.token_ids)) or job
        return job

    async def bill_cancelled(
        self, job_id: str, prompt_tokens: int, completion_tokens: int
    ) -> JobRecord | None:
        return self._bill_cancelled(job_id, prompt_tokens, completion_tokens)

    def _bill_cancelled(
        self, job_id: str, prompt_tokens: int, completion_tokens: int
    ) -> JobRecord | None:
        current = self._jobs.get(job_id)
        if (
            current is None
            or current.status != JobStatus.CANCELLED
            or current.prompt_tokens is not None
        ):
            return None
        job = dataclasses.replace(
            current, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens
        )
        self._jobs[job_id] = job
        self._bill(job, prompt_tokens, completion_tokens)
        metrics.count_tokens_served(job.tenant_id, job.tier.value, prompt_tokens, completion_tokens)
        return job

    async def close(self) -> None:
        return None

    def _insert(self, new: NewJob, job_id: str, now: datetime) -> JobRecord:
        job = new_record(new, job_id, now)
        self._jobs[job.id] = job
        self._history[job.id] = [(JobStatus.QUEUED.value, None)]
        if new.idempotency_key is not None:
            self._keys[(new.tenant_id, new.idempotency_key)] = job.id
        return job

    # --- the state machine ------------------------------------------------------------

    def _transition(
        self,
        job_id: str,
        dst: JobStatus,
        sources: Sequence[JobStatus] | None = None,
        *,
        detail: str | None = None,
        delivery: int | None = None,
        **values: Any,
    ) -> JobRecord | None:
        """`models.jobs.transition`: `dst` if the job is in one of `sources` (and, given
        `delivery`, that is still its latest delivery); None when it was not."""
        current = self._jobs.get(job_id)
        allowed = sources if sources is not None else sources_for(dst)
        if current is None or current.status not in allowed:
            return None
        if delivery is not None and current.deliveries != delivery:
            return None
        return self._move(current, dst, detail, **values)

    def _move(
        self, current: JobRecord, dst: JobStatus, detail: str | None, **values: Any
    ) -> JobRecord:
        if dst in TERMINAL:
            values.setdefault("progress", None)  # nothing more resumes after it
        job = dataclasses.replace(current, status=dst, **values)
        self._jobs[job.id] = job
        self._history[job.id].append((dst.value, detail))
        return job

    def _bill(self, job: JobRecord, prompt_tokens: int, completion_tokens: int) -> None:
        if job.id in self._ledger:  # the ledger's key: one row per job
            return
        price_in = job.input_price or Decimal(0)
        price_out = job.output_price or Decimal(0)
        cost = cost_of(prompt_tokens, completion_tokens, price_in, price_out)
        self._ledger[job.id] = Usage(job.id, job.tenant_id, prompt_tokens, completion_tokens, cost)
        self._billed_at[job.id] = utcnow()


@dataclass(frozen=True)
class _Price:
    """A tier's newest price (a row of `prices`, as `models.prices.in_force` reads one)."""

    model: str
    tier: str
    input_per_million: Decimal
    output_per_million: Decimal
    effective_at: datetime


def _minute_tokens(job: JobRecord) -> int:
    """What a job counts against tokens per minute: its reservation until it has usage."""
    if job.prompt_tokens is not None and job.completion_tokens is not None:
        return job.prompt_tokens + job.completion_tokens
    return job.reserved_tokens
