"""The autoscaling signal (tierq/dispatcher/capacity.py): exact cases, and properties over
random inputs — it never asks for fewer workers when more work arrives."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tierq.core.tiers import TIER_ORDER, Tier
from tierq.dispatcher.capacity import (
    ArrivalRate,
    ServedRate,
    TokensPerJob,
    Waiting,
    desired_workers,
)

SLO = {Tier.INTERACTIVE: 5.0, Tier.STANDARD: 300.0, Tier.BATCH: 86_400.0}


def _waiting(interactive: int = 0, standard: int = 0, batch: int = 0, cost: float = 100):
    counts = {Tier.INTERACTIVE: interactive, Tier.STANDARD: standard, Tier.BATCH: batch}
    return [Waiting(t, n, n * cost) for t, n in counts.items()]


def test_no_work_needs_no_worker_and_any_work_needs_one() -> None:
    assert desired_workers(_waiting(), 0, 64, 200.0, SLO) == 0
    assert desired_workers(_waiting(batch=1), 0, 64, 200.0, SLO) == 1
    assert desired_workers(_waiting(), 1, 64, 200.0, SLO) == 1


def test_running_and_waiting_interactive_work_need_slots_now() -> None:
    # 100 running + 60 interactive waiting on 64-slot workers: 160 slots, 3 workers.
    assert desired_workers(_waiting(interactive=60), 100, 64, 200.0, SLO) == 3


def test_other_tiers_need_their_backlog_served_within_their_slo() -> None:
    # 600 standard jobs of 100 tokens within 300 s: 200 tokens/s, one worker's rate.
    assert desired_workers(_waiting(standard=600), 0, 64, 200.0, SLO) == 1
    assert desired_workers(_waiting(standard=601), 0, 64, 200.0, SLO) == 2
    # Before any measurement, each waiting job counts as a slot.
    assert desired_workers(_waiting(standard=129), 0, 64, None, SLO) == 3


def test_steady_arrivals_need_the_workers_that_keep_up_with_them() -> None:
    # Nothing waits, 10 jobs run, but 1,000 tokens/s arrive at 200 a worker: 5 workers.
    assert desired_workers(_waiting(), 10, 64, 200.0, SLO, arriving_tokens_per_s=1000.0) == 5
    # What runs is serving what arrives: the larger of the two terms, not their sum.
    assert desired_workers(_waiting(), 320, 64, 200.0, SLO, arriving_tokens_per_s=1000.0) == 5
    assert desired_workers(_waiting(), 384, 64, 200.0, SLO, arriving_tokens_per_s=1000.0) == 6
    # Unmeasured capacity: arrivals cannot be turned into workers yet.
    assert desired_workers(_waiting(), 10, 64, None, SLO, arriving_tokens_per_s=1000.0) == 1


def test_arrivals_are_the_growth_of_the_admitted_counter() -> None:
    rate = ArrivalRate(window_s=10)
    rate.tick(0.0, 1000)  # whatever came before this dispatcher started counting
    assert rate.per_second() == 0.0
    for second in range(1, 6):  # 3 jobs admitted each second
        rate.tick(float(second), 1000 + 3 * second)
    assert rate.per_second() == 3.0
    # Redis restarted empty: the counter went back; that tick counts nothing, the next
    # ones count again.
    rate.tick(6.0, 2)
    rate.tick(7.0, 5)
    assert rate.per_second() == (4 * 3 + 0 + 3) / 6
    for second in range(8, 30):  # quiet for a whole window
        rate.tick(float(second), 5)
    assert rate.per_second() == 0.0


def test_a_jobs_tokens_are_the_mean_of_those_finished_lately() -> None:
    per_job = TokensPerJob(window_s=10)
    assert per_job.mean(0.0) is None
    per_job.add(1.0, 100)
    per_job.add(2.0, 300)
    assert per_job.mean(2.0) == 200.0
    assert per_job.mean(11.5) == 300.0  # the first fell out of the window
    assert per_job.mean(30.0) is None


WORK = st.tuples(
    st.integers(0, 500), st.integers(0, 5_000), st.integers(0, 50_000), st.integers(0, 2_000)
)


@given(
    WORK,
    WORK,
    st.integers(1, 256),
    st.one_of(st.none(), st.floats(1.0, 10_000.0)),
    st.floats(1.0, 4_000.0),
    st.floats(0.0, 100_000.0),
    st.floats(0.0, 100_000.0),
)
def test_more_work_never_asks_for_fewer_workers(
    less: tuple[int, int, int, int],
    extra: tuple[int, int, int, int],
    slots: int,
    rate: float | None,
    cost: float,
    arriving: float,
    more_arriving: float,
) -> None:
    more = tuple(a + b for a, b in zip(less, extra, strict=True))
    low = desired_workers(_waiting(*less[:3], cost=cost), less[3], slots, rate, SLO, arriving)
    high = desired_workers(
        _waiting(*more[:3], cost=cost), more[3], slots, rate, SLO, arriving + more_arriving
    )
    assert high >= low
    # Enough slots for everything running and every interactive job waiting.
    assert high * slots >= more[3] + more[0]
    assert (high == 0) == (sum(more) == 0)


def test_the_served_rate_is_per_worker_per_second_it_was_measured() -> None:
    rate = ServedRate(window_s=10)
    assert rate.per_worker(0.0) is None
    for second in range(20):
        rate.add(float(second), 100, 2)  # two workers served 100 tokens that second
    # The last 10 s (seconds 9..19: 11 seconds with reports): 50 tokens a worker each.
    assert rate.per_worker(19.0) == 50.0
    # A quiet spell adds nothing (the dispatcher reports only while work waits): the
    # rate stays what a worker did at capacity, not what little was asked of it.
    rate.add(19.5, 10, 0)
    assert rate.per_worker(19.5) == 50.0
    assert rate.per_worker(100.0) is None
    assert set(TIER_ORDER) == set(SLO)
