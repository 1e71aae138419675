"""The reconciler runs as Celery beat's periodic task, through a real Celery worker and Redis."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.conftest import Platform
from tests.helpers import client
from tests.integration.celery_proc import CeleryWorker
from tierq.models import jobs as job_repo

pytestmark = pytest.mark.integration


async def test_beat_re_enqueues_a_job_that_redis_lost(platform: Platform, tenant_key: str) -> None:
    settings = platform.settings
    names = platform.dispatcher.names
    async with client(platform.url, tenant_key) as c:
        job = (await c.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 3})).json()
    async with platform.db.session() as s:
        record = await job_repo.get_job(s, job["id"])
    assert record is not None
    stream = names.tier_stream("standard", record.tenant_id)
    # Redis loses it: the stream entry and the marker are gone; the database still says queued.
    await platform.r.delete(stream, names.inflight)
    celery = CeleryWorker(settings, RECONCILE_INTERVAL_S="1", RECONCILE_GRACE_S="0")
    celery.start()
    try:
        deadline = time.monotonic() + 60
        while not await platform.r.sismember(names.inflight, job["id"]):
            assert celery.proc is not None and celery.proc.poll() is None, celery.output()
            assert time.monotonic() < deadline, "beat never re-enqueued the lost job"
            await asyncio.sleep(0.2)
        entries = await platform.r.xrange(stream)
        assert [job["id"] in fields["job"] for _, fields in entries] == [True]
    finally:
        celery.stop()
