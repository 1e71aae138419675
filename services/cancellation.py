"""Cancelling jobs. The Redis half (`announce`) once, for every path that cancels: a tenant
cancelling its job (`cancel_job`, the native and OpenAI routes), a tenant suspended or
deleted (api/admin/tenants.py), a batch cancelled or expired (workers/batches.py). The database
half is the repository's (`models.jobs.cancel_job`, `cancel_unfinished`,
`models.batches.stop_unfinished`); `announce` runs once that has committed.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis.asyncio as aioredis

from models import jobs as job_repo
from models.db import Database
from models.records import JobRecord
from services.requests import Refused
from tierq.messages import JobEvent
from tierq.queue import EventLog, forget_inflight
from tierq.redis_names import RedisNames
from tierq.states import JobStatus

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
    db: Database,
    r: aioredis.Redis,
    names: RedisNames,
    events: EventLog,
    tenant_id: str,
    job_id: str,
) -> JobRecord:
    """A tenant cancelling one of its jobs: 404 when it has no such job, 409 when the job
    already finished; cancelling twice is harmless."""
    async with db.transaction() as s:
        job = await job_repo.get_job(s, job_id, tenant_id)
        if job is None:
            raise Refused(404, f"No job found with id '{job_id}'.", "job_not_found")
        cancelled = await job_repo.cancel_job(s, job_id)
        if cancelled is None:
            current = await job_repo.get_job(s, job_id, tenant_id)
            assert current is not None
            if current.status == JobStatus.CANCELLED:
                return current
            raise Refused(
                409,
                f"The job is already {current.status.value} and cannot be cancelled.",
                "job_not_cancellable",
            )
    await announce(r, names, events, [cancelled])
    return cancelled
