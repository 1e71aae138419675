"""Cache-affine placement (tierq/dispatcher/policy.py `_Placement`): jobs sharing a prefix land
on one worker while it has room within the load bound; affinity never leaves a slot idle
that free-slot placement would have filled."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections import Counter, defaultdict

from hypothesis import given
from hypothesis import strategies as st

from tierq.core.messages import prefix_key
from tierq.core.tiers import TIER_ORDER, Tier
from tierq.dispatcher.policy import PolicyConfig, QueuedJob, TierqPolicy, WorkerSlots, _weight

_n = itertools.count()


def _job(prefix: str | None, tier: Tier = Tier.STANDARD, tenant: str = "a") -> QueuedJob:
    n = next(_n)
    return QueuedJob(f"{n}-0", f"job{n}", tier, tenant, float(n), 10, 0, prefix)


def _queues(jobs: list[QueuedJob]) -> dict[Tier, dict[str, list[QueuedJob]]]:
    out: dict[Tier, dict[str, list[QueuedJob]]] = {t: defaultdict(list) for t in TIER_ORDER}
    for j in jobs:
        out[j.tier][j.tenant_id].append(j)
    return out


def _policy(slack: float = 0.25) -> TierqPolicy:
    return TierqPolicy(PolicyConfig(min_share={}, affinity_slack=slack))


def _idle(n: int, slots: int) -> list[WorkerSlots]:
    return [WorkerSlots(f"w{i}", slots, slots, capacity=slots) for i in range(n)]


def test_jobs_sharing_a_prefix_land_on_one_worker_while_it_has_room() -> None:
    got = _policy().assign(_queues([_job("system-a") for _ in range(10)]), _idle(4, 64), 1.0)
    assert len({a.worker_id for a in got}) == 1  # 10 jobs within 16 (a quarter of 64)
    # Without a prefix (or with affinity off) they spread over the freest workers.
    spread = _policy().assign(_queues([_job(None) for _ in range(8)]), _idle(4, 64), 1.0)
    assert Counter(a.worker_id for a in spread) == {f"w{i}": 2 for i in range(4)}
    off = _policy(0).assign(_queues([_job("system-a") for _ in range(8)]), _idle(4, 64), 1.0)
    assert len({a.worker_id for a in off}) == 4


def test_two_prefixes_keep_their_own_workers() -> None:
    jobs = [_job(p) for p in ("a", "b") * 6]
    got = _policy().assign(_queues(jobs), _idle(8, 64), 1.0)
    by_prefix = defaultdict(set)
    for a in got:
        by_prefix[a.job.prefix].add(a.worker_id)
    assert all(len(w) == 1 for w in by_prefix.values())
    # The same ranking every round, on every dispatcher: the next job of "a" goes there too.
    again = _policy().assign(_queues([_job("a")]), _idle(8, 64), 2.0)
    assert again[0].worker_id in by_prefix["a"]


def test_the_load_bound_spills_a_hot_prefix_to_the_next_workers() -> None:
    # 8 slots a worker: a worker may run 2 more jobs than the least loaded one.
    got = _policy().assign(_queues([_job("hot") for _ in range(8)]), _idle(4, 8), 1.0)
    loads = Counter(a.worker_id for a in got)
    assert len(loads) == 4 and max(loads.values()) - min(loads.values()) <= 2
    # Without the bound, all 8 would have gone to the prefix's first worker.
    unbounded = _policy(1.0).assign(_queues([_job("hot") for _ in range(8)]), _idle(4, 8), 1.0)
    assert len({a.worker_id for a in unbounded}) == 1


def _two_workers_one_slot_on_bs_worker() -> tuple[list[WorkerSlots], str, str]:
    """Prefixes "a" and "b" have different own workers; only b's has a free slot."""
    names = ["w0", "w1"]
    own = {p: max(names, key=lambda w: _weight(p, w)) for p in ("a", "b")}
    assert own["a"] != own["b"]
    slots = [
        WorkerSlots(own["a"], 0, 0, capacity=8),
        WorkerSlots(own["b"], 1, 1, capacity=8),
    ]
    return slots, own["a"], own["b"]


def test_a_job_whose_own_worker_is_full_lets_its_tenants_next_at_home_go_first() -> None:
    slots, _, b_home = _two_workers_one_slot_on_bs_worker()
    queue = [_job("a"), _job("a"), _job("b")]
    got = _policy().assign(_queues(queue), slots, 1.0)
    assert [(a.job.job_id, a.worker_id) for a in got] == [(queue[2].job_id, b_home)]
    # Strict order within the tenant (lookahead 0), or a preempted head: it goes first.
    strict = TierqPolicy(PolicyConfig(min_share={}, affinity_lookahead=0))
    assert strict.assign(_queues(queue), slots, 1.0)[0].job == queue[0]
    preempted = dataclasses.replace(_job("a"), preemptions=1)
    got = _policy().assign(_queues([preempted, _job("b")]), slots, 1.0)
    assert got[0].job == preempted
    # Beyond the look-ahead, nothing is passed over; nor for a job without a prefix.
    far = [_job("a") for _ in range(9)] + [_job("b")]
    assert _policy().assign(_queues(far), slots, 1.0)[0].job == far[0]
    plain = [_job("a"), _job(None)]
    assert _policy().assign(_queues(plain), slots, 1.0)[0].job == plain[0]


def test_a_job_is_passed_over_lookahead_times_at_most_over_all_rounds() -> None:
    slots, _, b_home = _two_workers_one_slot_on_bs_worker()
    policy = TierqPolicy(PolicyConfig(min_share={}, affinity_lookahead=3))
    head = _job("a")
    behind = [_job("b") for _ in range(6)]
    placed: list[QueuedJob] = []
    for round_no in range(5):  # a slot frees on b's worker each round
        waiting = [j for j in [head, *behind] if j not in placed]
        got = policy.assign(_queues(waiting), slots, float(round_no))
        placed += [a.job for a in got]
    assert placed[:3] == behind[:3] and placed[3] == head  # three passed it, then its turn
    # And within one round, as many at once as there are slots, the same bound.
    many = [WorkerSlots(b_home, 8, 8, capacity=8), slots[0]]
    fresh = TierqPolicy(PolicyConfig(min_share={}, affinity_lookahead=3))
    got = fresh.assign(_queues([_job("a"), *[_job("b") for _ in range(6)]]), many, 1.0)
    assert [a.job.prefix for a in got][:4] == ["b", "b", "b", "a"]


def test_a_new_leader_keeps_the_passed_over_bound_of_the_old_one() -> None:
    """The counts travel in the policy's snapshot (JSON, as the dispatcher saves it): a job
    passed over three times by the old leader is not passed over again by the new one."""
    slots, _, _ = _two_workers_one_slot_on_bs_worker()
    config = PolicyConfig(min_share={}, affinity_lookahead=3)
    old = TierqPolicy(config)
    head = _job("a")
    behind = [_job("b") for _ in range(6)]
    placed: list[QueuedJob] = []
    for round_no in range(3):
        waiting = [j for j in [head, *behind] if j not in placed]
        placed += [a.job for a in old.assign(_queues(waiting), slots, float(round_no))]
    assert placed == behind[:3]
    new = TierqPolicy(config)
    new.restore(json.loads(json.dumps(old.snapshot())))
    waiting = [j for j in [head, *behind] if j not in placed]
    assert new.assign(_queues(waiting), slots, 3.0)[0].job == head
    fresh = TierqPolicy(config)  # without the counts it would pass the head over again
    assert fresh.assign(_queues(waiting), slots, 3.0)[0].job != head


def test_the_prefix_key_is_the_start_of_the_input() -> None:
    system = {"role": "system", "content": "You are terse. " * 100}
    one = prefix_key([system, {"role": "user", "content": "first"}], None)
    two = prefix_key([system, {"role": "user", "content": "second"}], None)
    assert one == two  # past 1,024 characters of a shared system prompt
    assert prefix_key([{"role": "user", "content": "hi"}], None) != prefix_key(None, "hi")
    assert prefix_key(None, "x" * 2000 + "a") == prefix_key(None, "x" * 2000 + "b")


def test_the_same_prompt_of_two_tenants_is_two_prefix_keys() -> None:
    """The prefix cache is each tenant's own (the engine's cache_salt), so placement keys on
    the tenant too: it gathers a tenant's shared prefixes, never two tenants'."""
    system = [{"role": "system", "content": "You are terse. " * 100}]
    assert prefix_key(system, None, scope="ten_a") == prefix_key(system, None, scope="ten_a")
    assert prefix_key(system, None, scope="ten_a") != prefix_key(system, None, scope="ten_b")
    assert prefix_key(system, None, scope="ten_a") != prefix_key(system, None)


WORKERS = st.lists(
    st.tuples(st.integers(0, 12), st.integers(0, 12), st.integers(0, 12)),
    min_size=1,
    max_size=6,
)
JOBS = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c", None]),
        st.sampled_from(list(TIER_ORDER)),
        st.sampled_from(["t1", "t2"]),
    ),
    max_size=60,
)


@given(WORKERS, JOBS, st.floats(0.05, 1.0), st.integers(0, 8))
def test_affinity_places_what_free_slots_would_and_leaves_no_slot_idle(
    workers: list[tuple[int, int, int]],
    jobs: list[tuple[str | None, Tier, str]],
    slack: float,
    lookahead: int,
) -> None:
    slots = [
        WorkerSlots(f"w{i}", free, min(free, lower), capacity=free + busy)
        for i, (free, lower, busy) in enumerate(workers)
    ]
    queued = [_job(p, t, tenant) for p, t, tenant in jobs]
    config = PolicyConfig(min_share={}, affinity_slack=slack, affinity_lookahead=lookahead)
    affine = TierqPolicy(config).assign(_queues(queued), slots, 1.0)
    plain = _policy(0).assign(_queues(queued), slots, 1.0)
    placed = [a.job.job_id for a in affine]
    assert len(placed) == len(set(placed))  # none twice
    # Within one tier, as many jobs placed, each tenant as many (the tier policy decides
    # whose turn it is), each from its first `lookahead` beyond that many: affinity
    # decides where, and bends a tenant's order by at most `lookahead` places. (Mixed, an
    # interactive job may take a slot that lower tiers could also use on one worker and
    # not on another: either way no job is left beside a slot it could take, below.)
    if len({t for _, t, _ in jobs}) <= 1:
        assert len(affine) == len(plain)
        for tenant in ("t1", "t2"):
            mine = {a.job.job_id for a in affine if a.job.tenant_id == tenant}
            assert len(mine) == sum(a.job.tenant_id == tenant for a in plain)
            order = [j.job_id for j in queued if j.tenant_id == tenant]
            # Every job left waiting was passed over by `lookahead` jobs behind it at most.
            for i, job_id in enumerate(order):
                if job_id not in mine:
                    assert sum(later in mine for later in order[i + 1 :]) <= lookahead
    free = {w.worker_id: [w.free, w.free_lower] for w in slots}
    for a in affine:
        room = free[a.worker_id]
        if a.job.tier == Tier.INTERACTIVE:
            assert room[0] > 0
        else:
            assert room[1] > 0
            room[1] -= 1
        room[0] -= 1
        room[1] = min(room[1], room[0])
    # No backlog beside a free slot: what is left could not have been placed.
    left = {j.job_id for j in queued} - {a.job.job_id for a in affine}
    if left:
        tiers = {j.tier for j in queued if j.job_id in left}
        if Tier.INTERACTIVE in tiers:
            assert all(r[0] == 0 for r in free.values())
        if tiers - {Tier.INTERACTIVE}:
            assert all(r[1] == 0 for r in free.values())
