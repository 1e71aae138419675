"""A tenant's uploads in progress, held in Redis for every API process at once: at most
FILES_MAX_CONCURRENT_UPLOADS of them, each on an expiring lease (a crashed process's slot
lapses by itself after LEASE_S), each with the bytes it may hold in the file store reserved.

Invariant, checked at every reservation: the tenant's committed bytes (PostgreSQL) plus
the reservations of its live uploads stay within its storage quota. A reservation carries
the `ended` counter read before the committed figure it was computed from; an upload's
reservation is dropped only after its file row committed, the counter bumped with it, so a
figure read before that commit is refused as stale and read again — never undercounted.
(Batch outputs do not move the counter: a figure older than FRESH_S is read again anyway,
and the check under the tenant's lock is the exact one.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from enum import Enum

import redis.asyncio as aioredis

from tierq.core import scripts
from tierq.core.aio import raise_if_cancelled
from tierq.core.redis_conn import with_retries
from tierq.core.redis_names import RedisNames

log = logging.getLogger(__name__)

LEASE_S = 30.0  # an upload's slot lapses this long after its process stopped renewing it
ENDED_TTL_S = 86_400  # the `ended` counter outlives any upload; gone, it reads as stale


class Reserved(Enum):
    LAPSED = -2  # the lease is gone (Redis unreachable past LEASE_S, or flushed)
    STALE = -3  # an upload ended since the committed figure was read: read it again
    NO_ROOM = -1


class UploadLease:
    """One upload's slot among its tenant's; `take` it, then `release` it in a finally."""

    def __init__(self, r: aioredis.Redis, names: RedisNames, tenant_id: str) -> None:
        self.r = r
        self.member = uuid.uuid4().hex
        self.keys = [
            names.tenant_uploads(tenant_id),
            names.tenant_upload_bytes(tenant_id),
            names.tenant_uploads_ended(tenant_id),
        ]
        self._acquire = r.register_script(scripts.source("upload_acquire"))
        self._reserve = r.register_script(scripts.source("upload_reserve"))
        self._renew = r.register_script(scripts.source("upload_renew"))
        self._release = r.register_script(scripts.source("upload_release"))

    async def take(self, limit: int) -> bool:
        """False when the tenant already has `limit` uploads in progress (0: no limit)."""
        args: list[str | int | float] = [limit, LEASE_S, self.member]
        try:
            got = await with_retries(lambda: self._acquire(keys=self.keys, args=args))
        except BaseException:
            await self.release(committed=False)  # in case it went through
            raise
        return bool(got)

    async def ended(self) -> str:
        """The `ended` counter, read before a committed figure that a reservation uses."""
        value = await with_retries(lambda: self.r.get(self.keys[2]))
        return "0" if value is None else value.decode() if isinstance(value, bytes) else value

    async def reserve(self, total: int, room: int, ended: str) -> int | Reserved:
        """Hold `total` stored bytes for this upload, given `room` (the quota less the
        committed bytes, read after `ended`): the most it may hold now, or why not."""
        args: list[str | int | float] = [self.member, total, room, ended]
        got = int(await with_retries(lambda: self._reserve(keys=self.keys, args=args)))
        return Reserved(got) if got < 0 else got

    async def release(self, committed: bool) -> None:
        """Let the slot go once the upload's row `committed` (or not: it was refused). Best
        effort: if Redis is away, the lease lapses by itself — but then a figure read before
        the commit is not known to be stale for up to FRESH_S (part_writer.py)."""
        args: list[str | int | float] = [self.member, ENDED_TTL_S, int(committed)]
        try:
            await self._release(keys=self.keys, args=args)
        except Exception as exc:
            raise_if_cancelled(exc)
            log.warning("could not release an upload slot: %s", exc)

    @contextlib.asynccontextmanager
    async def kept_alive(self, touch: Callable[[], None]) -> AsyncIterator[None]:
        """Renew the lease and `touch` the write (blocking; the expiry task's sign of life)
        every LEASE_S / 3 while the body is read: a client that pauses keeps both."""

        async def beat() -> None:
            while True:
                await asyncio.sleep(LEASE_S / 3)
                try:
                    await self._renew(keys=self.keys[:2], args=[LEASE_S, self.member])
                except Exception as exc:
                    raise_if_cancelled(exc)
                    log.warning("could not renew an upload slot: %s", exc)
                await asyncio.to_thread(touch)

        task = asyncio.create_task(beat(), name="upload-lease")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
