"""A cancel reaches its run whatever Redis drops on the way, and bills only what ran.

The notice on the cancel channel is published once; here the worker's subscription is cut
with `CLIENT KILL TYPE pubsub` over and over while the tenant cancels, so the notice is
lost. The worker's check of its jobs' statuses in the database (CANCEL_CHECK_INTERVAL_S)
must still stop the run within the bound. On real PostgreSQL and Redis, the simulated
engine (the engine is not the subject).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from tests.conftest import REDIS_TEST_URL, Platform
from tests.helpers import client, until, until_streamed, wait_for
from tierq.models import jobs as job_repo
from tierq.workers.engine.simulated_engine import CostModel

pytestmark = pytest.mark.integration

SLOW = CostModel(slots=8).scaled(2)  # 60 tokens take about a second
TOKENS = 900  # about 15 s: far longer than the bound


async def _kill_subscribers(stop: asyncio.Event, channel: str, listening: list[int]) -> None:
    """CLIENT KILL TYPE pubsub every few milliseconds until `stop`: every subscription on
    the server is cut as soon as it is made again. After each kill, `listening` gets how
    many subscribers the cancel channel has (the worker's subscription, when it is back)."""
    async with aioredis.Redis.from_url(REDIS_TEST_URL) as admin:
        while not stop.is_set():
            await admin.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
            ((_, subscribers),) = await admin.pubsub_numsub(channel)
            listening.append(int(subscribers))
            await asyncio.sleep(0.005)


async def test_a_cancel_whose_notice_is_lost_still_stops_the_run_and_bills_what_ran(
    platform: Platform, tenant_key: str
) -> None:
    platform.start_dispatcher()
    worker = await platform.start_worker("w1", cost=SLOW)
    bound_s = platform.settings.cancel_check_interval_s + 1.0
    async with client(platform.url, tenant_key) as c:
        job = (
            await c.post(
                "/v1/jobs",
                json={"messages": [{"role": "user", "content": "Count"}], "max_tokens": TOKENS},
            )
        ).json()
        await wait_for(c, job["id"], ("running",))
        await until_streamed(platform, job["id"])  # something ran, to be billed
        stop = asyncio.Event()
        listening: list[int] = []
        channel = platform.dispatcher.names.cancel_channel
        storm = asyncio.create_task(_kill_subscribers(stop, channel, listening))
        await until(lambda: 0 in listening, "the worker's subscription is cut", 10)
        cancelled_at = time.monotonic()
        resp = await c.post(f"/v1/jobs/{job['id']}/cancel")
        assert resp.status_code == 200, resp.text
        await asyncio.sleep(0.5)  # the notice went out meanwhile, to nobody
        stop.set()
        await storm
        while job["id"] in worker._runs:  # the run is still in the engine
            assert time.monotonic() - cancelled_at < bound_s + 5, "the run was never stopped"
            await asyncio.sleep(0.02)
        stopped_after = time.monotonic() - cancelled_at
        final = (await c.get(f"/v1/jobs/{job['id']}")).json()
    cut = listening.count(0)
    print(f"run stopped {stopped_after:.2f} s after the cancel; cancel channel empty {cut} times")
    assert stopped_after <= bound_s
    assert final["status"] == "cancelled"
    async with platform.db.session() as s:
        usage = await job_repo.usage_for_job(s, job["id"])
    assert len(usage) == 1
    billed = usage[0].completion_tokens
    # What ran until the stop, not max_tokens: about bound_s at 60 tokens a second.
    assert 0 < billed < TOKENS / 2
    assert final["usage"]["completion_tokens"] == billed
    assert await platform.r.xlen(platform.dispatcher.names.inbox("w1")) == 0  # slot freed


async def test_cancelling_a_cancelled_job_again_tells_the_workers_again(
    platform: Platform, tenant_key: str
) -> None:
    """The second cancel of a job finds it cancelled and answers 200, and publishes the
    notice again: a client retrying a cancel whose reply it lost still reaches the run."""
    async with client(platform.url, tenant_key) as c:
        job = (await c.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 4})).json()
        assert (await c.post(f"/v1/jobs/{job['id']}/cancel")).status_code == 200
        pubsub = platform.r.pubsub()
        await pubsub.subscribe(platform.dispatcher.names.cancel_channel)
        try:
            assert (await pubsub.get_message(timeout=1.0))["type"] == "subscribe"
            again = await c.post(f"/v1/jobs/{job['id']}/cancel")
            assert again.status_code == 200 and again.json()["status"] == "cancelled"
            notice = await pubsub.get_message(ignore_subscribe_messages=True, timeout=2.0)
        finally:
            await pubsub.aclose()
    assert notice is not None and notice["data"] == job["id"]
