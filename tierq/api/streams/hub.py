"""One Redis pub/sub connection per API process, fanned out to every stream it serves.

A follower (an SSE client, an online OpenAI request) registers here for its job's
channel; the hub subscribes on its one connection (refcounted, and unsubscribed lazily
so that a channel dropped and taken again does not race its confirmation) and hands every
live event to each follower's bounded queue. What a follower cannot keep up with is not
buffered without bound: it is told to re-read the job's replay buffer, which has every
event by sequence number. A lost connection is replaced, every channel subscribed again,
and every follower told to re-read the buffer, so no event is lost across it.

The access channel (a tenant suspended, a key revoked) is read on the same connection;
its messages go to `on_access` (tierq/api/streams/access.py closes the streams they name).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub

from tierq.core.aio import Detached, cancel_and_wait, raise_if_cancelled
from tierq.core.redis_conn import is_unavailable
from tierq.core.redis_names import RedisNames
from tierq.core.retry import Backoff

log = logging.getLogger(__name__)

STOP_TASKS_S = 5.0  # how long a stop waits for the hub's own tasks
QUEUE_MAX = 512  # live events a follower may have waiting before it re-reads the buffer
CONFIRM_TIMEOUT_S = 5.0


class _Resync:
    """Re-read the replay buffer from the last event sent (events may have been missed)."""


class _Recheck:
    """The job is over in the database: finish from the buffer, then from the database."""


RESYNC = _Resync()
RECHECK = _Recheck()


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

    async def next(self, wait_s: float | None = None) -> Any:
        """The next live message (raw), RESYNC, RECHECK, or None after `wait_s` (None: as
        long as it takes; whatever a follower must hear, a close, a recheck, a resync, is
        put in its queue). What arrived before a close is handed out first (a cancelled
        job's `done` precedes the suspension that closes its stream)."""
        if self.closed is not None and self.queue.empty():
            raise self.closed
        if self.lagged:
            self.lagged = False
            while not self.queue.empty():
                self.queue.get_nowait()
            return RESYNC
        if wait_s is None:
            item = await self.queue.get()  # no timer: an idle stream costs nothing
        else:
            try:
                item = await asyncio.wait_for(self.queue.get(), wait_s)
            except TimeoutError:
                return None
        if isinstance(item, StreamClosed):
            raise item
        return item


class EventHub:
    def __init__(
        self, r: aioredis.Redis, names: RedisNames, on_access: Callable[[str], None]
    ) -> None:
        self.r = r
        self.names = names
        self.on_access = on_access
        self.followers: dict[str, set[Follower]] = defaultdict(set)
        self._confirmed: dict[str, asyncio.Event] = {}
        self._pubsub: PubSub | None = None
        self._subscribed: set[str] = set()
        self._reading: asyncio.Task[None] | None = None
        self._cleanups = Detached("event hub: clean-up")

    # --- life ----------------------------------------------------------------------------

    async def start(self) -> None:
        self._reading = asyncio.create_task(self._read(), name="hub-read")

    async def stop(self) -> None:
        if self._reading is not None:
            await cancel_and_wait([self._reading], STOP_TASKS_S)
        await self._cleanups.wait(2.0)
        await self._drop_pubsub()

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
            self.followers[channel].discard(follower)  # let go by unsubscribe_idle

    def everyone(self) -> Iterator[Follower]:
        """Every follower of the process."""
        for group in list(self.followers.values()):
            yield from list(group)

    async def unsubscribe_idle(self) -> None:
        """Let go of the channels no follower holds any more (lazily: a channel dropped
        and taken again at once would race its confirmation)."""
        idle = [c for c, group in self.followers.items() if not group]
        for channel in idle:
            del self.followers[channel]
            self._confirmed.pop(channel, None)
        gone = [c for c in idle if c in self._subscribed]
        self._subscribed.difference_update(gone)
        if gone and self._pubsub is not None:
            await self._pubsub.unsubscribe(*gone)

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
            self._cleanups.spawn(self._subscribe([channel]))
            return
        if kind != "message":
            return
        data = str(msg["data"])
        if channel == self.names.access_channel:
            self.on_access(data)
            return
        for follower in self.followers.get(channel, ()):
            follower.push(data)
