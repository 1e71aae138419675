"""The dispatch policy is pure: hand-built states and property tests, no I/O."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from dispatcher.policy import QueuedJob, WorkerSlots, assign
from tierq.tiers import TIER_ORDER, Tier


def job(n: int, tier: Tier, at: float | None = None) -> QueuedJob:
    return QueuedJob(f"{n}-0", f"job{n}", tier, "t1", float(n) if at is None else at)


def test_higher_tiers_first_then_oldest_first() -> None:
    queues = {
        Tier.BATCH: [job(1, Tier.BATCH)],
        Tier.STANDARD: [job(3, Tier.STANDARD), job(2, Tier.STANDARD)],
        Tier.INTERACTIVE: [job(4, Tier.INTERACTIVE)],
    }
    got = assign(queues, [WorkerSlots("w", 3)])
    assert [a.job.job_id for a in got] == ["job4", "job2", "job3"]


def test_no_free_slot_no_assignment() -> None:
    queues = {Tier.INTERACTIVE: [job(1, Tier.INTERACTIVE)]}
    assert assign(queues, [WorkerSlots("w", 0), WorkerSlots("v", -2)]) == []
    assert assign(queues, []) == []


def test_load_is_spread_to_the_freest_worker() -> None:
    queues = {Tier.STANDARD: [job(i, Tier.STANDARD) for i in range(4)]}
    got = assign(queues, [WorkerSlots("a", 1), WorkerSlots("b", 3)])
    assert Counter(a.worker_id for a in got) == {"b": 3, "a": 1}
    assert got[0].worker_id == "b"


tiers = st.sampled_from(list(TIER_ORDER))
states = st.tuples(
    st.lists(st.tuples(tiers, st.floats(0, 1000)), max_size=60),
    st.lists(st.integers(-3, 10), max_size=6),
)


@given(states)
def test_properties_over_any_state(state: tuple[list[tuple[Tier, float]], list[int]]) -> None:
    raw_jobs, frees = state
    queues: dict[Tier, list[QueuedJob]] = {t: [] for t in TIER_ORDER}
    for n, (tier, at) in enumerate(raw_jobs):
        queues[tier].append(job(n, tier, at))
    workers = [WorkerSlots(f"w{i}", f) for i, f in enumerate(frees)]
    got = assign(queues, workers)

    # Never more than a worker's free slots, never a job twice.
    per_worker = Counter(a.worker_id for a in got)
    free = {w.worker_id: w.free for w in workers}
    assert all(n <= free[w] for w, n in per_worker.items())
    assert len({a.job.job_id for a in got}) == len(got)
    # Work-conserving: as many as jobs and free slots allow.
    assert len(got) == min(len(raw_jobs), sum(max(0, f) for f in frees))
    # Strict priority: nothing of a lower tier while a higher one has unassigned jobs.
    chosen = {a.job.job_id for a in got}
    rank = {t: i for i, t in enumerate(TIER_ORDER)}
    left_behind = [j for js in queues.values() for j in js if j.job_id not in chosen]
    if left_behind and got:
        best_left = min(rank[j.tier] for j in left_behind)
        assert all(rank[a.job.tier] <= best_left for a in got)
