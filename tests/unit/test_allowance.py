"""Tenants' max_running as the dispatcher offers jobs: hand-built states and property tests
(hypothesis), no Redis, no event loop."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from tierq.core.tiers import TIER_ORDER, Tier
from tierq.dispatcher.allowance import ALL_TIERS, Caps, dispatch_order, offer
from tierq.dispatcher.policy import QueuedJob, RunningJob

Queues = dict[Tier, dict[str, list[QueuedJob]]]
TENANTS = ("a", "b", "c")
_n = iter(range(10**9))


def job(tier: Tier, tenant: str = "a", at: float = 0.0, pre: int = 0) -> QueuedJob:
    n = next(_n)
    return QueuedJob(f"{n}-0", f"job{n}", tier, tenant, at, 10, pre)


def run(tier: Tier, tenant: str = "a") -> RunningJob:
    n = next(_n)
    return RunningJob(f"run{n}", tier, "w", 0.0, 0, tenant)


def buffered(*jobs: QueuedJob) -> Queues:
    out: Queues = {t: {} for t in TIER_ORDER}
    for j in jobs:
        out[j.tier].setdefault(j.tenant_id, []).append(j)
    return out


def ids(queues: Mapping[Tier, Mapping[str, list[QueuedJob]]], tier: Tier, tenant: str) -> list[str]:
    return [j.job_id for j in queues[tier].get(tenant, [])]


# --- examples --------------------------------------------------------------------------


def test_without_caps_every_queue_is_offered_whole_in_dispatch_order() -> None:
    late, early = job(Tier.BATCH, at=2), job(Tier.BATCH, at=1)
    preempted = job(Tier.BATCH, at=9, pre=1)
    got = offer(buffered(late, early, preempted), [run(Tier.BATCH)] * 5, {})
    assert got == {
        Tier.INTERACTIVE: {},
        Tier.STANDARD: {},
        Tier.BATCH: {"a": [preempted, early, late]},
    }


def test_the_all_tiers_cap_counts_running_jobs_of_every_tier() -> None:
    queued = [job(t, at=i) for i, t in enumerate([Tier.INTERACTIVE] * 2 + [Tier.STANDARD] * 2)]
    got = offer(buffered(*queued), [run(Tier.BATCH)], {"a": {ALL_TIERS: 2}})
    assert ids(got, Tier.INTERACTIVE, "a") == [queued[0].job_id]
    assert "a" not in got[Tier.STANDARD]


def test_a_tier_cap_cuts_that_tier_only() -> None:
    batch = [job(Tier.BATCH, at=i) for i in range(3)]
    interactive = [job(Tier.INTERACTIVE, at=i) for i in range(3)]
    got = offer(buffered(*batch, *interactive), [], {"a": {"batch": 1}})
    assert got[Tier.BATCH]["a"] == batch[:1]
    assert got[Tier.INTERACTIVE]["a"] == interactive


def test_the_tighter_of_two_caps_wins() -> None:
    queued = [job(Tier.STANDARD, at=i) for i in range(5)]
    caps = {"a": {ALL_TIERS: 4, "standard": 2}}
    assert len(offer(buffered(*queued), [], caps)[Tier.STANDARD]["a"]) == 2
    running = [run(Tier.INTERACTIVE)] * 3
    assert len(offer(buffered(*queued), running, caps)[Tier.STANDARD]["a"]) == 1


def test_a_tenant_over_its_cap_is_offered_nothing_and_others_are_untouched() -> None:
    # A cap lowered below what already runs, and a cap of zero.
    queued = [job(Tier.STANDARD, "a"), job(Tier.STANDARD, "b"), job(Tier.STANDARD, "c")]
    running = [run(Tier.STANDARD, "a")] * 3
    got = offer(buffered(*queued), running, {"a": {ALL_TIERS: 2}, "b": {"standard": 0}})
    assert got[Tier.STANDARD] == {"c": [queued[2]]}


def test_preempted_jobs_go_first_within_the_cap() -> None:
    first, second = job(Tier.BATCH, at=1), job(Tier.BATCH, at=2)
    preempted = job(Tier.BATCH, at=5, pre=2)
    got = offer(buffered(first, second, preempted), [], {"a": {ALL_TIERS: 2}})
    assert got[Tier.BATCH]["a"] == [preempted, first]


def test_the_first_tier_with_work_sets_the_whole_all_tiers_room_aside() -> None:
    """Conservative, as the dispatcher always did: the standard job waits a round."""
    interactive, standard = job(Tier.INTERACTIVE), job(Tier.STANDARD)
    got = offer(buffered(interactive, standard), [], {"a": {ALL_TIERS: 2}})
    assert got[Tier.INTERACTIVE]["a"] == [interactive]
    assert "a" not in got[Tier.STANDARD]


# --- properties ------------------------------------------------------------------------

EXAMPLES = settings(max_examples=150)  # enough to catch each broken allowance tried
SCOPES = [ALL_TIERS, *(t.value for t in TIER_ORDER)]
# (arrival, preemptions); arrivals collide on purpose (ties keep read order)
queue_of = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 2)), max_size=5)


@dataclass(frozen=True)
class State:
    caps: Caps
    running: list[RunningJob]
    queues: Queues  # as buffered
    got: Queues  # as offered


@st.composite
def states(draw: st.DrawFn) -> State:
    """Caps, running jobs, the buffered queues (read order, some empty) and the offer;
    per tenant and tier a few of each, so that caps are often reached and overrun (a cap
    lowered below what already runs)."""
    caps: dict[str, dict[str, int]] = {}
    running: list[RunningJob] = []
    queues: Queues = {t: {} for t in TIER_ORDER}
    for tenant in draw(st.permutations(TENANTS)):
        scopes = draw(st.dictionaries(st.sampled_from(SCOPES), st.integers(0, 4), max_size=3))
        listed = draw(st.booleans())  # an empty entry caps nothing, like no entry
        if scopes or listed:
            caps[tenant] = scopes
        for tier in TIER_ORDER:
            running += [run(tier, tenant) for _ in range(draw(st.integers(0, 3)))]
            queues[tier][tenant] = [job(tier, tenant, at, pre) for at, pre in draw(queue_of)]
    return State(caps, running, queues, offer(queues, running, caps))


def _running(s: State, tenant: str, scope: str) -> int:
    return sum(1 for r in s.running if r.tenant_id == tenant and scope in (ALL_TIERS, r.tier.value))


def _room(s: State, tenant: str, tier: Tier) -> int | None:
    """What the tenant's caps leave for one tier, from scratch; None where none applies."""
    scopes = s.caps.get(tenant, {})
    left = [
        cap - _running(s, tenant, scope)
        for scope, cap in scopes.items()
        if scope in (ALL_TIERS, tier.value)
    ]
    return min(left) if left else None


@EXAMPLES
@given(states())
def test_offered_jobs_never_take_a_tenant_past_any_cap(s: State) -> None:
    offered: Counter[tuple[str, str]] = Counter()
    for tier, tenants in s.got.items():
        for tenant, jobs in tenants.items():
            offered[(tenant, ALL_TIERS)] += len(jobs)
            offered[(tenant, tier.value)] += len(jobs)
    for tenant, scopes in s.caps.items():
        for scope, cap in scopes.items():
            # running + offered <= cap; nothing at all where the running jobs fill it
            assert offered[(tenant, scope)] <= max(0, cap - _running(s, tenant, scope))


@EXAMPLES
@given(states())
def test_uncapped_tenants_are_never_cut(s: State) -> None:
    for tier, tenants in s.queues.items():
        for tenant, jobs in tenants.items():
            if jobs and _room(s, tenant, tier) is None:
                assert len(s.got[tier].get(tenant, [])) == len(jobs)


@EXAMPLES
@given(states())
def test_offered_jobs_are_a_prefix_of_each_queue_preempted_first_then_by_arrival(
    s: State,
) -> None:
    assert set(s.got) == set(TIER_ORDER)
    for tier, tenants in s.got.items():
        for tenant, jobs in tenants.items():
            assert jobs, "a tenant with nothing to offer is left out"
            queue = s.queues[tier][tenant]
            # the order, spelled out apart from dispatch_order (stable: ties keep read order)
            preempted = sorted((j for j in queue if j.preemptions), key=lambda j: j.enqueued_at)
            fresh = sorted((j for j in queue if not j.preemptions), key=lambda j: j.enqueued_at)
            assert jobs == (preempted + fresh)[: len(jobs)]


@EXAMPLES
@given(states())
def test_a_tenant_below_its_caps_with_queued_work_is_offered_a_job(s: State) -> None:
    for tenant in TENANTS:
        rooms = [_room(s, tenant, t) for t in TIER_ORDER if s.queues[t][tenant]]
        if any(room is None or room > 0 for room in rooms):
            assert any(s.got[tier].get(tenant) for tier in TIER_ORDER)


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2)), max_size=20))
def test_dispatch_order_is_a_stable_sort_by_preempted_then_arrival(
    raw: list[tuple[int, int]],
) -> None:
    jobs = [job(Tier.BATCH, at=at, pre=pre) for at, pre in raw]
    ordered = dispatch_order(jobs)
    assert sorted(j.job_id for j in ordered) == sorted(j.job_id for j in jobs)
    keys = [(j.preemptions == 0, j.enqueued_at, jobs.index(j)) for j in ordered]
    assert keys == sorted(keys)
