"""The figures of `tierq bench qos`: what one policy's run recorded, measured.

Every figure covers the measured window (after the warm-up, until the arrivals end) and
is in simulated seconds where it is a time. An interactive job still waiting at the end
counts with its wait so far; the backlog is what arrived but is not yet in the engine —
for the engine-priority baseline also what waits inside the engine beyond its slots.
"""

from __future__ import annotations

import bisect
import itertools
import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from benchmarks.decode_ledger import DecodeLedger
from benchmarks.qos_workload import Arrival, Shape
from tierq.core.settings import Settings
from tierq.core.tiers import TIER_ORDER, Tier
from tierq.workers.engine.simulated_engine import CostModel


@dataclass
class Trace:
    """What the instrumented engine saw, in wall-clock seconds."""

    called: dict[str, float] = field(default_factory=dict)  # request id -> entered the engine
    first_token: dict[str, float] = field(default_factory=dict)
    tokens: list[tuple[float, str, int]] = field(default_factory=list)  # (t, request id, n)
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (t, in engine, arrived)
    decode: DecodeLedger = field(default_factory=DecodeLedger)  # decode work done twice


@dataclass
class Recorded:
    """One policy's run, as the harness leaves it."""

    trace: Trace
    jobs: dict[str, tuple[Arrival, float]]  # job id -> (arrival, wall time enqueued)
    t0: float  # wall clock at simulated time 0
    decision_seconds: list[float]  # the dispatcher's assign() calls
    settings: Settings


@dataclass(frozen=True)
class Window:
    """The measured span, in wall-clock seconds, and time's compression."""

    w0: float
    w1: float
    speedup: float

    def sim(self, seconds: float) -> float:
        return round(seconds * self.speedup, 3)


def p95(values: list[float]) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]


def metrics(run: Recorded, shape: Shape, cost: CostModel, speedup: float) -> dict[str, Any]:
    win = Window(run.t0 + shape.warmup_s / speedup, run.t0 + shape.duration_s / speedup, speedup)
    span = (win.w1 - win.w0) * speedup  # simulated seconds measured
    ttft = _interactive_ttft(run, win)
    to_engine, in_engine = _interactive_parts(run, win)
    served = _served_tokens(run, win)
    gap, gap_s = tenant_gap(run, win)
    total = sum(served.values()) or 1.0
    batch_waits = [
        (run.trace.called.get(j, win.w1) - wall)
        for j, (a, wall) in run.jobs.items()
        if a.tier == Tier.BATCH
    ]
    decisions = sorted(run.decision_seconds)
    p99 = decisions[int(0.99 * (len(decisions) - 1))] if decisions else 0.0
    return {
        "interactive_ttft_p95_s": win.sim(p95(ttft) or 0.0),
        "interactive_jobs_measured": len(ttft),
        # Where that time went: to the engine (admission to the engine's call: the
        # dispatcher and the worker), then in it (the call to the first token).
        "interactive_to_engine_p95_s": win.sim(p95(to_engine) or 0.0),
        "interactive_in_engine_p95_s": win.sim(p95(in_engine) or 0.0),
        "tier_share": {t.value: round(served[t] / total, 4) for t in TIER_ORDER},
        "backlogged_tiers": [t.value for t in _backlogged_tiers(run, win)],
        "tier_min_share": {
            Tier.STANDARD.value: run.settings.min_share_standard,
            Tier.BATCH.value: run.settings.min_share_batch,
        },
        "tenant_gap": round(gap, 2),
        "tenant_gap_backlogged_s": win.sim(gap_s),
        "batch_tenant_shares": tenant_shares(run, win),
        "batch_max_wait_s": win.sim(max(batch_waits) if batch_waits else 0.0),
        "idle_with_backlog": _idle_with_backlog(run, win, cost.slots),
        "throughput_tokens_per_s": round(total / span, 2),
        "decision_us_p99": round(p99 * 1e6, 1),
        "preempted_tokens_wasted": run.trace.decode.wasted(),
        "resumed_tokens": run.trace.decode.resumed,
    }


def _interactive_ttft(run: Recorded, win: Window) -> list[float]:
    """Interactive jobs that arrived in the window: first token less arrival, or for one
    still waiting at the end, its wait so far."""
    first = run.trace.first_token
    measured = _interactive_arrivals(run, win)
    ttft = [first[j] - wall for j, wall in measured if j in first]
    unserved = [win.w1 - wall for j, wall in measured if j not in first]
    return ttft + unserved


def _interactive_parts(run: Recorded, win: Window) -> tuple[list[float], list[float]]:
    """For the interactive jobs of the window that got a first token: arrival to the
    engine's call, and the call to the first token."""
    called, first = run.trace.called, run.trace.first_token
    served = [
        (j, wall) for j, wall in _interactive_arrivals(run, win) if j in first and j in called
    ]
    return [called[j] - wall for j, wall in served], [first[j] - called[j] for j, _ in served]


def _interactive_arrivals(run: Recorded, win: Window) -> list[tuple[str, float]]:
    """(job id, wall time enqueued) of the interactive jobs that arrived in the window."""
    return [
        (j, wall)
        for j, (a, wall) in run.jobs.items()
        if a.tier == Tier.INTERACTIVE and win.w0 <= wall
    ]


def _served_tokens(run: Recorded, win: Window) -> dict[Tier, float]:
    """Tokens served in the window per tier."""
    served: dict[Tier, float] = defaultdict(float)
    for t, rid, n in run.trace.tokens:
        if win.w0 <= t <= win.w1 and rid in run.jobs:
            served[run.jobs[rid][0].tier] += n
    return served


def tenant_gap(run: Recorded, win: Window) -> tuple[float, float]:
    """The widest gap between two batch tenants' tokens served, at any moment while every
    batch tenant was backlogged (had a job arrived and not yet begun), counted from the
    window's start, in jobs of the largest size; and how long from the window's start that
    lasted (wall seconds). The widest at any moment, not at the end: serving one tenant
    alone for a while and then the other would end even and still be a gap.

    Fairness is owed to backlogged tenants: once a tenant has nothing left waiting, the
    others rightly take its share, and counting their tokens from then on would measure
    the workload (how many jobs that tenant had), not the policy."""
    largest_job = max(a.prompt_tokens + a.max_tokens for a, _ in run.jobs.values())
    jobs: dict[str, list[str]] = defaultdict(list)
    for j, (a, _) in run.jobs.items():
        if a.tier == Tier.BATCH:
            jobs[a.tenant].append(j)
    if len(jobs) <= 1:
        return 0.0, win.w1 - win.w0
    until = min([win.w1, *(_backlog_ends(run, ids, win.w0) for ids in jobs.values())])
    tenant_of = {j: tenant for tenant, ids in jobs.items() for j in ids}
    served: dict[str, float] = dict.fromkeys(jobs, 0.0)
    gap = 0.0
    for t, rid, n in sorted(run.trace.tokens):
        if win.w0 <= t <= until and rid in tenant_of:
            served[tenant_of[rid]] += n
            gap = max(gap, max(served.values()) - min(served.values()))
    return gap / largest_job, until - win.w0


SHARE_BUCKETS = 12


def tenant_shares(run: Recorded, win: Window, buckets: int = SHARE_BUCKETS) -> dict[str, Any]:
    """Each batch tenant's share of the batch tier's tokens served in each of `buckets`
    equal spans of the window (the plot of fairness over time): `t_s` is each span's end in
    simulated seconds from the window's start; a span that served no batch tokens has no
    shares (None)."""
    tenant_of = {j: a.tenant for j, (a, _) in run.jobs.items() if a.tier == Tier.BATCH}
    tenants = sorted(set(tenant_of.values()))
    width = (win.w1 - win.w0) / buckets
    served = [dict.fromkeys(tenants, 0.0) for _ in range(buckets)]
    for t, rid, n in run.trace.tokens:
        if win.w0 <= t <= win.w1 and rid in tenant_of:
            served[min(buckets - 1, int((t - win.w0) / width))][tenant_of[rid]] += n
    shares: dict[str, list[float | None]] = {tenant: [] for tenant in tenants}
    for bucket in served:
        total = sum(bucket.values())
        for tenant in tenants:
            shares[tenant].append(round(bucket[tenant] / total, 4) if total else None)
    return {"t_s": [win.sim(width * (i + 1)) for i in range(buckets)], "shares": shares}


def _backlog_ends(run: Recorded, ids: list[str], start: float) -> float:
    """The first time from `start` on at which none of these jobs waits (arrived, no first
    token yet); infinity if some still wait at the end."""
    events = [(run.jobs[j][1], 1) for j in ids]
    events += [(run.trace.first_token[j], -1) for j in ids if j in run.trace.first_token]
    events.sort(key=lambda e: (e[0], -e[1]))  # at one instant an arrival counts first
    queued = 0
    for t, change in events:
        if t > start and queued == 0:
            return start
        queued += change
        if t >= start and queued == 0:
            return t
    return start if queued == 0 else float("inf")


def _intervals(run: Recorded, win: Window) -> list[tuple[float, float, int, int]]:
    """The engine samples in the window: (t, length, in engine, arrived so far)."""
    samples = run.trace.samples
    return [
        (t, t_next - t, active, arrived)
        for (t, active, arrived), (t_next, _, _) in itertools.pairwise(samples)
        if win.w0 <= t <= win.w1
    ]


def _idle_with_backlog(run: Recorded, win: Window, slots: int) -> float:
    """The fraction of slot time left idle while work waited."""
    entered = sorted(run.trace.called.values())
    idle_slot_time = 0.0
    slot_time = 0.0
    for t, dt, active, arrived in _intervals(run, win):
        waiting = arrived - bisect.bisect_right(entered, t) + max(0, active - slots)
        slot_time += slots * dt
        if waiting > 0:
            idle_slot_time += (slots - min(active, slots)) * dt
    return round(idle_slot_time / slot_time, 4) if slot_time else 0.0


def _backlogged_tiers(run: Recorded, win: Window) -> list[Tier]:
    """Tiers with work waiting (arrived, no first token yet) for 90 % of the window."""
    arrived: dict[Tier, list[float]] = defaultdict(list)
    entered: dict[Tier, list[float]] = defaultdict(list)
    for j, (a, wall) in run.jobs.items():
        arrived[a.tier].append(wall)
        if j in run.trace.first_token:  # served from its first token on, whatever the engine
            entered[a.tier].append(run.trace.first_token[j])
    for values in (*arrived.values(), *entered.values()):
        values.sort()
    backlogged_time: dict[Tier, float] = defaultdict(float)
    for t, dt, _active, _arrived in _intervals(run, win):
        for tier in TIER_ORDER:
            queued = bisect.bisect_right(arrived[tier], t) - bisect.bisect_right(entered[tier], t)
            if queued > 0:
                backlogged_time[tier] += dt
    return [t for t in TIER_ORDER if backlogged_time[t] >= 0.9 * (win.w1 - win.w0)]


def print_table(name: str, m: dict[str, Any]) -> None:
    print(f"\n== {name}")
    for key, value in m.items():
        print(f"  {key:32} {json.dumps(value)}")
    print(flush=True)
