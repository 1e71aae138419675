"""The lease on a batch: one Celery worker advances a batch at a time.

A Redis key holding a random token, set only if absent, renewed while its holder works
and released only by its holder (it may have expired and been taken meanwhile): a worker
killed mid-step holds the batch up for at most LOCK_MS.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator

import redis.asyncio as aioredis

LOCK_MS = 15_000

_RENEW = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then "
    "return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"
)
_RELEASE = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)


@contextlib.asynccontextmanager
async def lease(r: aioredis.Redis, key: str, ms: int = LOCK_MS) -> AsyncIterator[bool]:
    """Hold `key` for the block (True), or not at all when another holds it (False)."""
    token = secrets.token_hex(8)
    if not await r.set(key, token, nx=True, px=ms):
        yield False
        return
    renewer = asyncio.create_task(_renew(r, key, token, ms))
    try:
        yield True
    finally:
        renewer.cancel()
        await r.eval(_RELEASE, 1, key, token)


async def _renew(r: aioredis.Redis, key: str, token: str, ms: int) -> None:
    """Keep the lease while its holder works (validating a large file takes long)."""
    while True:
        await asyncio.sleep(ms / 3000)
        await r.eval(_RENEW, 1, key, token, ms)
