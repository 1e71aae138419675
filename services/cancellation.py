"""Cancelling jobs, the Redis half — once, for every path that cancels: a tenant cancelling
its job (api/jobs/service.py), a tenant suspended or deleted (api/admin/tenants.py), a batch
cancelled or expired (workers/batches.py). The database half is the repository's
(`models.jobs.cancel_job`, `cancel_unfinished`); this runs once that has committed.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis.asyncio as aioredis

from models.records import JobRecord
from tierq.messages import JobEvent
from tierq.queue import EventLog, forget_inflight
from tierq.redis_names import RedisNames

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
