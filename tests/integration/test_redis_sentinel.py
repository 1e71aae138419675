"""Redis under Sentinel (REDIS_URL=redis+sentinel://...): the API, the dispatcher, a worker
and a real Celery worker (the reconciler, over kombu's sentinel transport) follow a
primary that is SIGKILLed mid-run to the replica the sentinels promote; every job
accepted before, during and after the failover succeeds, and none is billed twice."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from sqlalchemy import text

from tests.conftest import Platform, base_settings
from tests.helpers import admit_retrying, client, wait_for
from tests.integration.celery_proc import CeleryWorker
from tests.redis_sentinel import SentinelRedis
from tierq.core.redis_conn import connect
from tierq.core.settings import Settings

pytestmark = pytest.mark.integration

JOBS = 60
BODY = {"tier": "standard", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def sentinel_redis(tmp_path: Path) -> Iterator[SentinelRedis]:
    server = SentinelRedis(tmp_path / "redis")
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def settings(pg_database: str, tmp_path: Path, sentinel_redis: SentinelRedis) -> Settings:
    return base_settings(pg_database, tmp_path).model_copy(update={"redis_url": sentinel_redis.url})


@pytest.fixture
async def redis_client(settings: Settings) -> AsyncIterator[aioredis.Redis]:
    """The dispatcher's and the workers' client: through the sentinels too."""
    r = await connect(settings, role="test")
    yield r
    await r.aclose()


async def test_a_primary_killed_mid_run_fails_over_and_nothing_accepted_is_lost(
    running: Platform, tenant_key: str, sentinel_redis: SentinelRedis
) -> None:
    celery = CeleryWorker(running.settings)  # the reconciler, through kombu's sentinel://
    celery.start()
    try:
        async with client(running.url, tenant_key, timeout=10) as c:
            deadline = time.monotonic() + 120

            async def paced(i: int) -> str:
                await asyncio.sleep(i * 0.1)  # six seconds of arrivals
                return await admit_retrying(c, BODY, f"job-{i}", deadline)

            submitting = asyncio.gather(*(paced(i) for i in range(JOBS)))
            await asyncio.sleep(2)  # two seconds into the arrivals
            old = sentinel_redis.primary_port()
            sentinel_redis.kill(sentinel_redis.node(old))  # mid-run
            ids = await submitting
            while sentinel_redis.primary_port() == old:  # promoted by now, as a rule
                assert time.monotonic() < deadline, sentinel_redis.logs()
                await asyncio.sleep(0.2)
            done = await asyncio.gather(*(wait_for(c, j, timeout=120) for j in ids))
        log = celery.log.read_text()
    finally:
        celery.stop()
    # Celery lost the old primary and went on with the new one.
    lost = log.find("Connection to broker lost")
    assert lost >= 0 and " succeeded in " in log[lost:], log[-3000:]
    assert len(set(ids)) == JOBS
    assert {j["status"] for j in done} == {"succeeded"}, [
        j for j in done if j["status"] != "succeeded"
    ][:3]
    async with running.db.session() as s:
        billed = (
            await s.execute(text("SELECT job_id, count(*) FROM usage_records GROUP BY job_id"))
        ).all()
    assert sorted(job for job, _ in billed) == sorted(ids)
    assert {n for _, n in billed} == {1}  # none twice
