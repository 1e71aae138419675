"""Two dispatchers as real processes (`tierq dispatcher`), the API and a worker on the
simulated engine in this process, the real PostgreSQL and Redis. The leader is killed
(SIGKILL) or paused (SIGSTOP, then SIGCONT): jobs keep flowing within the lease time,
the stale leader dispatches nothing, and each job runs and is billed once."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.ports import free_port
from tests.conftest import Platform
from tests.helpers import client, jobs_of, until_async, wait_for
from tests.integration.celery_proc import child_env
from tierq.core.redis_names import DISPATCH_GROUP, RedisNames
from tierq.dispatcher.loop import Dispatcher
from tierq.workers.engine.simulated_engine import CostModel

pytestmark = pytest.mark.integration

LEASE_S = 2.0
SLOW = CostModel(slots=8).scaled(2)  # 60 tokens take about a second
CHAT = {"messages": [{"role": "user", "content": "Count"}], "max_tokens": 60}


class DispatcherProc:
    """`tierq dispatcher` in a session of its own, with its metrics on a port."""

    def __init__(self, platform: Platform, name: str) -> None:
        s = platform.settings
        self.port = free_port()
        self.log = Path(s.state_dir) / f"{name}.log"
        env = child_env(
            s, DISPATCH_LEASE_S=str(LEASE_S), WORKER_DEAD_AFTER_S=str(s.worker_dead_after_s)
        )
        tierq = str(Path(sys.executable).parent / "tierq")
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [tierq, "dispatcher", "--metrics-port", str(self.port)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def signal(self, sig: signal.Signals) -> None:
        os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
        self.proc.wait()

    async def metric(self, name: str, missing: float | None = None) -> float:
        """A series' value; `missing` for a labelled one not exported yet (a counter
        whose labels were never used)."""
        async with httpx.AsyncClient(timeout=5) as c:
            text = (await c.get(f"http://127.0.0.1:{self.port}/metrics")).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        if missing is not None:
            return missing
        raise AssertionError(f"{name} not exported:\n{self.log.read_text()[-3000:]}")

    async def wait_metric(self, name: str, value: float, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if await self.metric(name) == value:
                    return
            except httpx.HTTPError:
                pass  # not serving yet
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, (
                f"{name} != {value}:\n{self.log.read_text()[-3000:]}"
            )
            await asyncio.sleep(0.1)


@pytest.fixture
async def pair(platform: Platform) -> AsyncIterator[tuple[DispatcherProc, DispatcherProc]]:
    """Two dispatchers; the first started leads (the second waits for its lease)."""
    first = DispatcherProc(platform, "dispatcher-1")
    await first.wait_metric("tierq_dispatcher_leader", 1)
    second = DispatcherProc(platform, "dispatcher-2")
    await second.wait_metric("tierq_dispatcher_leader", 0)
    await platform.start_worker("w1", cost=SLOW)
    yield first, second
    first.stop()
    second.stop()


async def _submit(c: httpx.AsyncClient, n: int) -> list[str]:
    ids = []
    for _ in range(n):
        resp = await c.post("/v1/jobs", json=CHAT)
        assert resp.status_code == 202, resp.text
        ids.append(resp.json()["id"])
    return ids


async def _assert_each_ran_and_was_billed_once(
    platform: Platform, c: httpx.AsyncClient, tenant_id: str, ids: list[str]
) -> list[Any]:
    finals = [await wait_for(c, i, timeout=90) for i in ids]
    assert {f["status"] for f in finals} == {"succeeded"}
    jobs = {j.id: j for j in await jobs_of(platform, tenant_id)}
    # Dispatched once: a second hand-off of a job would be a second delivery.
    assert {jobs[i].deliveries for i in ids} == {1}
    total = (await c.get("/v1/usage")).json()["total"]
    assert (total["requests"], total["completion_tokens"]) == (len(ids), 60 * len(ids))
    return [jobs[i] for i in ids]


async def test_a_killed_leader_is_replaced_within_the_lease_and_nothing_runs_twice(
    platform: Platform, tenant_key: str, pair: tuple[DispatcherProc, DispatcherProc]
) -> None:
    leader, standby = pair
    dispatched = 'tierq_jobs_dispatched_total{tier="standard"}'
    async with client(platform.url, tenant_key) as c:
        ids = await _submit(c, 40)  # 8 slots: five waves of about a second
        tenant_id = (await c.get("/v1/usage")).json()["tenant_id"]
        await wait_for(c, ids[0], timeout=30)
        leader.signal(signal.SIGKILL)
        killed = time.monotonic()
        assert await standby.metric(dispatched, 0) == 0
        # The standby's first hand-off: within the lease (it tries again just after the
        # lease would run out), plus a wave's decode for a slot to free.
        while await standby.metric(dispatched, 0) == 0:
            assert time.monotonic() - killed < LEASE_S + 5, standby.log.read_text()[-3000:]
            await asyncio.sleep(0.05)
        failover_s = time.monotonic() - killed
        await _assert_each_ran_and_was_billed_once(platform, c, tenant_id, ids)
    assert failover_s <= LEASE_S + 2.0


async def test_a_paused_leader_loses_its_lease_and_dispatches_nothing_when_it_wakes(
    platform: Platform, tenant_key: str, pair: tuple[DispatcherProc, DispatcherProc]
) -> None:
    leader, standby = pair
    async with client(platform.url, tenant_key) as c:
        ids = await _submit(c, 10)
        tenant_id = (await c.get("/v1/usage")).json()["tenant_id"]
        # 8 slots: the leader handed out 8 and holds 2 it read (pending for the group) but
        # could not place — the entries a stale leader would hand out again.
        stream = RedisNames(platform.settings.redis_prefix).tier_stream("standard", tenant_id)

        async def two_pending() -> bool:
            return bool((await platform.r.xpending(stream, DISPATCH_GROUP))["pending"] == 2)

        await until_async(two_pending, "the leader holds two entries it could not place", 20)
        leader.signal(signal.SIGSTOP)  # a long GC pause, a stopped VM
        ids += await _submit(c, 20)
        await standby.wait_metric("tierq_dispatcher_leader", 1, timeout=LEASE_S + 5)
        # While it sleeps, the standby runs everything (the paused one cannot).
        for i in ids:
            await wait_for(c, i, timeout=60)
        leader.signal(signal.SIGCONT)  # it wakes believing it leads
        await leader.wait_metric("tierq_dispatcher_leader", 0, timeout=LEASE_S + 5)
        ids += await _submit(c, 20)
        await _assert_each_ran_and_was_billed_once(platform, c, tenant_id, ids)
        # Handed out once in all: the stale leader's read-ahead went nowhere.
        dispatched = 'tierq_jobs_dispatched_total{tier="standard"}'
        assert await leader.metric(dispatched, 0) + await standby.metric(dispatched, 0) == len(ids)
        assert await leader.metric("tierq_dispatcher_leader") == 0
        assert await standby.metric("tierq_dispatcher_leader") == 1


async def test_a_standby_tries_for_the_lease_as_soon_as_it_would_run_out(
    platform: Platform,
) -> None:
    """A leader that stopped renewing leaves its lease to run out; the standby, told how
    long it has left, tries again just after it ends rather than at its next poll (a third
    of the lease, 1 s here)."""
    platform.settings.dispatch_lease_s = 3.0
    leader = Dispatcher(platform.settings, platform.r)
    standby = Dispatcher(platform.settings, platform.r)
    assert await leader.leadership.acquire()
    # The leader renewed last 2.6 s ago, and renews no more.
    await platform.r.pexpire(platform.dispatcher.names.dispatch_leader, 400)
    assert not await standby.leadership.acquire()
    assert 0 < standby.leadership.left_s <= 0.4
    started = time.monotonic()
    await standby._stand_by()
    assert await standby.leadership.acquire()
    assert time.monotonic() - started < 0.95  # its next poll would have been at 1 s
    # A lease without an expiry (set by hand) says nothing of its end: poll as before.
    standby.leadership.lost(fenced=False)
    await platform.r.persist(platform.dispatcher.names.dispatch_leader)
    assert not await leader.leadership.acquire()
    assert leader.leadership.left_s == 1.0  # a third of the lease
