"""A worker id names one inbox and one heartbeat, so one live process holds it: real
`tierq worker` processes (simulated engine) on the test's PostgreSQL and Redis.

- A second worker started under a live worker's id refuses to start (exit status 4,
  saying why), and the first keeps its heartbeat.
- After the holder is SIGKILLed, a worker restarted under its id on the same host takes it
  at once (the pid in the heartbeat is gone) — well before the heartbeat would be judged
  dead — and reads the inbox its predecessor left.
- An id whose heartbeat stopped moving elsewhere (another host's, frozen) is taken once
  WORKER_DEAD_AFTER_S passes without a refresh.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import Platform
from tests.integration.worker_proc import WorkerProcess, registered
from tierq.core.messages import Heartbeat
from tierq.core.queue import write_heartbeat
from tierq.core.redis_conn import redis_now
from tierq.launch.supervisor import default_worker_id
from tierq.workers import identity

pytestmark = pytest.mark.integration

# Long enough that taking an id "at once" cannot be a heartbeat that went stale.
DEAD_AFTER = {"WORKER_DEAD_AFTER_S": "60"}


async def _heartbeat(platform: Platform, worker_id: str) -> Heartbeat:
    raw = await platform.r.hget(platform.dispatcher.names.workers, worker_id)
    assert raw is not None
    return Heartbeat.decode(raw)


async def test_a_live_workers_id_is_refused_and_a_dead_ones_taken_at_once(
    platform: Platform, processes: list[WorkerProcess], tmp_path: Path
) -> None:
    first = WorkerProcess(platform, "w-one", tmp_path / "first.log", DEAD_AFTER)
    processes.append(first)
    await registered(platform, "w-one")
    held = await _heartbeat(platform, "w-one")
    assert held.holder.split(":")[1] == str(first.proc.pid)

    second = WorkerProcess(platform, "w-one", tmp_path / "second.log", DEAD_AFTER)
    processes.append(second)
    assert await second.exited(120) == 4
    assert "is held by a live worker" in (tmp_path / "second.log").read_text()
    assert first.proc.poll() is None
    assert (await _heartbeat(platform, "w-one")).holder == held.holder

    first.kill()  # SIGKILL: its heartbeat stays, live for another minute
    started = time.monotonic()
    third = WorkerProcess(platform, "w-one", tmp_path / "third.log", DEAD_AFTER)
    processes.append(third)
    deadline = time.monotonic() + 50
    while (await _heartbeat(platform, "w-one")).holder.split(":")[1] != str(third.proc.pid):
        assert time.monotonic() < deadline, "the restarted worker waited for a dead heartbeat"
        assert third.proc.poll() is None, (tmp_path / "third.log").read_text()
        await asyncio.sleep(0.1)
    assert time.monotonic() - started < 50
    third.signal(signal.SIGTERM)
    assert await third.exited(60) == 0


async def test_a_heartbeat_that_stops_moving_is_taken_once_it_is_dead(platform: Platform) -> None:
    names = platform.dispatcher.names
    now = await redis_now(platform.r)
    # Another host's worker, which last wrote a second ago and then stopped.
    await write_heartbeat(
        platform.r, names, Heartbeat("w-far", 8, 0, now - 1, holder="elsewhere:1234:abcd")
    )
    started = time.monotonic()
    await identity.claim(platform.r, names, "w-far", "here:1:a", dead_after_s=2.0, poll_s=0.1)
    waited = time.monotonic() - started
    assert 0.5 < waited < 10, waited  # it waited for the heartbeat to go stale, no longer

    # One that keeps moving is a live holder: refused.
    await write_heartbeat(
        platform.r, names, Heartbeat("w-live", 8, 0, now, holder="elsewhere:99:beef")
    )

    async def keep_beating() -> None:
        while True:
            await asyncio.sleep(0.05)
            ts = await redis_now(platform.r)
            await write_heartbeat(
                platform.r, names, Heartbeat("w-live", 8, 0, ts, holder="elsewhere:99:beef")
            )

    beating = asyncio.create_task(keep_beating())
    try:
        with pytest.raises(identity.WorkerIdTaken, match="held by a live worker"):
            await identity.claim(
                platform.r, names, "w-live", "here:2:b", dead_after_s=30.0, poll_s=0.1
            )
    finally:
        beating.cancel()


def test_tierq_run_gives_each_host_and_state_folder_its_own_worker_id(tmp_path: Path) -> None:
    from tierq.core.settings import Settings

    def of(folder: Path) -> str:
        return default_worker_id(Settings(state_dir=folder, _env_file=None))  # type: ignore[call-arg]

    a, b = of(tmp_path / "a"), of(tmp_path / "b")
    assert a != b and a == of(tmp_path / "a")  # stable across restarts
    assert a.startswith(f"{os.uname().nodename}-")


async def test_of_two_workers_starting_at_once_under_one_id_one_takes_it(
    platform: Platform,
) -> None:
    """No heartbeat yet, two claims at the same moment: one takes the id (its placeholder
    heartbeat written only if there was still none), the other judges the winner — here
    a live one, whose heartbeat moves — and is refused."""
    names = platform.dispatcher.names
    holders = {"far:1:one", "far:2:two"}
    claims = {
        asyncio.create_task(
            identity.claim(platform.r, names, "w-race", h, dead_after_s=30.0, poll_s=0.05)
        ): h
        for h in holders
    }
    done, pending = await asyncio.wait(claims, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1 and len(pending) == 1
    winner = claims[next(iter(done))]
    assert (await _heartbeat(platform, "w-race")).holder == winner

    async def keep_beating() -> None:
        while True:
            ts = await redis_now(platform.r)
            await write_heartbeat(platform.r, names, Heartbeat("w-race", 8, 0, ts, holder=winner))
            await asyncio.sleep(0.05)

    beating = asyncio.create_task(keep_beating())
    try:
        with pytest.raises(identity.WorkerIdTaken):
            await asyncio.wait_for(next(iter(pending)), 20)
    finally:
        beating.cancel()


async def test_a_draining_holder_is_waited_for_not_refused(platform: Platform) -> None:
    """A rolling restart: the new worker starts while the old one drains (its heartbeat
    still moving, draining). It waits, and takes the id once the old one retires."""
    names = platform.dispatcher.names
    old = "far:7:seven"

    async def drain_then_retire() -> None:
        for _ in range(20):
            ts = await redis_now(platform.r)
            await write_heartbeat(
                platform.r, names, Heartbeat("w-roll", 8, 1, ts, draining=True, holder=old)
            )
            await asyncio.sleep(0.05)
        await platform.r.hdel(names.workers, "w-roll")  # retired

    await write_heartbeat(
        platform.r,
        names,
        Heartbeat("w-roll", 8, 1, await redis_now(platform.r), draining=True, holder=old),
    )
    draining = asyncio.create_task(drain_then_retire())
    await identity.claim(platform.r, names, "w-roll", "far:8:new", dead_after_s=30, poll_s=0.05)
    assert draining.done()  # it waited for the retirement
    assert (await _heartbeat(platform, "w-roll")).holder == "far:8:new"
