"""The reconciler: Postgres is the truth, Redis the transport; put back what Redis lost.

A job that the database says is queued or running, older than a grace period (admission
writes the row before the XADD), that Redis does not hold (the `inflight` set, written in
the same transaction as every XADD) was lost — Redis restarted without persistence, or
was flushed — and is enqueued again. A running one is first set back to queued.

A running job is also held while a live worker lists it in its heartbeat (after a flush, a
worker that still runs a job says so with its next heartbeat), and is put back only once
it has been seen held by nothing for RECONCILE_ORPHAN_GRACE_S; should a live worker still
run it after all, the job's delivery fence stops that run. One reconciler runs at a time
(a lock in Redis), on its own Celery queue.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from datetime import timedelta

import redis
import redis.asyncio as aioredis
from redis.exceptions import LockNotOwnedError

from tierq.core import clock, metrics, tracing
from tierq.core.messages import FAULT_UNIT
from tierq.core.queue import enqueue, held_by_redis, live_workers
from tierq.core.redis_conn import redis_now
from tierq.core.redis_names import RedisNames
from tierq.core.settings import Settings
from tierq.core.states import JobStatus
from tierq.models.db import Database
from tierq.models.store import JobStore
from tierq.services import tenant_policy

log = logging.getLogger(__name__)

PAGE = 1000


async def reconcile(
    settings: Settings, db: Database, jobs: JobStore, r: aioredis.Redis
) -> list[str]:
    """Re-enqueue lost jobs; returns their ids (empty when another run holds the lock)."""
    names = RedisNames(settings.redis_prefix)
    lock_ttl_s = max(60, int(settings.reconcile_interval_s * 4))
    # Released only while this run still holds it (it may have expired and been taken).
    lock = r.lock(names.reconcile_lock, timeout=lock_ttl_s, blocking=False, thread_local=False)
    if not await lock.acquire():
        log.info("another reconciler is running; skipping this run")
        return []
    try:
        return await _reconcile(settings, db, jobs, r, names)
    finally:
        # Lost meanwhile, or Redis unreachable: it expires on its own.
        with contextlib.suppress(LockNotOwnedError, redis.RedisError, OSError):
            await lock.release()


async def _reconcile(
    settings: Settings, db: Database, jobs: JobStore, r: aioredis.Redis, names: RedisNames
) -> list[str]:
    cutoff = clock.utcnow() - timedelta(seconds=settings.reconcile_grace_s)
    alive, _ = await live_workers(r, names, settings.worker_dead_after_s)
    running_on_workers = {job_id for hb in alive for job_id in hb.jobs}
    lost = []
    after = None
    while True:  # page through every candidate: a large backlog must not hide the lost ones
        page = await jobs.unfinished(cutoff, PAGE, after)
        held = await held_by_redis(r, names, [job.id for job in page])
        found = [
            is_held or job.id in running_on_workers for job, is_held in zip(page, held, strict=True)
        ]
        lost += [job for job, is_found in zip(page, found, strict=True) if not is_found]
        # A running job seen held again starts its grace afresh should it be lost later
        # (one key a command: per-job keys live in different cluster slots).
        async with r.pipeline(transaction=False) as pipe:
            for job, is_found in zip(page, found, strict=True):
                if is_found and job.status == JobStatus.RUNNING:
                    pipe.delete(names.job_orphan(job.id))
            await pipe.execute()
        if len(page) < PAGE:
            break
        after = (page[-1].created_at, page[-1].id)
    requeued: list[str] = []
    now = await redis_now(r)
    for job in lost:
        if job.status == JobStatus.RUNNING and not await _orphaned_long_enough(
            r, names, job.id, now, settings.reconcile_orphan_grace_s
        ):
            continue
        if job.status == JobStatus.RUNNING:
            # Held by no live worker and by nothing in Redis: its worker died with Redis'
            # copy, or gave the run up (the database refused its result). Either may be the
            # job's doing, and nothing tells how many jobs shared it: one failed delivery.
            back = await jobs.requeue(
                job.id, "reconciler: lost by Redis", job.deliveries, charge=FAULT_UNIT
            )
            if back is None:
                continue  # it finished, or was delivered again, meanwhile
        # Back in the trace it started in, where that is kept (tracing on, not a batch line).
        trace = await tracing.recall(r, names.trace_context(job.id))
        await enqueue(r, names, dataclasses.replace(job.to_message(), trace=trace), arrival=False)
        await r.delete(names.job_orphan(job.id))
        requeued.append(job.id)
    await tenant_policy.sync_all(db, r, names)
    if requeued:
        metrics.JOBS_REENQUEUED.inc(len(requeued))
        log.warning("reconciler re-enqueued %d jobs lost by Redis", len(requeued))
    return requeued


async def _orphaned_long_enough(
    r: aioredis.Redis, names: RedisNames, job_id: str, now: float, grace_s: float
) -> bool:
    """Whether a running job has been held by nothing for `grace_s` (marking it now if not
    marked yet): a worker that re-registers with its next heartbeat is given that long."""
    if grace_s <= 0:
        return True
    key = names.job_orphan(job_id)
    await r.set(key, repr(now), nx=True, ex=int(grace_s * 10) + 60)
    first = await r.get(key)
    return first is not None and now - float(first) >= grace_s
