"""`services.admission.submit` on the embedded SQLite file, against real Redis: a plain
request and one with an Idempotency-Key (its replay answered, another body refused) in one
hop to the writer uncounted (path "fast"); a tenant with quotas sent back once to be counted
by the tokenizer, then counted first (path "quotas") and refused by its limit; a suspended
tenant refused with nothing written — and every admitted job on its tier's stream."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tests.conftest import REDIS_TEST_URL
from tierq import migrations
from tierq.core import metrics
from tierq.core.queue import Enqueuer
from tierq.core.redis_names import RedisNames
from tierq.core.settings import Settings
from tierq.models import jobs as job_repo
from tierq.models import quotas as quota_repo
from tierq.models import tenants as tenant_repo
from tierq.models.db import Database
from tierq.models.records import TenantRecord
from tierq.models.store import SqlJobStore
from tierq.services import admission
from tierq.services.requests import JobCreate, Refused

pytestmark = pytest.mark.integration

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def _path(path: str) -> float:
    return metrics.ADMISSION_STATEMENTS.labels(path=path)._value.get()


@pytest.fixture
async def env(
    tmp_path: Path,
) -> AsyncIterator[tuple[Database, aioredis.Redis, RedisNames, SqlJobStore]]:
    url = f"sqlite+aiosqlite:///{tmp_path / 'tierq.db'}"
    await asyncio.to_thread(migrations.upgrade, url)
    db = Database(url)
    jobs = SqlJobStore(db)
    r = aioredis.Redis.from_url(REDIS_TEST_URL)
    names = RedisNames(prefix=f"test-sqlite-{uuid.uuid4().hex[:8]}")
    try:
        yield db, r, names, jobs
    finally:
        keys = [k async for k in r.scan_iter(f"{names.prefix}:*")]
        if keys:
            await r.delete(*keys)
        await r.aclose()
        await jobs.close()
        await db.close()


async def _tenant(db: Database) -> TenantRecord:
    async with db.transaction() as s:
        return await tenant_repo.create_tenant(s, uuid.uuid4().hex)


async def test_each_request_takes_its_path_and_lands_on_the_stream(
    env: tuple[Database, aioredis.Redis, RedisNames, SqlJobStore],
) -> None:
    db, r, names, jobs = env
    assert jobs._local is not None  # the writer thread's one hop
    settings = Settings(database_url=str(db.url))
    body = JobCreate.model_validate(CHAT)
    queue = Enqueuer(r, names)

    async def submit(tenant: TenantRecord, key: str | None = None) -> str:
        job, created = await admission.submit(jobs, queue, settings, tenant, body, key)
        assert created
        return job.id

    plain = await _tenant(db)
    fast, quotas = _path("fast"), _path("quotas")
    await submit(plain)
    assert (_path("fast"), _path("quotas")) == (fast + 1, quotas)
    # An Idempotency-Key: the one hop too, which answers a replay as the same job and
    # refuses another body with the key.
    keyed = await submit(plain, "k-1")
    again, created = await admission.submit(jobs, queue, settings, plain, body, "k-1")
    assert again.id == keyed and not created
    other = JobCreate.model_validate({**CHAT, "max_tokens": 9})
    with pytest.raises(Refused) as reused:
        await admission.submit(jobs, queue, settings, plain, other, "k-1")
    assert (reused.value.status, reused.value.code) == (409, "idempotency_key_reused")
    assert (_path("fast"), _path("quotas")) == (fast + 4, quotas)

    limited = await _tenant(db)
    async with db.transaction() as s:
        await quota_repo.set_quota(s, limited.id, "*", requests_per_minute=2)
    await submit(limited)  # sent back to be counted, then admitted
    assert (_path("fast"), _path("quotas")) == (fast + 5, quotas + 1)
    await submit(limited)  # counted first: its quotas were seen a moment ago
    assert (_path("fast"), _path("quotas")) == (fast + 5, quotas + 2)
    with pytest.raises(Refused) as refused:
        await submit(limited)
    assert (refused.value.status, refused.value.code) == (429, "rate_limit_exceeded")

    suspended = await _tenant(db)
    async with db.transaction() as s:
        await tenant_repo.update_tenant(s, suspended.id, status="suspended")
    with pytest.raises(Refused) as refused:
        await submit(suspended)  # authenticated before the suspension committed
    assert (refused.value.status, refused.value.code) == (403, "tenant_suspended")

    async with db.session() as s:
        assert await job_repo.tenant_job_counts(s, plain.id) == {("standard", "queued"): 2}
        assert await job_repo.tenant_job_counts(s, limited.id) == {("standard", "queued"): 2}
        assert await job_repo.tenant_job_counts(s, suspended.id) == {}
    assert await r.xlen(names.tier_stream("standard", plain.id)) == 2
    assert await r.xlen(names.tier_stream("standard", limited.id)) == 2
    assert await r.xlen(names.tier_stream("standard", suspended.id)) == 0
