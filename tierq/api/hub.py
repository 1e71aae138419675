"""One Redis pub/sub connection per API process, fanned out to every stream it serves.

A follower (an SSE client, an online OpenAI request) registers here for its job's
channel; the hub subscribes on its one connection (refcounted, and unsubscribed lazily
so that a channel dropped and taken again does not race its confirmation) and hands every
live event to each follower's bounded queue. What a follower cannot keep up with is not
buffered without bound: it is told to re-read the job's replay buffer, which has every
event by sequence number. A lost connection is replaced, every channel subscribed again,
and every follower told to re-read the buffer, so no event is lost across it.

The hub also does, once for every follower of the process, what each did on its own
before: it looks in the database every RECHECK_S for jobs whose terminal event never
arrived (a publish lost in a failover), and it closes the streams of a suspended tenant or
a revoked key — told at once on the access channel, and found by the same periodic look
if that message was lost.

Stream slots: each tenant may hold `max_streams_per_tenant` open streams and waiting
online requests over every API process. A slot is a member of the tenant's sorted set in
Redis whose score is the end of its lease; this process renews its slots' leases while it
holds them, so the slots of a process that dies are let go after `stream_lease_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub

from tierq.core import clock, fleet, scripts
from tierq.core.aio import cancel_and_wait, raise_if_cancelled
from tierq.core.redis_conn import is_unavailable, with_retries
from tierq.core.redis_names import RedisNames
from tierq.core.retry import Backoff
from tierq.core.settings import Settings
from tierq.core.states import TERMINAL
from tierq.models import jobs as job_repo
from tierq.models import tenants as tenant_repo
from tierq.models.db import Database

log = logging.getLogger(__name__)

# While a follower hears nothing, the hub looks at its job in the database this often.
RECHECK_S = 2.0
STOP_TASKS_S = 5.0  # how long a stop waits for the hub's own tasks
QUEUE_MAX = 512  # live events a follower may have waiting before it re-reads the buffer
CONFIRM_TIMEOUT_S = 5.0


class Resync:
    """Re-read the replay buffer from the last event sent (events may have been missed)."""


class Recheck:
    """The job is over in the database: finish from the buffer, then from the database."""


RESYNC = Resync()
RECHECK = Recheck()


class StreamClosed(Exception):
    """The stream's tenant was suspended or its key revoked while it was open."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def status(self) -> int:
        """The HTTP status a request answers with: 403 suspended, 401 key revoked."""
        return 403 if self.code == "tenant_suspended" else 401


class TooManyStreams(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"at most {limit} streams per tenant")
        self.limit = limit


@dataclass(eq=False)
class Follower:
    job_id: str
    tenant_id: str
    key_id: str | None
    channel: str
    queue: asyncio.Queue[Any] = field(default_factory=lambda: asyncio.Queue(QUEUE_MAX))
    lagged: bool = False
    closed: StreamClosed | None = None
    heard_at: float = 0.0

    def push(self, item: Any) -> None:
        self.heard_at = asyncio.get_running_loop().time()
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            self.lagged = True  # dropped: the buffer has it

    def close(self, reason: StreamClosed) -> None:
        self.closed = reason
        self.push(reason)

    async def next(self, wait_s: float) -> Any:
        """The next live message (raw), RESYNC, RECHECK, or None after `wait_s`. What
        arrived before a close is handed out first (a cancelled job's `done` precedes the
        suspension that closes its stream)."""
        if self.closed is not None and self.queue.empty():
            raise self.closed
        if self.lagged:
            self.lagged = False
            while not self.queue.empty():
                self.queue.get_nowait()
            return RESYNC
        try:
            item = await asyncio.wait_for(self.queue.get(), wait_s)
        except TimeoutError:
            return None
        if isinstance(item, StreamClosed):
            raise item
        return item


@dataclass(eq=False)
class Slot:
    hub: EventHub
    tenant_id: str
    member: str
    released: bool = False

    def release(self) -> None:
        """Let the slot go. Not awaited by the caller: a stream's clean-up runs while its
        response is being cancelled (where every await is cancelled again), so the ZREM
        runs in a task of its own; if Redis is away, the lease lets the slot go."""
        if self.released:
            return
        self.released = True
        held = self.hub.slots.get(self.tenant_id)
        if held is not None:
            held.discard(self.member)
            if not held:
                del self.hub.slots[self.tenant_id]
        key = self.hub.names.tenant_streams(self.tenant_id)
        self.hub.spawn(self.hub.r.zrem(key, self.member))


class EventHub:
    def __init__(self, r: aioredis.Redis, names: RedisNames, db: Database, settings: Settings):
        self.r = r
        self.names = names
        self.db = db
        self.settings = settings
        self.followers: dict[str, set[Follower]] = defaultdict(set)
        self.slots: dict[str, set[str]] = defaultdict(set)
        self._confirmed: dict[str, asyncio.Event] = {}
        self._pubsub: PubSub | None = None
        self._subscribed: set[str] = set()
        # Told every access message (a revoked key, a suspended or changed tenant).
        self.access_listeners: list[Callable[[str], None]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._cleanups: set[asyncio.Task[None]] = set()
        self._acquire = r.register_script(scripts.source("stream_slot_acquire"))
        self._renew = r.register_script(scripts.source("stream_slots_renew"))

    # --- life ----------------------------------------------------------------------------

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._read(), name="hub-read"),
            asyncio.create_task(self._recheck(), name="hub-recheck"),
            asyncio.create_task(self._renew_leases(), name="hub-leases"),
        ]

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks, STOP_TASKS_S)
        if self._cleanups:
            await asyncio.wait(self._cleanups, timeout=2.0)
        for tenant_id, members in list(self.slots.items()):
            with contextlib.suppress(Exception):
                await self.r.zrem(self.names.tenant_streams(tenant_id), *members)
        self.slots.clear()
        await self._drop_pubsub()

    # --- stream slots --------------------------------------------------------------------

    async def take_slot(self, tenant_id: str) -> Slot:
        """One of the tenant's stream slots; TooManyStreams at its cap."""
        limit = self.settings.max_streams_per_tenant
        member = uuid.uuid4().hex
        key = self.names.tenant_streams(tenant_id)
        args: list[str | int | float] = [limit, self.settings.stream_lease_s, member]
        try:
            got = await with_retries(lambda: self._acquire(keys=[key], args=args))
        except BaseException:
            Slot(self, tenant_id, member).release()  # in case it went through
            raise
        if not got:
            raise TooManyStreams(limit)
        self.slots[tenant_id].add(member)  # renewed from now on
        return Slot(self, tenant_id, member)

    def spawn(self, work: Awaitable[Any]) -> None:
        """Run clean-up work in a task of its own, kept until it ends (errors logged)."""

        async def run() -> None:
            try:
                await work
            except Exception as exc:
                log.warning("event hub: clean-up failed: %s", exc)

        task = asyncio.create_task(run())
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _renew_leases(self) -> None:
        period = max(0.5, self.settings.stream_lease_s / 3)
        while True:
            await asyncio.sleep(period)
            held = {t: list(m) for t, m in self.slots.items() if m}
            if not held:
                continue
            try:
                async with self.r.pipeline(transaction=False) as pipe:
                    for tenant_id, members in held.items():
                        key = self.names.tenant_streams(tenant_id)
                        args: list[str | float] = [self.settings.stream_lease_s, *members]
                        await self._renew(keys=[key], args=args, client=pipe)
                    await pipe.execute()
            except Exception as exc:
                raise_if_cancelled(exc)
                log.warning("could not renew stream leases: %s", exc)

    # --- following -----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def follow(
        self, job_id: str, tenant_id: str, key_id: str | None
    ) -> AsyncIterator[Follower]:
        """Register for a job's live events; returns once this process is subscribed to
        its channel (so a replay read after it misses nothing)."""
        channel = self.names.job_channel(job_id)
        follower = Follower(job_id, tenant_id, key_id, channel)
        follower.heard_at = asyncio.get_running_loop().time()
        self.followers[channel].add(follower)
        try:
            confirmed = self._confirmed.setdefault(channel, asyncio.Event())
            await self._subscribe([channel])
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(confirmed.wait(), CONFIRM_TIMEOUT_S)
            yield follower
        finally:
            self.followers[channel].discard(follower)  # unsubscribed by the recheck loop

    async def _subscribe(self, channels: list[str]) -> None:
        """SUBSCRIBE what the current connection has not (none while reconnecting: the
        reader subscribes every followed channel once it has a connection)."""
        pubsub = self._pubsub
        todo = [c for c in channels if c not in self._subscribed]
        if pubsub is None or not todo:
            return
        self._subscribed.update(todo)
        with contextlib.suppress(Exception):  # the reader notices, reconnects, subscribes
            await pubsub.subscribe(*todo)

    async def _connect(self) -> None:
        for event in self._confirmed.values():
            event.set()  # release waiters of the old connection: they are sent RESYNC
        self._confirmed = {c: asyncio.Event() for c in self.followers}
        self._subscribed = {self.names.access_channel}
        pubsub = self.r.pubsub()
        try:
            await pubsub.subscribe(self.names.access_channel)
        except BaseException:
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # its connection goes back to the pool
            raise
        self._pubsub = pubsub
        await self._subscribe(list(self.followers))

    async def _drop_pubsub(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        self._subscribed = set()
        if pubsub is not None:
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    async def _read(self) -> None:
        backoff = Backoff(0.1, 2.0)
        while True:
            try:
                if self._pubsub is None:
                    await self._connect()
                    for group in self.followers.values():  # they may have missed events
                        for follower in group:
                            follower.push(RESYNC)
                assert self._pubsub is not None
                msg = await self._pubsub.get_message(timeout=1.0)
                backoff.reset()
            except Exception as exc:
                raise_if_cancelled(exc)
                if not is_unavailable(exc):
                    log.exception("event hub: unexpected error; reconnecting")
                else:
                    log.warning("event hub: Redis unreachable (%s); reconnecting", exc)
                await self._drop_pubsub()
                await backoff.wait()
                continue
            if msg is not None:
                self._deliver(msg)

    def _deliver(self, msg: dict[str, Any]) -> None:
        channel = str(msg.get("channel"))
        kind = msg.get("type")
        if kind == "subscribe":
            event = self._confirmed.get(channel)
            if event is not None:
                event.set()
            return
        if kind == "unsubscribe" and self.followers.get(channel):
            # A follower came for the channel while it was being let go, and its SUBSCRIBE
            # may have reached Redis first: subscribe again.
            self._subscribed.discard(channel)
            self.spawn(self._subscribe([channel]))
            return
        if kind != "message":
            return
        data = str(msg["data"])
        if channel == self.names.access_channel:
            self._revoke(data)
            return
        for follower in self.followers.get(channel, ()):
            follower.push(data)

    def _revoke(self, what: str) -> None:
        for listener in self.access_listeners:
            listener(what)
        kind, _, ident = what.partition(":")
        for group in self.followers.values():
            for follower in group:
                if kind == "tenant" and follower.tenant_id == ident:
                    follower.close(StreamClosed("tenant_suspended", "The tenant was suspended."))
                elif kind == "key" and follower.key_id == ident:
                    follower.close(
                        StreamClosed("invalid_api_key", "The stream's API key was revoked.")
                    )

    # --- the periodic look ---------------------------------------------------------------

    async def _recheck(self) -> None:
        while True:
            await asyncio.sleep(RECHECK_S)
            await clock.refresh(self.r)  # this process's admission times (tierq.core.clock)
            await fleet.refresh(self.r, self.names, self.settings)  # what admission checks
            try:
                await self._unsubscribe_idle()
                await self._recheck_once()
            except Exception as exc:
                raise_if_cancelled(exc)  # a cancel the read turned into an error: stop
                log.warning("event hub: recheck failed: %s", exc)

    async def _unsubscribe_idle(self) -> None:
        idle = [c for c, group in self.followers.items() if not group]
        for channel in idle:
            del self.followers[channel]
            self._confirmed.pop(channel, None)
        gone = [c for c in idle if c in self._subscribed]
        self._subscribed.difference_update(gone)
        if gone and self._pubsub is not None:
            await self._pubsub.unsubscribe(*gone)

    async def _recheck_once(self) -> None:
        everyone = [f for group in self.followers.values() for f in group]
        if not everyone:
            return
        now = asyncio.get_running_loop().time()
        quiet = {f.job_id for f in everyone if now - f.heard_at >= RECHECK_S}
        keys = {f.key_id for f in everyone if f.key_id is not None}
        async with self.db.session() as s:
            status = await job_repo.statuses(s, sorted(quiet)) if quiet else {}
            dead_keys = await tenant_repo.unusable_keys(s, sorted(keys)) if keys else set()
        for follower in everyone:
            if follower.key_id in dead_keys:
                follower.close(
                    StreamClosed("invalid_api_key", "The stream's API key is no longer valid.")
                )
            elif follower.job_id in quiet:
                current = status.get(follower.job_id)
                if current is None or current in TERMINAL:
                    follower.push(RECHECK)


def slot_retry_after(settings: Settings) -> int:
    return max(1, math.ceil(settings.stream_lease_s / 10))
