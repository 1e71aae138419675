"""The lease on a batch: one Celery worker advances a batch at a time.

A Redis key holding a random token, set only if absent, renewed while its holder works
and released only by its holder (it may have expired and been taken meanwhile): a worker
killed mid-step holds the batch up for at most the lease's length (BATCH_LEASE_S).

The key alone is not a fence: a holder whose renewals stopped reaching Redis, or whose
process froze past the lease, may go on while another takes the batch. So the lease also
notes when a renewal finds the key gone or another's (`lost`: the holder stops between
steps), and workers/batches.py fences every write in the database (models.batches
`take_fence`, `hold`): what a stale holder tries to write after the takeover is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass

import redis.asyncio as aioredis

log = logging.getLogger(__name__)

_RENEW = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then "
    "return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"
)
_RELEASE = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)


@dataclass
class Lease:
    held: bool  # taken (False: another holds the batch; nothing was taken)
    lost: bool = False  # a renewal found the key gone or another's


@contextlib.asynccontextmanager
async def lease(r: aioredis.Redis, key: str, ms: int) -> AsyncIterator[Lease]:
    """Hold `key` for the block, or not at all when another holds it (`held` False)."""
    token = secrets.token_hex(8)
    if not await r.set(key, token, nx=True, px=ms):
        yield Lease(held=False)
        return
    held = Lease(held=True)
    renewer = asyncio.create_task(_renew(r, key, token, ms, held))
    try:
        yield held
    finally:
        renewer.cancel()
        with contextlib.suppress(Exception):  # unreachable Redis: it expires by itself
            await r.eval(_RELEASE, 1, key, token)


async def _renew(r: aioredis.Redis, key: str, token: str, ms: int, held: Lease) -> None:
    """Keep the lease while its holder works (validating a large file takes long)."""
    while True:
        await asyncio.sleep(ms / 3000)
        try:
            renewed = await r.eval(_RENEW, 1, key, token, ms)
        except Exception as exc:  # a blip: the next renewal may still come in time
            log.warning("renewing the lease %s failed (%s)", key, exc)
            continue
        if not renewed:
            log.warning("the lease %s was lost (expired, or taken by another)", key)
            held.lost = True
            return
