"""Cancelling jobs. The Redis half (`announce`) once, for every path that cancels: a tenant
cancelling its job (`cancel_job`, the native and OpenAI routes), a tenant suspended or
deleted (tierq/api/admin/tenants.py), a batch cancelled or expired (tierq/workers/batches.py).
The database half is the job store's (`JobStore.cancel`, `JobStore.cancel_all`) or, for a
batch, its fenced transaction's (`models.batches.stop_unfinished`); `announce` runs once
that has committed.

Cancelling a batch (`cancel_batch`: its tenant, or an operator through the admin API) only
moves it to `cancelling` and asks Celery to advance it: Celery stops its jobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis

from tierq.core import clock, metrics
from tierq.core.messages import JobEvent
from tierq.core.queue import EventLog, forget_inflight
from tierq.core.redis_names import RedisNames
from tierq.core.settings import Settings
from tierq.core.states import BatchStatus, JobStatus
from tierq.models import batches as batch_repo
from tierq.models.db import Database
from tierq.models.records import JobRecord
from tierq.models.store import JobStore
from tierq.services import batch_signal
from tierq.services.requests import Refused

CHUNK = 500  # jobs per Redis round trip (a cancelled batch may hold 50,000)


async def announce(
    r: aioredis.Redis, names: RedisNames, events: EventLog, jobs: Sequence[JobRecord]
) -> None:
    """The cancelled `jobs`, told: a worker running one aborts it (the cancel channel),
    each job's event stream ends with its final `done` event, so that its followers learn
    at once (not at the hub's periodic recheck), and Redis forgets them as in flight."""
    for start in range(0, len(jobs), CHUNK):
        chunk = jobs[start : start + CHUNK]
        async with r.pipeline(transaction=False) as pipe:
            for job in chunk:
                pipe.publish(names.cancel_channel, job.id)
            await pipe.execute()
        await events.append_many(
            [(job.id, JobEvent("done", job.to_api()), None, None) for job in chunk]
        )
        await forget_inflight(r, names, [job.id for job in chunk])


async def cancel_job(
    jobs: JobStore,
    r: aioredis.Redis,
    names: RedisNames,
    events: EventLog,
    tenant_id: str,
    job_id: str,
) -> JobRecord:
    """A tenant cancelling one of its jobs: 404 when it has no such job, 409 when the job
    already finished; cancelling twice is harmless (the second tells the workers again)."""
    cancelled = await jobs.cancel(job_id, tenant_id)
    if cancelled is None:
        # Not queued or running when the cancel looked, so ended: an ending is final, and
        # what the job shows now is why it could not be cancelled.
        current = await jobs.get(job_id, tenant_id)
        if current is None:
            raise Refused(404, f"No job found with id '{job_id}'.", "job_not_found")
        if current.status != JobStatus.CANCELLED:
            raise Refused(
                409,
                f"The job is already {current.status.value} and cannot be cancelled.",
                "job_not_cancellable",
            )
        # Cancelled before: its notice may have been lost (the first call's reply with it),
        # so a worker still running it is told again. Workers also see the cancel in the
        # database within CANCEL_CHECK_INTERVAL_S, whatever Redis drops.
        await r.publish(names.cancel_channel, job_id)
        return current
    await announce(r, names, events, [cancelled])
    return cancelled


async def cancel_batch(
    db: Database,
    r: aioredis.Redis,
    names: RedisNames,
    settings: Settings,
    batch_id: str,
    tenant_id: str | None,
) -> dict[str, Any]:
    """Cancel a batch (of `tenant_id`'s, or any with None: an operator): the batch object
    as the Batches API shows it. 404 when there is no such batch, 409 when it already
    ended; cancelling twice is harmless."""
    async with db.transaction() as s:
        batch = await batch_repo.get_batch(s, batch_id, tenant_id)
        if batch is None:
            raise Refused(404, f"No batch found with id '{batch_id}'.", "batch_not_found")
        if batch.status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
            return batch.to_api(await batch_repo.live_counts(s, batch))
        moved = await batch_repo.transition(
            s,
            batch_id,
            BatchStatus.CANCELLING,
            (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS),
            cancelling_at=clock.utcnow(),
        )
        if moved is None:
            raise Refused(
                409,
                f"The batch is {batch.status} and can no longer be cancelled.",
                "batch_not_cancellable",
            )
        result = moved.to_api(await batch_repo.live_counts(s, moved))
    metrics.BATCHES.labels(status=BatchStatus.CANCELLING).inc()
    await batch_signal.poke(settings, r, names, batch_id)
    return result
