"""The reconciler: Postgres is the truth, Redis the transport; put back what Redis lost.

A job that the database says is queued or running, older than a grace period (admission
writes the row before the XADD), that Redis does not hold (the `inflight` set, written in
the same transaction as every XADD) was lost — Redis restarted without persistence, or
was flushed — and is enqueued again. A running one is first set back to queued.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

import redis.asyncio as aioredis

from models import jobs as job_repo
from models.db import Database
from tierq import metrics, tenant_policy
from tierq.queue import enqueue, held_by_redis
from tierq.redis_names import RedisNames
from tierq.settings import Settings
from tierq.states import JobStatus

log = logging.getLogger(__name__)

PAGE = 1000


async def reconcile(settings: Settings, db: Database, r: aioredis.Redis) -> list[str]:
    """Re-enqueue lost jobs; returns their ids."""
    names = RedisNames(settings.redis_prefix)
    cutoff = datetime.now(UTC) - timedelta(seconds=settings.reconcile_grace_s)
    lost = []
    after = None
    while True:  # page through every candidate: a large backlog must not hide the lost ones
        async with db.session() as s:
            page = await job_repo.unfinished_jobs(s, cutoff, PAGE, after)
        held = await held_by_redis(r, names, [job.id for job in page])
        lost += [job for job, is_held in zip(page, held, strict=True) if not is_held]
        if len(page) < PAGE:
            break
        after = (page[-1].created_at, page[-1].id)
    requeued: list[str] = []
    for job in lost:
        if job.status == JobStatus.RUNNING:
            async with db.transaction() as s:
                if await job_repo.requeue_job(s, job.id, "reconciler: lost by Redis") is None:
                    continue  # it finished meanwhile
        await enqueue(r, names, job.to_message())
        requeued.append(job.id)
    await tenant_policy.sync_all(db, r, names)
    if requeued:
        metrics.JOBS_REENQUEUED.inc(len(requeued))
        log.warning("reconciler re-enqueued %d jobs lost by Redis", len(requeued))
    return requeued
