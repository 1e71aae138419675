"""The one retry policy (tierq/core/retry.py): its waits, and what `retrying` retries, stops
on and never swallows."""

from __future__ import annotations

import asyncio

import pytest

from tierq.core.retry import Backoff, retrying


def test_the_waits_double_from_the_first_up_to_the_cap_and_start_over_after_a_success() -> None:
    backoff = Backoff(0.1, 1.0, jitter=False)
    assert [backoff.next_s() for _ in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    assert backoff.waited_s == 1.0
    backoff.reset()
    assert backoff.waited_s == 0.0
    assert backoff.next_s() == pytest.approx(0.1)
    # A cap below the first wait is every wait (as a webhook's settings may be set).
    assert [Backoff(5.0, 2.0, jitter=False).delay_s(n) for n in (1, 2, 3)] == [2.0, 2.0, 2.0]
    # Many failures in a row do not overflow.
    assert Backoff(0.1, 30.0, jitter=False).delay_s(10_000) == 30.0
    with pytest.raises(ValueError):
        Backoff(0.0, 1.0)


def test_each_jittered_wait_lies_between_half_and_all_of_its_delay_and_they_spread() -> None:
    waits = []
    for _ in range(200):
        backoff = Backoff(0.2, 0.8)
        waits.append([backoff.next_s() for _ in range(4)])
    for row in waits:
        for wait, delay in zip(row, (0.2, 0.4, 0.8, 0.8), strict=True):
            assert delay / 2 <= wait <= delay
    # Fleet members retrying together do not wait alike.
    assert len({round(row[0], 6) for row in waits}) > 100


async def test_retrying_waits_out_transient_errors_and_returns_the_result() -> None:
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 4:
            raise ConnectionError("refused")
        return "done"

    backoff = Backoff(0.001, 0.004)
    got = await retrying(flaky, transient=lambda e: isinstance(e, ConnectionError), backoff=backoff)
    assert (got, calls, backoff.failures) == ("done", 4, 3)


async def test_retrying_raises_other_errors_at_once_and_transient_ones_past_its_bounds() -> None:
    calls = 0

    async def broken() -> None:
        nonlocal calls
        calls += 1
        raise ValueError("not an outage")

    with pytest.raises(ValueError):
        await retrying(broken, transient=lambda e: False, backoff=Backoff(0.001, 0.001))
    assert calls == 1

    calls = 0

    async def down() -> None:
        nonlocal calls
        calls += 1
        raise ConnectionError("down")

    with pytest.raises(ConnectionError):
        await retrying(down, transient=lambda e: True, backoff=Backoff(0.001, 0.001), attempts=3)
    assert calls == 3

    # give_up is asked after each failure is counted: here, once the wait would pass 4 ms.
    calls = 0
    backoff = Backoff(0.001, 1.0, jitter=False)
    with pytest.raises(ConnectionError):
        await retrying(
            down,
            transient=lambda e: True,
            backoff=backoff,
            give_up=lambda: backoff.waited_s > 0.004,
        )
    assert calls == 4  # waits of 1, 2 and 4 ms, then 8 ms is past the bound


async def test_a_cancel_reported_by_a_library_as_an_outage_still_ends_the_retries() -> None:
    """redis-py may turn a cancelled read into a ConnectionError: `retrying` must end
    with the cancel, not wait it out as an outage."""
    started = asyncio.Event()

    async def read() -> None:
        started.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise ConnectionError("connection closed by a cancelled read") from None

    task = asyncio.create_task(
        retrying(read, transient=lambda e: True, backoff=Backoff(0.001, 0.001))
    )
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 1.0)
