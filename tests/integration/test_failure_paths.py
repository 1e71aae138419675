"""Every failure ends a job or hands it back, on real PostgreSQL and Redis.

The engine is the simulated one wrapped in the fault-injecting engine
(tierq/workers/engine/faulty_engine.py), which raises each class of failure an engine raises — the
request refused, vLLM's own validation error, an unknown error, the engine dying. Redis
faults are real: `CLIENT KILL` of every connection, keys deleted under running workers.
After each: every job ends `succeeded` or `failed` with a clear code, every inbox is empty
(the worker's load is back to zero), nothing is pending in any consumer group, and each
succeeded job has exactly one usage record matching its result.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import uuid
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from sqlalchemy import exc as sa_exc

from tests.conftest import REDIS_TEST_URL, Platform
from tests.helpers import (
    client,
    jobs_of,
    read_sse,
    until,
    until_async,
    until_streamed,
    wait_for,
)
from tierq.core import metrics
from tierq.core.queue import enqueue
from tierq.core.redis_names import DISPATCH_GROUP, WORKER_GROUP
from tierq.dispatcher.loop import Dispatcher
from tierq.models import jobs as job_repo
from tierq.workers import worker as worker_mod
from tierq.workers.engine.base import Engine, EngineWrapper
from tierq.workers.engine.faulty_engine import FaultyEngine
from tierq.workers.engine.simulated_engine import CostModel
from tierq.workers.reconcile import reconcile

pytestmark = pytest.mark.integration

CHAT = {"messages": [{"role": "user", "content": "Count"}], "max_tokens": 20}
SLOW = CostModel(slots=8).scaled(2)  # 60 tokens take about a second
FREEZE_S = float(os.environ.get("TIERQ_FREEZE_S", "5"))


def faulty(kind: str, rate: float = 1.0) -> Any:
    def wrap(engine: Engine) -> Engine:
        return FaultyEngine(engine, rate, seed=7, kinds=(kind,))

    return wrap


async def assert_nothing_left(platform: Platform, job_ids: list[str]) -> list[dict[str, Any]]:
    """Every job ended with a code, no slot or entry leaked, each success billed once."""
    # A client of its own: the platform's pool may hold connections a fault killed.
    r = aioredis.Redis.from_url(platform.settings.resolved_redis_url, decode_responses=True)
    try:
        return await _assert_nothing_left(platform, job_ids, r)
    finally:
        await r.aclose()


async def _assert_nothing_left(
    platform: Platform, job_ids: list[str], r: aioredis.Redis
) -> list[dict[str, Any]]:
    names = platform.dispatcher.names
    finals = []
    async with platform.db.session() as s:
        for job_id in job_ids:
            job = await job_repo.get_job(s, job_id)
            assert job is not None
            assert job.status.value in ("succeeded", "failed"), (job_id, job.status)
            usage = await job_repo.usage_for_job(s, job_id)
            if job.status.value == "succeeded":
                assert len(usage) == 1 and usage[0].completion_tokens == job.completion_tokens
            else:
                assert job.error_code, job_id
                assert usage == []
            history = [st for st, _ in await job_repo.transitions(s, job_id)]
            assert history.count("succeeded") + history.count("failed") == 1, history
            finals.append(job.to_api())
    # The inboxes of every worker are empty: each slot was given back.
    for worker_id in platform.workers:
        inbox = names.inbox(worker_id)

        async def emptied(inbox: str = inbox) -> bool:
            return await r.xlen(inbox) == 0

        await until_async(emptied, f"{worker_id}'s inbox emptied", 5)
        if await r.exists(names.inbox(worker_id)):
            pending: Any = await r.xpending(names.inbox(worker_id), WORKER_GROUP)
            assert pending["pending"] == 0
    # Nothing is pending in the dispatcher's group on any tier stream.
    async for key in r.scan_iter(match=f"{platform.settings.redis_prefix}:stream:*"):
        pending = await r.xpending(key, DISPATCH_GROUP)
        assert pending["pending"] == 0, key
    return finals


async def submit(c: httpx.AsyncClient, n: int, body: dict[str, Any] = CHAT) -> list[str]:
    """Submit as the SDKs do: a 503 (a dependency restarting) is retried, with the same
    Idempotency-Key, after its Retry-After."""
    ids = []
    for _ in range(n):
        key = uuid.uuid4().hex
        for _attempt in range(10):
            resp = await c.post("/v1/jobs", json=body, headers={"Idempotency-Key": key})
            if resp.status_code != 503:
                break
            await asyncio.sleep(float(resp.headers["Retry-After"]))
        assert resp.status_code == 202, resp.text
        ids.append(resp.json()["id"])
    return ids


@pytest.mark.parametrize(
    ("kind", "code"),
    [("request", "invalid_request"), ("validation", "context_length_exceeded")],
)
async def test_a_request_the_engine_refuses_fails_with_its_code_and_frees_its_slot(
    platform: Platform, tenant_key: str, kind: str, code: str
) -> None:
    platform.start_dispatcher()
    await platform.start_worker("w1", wrap=faulty(kind))
    async with client(platform.url, tenant_key) as c:
        ids = await submit(c, 12)  # more than the worker's 8 slots: a leak would jam it
        finals = [await wait_for(c, i, timeout=30) for i in ids]
    assert {(f["status"], f["error"]["code"]) for f in finals} == {("failed", code)}
    await assert_nothing_left(platform, ids)


async def test_an_unknown_engine_error_is_retried_then_fails_with_engine_error(
    platform: Platform, tenant_key: str
) -> None:
    platform.settings.max_deliveries = 3
    platform.start_dispatcher()
    await platform.start_worker("w1", wrap=faulty("random"))
    async with client(platform.url, tenant_key) as c:
        # Each delivery fails after at most 8 tokens, and the next resumes after them: 100
        # tokens cannot be reached in 3 deliveries.
        ids = await submit(c, 10, {**CHAT, "max_tokens": 100})
        finals = [await wait_for(c, i, timeout=30) for i in ids]
    assert {(f["status"], f["error"]["code"]) for f in finals} == {("failed", "engine_error")}
    await assert_nothing_left(platform, ids)
    async with platform.db.session() as s:
        for job_id in ids:
            job = await job_repo.get_job(s, job_id)
            assert job is not None and job.deliveries == 3  # every delivery was used


async def test_an_unknown_error_once_is_retried_and_the_job_succeeds(
    platform: Platform, tenant_key: str
) -> None:
    platform.start_dispatcher()
    await platform.start_worker("w1", wrap=faulty("random", rate=0.5))
    async with client(platform.url, tenant_key) as c:
        ids = await submit(c, 16)
        finals = [await wait_for(c, i, timeout=60) for i in ids]
    # Half fail on each delivery, so with 3 deliveries most succeed; none is left hanging.
    assert sum(f["status"] == "succeeded" for f in finals) >= 8
    assert all(f["status"] == "succeeded" or f["error"]["code"] == "engine_error" for f in finals)
    await assert_nothing_left(platform, ids)
    async with platform.db.session() as s:
        jobs = [await job_repo.get_job(s, i) for i in ids]
    # Some succeeded only on a later delivery: the error really was retried.
    assert any(j is not None and j.status.value == "succeeded" and j.deliveries > 1 for j in jobs)


async def test_a_dead_engine_hands_its_jobs_back_and_the_worker_exits(
    platform: Platform, tenant_key: str
) -> None:
    platform.settings.engine_health_interval_s = 0.1
    platform.start_dispatcher()
    await platform.start_worker("doomed", cost=SLOW, wrap=faulty("dead", rate=0.3))
    _, task, _ = platform.workers["doomed"]
    async with client(platform.url, tenant_key) as c:
        assert (await c.get("/readyz?min_workers=1")).status_code == 200
        ids = await submit(c, 6, {**CHAT, "max_tokens": 40})
        with pytest.raises(worker_mod.EngineDead):
            await asyncio.wait_for(task, 30)  # it stops on its own, loudly
        # It stopped advertising capacity: its heartbeat is gone.
        names = platform.dispatcher.names
        assert await platform.r.hget(names.workers, "doomed") is None
        platform.workers.pop("doomed")
        async with platform.db.session() as s:
            statuses = {(await job_repo.get_job(s, i)).status.value for i in ids}  # type: ignore[union-attr]
        assert statuses <= {"queued", "succeeded"}  # handed back, none left running
        await platform.start_worker("healthy", cost=SLOW)
        finals = [await wait_for(c, i, timeout=60) for i in ids]
    assert {f["status"] for f in finals} == {"succeeded"}
    await assert_nothing_left(platform, ids)


async def test_a_run_the_engine_goes_silent_on_is_handed_back_once_and_finishes(
    platform: Platform, tenant_key: str
) -> None:
    """The watchdog (JOB_STALL_S): a run whose engine streams nothing more is aborted in the
    engine and handed back with its progress, at no charge — with one delivery allowed, a
    charged hand-back would dead-letter the job; here each finishes on its next run."""
    platform.settings.job_stall_s = 1.0
    platform.settings.max_deliveries = 1
    platform.start_dispatcher()
    hosted: list[FaultyEngine] = []

    def stalls(engine: Engine) -> Engine:
        hosted.append(FaultyEngine(engine, 1.0, seed=7, kinds=("stall",)))
        return hosted[0]

    await platform.start_worker("w1", cost=SLOW, wrap=stalls)
    stalled_before = metrics.JOB_STALLS.labels("standard")._value.get()
    async with client(platform.url, tenant_key) as c:
        ids = await submit(c, 4, {**CHAT, "max_tokens": 40})
        finals = [await wait_for(c, i, timeout=60) for i in ids]
    assert [f["status"] for f in finals] == ["succeeded"] * 4
    assert all(f["usage"]["completion_tokens"] == 40 for f in finals)
    await assert_nothing_left(platform, ids)
    async with platform.db.session() as s:
        for job_id in ids:
            job = await job_repo.get_job(s, job_id)
            assert job is not None and job.deliveries == 2 and job.fault_charge == 0
            history = [st for st, _ in await job_repo.transitions(s, job_id)]
            assert history == ["queued", "running", "queued", "running", "succeeded"], history
    assert hosted[0].injected["stall"] == 4
    assert metrics.JOB_STALLS.labels("standard")._value.get() - stalled_before == 4
    # Nothing of the silent runs is left in the engine: each was aborted there.
    _, _, engine = platform.workers["w1"]
    assert engine._running == {} and engine._waiting == []


async def test_a_cancelled_job_is_billed_for_what_the_engine_generated_and_once(
    platform: Platform, tenant_key: str
) -> None:
    platform.start_dispatcher()
    worker = await platform.start_worker("w1", cost=SLOW)
    async with client(platform.url, tenant_key) as c:
        (running,) = await submit(c, 1, {**CHAT, "max_tokens": 200})
        await read_sse(c, f"/v1/jobs/{running}/events", limit=10)  # tokens generated
        assert (await c.post(f"/v1/jobs/{running}/cancel")).status_code == 200
        (queued,) = await submit(c, 1, {**CHAT, "tier": "batch"})
        assert (await c.post(f"/v1/jobs/{queued}/cancel")).status_code == 200  # never ran
        billed: dict[str, Any] = {}

        async def is_billed() -> bool:
            billed.update((await c.get(f"/v1/jobs/{running}")).json())
            return billed["usage"] is not None

        await until_async(is_billed, "the cancelled run billed", 5)
        never_ran = (await c.get(f"/v1/jobs/{queued}")).json()
        await until(lambda: not worker._runs, "the worker is done with the cancelled run", 10)
        again = (await c.post(f"/v1/jobs/{running}/cancel")).json()
    assert billed["status"] == "cancelled"
    assert 10 <= billed["usage"]["completion_tokens"] < 200
    assert never_ran["usage"] is None
    assert again["usage"] == billed["usage"]  # cancelling twice bills nothing more
    async with platform.db.session() as s:
        ledger = await job_repo.usage_for_job(s, running)
        assert await job_repo.usage_for_job(s, queued) == []
    assert [(u.prompt_tokens, u.completion_tokens) for u in ledger] == [
        (billed["usage"]["prompt_tokens"], billed["usage"]["completion_tokens"])
    ]


async def test_readyz_names_a_worker_whose_engine_died(platform: Platform) -> None:
    from tierq.core.messages import Heartbeat
    from tierq.core.queue import write_heartbeat
    from tierq.core.redis_conn import redis_now

    names = platform.dispatcher.names
    now = await redis_now(platform.r)
    hb = Heartbeat("w-dead", 8, 0, now, draining=True, engine_ok=False)
    await write_heartbeat(platform.r, names, hb)
    async with client(platform.url, None) as c:
        resp = await c.get("/readyz")
        waiting = await c.get("/readyz", params={"min_workers": 1})
    # The replica still admits (the jobs wait in their tiers); the fleet's state is named.
    assert resp.status_code == 200
    assert resp.json()["fleet"] == "engine dead on w-dead"
    assert resp.json()["dead_engines"] == ["w-dead"]
    assert waiting.status_code == 503
    assert waiting.json()["checks"]["workers"] == "error: 0 of 1: engine dead on w-dead"


async def test_a_transient_database_error_in_finish_is_retried(
    platform: Platform, tenant_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_finish = job_repo.finish_job
    failures = {"left": 3}

    def flaky_finish(*args: Any, **kwargs: Any) -> Any:
        if failures["left"] > 0:
            failures["left"] -= 1
            raise sa_exc.OperationalError("UPDATE jobs", {}, ConnectionResetError("reset"))
        return real_finish(*args, **kwargs)

    monkeypatch.setattr(job_repo, "finish_job", flaky_finish)
    platform.start_dispatcher()
    await platform.start_worker("w1")
    async with client(platform.url, tenant_key) as c:
        ids = await submit(c, 3)
        finals = [await wait_for(c, i, timeout=30) for i in ids]
    assert failures["left"] == 0
    assert {f["status"] for f in finals} == {"succeeded"}
    await assert_nothing_left(platform, ids)


async def test_a_database_that_refuses_the_result_leaves_the_job_to_the_reconciler(
    platform: Platform, tenant_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-transient error in finish: the slot is freed, and the job, held by nothing,
    goes back through the reconciler until it is dead-lettered — never stuck running."""

    def refusing_finish(*args: Any, **kwargs: Any) -> Any:
        raise sa_exc.DataError("UPDATE jobs", {}, ValueError("refused"))

    monkeypatch.setattr(job_repo, "finish_job", refusing_finish)
    platform.settings.max_deliveries = 2
    platform.settings.reconcile_orphan_grace_s = 0.0
    platform.start_dispatcher()
    await platform.start_worker("w1")
    async with client(platform.url, tenant_key) as c:
        (job_id,) = await submit(c, 1)
        for _ in range(10):
            await asyncio.sleep(0.5)
            await reconcile(platform.settings, platform.db, platform.jobs, platform.r)
            if (await c.get(f"/v1/jobs/{job_id}")).json()["status"] == "failed":
                break
        final = await wait_for(c, job_id, timeout=5)
    assert final["status"] == "failed"
    assert final["error"]["code"] == "max_deliveries_exceeded"
    await assert_nothing_left(platform, [job_id])


async def test_a_duplicate_entry_for_a_running_job_holds_no_slot_and_is_acknowledged(
    platform: Platform, tenant_key: str
) -> None:
    platform.start_dispatcher()
    await platform.start_worker("w1", cost=SLOW)
    async with client(platform.url, tenant_key) as c:
        (job_id,) = await submit(c, 1, {**CHAT, "max_tokens": 60})
        await wait_for(c, job_id, ("running",))
        async with platform.db.session() as s:
            record = await job_repo.get_job(s, job_id)
        assert record is not None
        names = platform.dispatcher.names
        await platform.r.xadd(names.inbox("w1"), record.to_message().encode())  # type: ignore[arg-type]

        async def one_entry() -> bool:  # the worker adopts the new entry, lets the old one go
            return await platform.r.xlen(names.inbox("w1")) == 1

        await until_async(one_entry, "one entry left in w1's inbox", 2)
        final = await wait_for(c, job_id)
    assert final["status"] == "succeeded"
    await assert_nothing_left(platform, [job_id])
    async with platform.db.session() as s:
        assert (await job_repo.get_job(s, job_id)).deliveries == 1  # type: ignore[union-attr]


async def test_a_job_run_twice_streams_and_finishes_once(
    platform: Platform, tenant_key: str
) -> None:
    """Redis lost track of a running job and it was enqueued again while its first run
    went on: the later delivery fences the earlier off — no delta twice, one finish."""
    # Placement by free slots: the second delivery goes to the idle worker (affinity would
    # send it to the first, which holds the job already and lets the duplicate go).
    unpinned = platform.settings.model_copy(update={"affinity_slack": 0.0})
    platform.dispatcher = Dispatcher(unpinned, platform.r)
    platform.start_dispatcher()
    slower = CostModel(slots=8).scaled(1)  # 150 tokens take about 5 s
    await platform.start_worker("first", cost=slower)
    async with client(platform.url, tenant_key) as c:
        # Long enough that the second delivery claims it while the first still runs, even
        # on a loaded machine (at SLOW's 2.5 s a CI run under load once lost that race).
        (job_id,) = await submit(c, 1, {**CHAT, "max_tokens": 150})
        follower = asyncio.create_task(read_sse(c, f"/v1/jobs/{job_id}/events"))
        await read_sse(c, f"/v1/jobs/{job_id}/events", limit=5)  # under way on `first`
        await platform.start_worker("second", cost=slower)
        # Placement reads the workers' heartbeats: until `second` has written its first,
        # the duplicate would go to `first`, which holds the job and lets it go (a CI run
        # once lost that race).
        names = platform.dispatcher.names

        async def second_beats() -> bool:
            return await platform.r.hget(names.workers, "second") is not None

        await until_async(second_beats, "the second worker's first heartbeat", 5)
        async with platform.db.session() as s:
            record = await job_repo.get_job(s, job_id)
        assert record is not None
        await enqueue(platform.r, platform.dispatcher.names, record.to_message())
        final = await wait_for(c, job_id, timeout=30)
        events = await asyncio.wait_for(follower, 30)
    assert final["status"] == "succeeded"
    text = "".join(e["data"]["text"] for e in events if e["event"] == "delta")
    assert text == final["result"]["text"] == "".join(f" tok{i}" for i in range(1, 151))
    assert [int(e["id"]) for e in events] == list(range(1, len(events) + 1))
    assert [e["event"] for e in events].count("done") == 1
    async with platform.db.session() as s:
        assert (await job_repo.get_job(s, job_id)).deliveries == 2  # type: ignore[union-attr]
    await assert_nothing_left(platform, [job_id])


async def test_after_a_redis_flush_a_job_a_live_worker_runs_is_not_run_again(
    platform: Platform, tenant_key: str
) -> None:
    platform.settings.reconcile_orphan_grace_s = 1.0
    platform.start_dispatcher()
    await platform.start_worker("w1", cost=SLOW)
    async with client(platform.url, tenant_key) as c:
        (job_id,) = await submit(c, 1, {**CHAT, "max_tokens": 100})
        await wait_for(c, job_id, ("running",))
        keys = [k async for k in platform.r.scan_iter(match=f"{platform.settings.redis_prefix}:*")]
        await platform.r.delete(*keys)  # Redis restarted empty
        # The reconciler runs while the worker still generates, past the 1 s orphan grace.
        for _ in range(4):
            assert await reconcile(platform.settings, platform.db, platform.jobs, platform.r) == []
            await asyncio.sleep(0.4)
        final = await wait_for(c, job_id, timeout=30)
    assert final["status"] == "succeeded"
    async with platform.db.session() as s:
        assert (await job_repo.get_job(s, job_id)).deliveries == 1  # type: ignore[union-attr]
    await assert_nothing_left(platform, [job_id])


async def test_a_follower_reconnecting_after_redis_lost_its_data_misses_nothing(
    platform: Platform, tenant_key: str
) -> None:
    """Redis restarts empty mid-stream: the worker restores the job's replay buffer with
    the ids clients already saw, so a reconnect with Last-Event-ID resumes exactly."""
    platform.start_dispatcher()
    await platform.start_worker("w1", cost=SLOW)
    async with client(platform.url, tenant_key) as c:
        (job_id,) = await submit(c, 1, {**CHAT, "max_tokens": 60})
        first = await read_sse(c, f"/v1/jobs/{job_id}/events", limit=5)
        keys = [k async for k in platform.r.scan_iter(match=f"{platform.settings.redis_prefix}:*")]
        await platform.r.delete(*keys)  # Redis restarted without persistence
        await until_streamed(platform, job_id)  # the worker streams on, into a fresh buffer
        rest = await read_sse(
            c, f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": first[-1]["id"]}
        )
        final = await wait_for(c, job_id, timeout=30)
    events = first + rest
    assert [int(e["id"]) for e in events] == list(range(1, len(events) + 1))
    text = "".join(e["data"]["text"] for e in events if e["event"] == "delta")
    assert text == final["result"]["text"] == "".join(f" tok{i}" for i in range(1, 61))
    assert events[-1]["event"] == "done"


async def test_client_kill_during_hand_offs_loses_nothing(
    platform: Platform, tenant_key: str
) -> None:
    platform.start_dispatcher()
    await platform.start_worker("w1")
    await platform.start_worker("w2")
    async with client(platform.url, tenant_key) as c:
        ids: list[str] = []
        for _ in range(8):
            ids += await submit(c, 5)
            # Every connection but this one: the dispatcher's, the workers' and the API's,
            # and the subscriptions (the workers' control channels, SSE followers).
            # (From a connection of its own: the platform's pool is among the killed.)
            killer = aioredis.Redis.from_url(REDIS_TEST_URL)
            try:
                killed = await killer.execute_command(
                    "CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"
                )
                killed += await killer.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
            finally:
                await killer.aclose()
            assert killed > 0
            await asyncio.sleep(0.1)  # the kills spread over the run, between the submissions
        finals = [await wait_for(c, i, timeout=60) for i in ids]
    assert {f["status"] for f in finals} == {"succeeded"}
    await assert_nothing_left(platform, ids)


async def test_postgres_dropping_every_connection_mid_run_loses_nothing(
    platform: Platform, tenant_key: str
) -> None:
    """PostgreSQL ends every session of the platform's database while jobs start, stream
    and finish (as a restart or a failover does): the workers wait it out and go on."""
    from sqlalchemy import text

    platform.start_dispatcher()
    await platform.start_worker("w1", cost=SLOW)
    await platform.start_worker("w2", cost=SLOW)
    terminate = text(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )
    async with client(platform.url, tenant_key) as c:
        ids: list[str] = []
        for _ in range(5):
            ids += await submit(c, 4, {**CHAT, "max_tokens": 30})
            await asyncio.sleep(0.3)  # the drops spread over the run, between the submissions
            async with platform.db.session() as s:
                assert (await s.execute(terminate)).scalar_one() > 0
        finals = [await wait_for(c, i, timeout=60) for i in ids]
    assert {f["status"] for f in finals} == {"succeeded"}
    await assert_nothing_left(platform, ids)


async def test_a_restarted_dispatcher_delivers_every_pending_entry_of_a_shard(
    platform: Platform, tenant_key: str
) -> None:
    """A dispatcher read 100 entries of one tenant's shard and died before handing them
    out: they are pending for its consumer name, and its successor delivers all 100."""
    async with client(platform.url, tenant_key) as c:
        ids = await submit(c, 100, {**CHAT, "max_tokens": 2})
        first = Dispatcher(platform.settings, platform.r)
        assert await first.leadership.acquire()  # it led, and dies holding the lease
        await first._recover()
        for _ in range(10):  # read the whole shard into its read-ahead (pending now)
            first._buffered.clear()
            await first._read()
        tenant = await _tenant_of(platform, ids[0])
        stream = platform.dispatcher.names.tier_stream("standard", tenant)
        pending: Any = await platform.r.xpending(stream, DISPATCH_GROUP)
        assert pending["pending"] == 100
        # Same consumer name, as every dispatcher has; it leads once the lease runs out.
        platform.start_dispatcher()
        await platform.start_worker("w1")
        finals = [await wait_for(c, i, timeout=60) for i in ids]
    assert {f["status"] for f in finals} == {"succeeded"}
    await assert_nothing_left(platform, ids)


async def _tenant_of(platform: Platform, job_id: str) -> str:
    async with platform.db.session() as s:
        job = await job_repo.get_job(s, job_id)
    assert job is not None
    return job.tenant_id


async def test_max_running_holds_across_a_dispatcher_restart(platform: Platform) -> None:
    from tests.helpers import admin, new_tenant, until_async

    capped_id, capped_key = await new_tenant(platform)
    async with admin(platform) as a:
        await a.put(f"/admin/tenants/{capped_id}/quota", json={"max_running": 2})
    platform.start_dispatcher()
    first = platform.tasks[-1]
    await platform.start_worker("w1", cost=SLOW)
    async with client(platform.url, capped_key) as c:
        ids = await submit(c, 6, {**CHAT, "max_tokens": 60})

        async def two_running() -> bool:
            return sum(j.status == "running" for j in await jobs_of(platform, capped_id)) == 2

        await until_async(two_running, "two of the capped tenant's jobs running", 10)
        # The dispatcher stops; a new one (a new process, an empty memory) takes over.
        platform.dispatcher.request_stop()
        await asyncio.wait_for(first, 10)
        platform.dispatcher = Dispatcher(platform.settings, platform.r)
        platform.start_dispatcher()
        peak = 0
        for _ in range(200):
            jobs = await jobs_of(platform, capped_id)
            peak = max(peak, sum(j.status == "running" for j in jobs))
            if all(j.status == "succeeded" for j in jobs):
                break
            await asyncio.sleep(0.05)
        finals = [await wait_for(c, i, timeout=60) for i in ids]
    assert {f["status"] for f in finals} == {"succeeded"}
    assert peak == 2


async def test_the_api_answers_503_with_retry_after_while_the_database_is_unreachable(
    platform: Platform, tenant_key: str
) -> None:
    from tierq.api.app import build_app

    down = platform.settings.model_copy(
        update={"database_url": "postgresql+asyncpg://postgres@127.0.0.1:1/nowhere"}
    )
    app = build_app(down)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://api",
            headers={"Authorization": f"Bearer {tenant_key}"},
        ) as c,
    ):
        resp = await c.post("/v1/jobs", json=CHAT)
    assert resp.status_code == 503, resp.text
    assert resp.headers["Retry-After"].isdigit()
    assert resp.json()["error"]["code"] == "service_unavailable"


@pytest.fixture
async def own_redis(settings: Any) -> Any:
    """A redis-server of this test's own, which it may freeze (SIGSTOP) without harming
    anything else."""
    import shutil
    import signal
    import subprocess

    from benchmarks.ports import free_port

    binary = shutil.which("redis-server")
    assert binary is not None, "redis-server is needed"
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    r = aioredis.Redis.from_url(url, decode_responses=True)
    for _ in range(100):
        try:
            await r.ping()
            break
        except Exception:
            await asyncio.sleep(0.05)
    yield url, r, proc
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGCONT)
    await r.aclose()
    proc.kill()
    proc.wait()


async def test_redis_frozen_for_seconds_costs_no_running_generation(
    settings: Any, db: Any, tenant_key: str, own_redis: Any
) -> None:
    """Redis stops answering for 5 s (more than WORKER_DEAD_AFTER_S; TIERQ_FREEZE_S=30 for
    the issue's 30 s) while jobs stream:
    every process waits, and afterwards each job finishes in its first delivery — nothing
    was reclaimed, re-run or lost, and a follower saw every delta once."""
    import signal

    url, r, proc = own_redis
    cfg = settings.model_copy(update={"redis_url": url})
    p = Platform(cfg, db, r)
    await p.start_api()
    try:
        p.start_dispatcher()
        await p.start_worker("w1", cost=SLOW)
        async with client(p.url, tenant_key) as c:
            ids = await submit(c, 4, {**CHAT, "max_tokens": 80})
            follower = asyncio.create_task(read_sse(c, f"/v1/jobs/{ids[0]}/events"))
            for job_id in ids:
                await wait_for(c, job_id, ("running",))
            proc.send_signal(signal.SIGSTOP)
            await asyncio.sleep(FREEZE_S)
            proc.send_signal(signal.SIGCONT)
            finals = [await wait_for(c, i, timeout=60) for i in ids]
            events = await asyncio.wait_for(follower, 30)
        assert {f["status"] for f in finals} == {"succeeded"}
        async with db.session() as s:
            for job_id in ids:
                assert (await job_repo.get_job(s, job_id)).deliveries == 1  # type: ignore[union-attr]
        text = "".join(e["data"]["text"] for e in events if e["event"] == "delta")
        assert text == finals[0]["result"]["text"]
        await assert_nothing_left(p, ids)
    finally:
        await p.stop()


class LeakyEngine(EngineWrapper):
    """Raises an unknown error whose text is what must never reach a tenant: SQL with its
    parameters, as a driver error reads."""

    SECRET = "SELECT key_hash FROM api_keys WHERE tenant_id = 'ten_other'"

    def observe(self, request_id: str, resume: Any, run: Any) -> Any:
        return self._fail()

    async def _fail(self) -> Any:
        raise RuntimeError(f"(psycopg.errors.InternalError) {self.SECRET}")
        yield  # an async generator


async def test_an_internal_error_reaches_the_tenant_as_a_code_and_a_reference(
    platform: Platform, tenant_key: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The tenant sees `engine_error` and a stable message with a reference, on the job
    API and the OpenAI surface; the operator's log has the detail under that reference."""
    platform.settings.max_deliveries = 1
    platform.start_dispatcher()
    await platform.start_worker("w1", wrap=leaky)
    caplog.set_level("ERROR", logger="tierq.workers.worker")
    async with client(platform.url, tenant_key) as c:
        (job_id,) = await submit(c, 1)
        final = await wait_for(c, job_id, timeout=30)
        chat = await c.post(
            "/v1/chat/completions",
            json={"model": platform.settings.served_model_name, **CHAT},
        )
    assert final["status"] == "failed" and final["error"]["code"] == "engine_error"
    message = final["error"]["message"]
    shown = message + chat.text
    for leak in ("SELECT", "api_keys", "RuntimeError", "psycopg", "ten_other"):
        assert leak not in shown, shown
    assert chat.status_code >= 500 and chat.json()["error"]["code"] == "engine_error"
    ref = message.split("reference ")[1].rstrip(").")
    assert ref.startswith("err_")
    logged = [r for r in caplog.records if ref in r.getMessage()]
    assert logged and LeakyEngine.SECRET in logged[0].getMessage()


def leaky(engine: Engine) -> Engine:
    return LeakyEngine(engine, "leaky")


class EndsInError(EngineWrapper):
    """The engine ends each request's first run with finish_reason "error" (vLLM's own
    request-level error: a grammar that failed mid-run, a KV load that failed)."""

    def __init__(self, inner: Engine) -> None:
        super().__init__(inner, f"ends-in-error-{inner.name}")
        self.ended: set[str] = set()

    def observe(self, request_id: str, resume: Any, run: Any) -> Any:
        return self._run(request_id, run)

    async def _run(self, request_id: str, run: Any) -> Any:
        async for chunk in run:
            if chunk.finish_reason is not None and request_id not in self.ended:
                self.ended.add(request_id)
                chunk = dataclasses.replace(chunk, finish_reason="error")
            yield chunk


async def test_a_run_the_engine_ends_with_an_error_is_not_an_answer(
    platform: Platform, tenant_key: str
) -> None:
    """finish_reason "error" is no answer: the job is tried again (a failed delivery, as
    any engine error), succeeds on its next run and is billed once; "error" never reaches
    the tenant as a finish reason."""
    platform.start_dispatcher()
    await platform.start_worker("w1", wrap=EndsInError)
    async with client(platform.url, tenant_key) as c:
        (job_id,) = await submit(c, 1, CHAT)
        done = await wait_for(c, job_id, timeout=60)
    assert done["status"] == "succeeded" and done["result"]["finish_reason"] == "length"
    async with platform.db.session() as s:
        job = await job_repo.get_job(s, job_id)
        history = [st for st, _ in await job_repo.transitions(s, job_id)]
        assert len(await job_repo.usage_for_job(s, job_id)) == 1
    assert job is not None and job.deliveries == 2 and job.fault_charge > 0
    assert history == ["queued", "running", "queued", "running", "succeeded"], history
