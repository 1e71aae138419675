"""Server-Sent Events for one job: replay what the client missed, then follow live.

Every event has an id: its 1-based sequence number in the job's replay buffer. A client
that connects late, or reconnects with Last-Event-ID, first gets the buffer from that id
on, then the live events, skipping any it already has — none lost, none doubled.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from tierq.api.streams.hub import RECHECK, RESYNC, EventHub, Follower, StreamClosed
from tierq.api.streams.slots import Slot
from tierq.core import tracing
from tierq.core.aio import raise_if_cancelled
from tierq.core.messages import JobEvent
from tierq.core.queue import EventLog
from tierq.core.redis_conn import is_unavailable as redis_unavailable
from tierq.core.retry import Backoff
from tierq.core.states import TERMINAL
from tierq.models import jobs as job_repo
from tierq.models.db import Database
from tierq.models.records import JobHead, JobRecord

log = logging.getLogger(__name__)

TERMINAL_KINDS = ("done", "error")
# The id of a final event read from the database once the job's replay buffer expired: no
# sequence number reaches it, so a reconnect that carries it is told (204) that nothing
# follows, where the buffer cannot say so any more.
FINAL_AFTER_EXPIRY = 999_999_999_999_999_999

# A streamed answer as the OpenAPI document states it: events, each with its data (JSON, or
# [DONE] to end an OpenAI stream).
EVENT_STREAM: dict[str, Any] = {
    "text/event-stream": {
        "itemSchema": {
            "type": "object",
            "required": ["data"],
            "properties": {
                "data": {"type": "string"},
                "event": {"type": "string"},
                "id": {"type": "string"},
            },
        }
    }
}


def _sse(seq: int, event: JobEvent) -> dict[str, Any]:
    return {"id": str(seq), "event": event.kind, "data": json.dumps(event.data)}


def _final_event(job: JobRecord) -> JobEvent:
    return JobEvent("error" if job.status.value == "failed" else "done", job.to_api(logprobs=False))


async def job_event_stream(
    hub: EventHub,
    db: Database,
    events: EventLog,
    job: JobHead | JobRecord,
    last_seq: int,
    key_id: str | None,
    slot: Slot,
) -> AsyncIterator[dict[str, Any]]:
    """The SSE events of a job; a stream closed by a suspension or a revocation ends with
    an `error` event in OpenAI's error shape. Holds (and lets go of) the stream's slot."""
    try:
        async with contextlib.aclosing(follow_job(hub, db, events, job, last_seq, key_id)) as it:
            async for seq, event in it:
                yield _sse(seq, event)
    except StreamClosed as closed:
        body = {"error": {"message": closed.message, "type": "invalid_request_error"}}
        body["error"]["code"] = closed.code
        yield {"event": "error", "data": json.dumps(body)}
    finally:
        slot.release()


async def follow_job(
    hub: EventHub,
    db: Database,
    events: EventLog,
    job: JobHead | JobRecord,
    last_seq: int = 0,
    key_id: str | None = None,
) -> AsyncGenerator[tuple[int, JobEvent], None]:
    """A job's events after `last_seq`, numbered, up to and including the terminal one.

    Live events come through the process's one pub/sub connection (`EventHub`); whatever
    may have been missed (a lost connection, a follower too slow for its queue) is read
    again from the replay buffer by sequence number. Raises StreamClosed when the tenant
    is suspended or the key revoked meanwhile.
    """
    stream_span = tracing.following(events.r, events.names.trace_context(job.id))
    async with hub.follow(job.id, job.tenant_id, key_id) as follower, stream_span as span:
        span.set(job_id=job.id, tenant_id=job.tenant_id, from_event=last_seq)
        cursor = _Cursor(last_seq)
        finish = job.status in TERMINAL
        backoff = Backoff(0.1, 2.0)
        while True:
            try:
                # Subscribed before this read: nothing falls between the two.
                for item in await events.since(job.id, cursor.seq):
                    yield cursor.take(item)
                    if cursor.over:
                        return
                if finish:
                    expired = not await events.exists(job.id)
                    async for item in _finish_from_database(db, job.id, cursor.seq, expired):
                        yield item
                    return
                async for item in _live(follower, events, cursor):
                    yield item
                    if cursor.over:
                        return
                # Back to the buffer: the hub asks to re-read it, or says the job is over.
                finish, cursor.recheck = cursor.recheck, False
                backoff.reset()
            except StreamClosed:
                raise
            except Exception as exc:
                raise_if_cancelled(exc)  # the client went: a cancelled read, not an outage
                if not redis_unavailable(exc):
                    raise
                log.warning("following job %s: Redis unreachable (%s); retrying", job.id, exc)
                await backoff.wait()


class _Cursor:
    """The last event sent, and whether the stream is over."""

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.over = False
        self.recheck = False

    def take(self, item: tuple[int, JobEvent]) -> tuple[int, JobEvent]:
        self.seq = item[0]
        self.over = item[1].kind in TERMINAL_KINDS
        return item


async def _live(
    follower: Follower, events: EventLog, state: _Cursor
) -> AsyncIterator[tuple[int, JobEvent]]:
    """Live events until the terminal one, or until the buffer must be read again."""
    while True:
        # No timeout: the hub's recheck looks at the database for quiet jobs and puts
        # RECHECK here when one is over; a close, a resync, every event come here too.
        msg = await follower.next()
        if msg is RESYNC:
            return
        if msg is RECHECK:
            state.recheck = True
            return
        seq, event = EventLog.decode_live(msg)
        if seq <= state.seq:
            continue  # already sent from the replay buffer
        if seq > state.seq + 1:  # a gap: fill it from the buffer
            for gap in await events.since(follower.job_id, state.seq):
                if gap[0] >= seq:
                    break
                yield state.take(gap)
        yield state.take((seq, event))
        if state.over:
            return


async def _finish_from_database(
    db: Database, job_id: str, last_seq: int, expired: bool
) -> AsyncIterator[tuple[int, JobEvent]]:
    """Close a stream whose terminal event is not in the buffer (`expired`, or never
    written). The final event carries the whole job, its text included, so a client that
    missed deltas still has everything."""
    async with db.session() as s:
        job = await job_repo.get_job(s, job_id)
    if job is None:
        return
    if last_seq == 0 and job.result_text:
        # The replay buffer expired: the whole text as one delta, so the client still has it.
        last_seq += 1
        yield last_seq, JobEvent("delta", {"text": job.result_text})
    yield FINAL_AFTER_EXPIRY if expired else last_seq + 1, _final_event(job)
