"""Leadership among dispatchers: any number run, one leads (reads the tier streams and hands
out jobs), the others stand by.

The leader holds a lease in Redis, `dispatch:leader` = "<epoch>:<holder>", set only when
absent and expiring after DISPATCH_LEASE_S; it renews it every third of that. A leader
that stops renewing — killed, hung, paused, cut off — loses it within the lease time, and
a standby takes it with the next epoch (one more than any before: the fencing token).

Every write a dispatcher makes as leader is fenced by the lease: the read of the streams
(which takes entries into the group's pending list), the hand-off to worker inboxes, the
preemption notices and the policy's saved accounting each run as one Lua script that
first checks the lease still holds this dispatcher's value, and does nothing when it does
not (LeaseLost). A leader that wakes after losing its lease cannot dispatch; what it had
read stays pending under the one consumer name all dispatchers share, and the new leader
re-reads every pending entry when it takes over (tierq/dispatcher/loop.py `_recover`).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis

from tierq.core import metrics, scripts
from tierq.core.redis_names import RedisNames


class LeaseLost(Exception):
    """This dispatcher no longer holds the lease: another leads, or none yet."""


StreamEntry = tuple[str, dict[str, str]]
# Streams per fenced XREADGROUP: Lua's unpack() takes some 8,000 values at most, and a
# tier has a shard per tenant.
READ_CHUNK = 1000


class Leadership:
    """This dispatcher's part in the election, and its fenced writes."""

    def __init__(self, r: aioredis.Redis, names: RedisNames, lease_s: float) -> None:
        self.r = r
        self.names = names
        self.lease_ms = max(1, int(lease_s * 1000))
        self.holder = secrets.token_hex(8)
        self.value: str | None = None  # "<epoch>:<holder>" while held
        self.epoch = 0
        self.left_s = 0.0  # what the holder's lease had left at the last failed acquire
        self._acquire = r.register_script(scripts.source("leader_acquire"))
        self._renew = r.register_script(scripts.source("leader_renew"))
        self._release = r.register_script(scripts.source("release_if_holder"))
        self._read = r.register_script(scripts.source("leader_read"))
        self._hand_off = r.register_script(scripts.source("leader_hand_off"))
        self._publish = r.register_script(scripts.source("leader_publish"))
        self._save = r.register_script(scripts.source("leader_save"))
        self._requeue = r.register_script(scripts.source("leader_requeue"))
        self._forget = r.register_script(scripts.source("leader_forget_worker"))
        self._take_ready = r.register_script(scripts.source("leader_take_ready"))

    @property
    def held(self) -> bool:
        return self.value is not None

    async def acquire(self) -> bool:
        """Take the lease if nobody holds it; True when this dispatcher now leads."""
        keys = [self.names.dispatch_leader, self.names.dispatch_epoch]
        epoch = int(await self._acquire(keys=keys, args=[self.holder, self.lease_ms]))
        if epoch < 0:
            self.left_s = (-epoch - 1) / 1000 if epoch < -1 else self.lease_ms / 3000
            return False
        if epoch:
            self.epoch = epoch
            self.value = f"{epoch}:{self.holder}"
            metrics.DISPATCHER_LEADERSHIPS.inc()
            metrics.DISPATCHER_LEADER.set(1)
        return bool(epoch)

    async def renew(self) -> bool:
        """Extend the lease; False (and no longer held) when it was lost meanwhile."""
        value = self.value
        if value is None:
            return False
        kept = int(
            await self._renew(keys=[self.names.dispatch_leader], args=[value, self.lease_ms])
        )
        if not kept and self.value == value:  # not a lease taken again meanwhile
            self.lost()
        return bool(kept)

    async def release(self) -> None:
        """Give the lease up (a clean stop): a standby takes over at once, not after it
        expires."""
        if self.value is not None:
            await self._release(keys=[self.names.dispatch_leader], args=[self.value])
        self.lost(fenced=False)

    def lost(self, *, fenced: bool = True) -> None:
        if self.value is not None and fenced:
            metrics.DISPATCHER_FENCED.inc()
        self.value = None
        metrics.DISPATCHER_LEADER.set(0)

    def _checked(self, result: Any) -> Any:
        if result == -1:
            self.lost()
            raise LeaseLost
        return result

    def _fence(self) -> str:
        if self.value is None:
            raise LeaseLost
        return self.value

    async def read_group(
        self, group: str, consumer: str, streams: dict[str, str], count: int
    ) -> list[tuple[str, list[StreamEntry]]]:
        """XREADGROUP of `streams` (stream -> id: ">" new, else pending after it), as the
        leader only. Fields are {} for entries deleted meanwhile."""
        out: list[tuple[str, list[StreamEntry]]] = []
        items = list(streams.items())
        for start in range(0, len(items), READ_CHUNK):
            chunk = dict(items[start : start + READ_CHUNK])
            keys = [self.names.dispatch_leader, *chunk]
            args: list[Any] = [self._fence(), group, consumer, count, *chunk.values()]
            got = self._checked(await self._read(keys=keys, args=args))
            out.extend(
                (str(stream), [(str(eid), _pairs(fields)) for eid, fields in entries])
                for stream, entries in got or []
            )
        return out

    async def take_ready(self, most: int) -> list[str]:
        """Up to `most` streams given entries since the last take, taken out of the set."""
        keys = [self.names.dispatch_leader, self.names.dispatch_ready]
        got = self._checked(await self._take_ready(keys=keys, args=[self._fence(), most]))
        return [g.decode() if isinstance(g, bytes) else str(g) for g in got or []]

    async def hand_off(
        self, group: str, moves: Sequence[tuple[str, str, str, str, dict[str, str]]]
    ) -> list[bool]:
        """Each (worker id, inbox, stream, entry id, fields): the job into the worker's
        inbox and its source entry acknowledged and deleted — all of them or, fenced, none.
        A job whose worker has gone or is draining stays pending on its stream (False)."""
        args: list[Any] = [self._fence(), group]
        for worker_id, inbox, stream, entry_id, fields in moves:
            args += [worker_id, inbox, stream, entry_id, 2 * len(fields)]
            for name, value in fields.items():
                args += [name, value]
        keys = [self.names.dispatch_leader, self.names.workers]
        return [bool(m) for m in self._checked(await self._hand_off(keys=keys, args=args))]

    async def requeue(
        self, group: str, inbox: str, entry_id: str, stream: str | None, fields: dict[str, str]
    ) -> None:
        """A dead worker's inbox entry back on `stream` (None: only let go of it)."""
        args: list[Any] = [self._fence(), group, inbox, entry_id, stream or "", 2 * len(fields)]
        for name, value in fields.items():
            args += [name, value]
        keys = [self.names.dispatch_leader, self.names.dispatch_ready]
        self._checked(await self._requeue(keys=keys, args=args))

    async def forget_worker(self, inbox: str, worker_id: str) -> None:
        args = [self._fence(), inbox, self.names.workers, worker_id]
        self._checked(await self._forget(keys=[self.names.dispatch_leader], args=args))

    async def publish(self, messages: Sequence[tuple[str, str]]) -> None:
        args: list[Any] = [self._fence()]
        for channel, message in messages:
            args += [channel, message]
        self._checked(await self._publish(keys=[self.names.dispatch_leader], args=args))

    async def save(self, key: str, value: str) -> None:
        keys = [self.names.dispatch_leader, key]
        self._checked(await self._save(keys=keys, args=[self._fence(), value]))


def _pairs(fields: Any) -> dict[str, str]:
    if not fields:
        return {}
    return {str(fields[i]): str(fields[i + 1]) for i in range(0, len(fields), 2)}
