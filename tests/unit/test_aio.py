"""The stop habits every loop shares (tierq.core.aio): a cancel that a library reports as an
error still ends the loop, and a stop never hangs on a task that will not end."""

from __future__ import annotations

import asyncio

import pytest
import redis

from tierq.core.aio import Detached, being_cancelled, cancel_and_wait


async def _read_that_turns_a_cancel_into_an_error() -> None:
    """What redis-py does to a read cut short by a cancel."""
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        raise redis.ConnectionError("Connection closed by server.") from None


async def test_a_loop_that_asks_being_cancelled_ends_at_its_first_cancel() -> None:
    turns = 0
    reading = asyncio.Event()

    async def loop() -> None:
        nonlocal turns
        while True:
            turns += 1
            try:
                reading.set()
                await _read_that_turns_a_cancel_into_an_error()
            except Exception as exc:
                if being_cancelled():
                    raise asyncio.CancelledError from exc
                await asyncio.sleep(0.01)  # an outage: carry on

    task = asyncio.create_task(loop())
    await asyncio.wait_for(reading.wait(), 1)  # cancelled in its read, as redis-py's are
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2)
    assert turns == 1


async def test_being_cancelled_is_false_for_a_real_outage() -> None:
    async def read() -> bool:
        try:
            raise redis.ConnectionError("refused")
        except redis.ConnectionError:
            return being_cancelled()

    assert await read() is False


async def test_cancel_and_wait_ends_a_loop_that_swallowed_its_cancel() -> None:
    """The hub's recheck loop before it asked being_cancelled: its cancel came back as a
    ConnectionError, the loop logged it and slept again. A second cancel ends it."""
    entered = asyncio.Event()
    reads = 0

    async def careless_loop() -> None:
        nonlocal reads
        while True:
            reads += 1
            try:
                entered.set()
                await _read_that_turns_a_cancel_into_an_error()
            except Exception:
                pass  # logged and carried on past: the cancel is gone
            await asyncio.sleep(30)  # its period

    task = asyncio.create_task(careless_loop(), name="careless")
    await asyncio.wait_for(entered.wait(), 1)
    loop = asyncio.get_running_loop()
    started = loop.time()
    stuck = await cancel_and_wait([task], timeout_s=5, recancel_s=0.2)
    assert stuck == set()
    assert task.cancelled()
    assert loop.time() - started < 2
    assert reads == 1  # the first cancel was swallowed in the read, the second ended the wait


async def test_cancel_and_wait_gives_up_on_a_task_that_will_not_end() -> None:
    release = asyncio.Event()
    entered = asyncio.Event()

    async def stubborn() -> None:
        entered.set()
        while not release.is_set():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                continue

    task = asyncio.create_task(stubborn(), name="stubborn")
    await asyncio.wait_for(entered.wait(), 1)  # a task not yet started would end at its cancel
    loop = asyncio.get_running_loop()
    started = loop.time()
    stuck = await cancel_and_wait([task], timeout_s=0.5, recancel_s=0.1)
    assert stuck == {task}
    assert 0.5 <= loop.time() - started < 1.5
    release.set()
    task.cancel()
    await asyncio.wait([task], timeout=1)
    assert task.done()


async def test_cancel_and_wait_retrieves_what_the_tasks_raised() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    done = asyncio.create_task(fails())
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert await cancel_and_wait([done], timeout_s=1) == set()
    assert done.done() and isinstance(done.exception(), RuntimeError)


async def test_detached_work_outlives_its_callers_cancel_and_its_errors_are_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    detached = Detached("a clean-up")
    finished = asyncio.Event()
    spawned = asyncio.Event()

    async def clean_up() -> None:
        await asyncio.sleep(0.05)
        finished.set()

    async def fail() -> None:
        raise ValueError("the clean-up's own error")

    async def caller() -> None:
        detached.spawn(clean_up())
        detached.spawn(fail())
        spawned.set()
        await asyncio.sleep(30)

    task = asyncio.create_task(caller())
    await asyncio.wait_for(spawned.wait(), 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not finished.is_set()  # the caller is gone, its clean-up not yet done
    await detached.wait(5)
    assert finished.is_set()
    assert "a clean-up failed: the clean-up's own error" in caplog.text
    await detached.wait(5)  # nothing left: returns at once


async def test_detached_waits_for_work_spawned_meanwhile_and_stop_cancels_the_rest() -> None:
    detached = Detached("a clean-up")
    ended: list[str] = []

    async def second() -> None:
        await asyncio.sleep(0.05)
        ended.append("second")

    async def first() -> None:
        await asyncio.sleep(0.05)
        detached.spawn(second())  # started while the owner waits
        ended.append("first")

    async def forever() -> None:
        try:
            await asyncio.sleep(30)
        finally:
            ended.append("forever, cancelled")

    detached.spawn(first())
    await detached.wait(5)
    assert ended == ["first", "second"]
    detached.spawn(forever())
    loop = asyncio.get_running_loop()
    started = loop.time()
    await detached.stop(0.1, cancel_s=1)
    assert loop.time() - started < 1
    assert ended[-1] == "forever, cancelled"
