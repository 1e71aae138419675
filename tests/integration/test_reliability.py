"""At-least-once delivery, dead-lettering, the reconciler and drain, on real PostgreSQL and Redis."""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import Platform
from tests.helpers import client, read_sse, until_async, until_streamed, wait_for
from tierq.core.messages import Served
from tierq.core.queue import enqueue
from tierq.core.redis_names import WORKER_GROUP
from tierq.models import jobs as job_repo
from tierq.workers.engine.simulated_engine import CostModel
from tierq.workers.reconcile import reconcile

pytestmark = pytest.mark.integration

CHAT = {"messages": [{"role": "user", "content": "Count"}], "max_tokens": 60}
SLOW = CostModel(slots=8).scaled(2)  # 60 tokens take about a second


async def test_a_killed_worker_is_reclaimed_and_its_job_finishes_elsewhere_once(
    platform: Platform, tenant_key: str
) -> None:
    platform.start_dispatcher()
    await platform.start_worker("doomed", cost=SLOW)
    async with client(platform.url, tenant_key) as c:
        job = (await c.post("/v1/jobs", json=CHAT)).json()
        await until_streamed(platform, job["id"])  # some deltas out
        await platform.kill_worker("doomed")
        survivor_stream = asyncio.create_task(read_sse(c, f"/v1/jobs/{job['id']}/events"))
        await platform.start_worker("survivor", cost=SLOW)
        try:
            done = await wait_for(c, job["id"], timeout=30)
        except AssertionError as exc:  # say where it stood (a CI run once saw this)
            async with platform.db.session() as s:
                history = await job_repo.transitions(s, job["id"])
            inboxes = {
                w: await platform.r.xpending(platform.dispatcher.names.inbox(w), WORKER_GROUP)
                for w in ("doomed", "survivor")
            }
            raise AssertionError(f"{exc}; transitions {history}; inboxes {inboxes}") from None
        events = await survivor_stream
    assert done["status"] == "succeeded"
    assert done["result"]["text"] == "".join(f" tok{i}" for i in range(1, 61))
    # The deltas a client saw before the crash are not repeated after it.
    assert (
        "".join(e["data"]["text"] for e in events if e["event"] == "delta")
        == done["result"]["text"]
    )
    assert [int(e["id"]) for e in events] == list(range(1, len(events) + 1))
    async with platform.db.session() as s:
        history = [status for status, _ in await job_repo.transitions(s, job["id"])]
        usage = await job_repo.usage_for_job(s, job["id"])
    assert history == ["queued", "running", "running", "succeeded"]
    assert len(usage) == 1 and usage[0].completion_tokens == 60
    assert await platform.r.hkeys(platform.dispatcher.names.workers) == ["survivor"]


async def test_a_restarted_worker_with_the_same_id_resumes_its_pending_entries(
    platform: Platform, tenant_key: str
) -> None:
    platform.start_dispatcher()
    await platform.start_worker("stable", cost=SLOW)
    async with client(platform.url, tenant_key) as c:
        job = (await c.post("/v1/jobs", json=CHAT)).json()
        await wait_for(c, job["id"], ("running",))
        await platform.kill_worker("stable")
        await platform.start_worker("stable", cost=SLOW)
        done = await wait_for(c, job["id"])
    assert done["status"] == "succeeded"


async def test_a_job_delivered_twice_is_run_to_the_end_once(
    platform: Platform, tenant_key: str
) -> None:
    async with client(platform.url, tenant_key) as c:
        job = (await c.post("/v1/jobs", json={**CHAT, "max_tokens": 5})).json()
        async with platform.db.session() as s:
            record = await job_repo.get_job(s, job["id"])
        assert record is not None
        await enqueue(platform.r, platform.dispatcher.names, record.to_message())  # a duplicate
        follower = asyncio.create_task(read_sse(c, f"/v1/jobs/{job['id']}/events"))
        platform.start_dispatcher()
        await platform.start_worker("w1")
        await platform.start_worker("w2")
        done = await wait_for(c, job["id"])
        events = await asyncio.wait_for(follower, 10)
        names = platform.dispatcher.names
        for _ in range(100):  # both deliveries consumed: each inbox empty again
            inboxes = [await platform.r.xlen(names.inbox(w)) for w in ("w1", "w2")]
            if inboxes == [0, 0]:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"entries left in the inboxes: {inboxes}")
    assert done["status"] == "succeeded"
    # One run reached the end: one success in the history, one usage record, and a follower
    # saw the text once (a second run is skipped, or fences the first off and goes on).
    assert (
        "".join(e["data"]["text"] for e in events if e["event"] == "delta")
        == (done["result"]["text"])
    )
    async with platform.db.session() as s:
        history = [status for status, _ in await job_repo.transitions(s, job["id"])]
        assert len(await job_repo.usage_for_job(s, job["id"])) == 1
    assert history.count("succeeded") == 1
    reports = [Served.decode(f) for _, f in await platform.r.xrange(names.served)]
    assert [r.outcome for r in reports if r.job_id == job["id"]].count("succeeded") == 1


async def test_a_job_that_keeps_dying_is_dead_lettered(platform: Platform, tenant_key: str) -> None:
    platform.settings.max_deliveries = 2
    platform.start_dispatcher()
    async with client(platform.url, tenant_key) as c:
        job = (await c.post("/v1/jobs", json=CHAT)).json()
        for attempt in range(2):
            await platform.start_worker(f"crashy-{attempt}", cost=SLOW)
            await wait_for(c, job["id"], ("running",))

            async def delivered(times: int = attempt + 1) -> bool:
                async with platform.db.session() as s:
                    record = await job_repo.get_job(s, job["id"])
                return record is not None and record.deliveries == times

            await until_async(delivered, f"delivery {attempt + 1} recorded", 2)
            await platform.kill_worker(f"crashy-{attempt}")
        await platform.start_worker("last", cost=SLOW)
        final = await wait_for(c, job["id"], timeout=30)
    assert final["status"] == "failed"
    assert final["error"]["code"] == "max_deliveries_exceeded"


async def test_the_reconciler_re_enqueues_jobs_redis_lost(
    platform: Platform, tenant_key: str
) -> None:
    async with client(platform.url, tenant_key) as c:
        jobs = [(await c.post("/v1/jobs", json={**CHAT, "max_tokens": 4})).json() for _ in range(3)]
        # Redis restarts without persistence: every stream, inbox and marker is gone.
        keys = [k async for k in platform.r.scan_iter(match=f"{platform.settings.redis_prefix}:*")]
        await platform.r.delete(*keys)
        requeued = await reconcile(platform.settings, platform.db, platform.jobs, platform.r)
        assert sorted(requeued) == sorted(j["id"] for j in jobs)
        assert (
            await reconcile(platform.settings, platform.db, platform.jobs, platform.r) == []
        )  # held again
        platform.start_dispatcher()
        await platform.start_worker("w1")
        finals = [await wait_for(c, j["id"]) for j in jobs]
    assert all(f["status"] == "succeeded" for f in finals)
    assert await reconcile(platform.settings, platform.db, platform.jobs, platform.r) == []


async def test_the_reconciler_puts_back_a_running_job_whose_worker_and_redis_are_gone(
    platform: Platform, tenant_key: str
) -> None:
    platform.start_dispatcher()
    await platform.start_worker("gone", cost=SLOW)
    async with client(platform.url, tenant_key) as c:
        job = (await c.post("/v1/jobs", json=CHAT)).json()
        await wait_for(c, job["id"], ("running",))
        await platform.kill_worker("gone")
        keys = [k async for k in platform.r.scan_iter(match=f"{platform.settings.redis_prefix}:*")]
        await platform.r.delete(*keys)
        # Held by nothing, but a live worker could still re-register it with its next
        # heartbeat: the first pass only marks it; once the grace has passed, it goes back.
        platform.settings.reconcile_orphan_grace_s = 0.5
        assert await reconcile(platform.settings, platform.db, platform.jobs, platform.r) == []
        await asyncio.sleep(0.6)  # past the grace
        assert await reconcile(platform.settings, platform.db, platform.jobs, platform.r) == [
            job["id"]
        ]
        await platform.start_worker("fresh", cost=SLOW)
        final = await wait_for(c, job["id"])
    assert final["status"] == "succeeded"


async def test_sigterm_drains_running_jobs_before_exiting(
    platform: Platform, tenant_key: str
) -> None:
    platform.start_dispatcher()
    worker = await platform.start_worker("w1", cost=SLOW)
    _, task, _ = platform.workers["w1"]
    async with client(platform.url, tenant_key) as c:
        job = (await c.post("/v1/jobs", json=CHAT)).json()
        await wait_for(c, job["id"], ("running",))
        worker.request_stop()  # first signal: finish what runs, take nothing new
        queued_later = (await c.post("/v1/jobs", json=CHAT)).json()
        await asyncio.wait_for(task, 10)
        drained = (await c.get(f"/v1/jobs/{job['id']}")).json()
        assert (await c.get(f"/v1/jobs/{queued_later['id']}")).json()["status"] == "queued"
        platform.workers.pop("w1")
        await platform.start_worker("w2")
        assert (await wait_for(c, queued_later["id"]))["status"] == "succeeded"
    assert drained["status"] == "succeeded"


async def test_a_second_signal_hands_running_jobs_back_to_their_tier(
    platform: Platform, tenant_key: str
) -> None:
    platform.start_dispatcher()
    worker = await platform.start_worker("w1", cost=SLOW)
    _, task, _ = platform.workers["w1"]
    async with client(platform.url, tenant_key) as c:
        job = (await c.post("/v1/jobs", json={**CHAT, "max_tokens": 600})).json()
        await wait_for(c, job["id"], ("running",))
        worker.request_stop()
        worker.request_stop()  # second signal: stop now
        await asyncio.wait_for(task, 10)
        platform.workers.pop("w1")
        handed_back = (await c.get(f"/v1/jobs/{job['id']}")).json()
        await platform.start_worker("w2")
        final = await wait_for(c, job["id"], timeout=30)
    assert handed_back["status"] == "queued"
    assert final["status"] == "succeeded" and final["usage"]["completion_tokens"] == 600
