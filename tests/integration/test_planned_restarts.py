"""Planned restarts and crashes a job did not cause cost it none of its deliveries.

MAX_DELIVERIES bounds the deliveries a job may have caused to fail (`jobs.fault_charge`):
a drain on SIGTERM, a drain cut short, a preemption cost nothing; a dead engine is charged
to the jobs that may have killed it, not to the ones generating beside them. On real
PostgreSQL and Redis; the workers of the first test are real `tierq worker` processes on
the simulated engine (the engine is not the subject), stopped with real signals.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Platform
from tests.helpers import client, until_async, until_streamed, wait_for
from tests.integration.worker_proc import WorkerProcess, registered
from tierq.core.messages import FAULT_UNIT, Heartbeat, JobMessage
from tierq.core.queue import write_heartbeat
from tierq.core.redis_names import DISPATCH_GROUP, RedisNames
from tierq.core.tiers import Tier
from tierq.dispatcher.leadership import Leadership
from tierq.models import jobs as job_repo
from tierq.workers.engine.base import Chunk, Engine, EngineDead, EngineWrapper
from tierq.workers.engine.simulated_engine import CostModel

pytestmark = pytest.mark.integration

SLOW = CostModel(slots=8).scaled(2)  # 60 tokens take about a second


async def test_three_sigterms_during_one_long_job_cost_it_no_delivery(
    platform: Platform, tenant_key: str, processes: list[WorkerProcess], tmp_path: Path
) -> None:
    """A rolling restart three times over one long job (MAX_DELIVERIES 3): each SIGTERM
    drains, hands the job back with what it generated, and the next worker resumes; the
    job succeeds with its whole output, billed once. (Each drain counted as a failed
    delivery before, and the fourth delivery dead-lettered it.)"""
    assert platform.settings.max_deliveries == 3
    platform.start_dispatcher()
    tokens = 600
    async with client(platform.url, tenant_key) as c:
        job = (
            await c.post(
                "/v1/jobs",
                json={
                    "messages": [{"role": "user", "content": "Count"}],
                    "max_tokens": tokens,
                    "tier": "standard",
                },
            )
        ).json()
        for restart in range(3):
            worker = WorkerProcess(platform, f"rolling-{restart}", tmp_path / f"w{restart}.log")
            processes.append(worker)
            await registered(platform, worker.worker_id)
            await wait_for(c, job["id"], ("running",), timeout=60)
            before = await _generated(platform, job["id"])
            # Let this run generate some tokens of its own, then restart it as planned.
            await _streams_more(platform, job["id"])
            worker.signal(signal.SIGTERM)
            assert await worker.exited(30) == 0
            handed_back = await _record(platform, job["id"])
            async with platform.db.session() as s:
                history = await job_repo.transitions(s, job["id"])
            assert handed_back.status.value == "queued", (
                history,
                handed_back.completion_tokens,
                handed_back.finish_reason,
            )
            assert await _generated(platform, job["id"]) > before  # it kept what it made
        last = WorkerProcess(platform, "rolling-last", tmp_path / "last.log")
        processes.append(last)
        final = await wait_for(c, job["id"], timeout=120)
    assert final["status"] == "succeeded", final
    assert final["result"]["text"] == "".join(f" tok{i}" for i in range(1, tokens + 1))
    assert final["usage"]["completion_tokens"] == tokens
    record = await _record(platform, job["id"])
    assert record.deliveries == 4 and record.fault_charge == 0
    async with platform.db.session() as s:
        assert len(await job_repo.usage_for_job(s, job["id"])) == 1


async def _record(platform: Platform, job_id: str) -> Any:
    async with platform.db.session() as s:
        record = await job_repo.get_job(s, job_id)
    assert record is not None
    return record


async def _streams_more(platform: Platform, job_id: str) -> None:
    """Until the job's run streams a token past those in its replay buffer now (the buffer
    holds every delivery's events, and only deltas until the job ends)."""
    events = RedisNames(platform.settings.redis_prefix).job_events(job_id)
    streamed = int(await platform.r.llen(events))

    async def more() -> bool:
        return int(await platform.r.llen(events)) > streamed

    await until_async(more, f"job {job_id} streams tokens of this run", 30)


async def _generated(platform: Platform, job_id: str) -> int:
    record = await _record(platform, job_id)
    return 0 if record.progress is None else len(record.progress.token_ids)


class PoisonEngine(EngineWrapper):
    """Kills the engine (EngineDead from then on, as vLLM's dead engine core) whenever a
    request whose prompt says POISON reaches its first step; other requests run as the
    inner engine runs them until then."""

    def __init__(self, inner: Engine) -> None:
        super().__init__(inner, "poison")
        self.dead = False

    def generate(
        self,
        request_id: str,
        messages: list[dict[str, Any]] | None,
        prompt: str | None,
        params: dict[str, Any],
        priority: int,
        resume: Sequence[int] = (),
        cache_salt: str | None = None,
    ) -> AsyncIterator[Chunk]:
        poison = "POISON" in str(messages or prompt)
        run = self.inner.generate(
            request_id, messages, prompt, params, priority, resume, cache_salt=cache_salt
        )
        return self._run(poison, run)

    async def _run(self, poison: bool, run: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
        if self.dead:
            raise EngineDead("the engine died")
        if poison:
            self.dead = True
            raise EngineDead("a poison request killed the engine")
        async for chunk in run:
            if self.dead:
                raise EngineDead("the engine died")
            yield chunk

    async def check_health(self) -> None:
        if self.dead:
            raise EngineDead("the engine died")
        await self.inner.check_health()


async def test_a_request_that_kills_the_engine_is_dead_lettered_alone(
    platform: Platform, tenant_key: str, other_tenant_key: str
) -> None:
    """One tenant's request kills the engine every time it is scheduled; another tenant's
    long jobs run beside it. Its crashes are charged to it (the one in its first step),
    so it is dead-lettered after MAX_DELIVERIES crashes, while the other tenant's jobs,
    handed back with their progress each time, succeed whole and billed once. (Before,
    every crash counted against every job in the engine: after three, all were dead.)"""
    platform.start_dispatcher()
    tokens = 300
    innocent_body = {
        "messages": [{"role": "user", "content": "Count"}],
        "max_tokens": tokens,
        "tier": "standard",
    }
    async with (
        client(platform.url, other_tenant_key) as other,
        client(platform.url, tenant_key) as c,
    ):
        innocent = [(await other.post("/v1/jobs", json=innocent_body)).json() for _ in range(3)]
        worker_no = 0
        await platform.start_worker("crashy-0", cost=SLOW, wrap=PoisonEngine)
        for j in innocent:
            await until_streamed(platform, j["id"])  # they generate
        poison = (
            await c.post(
                "/v1/jobs",
                json={"messages": [{"role": "user", "content": "POISON"}], "max_tokens": 8},
            )
        ).json()
        deadline = time.monotonic() + 90
        while (await c.get(f"/v1/jobs/{poison['id']}")).json()["status"] not in (
            "failed",
            "succeeded",
        ):
            assert time.monotonic() < deadline, "the poison job was never dead-lettered"
            _, task, _ = platform.workers[f"crashy-{worker_no}"]
            if task.done():  # its engine died: the supervisor starts a fresh worker
                platform.workers.pop(f"crashy-{worker_no}")
                worker_no += 1
                await platform.start_worker(f"crashy-{worker_no}", cost=SLOW, wrap=PoisonEngine)
            await asyncio.sleep(0.05)
        dead = (await c.get(f"/v1/jobs/{poison['id']}")).json()
        finals = [await wait_for(other, j["id"], timeout=90) for j in innocent]
    assert dead["status"] == "failed" and dead["error"]["code"] == "max_deliveries_exceeded"
    assert worker_no >= 3  # it killed an engine once a delivery, MAX_DELIVERIES times
    expected = "".join(f" tok{i}" for i in range(1, tokens + 1))
    for final in finals:
        assert final["status"] == "succeeded", final
        assert final["result"]["text"] == expected
        record = await _record(platform, final["id"])
        assert record.fault_charge < platform.settings.max_deliveries * FAULT_UNIT
        async with platform.db.session() as s:
            assert len(await job_repo.usage_for_job(s, final["id"])) == 1
    poisoned = await _record(platform, poison["id"])
    assert poisoned.fault_charge >= platform.settings.max_deliveries * FAULT_UNIT


async def test_a_hand_off_never_recreates_the_inbox_of_a_worker_that_retired(
    platform: Platform, tenant_key: str
) -> None:
    """A dispatcher acting on a snapshot of the heartbeats taken before a worker retired
    (its inbox and heartbeat deleted together) hands nothing to it: the job stays pending
    on its stream, no inbox is made that nobody reads, and the job goes to a live worker.
    A draining worker is refused the same way."""
    names: RedisNames = platform.dispatcher.names
    r = platform.r
    lease = Leadership(r, names, 10.0)
    assert await lease.acquire()
    async with client(platform.url, tenant_key) as c:
        job = (
            await c.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 4, "tier": "standard"})
        ).json()
    record = await _record(platform, job["id"])
    stream = names.tier_stream(Tier.STANDARD, record.tenant_id)
    await r.xgroup_create(stream, DISPATCH_GROUP, id="0", mkstream=True)  # as a dispatcher
    (got,) = await lease.read_group(DISPATCH_GROUP, "d", {stream: ">"}, 10)
    ((entry_id, fields),) = got[1]
    msg = JobMessage.decode(fields)
    # "gone" retired: no heartbeat, no inbox. "leaving" drains.
    await write_heartbeat(r, names, Heartbeat("leaving", 8, 0, time.time(), draining=True))
    moves = [(w, names.inbox(w), stream, entry_id, msg.encode()) for w in ("gone", "leaving")]
    assert await lease.hand_off(DISPATCH_GROUP, moves) == [False, False]
    assert not await r.exists(names.inbox("gone"))
    assert not await r.exists(names.inbox("leaving"))
    pending = await r.xpending(stream, DISPATCH_GROUP)
    assert pending["pending"] == 1  # still the dispatcher's to hand out
    await write_heartbeat(r, names, Heartbeat("live", 8, 0, time.time()))
    assert await lease.hand_off(
        DISPATCH_GROUP, [("live", names.inbox("live"), stream, entry_id, msg.encode())]
    ) == [True]
    assert await r.xlen(names.inbox("live")) == 1
    assert (await r.xpending(stream, DISPATCH_GROUP))["pending"] == 0
    await lease.release()
