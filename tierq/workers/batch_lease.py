"""The lease on a batch: one Celery worker advances a batch at a time.

A Redis key holding a random token, set only if absent, renewed while its holder works
and released only by its holder (it may have expired and been taken meanwhile): a worker
killed mid-step holds the batch up for at most the lease's length (BATCH_LEASE_S).

The key alone is not a fence: a holder whose renewals stopped reaching Redis, or whose
process froze past the lease, may go on while another takes the batch. So the lease also
notes when a renewal finds the key gone or another's (`lost`: the holder stops between
steps), and tierq/workers/batches.py fences every write in the database (models.batches
`take_fence`, `hold`): what a stale holder tries to write after the takeover is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import LockNotOwnedError

log = logging.getLogger(__name__)


@dataclass
class Lease:
    held: bool  # taken (False: another holds the batch; nothing was taken)
    lost: bool = False  # a renewal found the key gone or another's


@contextlib.asynccontextmanager
async def lease(r: aioredis.Redis, key: str, ms: int) -> AsyncIterator[Lease]:
    """Hold `key` for the block, or not at all when another holds it (`held` False).
    redis-py's Lock: a random token set only if absent, renewed and released only by its
    holder (no fencing token: the database fences the writes)."""
    lock = r.lock(key, timeout=ms / 1000, blocking=False, thread_local=False)
    if not await lock.acquire():
        yield Lease(held=False)
        return
    held = Lease(held=True)
    renewer = asyncio.create_task(_renew(lock, ms, held))
    try:
        yield held
    finally:
        renewer.cancel()
        with contextlib.suppress(Exception):  # lost, or Redis unreachable: it expires
            await lock.release()


async def _renew(lock: aioredis.lock.Lock, ms: int, held: Lease) -> None:
    """Keep the lease while its holder works (validating a large file takes long)."""
    while True:
        await asyncio.sleep(ms / 3000)
        try:
            await lock.reacquire()  # its time to live set back to the whole lease
        except LockNotOwnedError:
            log.warning("the lease %s was lost (expired, or taken by another)", lock.name)
            held.lost = True
            return
        except Exception as exc:  # a blip: the next renewal may still come in time
            log.warning("renewing the lease %s failed (%s)", lock.name, exc)
