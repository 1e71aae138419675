"""The Redis operations shared by the API, the dispatcher, the worker and Celery.

Enqueueing a job, appending to and reading a job's event stream, and worker heartbeats.
Names come from `RedisNames`; nothing here decides policy.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tierq.core import scripts, tracing
from tierq.core.aio import cancel_and_wait
from tierq.core.messages import Heartbeat, JobEvent, JobMessage
from tierq.core.redis_conn import redis_now, with_retries
from tierq.core.redis_names import RedisNames
from tierq.core.settings import Settings

# What enqueue.lua puts before the error of a job it could not enqueue (its reply's mark).
ERROR_MARK = "error: "
ENQUEUE_DEADLINE_S = 5.0  # the longest an admission waits for its enqueue's call
_ENQUEUE = scripts.source("enqueue")
_ENQUEUE_SHA = hashlib.sha1(_ENQUEUE.encode()).hexdigest()
_Part = tuple[tuple[str, str, str], tuple[str | int, ...]]  # one job's keys and arguments


def _enqueue_part(names: RedisNames, msg: JobMessage, head_of_tier: bool, arrival: bool) -> _Part:
    """One job's keys and arguments of the script, stamped with the caller's trace context
    (so made in the caller's task)."""
    msg = tracing.stamp(msg)
    if head_of_tier:
        stream = names.preempted_stream(msg.tier)
    else:
        stream = names.tier_stream(msg.tier, msg.tenant_id)
    trace = msg.trace if msg.batch_id is None and tracing.sampled(msg.trace) else None
    keys = (
        stream,
        names.tier_tenants(msg.tier),
        names.trace_context(msg.job_id) if trace else stream,  # (unused without one)
    )
    ((field, value),) = msg.encode().items()
    args = (
        field,
        value,
        "" if head_of_tier else msg.tenant_id,
        msg.job_id,
        "1" if arrival else "",
        trace or "",
        tracing.TRACE_CONTEXT_TTL_S,
    )
    return keys, args


async def _enqueue_parts(r: aioredis.Redis, names: RedisNames, parts: list[_Part]) -> list[str]:
    keys = [names.inflight, names.arrivals, names.dispatch_wake, names.dispatch_ready]
    args: list[str | int] = []
    for job_keys, job_args in parts:
        keys.extend(job_keys)
        args.extend(job_args)
    try:
        ids = await r.evalsha(_ENQUEUE_SHA, len(keys), *keys, *args)
    except NoScriptError:  # a restarted Redis, or SCRIPT FLUSH: EVAL loads it again
        ids = await r.eval(_ENQUEUE, len(keys), *keys, *args)
    return [i.decode() if isinstance(i, bytes) else str(i) for i in ids]


def _entry_id(result: str) -> str:
    """A job's entry id from the script's reply, or its own error raised."""
    if result.startswith(ERROR_MARK):
        raise ResponseError(result.removeprefix(ERROR_MARK))
    return result


async def enqueue(
    r: aioredis.Redis,
    names: RedisNames,
    msg: JobMessage,
    *,
    head_of_tier: bool = False,
    arrival: bool = True,
) -> str:
    """XADD a job to its tier's stream (its tenant's shard, or the head-of-tier stream for a
    preempted job), mark it as held by Redis, and wake the dispatcher. `arrival`: new work
    (admitted, a batch line), counted for the autoscaling signal; False for a job put back
    (handed back, preempted, re-enqueued by the reconciler). With tracing on, the entry
    carries the current trace context (tierq/core/tracing.py), and a job's first one keeps it
    for the job's SSE followers."""
    part = _enqueue_part(names, msg, head_of_tier, arrival)
    (entry_id,) = await _enqueue_parts(r, names, [part])
    return _entry_id(entry_id)


class Enqueuer:
    """The API's enqueues of admitted jobs, coalesced: while one script call is in flight,
    the jobs admitted meanwhile wait, and the next call carries them all (up to
    `max_batch`). Under a burst that is one command and one reply for many jobs, where each
    job's own call cost it a fifth of its admission's CPU; a lone job goes at once.

    Each waiter gets its own entry's id, or its own error: its job's (the others' go on),
    or its call's (after `with_retries`; a call that has not answered in `deadline_s` —
    a connection gone half-open — fails with `redis.TimeoutError`, so that one stuck call
    cannot hold every admission). A waiter that goes away (its client hung up) does not
    stop its job's enqueue, which runs in the Enqueuer's task, not the request's. Once
    `aclose` has begun, enqueues fail at once: the jobs are committed, and the reconciler
    enqueues what Redis does not hold."""

    def __init__(
        self,
        r: aioredis.Redis,
        names: RedisNames,
        max_batch: int = 256,
        deadline_s: float = ENQUEUE_DEADLINE_S,
    ) -> None:
        self.r = r
        self.names = names
        self.max_batch = max_batch
        self.deadline_s = deadline_s
        self.calls = 0  # script calls made (tests and the curious)
        self._pending: list[tuple[_Part, asyncio.Future[str]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._closed = False

    async def enqueue(self, msg: JobMessage) -> str:
        """`enqueue(r, names, msg)` (an arrival, on its tenant's stream), coalesced."""
        if self._closed:
            raise RedisConnectionError("the API is stopping")
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._pending.append((_enqueue_part(self.names, msg, False, True), future))
        if self._flusher is None or self._flusher.done():
            # In a context of its own: not the first request's (its log fields, its span).
            self._flusher = asyncio.create_task(
                self._flush(), name="tierq-enqueue", context=contextvars.Context()
            )
        return await future

    async def _flush(self) -> None:
        while self._pending:
            batch = self._pending[: self.max_batch]
            del self._pending[: self.max_batch]
            try:
                await self._send(batch)
            except asyncio.CancelledError:
                # Stopped (the API's stop): these jobs are committed, and the reconciler
                # enqueues what Redis does not hold.
                self._fail(batch + self._pending, RedisConnectionError("the API is stopping"))
                self._pending = []
                raise
            except Exception as exc:
                self._fail(batch, exc)
            finally:
                # Whatever happened, no waiter of this batch is left waiting.
                self._fail(batch, RedisConnectionError("the enqueue ended without a reply"))

    async def _send(self, batch: list[tuple[_Part, asyncio.Future[str]]]) -> None:
        parts = [part for part, _ in batch]
        try:
            async with asyncio.timeout(self.deadline_s):
                ids = await with_retries(functools.partial(self._call, parts))
        except TimeoutError:
            raise RedisTimeoutError(
                f"Redis did not answer the enqueue in {self.deadline_s:.0f} s"
            ) from None
        for (_, future), result in zip(batch, ids, strict=True):
            if future.done():
                continue
            try:
                future.set_result(_entry_id(result))
            except ResponseError as exc:
                future.set_exception(exc)

    async def _call(self, parts: list[_Part]) -> list[str]:
        self.calls += 1
        return await _enqueue_parts(self.r, self.names, parts)

    @staticmethod
    def _fail(batch: list[tuple[_Part, asyncio.Future[str]]], exc: BaseException) -> None:
        for _, future in batch:
            if not future.done():
                future.set_exception(exc)

    async def aclose(self, timeout_s: float | None = None) -> None:
        """Refuse new enqueues, let those under way finish (within `timeout_s`, by default
        a call's deadline), then stop; a waiter left is told the API is stopping."""
        self._closed = True
        flusher = self._flusher
        if flusher is None or flusher.done():
            return
        wait_s = self.deadline_s if timeout_s is None else timeout_s
        done, _ = await asyncio.wait([flusher], timeout=wait_s)
        if not done:
            await cancel_and_wait([flusher], 1.0)
        self._fail(self._pending, RedisConnectionError("the API is stopping"))
        self._pending = []


async def wake_dispatcher(r: aioredis.Redis, names: RedisNames) -> None:
    async with r.pipeline(transaction=True) as pipe:
        pipe.lpush(names.dispatch_wake, "1")
        pipe.ltrim(names.dispatch_wake, 0, 0)
        await pipe.execute()


async def forget_inflight(r: aioredis.Redis, names: RedisNames, job_ids: Iterable[str]) -> None:
    ids = list(job_ids)
    if ids:
        await r.srem(names.inflight, *ids)


async def held_by_redis(r: aioredis.Redis, names: RedisNames, job_ids: list[str]) -> list[bool]:
    if not job_ids:
        return []
    return [bool(x) for x in await r.smismember(names.inflight, job_ids)]


def truncated(event: JobEvent) -> str:
    """What a replay buffer keeps of a delta past its byte limit: how many characters it
    had (a re-run of the job skips that much of its text, as it skips what was kept)."""
    chars = len(event.data.get("text", ""))
    kept: dict[str, Any] = {"text": "", "replay_truncated": True, "chars": chars}
    if event.data.get("logprobs"):
        kept["scored"] = len(event.data["logprobs"])  # the tokens' log probabilities it had
    if event.data.get("index"):
        kept["index"] = event.data["index"]  # the choice it continued (n > 1)
    return JobEvent("delta", kept).encode()


def delta_chars(event: JobEvent) -> int:
    """Characters of text a delta carried, kept or truncated in the buffer."""
    return int(event.data.get("chars", len(event.data.get("text", ""))))


@dataclass(frozen=True)
class Streamed:
    """What a job's deltas carried, per choice (0 unless the job has n > 1): characters of
    text, and tokens whose log probabilities went with them."""

    chars: dict[int, int]
    scored: dict[int, int]


def streamed_so_far(events: list[JobEvent]) -> Streamed:
    chars: dict[int, int] = {}
    scored: dict[int, int] = {}
    for event in events:
        if event.kind == "delta":
            index = int(event.data.get("index", 0))
            chars[index] = chars.get(index, 0) + delta_chars(event)
            tokens = int(event.data.get("scored", len(event.data.get("logprobs", ()))))
            scored[index] = scored.get(index, 0) + tokens
    return Streamed(chars, scored)


class EventLog:
    """A job's events: a replay buffer (list) plus a live channel (pub/sub).

    A buffer lives `ttl_s` after its last event, `done_ttl_s` after the final one (the
    database has the whole result then), and keeps at most `max_bytes` of deltas."""

    def __init__(
        self,
        r: aioredis.Redis,
        names: RedisNames,
        ttl_s: int,
        done_ttl_s: int | None = None,
        max_bytes: int | None = None,
    ) -> None:
        self.r = r
        self.names = names
        self.ttl_s = ttl_s
        self.done_ttl_s = ttl_s if done_ttl_s is None else done_ttl_s
        self.max_bytes = max_bytes
        self._append = r.register_script(scripts.source("append_event"))
        self._claim = r.register_script(scripts.source("claim_delivery"))
        self._restore = r.register_script(scripts.source("restore_events"))

    @classmethod
    def for_settings(cls, r: aioredis.Redis, names: RedisNames, settings: Settings) -> EventLog:
        """The event log with the deployment's replay limits (REPLAY_*)."""
        return cls(
            r, names, settings.replay_ttl_s, settings.replay_done_ttl_s, settings.replay_max_bytes
        )

    def _keys(self, job_id: str) -> list[str]:
        n = self.names
        return [
            n.job_events(job_id),
            n.job_channel(job_id),
            n.job_delivery(job_id),
            n.job_event_bytes(job_id),
        ]

    def _args(self, event: JobEvent, fence: str, check: str) -> list[str | int]:
        final = event.kind != "delta"
        limit = "" if final or self.max_bytes is None else str(self.max_bytes)
        ttl = self.done_ttl_s if final else self.ttl_s
        return [event.encode(), ttl, fence, check, limit, truncated(event) if limit else ""]

    async def append(self, job_id: str, event: JobEvent, delivery: int | None = None) -> int:
        """Append one event; its sequence number, or 0 if a later delivery fenced it off."""
        fence = "" if delivery is None else str(delivery)
        args = self._args(event, fence, "")
        return int(await self._append(keys=self._keys(job_id), args=args))

    async def append_many(
        self, items: list[tuple[str, JobEvent, int | None, int | None]]
    ) -> list[int]:
        """Append many events (job, event, delivery, expected sequence number) in one round
        trip, in order; each one's sequence number, 0 where a later delivery of its job
        fenced it off, or -1 where the job's buffer was lost (see `restore`)."""
        async with self.r.pipeline(transaction=False) as pipe:
            for job_id, event, delivery, expected in items:
                fence = "" if delivery is None else str(delivery)
                check = "" if expected is None else str(expected)
                args = self._args(event, fence, check)
                await self._append(keys=self._keys(job_id), args=args, client=pipe)
            return [int(n) for n in await pipe.execute()]

    async def restore(self, job_id: str, encoded: list[str], written: int) -> None:
        """Rewrite a job's lost buffer with all its events, publishing those after the
        first `written` (which clients may have seen already)."""
        keys = self._keys(job_id)[:2]
        args: list[str | int] = [self.ttl_s, written, *encoded]
        await self._restore(keys=keys, args=args)

    async def claim_delivery(self, job_id: str, delivery: int) -> bool:
        """Fence the job's events to this delivery; False if a later one runs already."""
        keys = [self.names.job_delivery(job_id)]
        return bool(await self._claim(keys=keys, args=[delivery, self.ttl_s]))

    async def exists(self, job_id: str) -> bool:
        """Whether the job's replay buffer is still there (it expires after its last event)."""
        return bool(await self.r.exists(self.names.job_events(job_id)))

    async def since(self, job_id: str, after_seq: int) -> list[tuple[int, JobEvent]]:
        """Events with a sequence number above `after_seq` (1-based), in order."""
        raw = await self.r.lrange(self.names.job_events(job_id), after_seq, -1)
        return [(after_seq + i + 1, JobEvent.decode(item)) for i, item in enumerate(raw)]

    @staticmethod
    def decode_live(raw: str) -> tuple[int, JobEvent]:
        seq, _, body = raw.partition("|")
        return int(seq), JobEvent.decode(body)


async def write_heartbeat(r: aioredis.Redis, names: RedisNames, hb: Heartbeat) -> None:
    await r.hset(names.workers, hb.worker_id, hb.encode())


async def live_workers(
    r: aioredis.Redis, names: RedisNames, dead_after_s: float, now: float | None = None
) -> tuple[list[Heartbeat], list[Heartbeat]]:
    """(alive, dead) workers by the age of their last heartbeat, on Redis' clock (which
    stamped every heartbeat): hosts whose clocks disagree still agree on who is alive."""
    now = await redis_now(r) if now is None else now
    raw = await r.hgetall(names.workers)
    alive: list[Heartbeat] = []
    dead: list[Heartbeat] = []
    for value in raw.values():
        hb = Heartbeat.decode(value)
        (alive if now - hb.ts <= dead_after_s else dead).append(hb)
    return alive, dead


# Latency samples each (kind, tier) list keeps: enough for a p99, small enough to read
# every second or two (the operator console polls them).
LATENCY_SAMPLES_KEPT = 500
LATENCY_KINDS = ("wait", "ttft")


async def push_latency_samples(
    r: aioredis.Redis, names: RedisNames, samples: dict[tuple[str, str], list[float]]
) -> None:
    """Add a worker's latest samples ((kind, tier) -> seconds, oldest first) in one round
    trip, each list trimmed to the newest LATENCY_SAMPLES_KEPT."""
    if not samples:
        return
    async with r.pipeline(transaction=False) as pipe:
        for (kind, tier), values in samples.items():
            key = names.latency_samples(kind, tier)
            pipe.lpush(key, *(f"{v:.6f}" for v in values))
            pipe.ltrim(key, 0, LATENCY_SAMPLES_KEPT - 1)
        await pipe.execute()


async def latency_samples(
    r: aioredis.Redis, names: RedisNames, kind: str, tier: str
) -> list[float]:
    """A tier's latest samples of one kind, newest first (at most LATENCY_SAMPLES_KEPT)."""
    raw = await r.lrange(names.latency_samples(kind, tier), 0, LATENCY_SAMPLES_KEPT - 1)
    return [float(x) for x in raw]


StreamEntry = tuple[str, dict[str, str]]


async def read_group(
    r: aioredis.Redis,
    group: str,
    consumer: str,
    streams: dict[str, str],
    *,
    count: int | None = None,
    block_ms: int | None = None,
) -> list[tuple[str, list[StreamEntry]]]:
    """XREADGROUP, typed: [(stream, [(entry_id, fields)])]. Fields are {} for deleted entries."""
    got: Any = await r.xreadgroup(group, consumer, streams, count=count, block=block_ms)  # type: ignore[arg-type]
    if not got:
        return []
    if isinstance(got, dict):  # RESP3 shape
        got = list(got.items())
    return [
        (str(stream), [(str(eid), dict(fields or {})) for eid, fields in entries])
        for stream, entries in got
    ]


async def claim_all(
    r: aioredis.Redis, stream: str, group: str, consumer: str, count: int = 100
) -> list[StreamEntry]:
    """XAUTOCLAIM every pending entry of a group to `consumer` (entries deleted meanwhile: {})."""
    claimed: list[StreamEntry] = []
    cursor = "0-0"
    while True:
        reply: Any = await r.xautoclaim(stream, group, consumer, 0, start_id=cursor, count=count)
        cursor, entries = str(reply[0]), reply[1]
        claimed.extend((str(eid), dict(fields or {})) for eid, fields in entries)
        if cursor == "0-0":
            return claimed
