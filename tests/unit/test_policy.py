"""The dispatch policy: hand-built states and property tests (hypothesis), no I/O."""

from __future__ import annotations

import os
from collections import Counter, defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierq.core.tiers import TIER_ORDER, Tier
from tierq.dispatcher import policy as policy_module
from tierq.dispatcher.policy import (
    EnginePriorityPolicy,
    FcfsPolicy,
    PolicyConfig,
    QueuedJob,
    RunningJob,
    TierqPolicy,
    WorkerSlots,
)

NO_SHARES = PolicyConfig(min_share={})
_n = iter(range(10**9))


def job(tier: Tier, tenant: str = "a", at: float = 0.0, cost: int = 10, pre: int = 0) -> QueuedJob:
    n = next(_n)
    return QueuedJob(f"{n}-0", f"job{n}", tier, tenant, at, cost, pre)


def queues_of(*jobs: QueuedJob) -> dict[Tier, dict[str, list[QueuedJob]]]:
    out: dict[Tier, dict[str, list[QueuedJob]]] = {t: defaultdict(list) for t in TIER_ORDER}
    for j in jobs:
        out[j.tier][j.tenant_id].append(j)
    return out


def test_strict_priority_when_no_tier_is_below_its_share() -> None:
    policy = TierqPolicy(NO_SHARES)
    jobs = [job(Tier.BATCH), job(Tier.STANDARD), job(Tier.INTERACTIVE)]
    got = policy.assign(queues_of(*jobs), [WorkerSlots("w", 2, 2)], now=100)
    assert [a.job.tier for a in got] == [Tier.INTERACTIVE, Tier.STANDARD]


def test_a_deprived_backlogged_tier_is_served_next() -> None:
    policy = TierqPolicy(PolicyConfig(min_share={Tier.BATCH: 0.10}))
    policy.charge(Tier.INTERACTIVE, "x", 1000, now=99)  # batch has had nothing in the window
    got = policy.assign(
        queues_of(job(Tier.INTERACTIVE), job(Tier.BATCH)), [WorkerSlots("w", 1, 1)], now=100
    )
    assert [a.job.tier for a in got] == [Tier.BATCH]
    # Once at its share, strict priority again.
    policy.charge(Tier.BATCH, "x", 500, now=100)
    got = policy.assign(
        queues_of(job(Tier.INTERACTIVE), job(Tier.BATCH)), [WorkerSlots("w", 1, 1)], now=101
    )
    assert [a.job.tier for a in got] == [Tier.INTERACTIVE]


def test_the_share_window_slides() -> None:
    policy = TierqPolicy(PolicyConfig(min_share={Tier.BATCH: 0.10}, window_s=10))
    policy.charge(Tier.BATCH, "x", 1000, now=0)
    policy.charge(Tier.INTERACTIVE, "x", 100, now=5)
    got = policy.assign(
        queues_of(job(Tier.INTERACTIVE), job(Tier.BATCH)), [WorkerSlots("w", 1, 1)], 9
    )
    assert got[0].job.tier == Tier.INTERACTIVE  # batch has 90 % of the window
    got = policy.assign(
        queues_of(job(Tier.INTERACTIVE), job(Tier.BATCH)), [WorkerSlots("w", 1, 1)], 12
    )
    assert got[0].job.tier == Tier.BATCH  # its tokens left the window


def test_the_reserve_keeps_slots_for_interactive_work() -> None:
    policy = TierqPolicy(NO_SHARES)
    lower = [job(Tier.BATCH) for _ in range(10)]
    got = policy.assign(queues_of(*lower), [WorkerSlots("w", 8, 6)], now=1)
    assert len(got) == 6  # two slots stay free
    got = policy.assign(
        queues_of(job(Tier.INTERACTIVE), job(Tier.INTERACTIVE)), [WorkerSlots("w", 2, 0)], 2
    )
    assert len(got) == 2


def test_tenants_share_a_tier_by_tokens_not_by_job_count() -> None:
    policy = TierqPolicy(NO_SHARES)
    big = [job(Tier.BATCH, "big", at=i, cost=100) for i in range(50)]
    small = [job(Tier.BATCH, "small", at=100 + i, cost=100) for i in range(10)]
    got = policy.assign(queues_of(*big, *small), [WorkerSlots("w", 20, 20)], now=200)
    assert Counter(a.job.tenant_id for a in got) == {"big": 10, "small": 10}


def test_weights_divide_service() -> None:
    policy = TierqPolicy(PolicyConfig(min_share={}, tenant_weights={"gold": 3.0}))
    jobs = [job(Tier.STANDARD, t, cost=10) for t in ("gold", "plain") for _ in range(40)]
    got = policy.assign(queues_of(*jobs), [WorkerSlots("w", 40, 40)], now=1)
    assert Counter(a.job.tenant_id for a in got) == {"gold": 30, "plain": 10}


def test_a_newly_backlogged_tenant_earns_no_credit_for_idle_time() -> None:
    policy = TierqPolicy(NO_SHARES)
    busy = [job(Tier.BATCH, "busy", cost=10) for _ in range(100)]
    policy.assign(queues_of(*busy[:50]), [WorkerSlots("w", 50, 50)], now=1)
    late = [job(Tier.BATCH, "late", cost=10) for _ in range(100)]
    got = policy.assign(queues_of(*busy[50:], *late), [WorkerSlots("w", 20, 20)], now=2)
    counts = Counter(a.job.tenant_id for a in got)
    assert counts["late"] <= 11 and counts["busy"] >= 9  # shares from now on, no catch-up burst


def test_an_urgent_job_goes_before_fair_order() -> None:
    policy = TierqPolicy(
        PolicyConfig(min_share={}, slo_s={Tier.STANDARD: 100}, urgency_fraction=0.5)
    )
    policy.charge(Tier.STANDARD, "old", 10_000, now=99)  # would lose on fairness
    old = job(Tier.STANDARD, "old", at=0)
    fresh = job(Tier.STANDARD, "fresh", at=99)
    got = policy.assign(queues_of(old, fresh), [WorkerSlots("w", 1, 1)], now=100)
    assert got[0].job is old


def test_preempted_jobs_are_urgent_within_their_tier() -> None:
    policy = TierqPolicy(NO_SHARES)
    policy.charge(Tier.BATCH, "a", 10_000, now=1)
    back = job(Tier.BATCH, "a", at=50, pre=1)
    other = job(Tier.BATCH, "b", at=10)
    got = policy.assign(queues_of(back, other), [WorkerSlots("w", 1, 1)], now=60)
    assert got[0].job is back


def test_preemption_picks_batch_first_newest_first_and_is_bounded() -> None:
    policy = TierqPolicy(PolicyConfig(max_preemptions=1))
    running = [
        RunningJob("s1", Tier.STANDARD, "w", 1.0, 0),
        RunningJob("b-old", Tier.BATCH, "w", 2.0, 0),
        RunningJob("b-new", Tier.BATCH, "w", 3.0, 0),
        RunningJob("b-twice", Tier.BATCH, "w", 4.0, 1),
        RunningJob("i1", Tier.INTERACTIVE, "w", 5.0, 0),
    ]
    full = [WorkerSlots("w", 0, 0)]
    assert [r.job_id for r in policy.preempt(3, running, full, 0)] == ["b-new", "b-old", "s1"]
    assert [r.job_id for r in policy.preempt(3, running, full, 2)] == ["b-new"]
    assert policy.preempt(1, running, [WorkerSlots("w", 1, 0)], 0) == []  # a slot is free
    assert policy.preempt(0, running, full, 0) == []


def test_jobs_on_workers_whose_engine_preempts_for_priority_are_never_aborted() -> None:
    policy = TierqPolicy(PolicyConfig(max_preemptions=1))
    running = [
        RunningJob("b-engine", Tier.BATCH, "engine", 5.0, 0),
        RunningJob("b-platform", Tier.BATCH, "plain", 1.0, 0),
    ]
    full = [WorkerSlots("engine", 0, 0, engine_preempts=True), WorkerSlots("plain", 0, 0)]
    assert [r.job_id for r in policy.preempt(2, running, full, 0)] == ["b-platform"]
    assert policy.preempt(2, running, full[:1], 0) == []
    # An interactive job goes beyond the engine's slots, where lower tiers may not.
    beyond = WorkerSlots("engine", free=4, free_lower=0, engine_preempts=True)
    got = policy.assign(queues_of(job(Tier.BATCH, at=1), job(Tier.INTERACTIVE, at=2)), [beyond], 3)
    assert [a.job.tier for a in got] == [Tier.INTERACTIVE]


def test_baselines() -> None:
    jobs = [job(Tier.BATCH, at=1), job(Tier.INTERACTIVE, at=2), job(Tier.STANDARD, at=0)]
    for policy in (FcfsPolicy(), EnginePriorityPolicy()):
        got = policy.assign(queues_of(*jobs), [WorkerSlots("w", 2, 0)], now=3)
        assert [a.job.enqueued_at for a in got] == [0, 1]  # arrival order, reserve ignored
        assert policy.preempt(5, [], [WorkerSlots("w", 0, 0)], 0) == []


# --- properties ------------------------------------------------------------------------

arrivals = st.lists(
    st.tuples(
        st.sampled_from(list(TIER_ORDER)), st.sampled_from(["a", "b", "c"]), st.integers(1, 300)
    ),
    max_size=80,
)
worker_states = st.lists(
    st.tuples(st.integers(-2, 12), st.integers(-2, 12)), min_size=0, max_size=5
)


@given(arrivals, worker_states)
def test_capacity_is_respected_and_work_is_conserved(
    raw: list[tuple[Tier, str, int]], raw_workers: list[tuple[int, int]]
) -> None:
    jobs = [job(t, ten, at=i, cost=c) for i, (t, ten, c) in enumerate(raw)]
    workers = [WorkerSlots(f"w{i}", f, fl) for i, (f, fl) in enumerate(raw_workers)]
    got = TierqPolicy().assign(queues_of(*jobs), workers, now=1000)

    assert len({a.job.job_id for a in got}) == len(got)
    per = Counter(a.worker_id for a in got)
    lower = Counter(a.worker_id for a in got if a.job.tier != Tier.INTERACTIVE)
    for w in workers:
        assert per[w.worker_id] <= max(0, w.free)
        assert lower[w.worker_id] <= max(0, min(w.free, w.free_lower))
    # Work-conserving: nothing placeable is left behind.
    chosen = {a.job.job_id for a in got}
    left = [j for j in jobs if j.job_id not in chosen]
    free_after = {w.worker_id: max(0, w.free) - per[w.worker_id] for w in workers}
    lower_after = {
        w.worker_id: min(
            free_after[w.worker_id], max(0, min(w.free, w.free_lower)) - lower[w.worker_id]
        )
        for w in workers
    }
    if any(j.tier == Tier.INTERACTIVE for j in left):
        assert all(v <= 0 for v in free_after.values())
    if any(j.tier != Tier.INTERACTIVE for j in left):
        assert all(v <= 0 for v in lower_after.values())


@settings(max_examples=int(os.environ.get("TIERQ_PROPERTY_EXAMPLES", "60")), deadline=None)
@given(st.lists(st.integers(1, 400), min_size=50, max_size=50), st.integers(1, 6))
def test_no_backlogged_tier_stays_below_its_minimum_share(
    costs: list[int], slots_per_round: int
) -> None:
    """Every tier backlogged throughout, slots freeing each second: after every round, over
    the sliding window, each lower tier has at least its minimum share, give or take one
    job's cost for every slot of a round plus one. The slack is real, not caution: jobs are
    indivisible (a decision can only bring a deprived tier back by whole jobs), and the jobs
    of one round all leave the window in the same later round, so one round can take up to
    `slots_per_round` jobs' worth of tokens out of a tier's share at once."""
    config = PolicyConfig(window_s=30)
    policy = TierqPolicy(config)
    queue: dict[Tier, list[QueuedJob]] = {t: [] for t in TIER_ORDER}
    cost_iter = iter(costs * 100)
    served: list[tuple[float, Tier, int]] = []
    for second in range(120):
        for tier in TIER_ORDER:  # keep every tier backlogged
            while len(queue[tier]) < 10:
                queue[tier].append(job(tier, "t", at=second, cost=next(cost_iter)))
        q = {t: {"t": list(js)} for t, js in queue.items()}
        got = policy.assign(q, [WorkerSlots("w", slots_per_round, slots_per_round)], now=second)
        for a in got:
            queue[a.job.tier].remove(a.job)
            served.append((second, a.job.tier, a.job.cost))
        if second < 30:
            continue
        window = [(t, c) for s, t, c in served if s >= second - 30]
        total = sum(c for _, c in window)
        for tier, minimum in config.min_share.items():
            share = sum(c for t, c in window if t == tier) / total
            assert share >= minimum - (slots_per_round + 1) * max(costs) / total
    # Over the whole run, past the first window, the slack is one job per slot of a round.
    run = [(t, c) for s, t, c in served if s >= 30]
    run_total = sum(c for _, c in run)
    for tier, minimum in config.min_share.items():
        share = sum(c for t, c in run if t == tier) / run_total
        assert share >= minimum - slots_per_round * max(costs) / run_total


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 500), min_size=20, max_size=200),
    st.lists(st.integers(1, 500), min_size=20, max_size=200),
)
def test_two_backlogged_tenants_stay_within_one_job_of_each_other(
    costs_a: list[int], costs_b: list[int]
) -> None:
    policy = TierqPolicy(NO_SHARES)
    queues = {
        "a": [job(Tier.BATCH, "a", at=i, cost=c) for i, c in enumerate(costs_a)],
        "b": [job(Tier.BATCH, "b", at=i, cost=c) for i, c in enumerate(costs_b)],
    }
    served = {"a": 0, "b": 0}
    biggest = max(costs_a + costs_b)
    now = 0.0
    while queues["a"] and queues["b"]:  # while both are backlogged
        now += 1
        got = policy.assign({Tier.BATCH: queues}, [WorkerSlots("w", 1, 1)], now)
        for a in got:
            queues[a.job.tenant_id].remove(a.job)
            served[a.job.tenant_id] += a.job.cost
        assert abs(served["a"] - served["b"]) <= 2 * biggest


def test_the_counters_of_tenants_gone_idle_stay_bounded_and_fairness_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dispatcher that serves tenant after tenant keeps at most IDLE_COUNTERS_KEPT idle
    counters a tier beyond its backlogged tenants' number; the forgotten ones were at or
    below the floor (no credit changes hands), then the smallest; a heavy tenant's counter
    survives, so it cannot come back as new."""
    monkeypatch.setattr(policy_module, "IDLE_COUNTERS_KEPT", 8)
    policy = TierqPolicy(NO_SHARES)
    policy.charge(Tier.STANDARD, "heavy", 1_000_000, now=0)  # served a lot, then idle
    for i in range(100):  # one job each from tenants never seen again
        policy.assign(queues_of(job(Tier.STANDARD, f"t{i}")), [WorkerSlots("w", 1, 1)], now=i)
    counters = policy.counters[Tier.STANDARD]
    assert len(counters) <= 8 + 2 * 1  # one tenant backlogged at a time
    assert counters["heavy"] == 1_000_000
    # The heavy tenant, back beside a newcomer, still waits its turn: the newcomer goes first.
    got = policy.assign(
        queues_of(job(Tier.STANDARD, "heavy"), job(Tier.STANDARD, "new")),
        [WorkerSlots("w", 1, 1)],
        now=200,
    )
    assert [a.job.tenant_id for a in got] == ["new"]
