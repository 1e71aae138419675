"""`tierq bench qos`'s fairness figures: the tenant gap, counted only while every batch tenant
is backlogged, and the batch tenants' shares over time."""

from __future__ import annotations

import pytest

from benchmarks.qos_report import Recorded, Trace, Window, tenant_gap, tenant_shares
from benchmarks.qos_workload import Arrival
from tierq.core.settings import Settings
from tierq.core.tiers import Tier

JOB = 100  # prompt + max tokens of every job here: the gap's unit


def recorded(
    starts: dict[str, list[float | None]], tokens: list[tuple[float, str, int]]
) -> Recorded:
    """Batch jobs all enqueued at 0; `starts`: per tenant, each job's first token (None:
    still waiting at the end); job ids are tenant-index."""
    trace = Trace(tokens=tokens)
    jobs: dict[str, tuple[Arrival, float]] = {}
    for tenant, firsts in starts.items():
        for i, first in enumerate(firsts):
            jid = f"{tenant}-{i}"
            jobs[jid] = (Arrival(0.0, Tier.BATCH, tenant, 40, 60), 0.0)
            if first is not None:
                trace.first_token[jid] = first
    jobs["chat"] = (Arrival(0.0, Tier.INTERACTIVE, "chat", 10, 10), 0.0)
    return Recorded(trace, jobs, 0.0, [], Settings())


def test_the_gap_stops_counting_when_a_tenant_has_nothing_left_waiting() -> None:
    # "small" has its last job begun at 5: from then on "big" rightly takes every batch token.
    run = recorded(
        {"small": [1.0, 5.0], "big": [1.0, 2.0, 6.0, None]},
        [
            (2.0, "small-0", 100),
            (3.0, "big-0", 150),
            (6.0, "big-2", 1000),  # after small's backlog ended: not a gap
            (9.0, "chat", 500),  # not batch
        ],
    )
    gap, backlogged_s = tenant_gap(run, Window(1.0, 10.0, 1.0))
    assert backlogged_s == pytest.approx(4.0)  # from the window's start (1) to 5
    assert gap == pytest.approx(100 / JOB)  # at 2, small 100 ahead; at 3, big 50 ahead


def test_the_gap_is_the_widest_at_any_moment_not_at_the_end() -> None:
    # "a" served alone first, then "b" alone: even at the end, 300 apart midway.
    run = recorded(
        {"a": [1.0, None], "b": [1.0, None]},
        [(2.0, "a-0", 300), (5.0, "b-0", 150), (7.0, "b-0", 150)],
    )
    assert tenant_gap(run, Window(1.0, 10.0, 1.0)) == (pytest.approx(300 / JOB), 9.0)


def test_tenants_backlogged_to_the_end_are_compared_over_the_whole_window() -> None:
    run = recorded(
        {"a": [1.0, None], "b": [1.0, None]},
        [(2.0, "a-0", 300), (8.0, "b-0", 100), (11.0, "b-0", 999)],  # the last: past the window
    )
    gap, backlogged_s = tenant_gap(run, Window(1.0, 10.0, 1.0))
    assert backlogged_s == pytest.approx(9.0)
    assert gap == pytest.approx(300 / JOB)  # widest at 2, before b's 100


def test_a_tenant_drained_before_the_window_leaves_nothing_to_compare() -> None:
    run = recorded({"a": [0.5], "b": [1.0, None]}, [(3.0, "b-1", 400)])
    assert tenant_gap(run, Window(2.0, 10.0, 1.0)) == (0.0, 0.0)


def test_one_batch_tenant_has_no_gap() -> None:
    run = recorded({"a": [1.0, None]}, [(3.0, "a-0", 400)])
    assert tenant_gap(run, Window(1.0, 10.0, 1.0)) == (0.0, 9.0)


def test_tenant_shares_over_time_split_each_span_of_the_window() -> None:
    run = recorded(
        {"small": [1.0], "big": [1.0, 2.0]},
        [
            (1.5, "small-0", 30),
            (2.0, "big-0", 90),  # span 1 (1-4): small 30 of 120
            (5.0, "big-1", 50),  # span 2 (4-7): big alone
            (9.0, "chat", 500),  # span 3 (7-10): no batch tokens, so no shares
            (11.0, "small-0", 500),  # after the window
        ],
    )
    shares = tenant_shares(run, Window(1.0, 10.0, 2.0), buckets=3)
    assert shares["t_s"] == [6.0, 12.0, 18.0]  # each span's end, simulated seconds
    assert shares["shares"] == {"big": [0.75, 1.0, None], "small": [0.25, 0.0, None]}
