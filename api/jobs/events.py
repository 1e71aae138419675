"""Server-Sent Events for one job: replay what the client missed, then follow live.

Every event has an id: its 1-based sequence number in the job's replay buffer. A client
that connects late, or reconnects with Last-Event-ID, first gets the buffer from that id
on, then the live events, skipping any it already has — none lost, none doubled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub

from models import jobs as job_repo
from models.db import Database
from models.records import JobRecord
from tierq.messages import JobEvent
from tierq.queue import EventLog
from tierq.redis_conn import is_unavailable as redis_unavailable
from tierq.redis_names import RedisNames
from tierq.states import TERMINAL

log = logging.getLogger(__name__)

TERMINAL_KINDS = ("done", "error")
# While nothing arrives, look at the database this often: a terminal state whose event
# was lost (a publish during a Redis failover, say) still ends the stream.
RECHECK_S = 2.0


def _sse(seq: int, event: JobEvent) -> dict[str, Any]:
    return {"id": str(seq), "event": event.kind, "data": json.dumps(event.data)}


def _final_event(job: JobRecord) -> JobEvent:
    return JobEvent("error" if job.status.value == "failed" else "done", job.to_api())


async def job_event_stream(
    db: Database,
    r: aioredis.Redis,
    names: RedisNames,
    events: EventLog,
    job: JobRecord,
    last_seq: int,
) -> AsyncIterator[dict[str, Any]]:
    async for seq, event in follow_job(db, r, names, events, job, last_seq):
        yield _sse(seq, event)


async def follow_job(
    db: Database,
    r: aioredis.Redis,
    names: RedisNames,
    events: EventLog,
    job: JobRecord,
    last_seq: int = 0,
) -> AsyncIterator[tuple[int, JobEvent]]:
    """A job's events after `last_seq`, numbered, up to and including the terminal one.

    A lost Redis connection (a restart, a killed connection) does not end the stream: it
    subscribes again and fills what it missed from the replay buffer, by sequence number.
    """
    delay = 0.1
    while True:
        pubsub = r.pubsub()
        try:
            async for seq, event in _follow(db, pubsub, names, events, job, last_seq):
                yield seq, event
                last_seq = seq
                delay = 0.1
            return
        except Exception as exc:
            if not redis_unavailable(exc):
                raise
            log.warning("following job %s: Redis unreachable (%s); resubscribing", job.id, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()


async def _follow(
    db: Database,
    pubsub: PubSub,
    names: RedisNames,
    events: EventLog,
    job: JobRecord,
    last_seq: int,
) -> AsyncIterator[tuple[int, JobEvent]]:
    await pubsub.subscribe(names.job_channel(job.id))  # before the replay: no gap between them
    for seq, event in await events.since(job.id, last_seq):
        yield seq, event
        last_seq = seq
        if event.kind in TERMINAL_KINDS:
            return
    if job.status in TERMINAL:
        async for item in _finish_from_database(db, job.id, last_seq):
            yield item
        return
    while True:
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=RECHECK_S)
        if msg is None:
            async with db.session() as s:
                current = await job_repo.get_job(s, job.id)
            if current is None or current.status in TERMINAL:
                # Take what the buffer holds first, then close from the database.
                for seq, event in await events.since(job.id, last_seq):
                    yield seq, event
                    last_seq = seq
                    if event.kind in TERMINAL_KINDS:
                        return
                async for item in _finish_from_database(db, job.id, last_seq):
                    yield item
                return
            continue
        seq, event = EventLog.decode_live(msg["data"])
        if seq <= last_seq:
            continue  # already sent from the replay buffer
        if seq > last_seq + 1:  # a gap: fill it from the buffer
            for gap_seq, gap_event in await events.since(job.id, last_seq):
                if gap_seq >= seq:
                    break
                yield gap_seq, gap_event
                last_seq = gap_seq
        yield seq, event
        last_seq = seq
        if event.kind in TERMINAL_KINDS:
            return


async def _finish_from_database(
    db: Database, job_id: str, last_seq: int
) -> AsyncIterator[tuple[int, JobEvent]]:
    """Close a stream whose terminal event is not in the buffer (expired, or never written)."""
    async with db.session() as s:
        job = await job_repo.get_job(s, job_id)
    if job is None:
        return
    if last_seq == 0 and job.result_text:
        # The replay buffer expired: the whole text as one delta, so the client still has it.
        last_seq += 1
        yield last_seq, JobEvent("delta", {"text": job.result_text})
    yield last_seq + 1, _final_event(job)
