"""The hot path's connections (tierq/models/db.py RawPool) on the real PostgreSQL: a request
that finds every connection taken waits at most the pool's timeout and is answered 503
(Unavailable), and a waiter that goes away (its client hung up) takes no slot with it."""

from __future__ import annotations

import asyncio
import time

import pytest

from tierq.core.settings import Settings
from tierq.models.db import RawPool, Unavailable


async def test_a_full_pool_refuses_after_its_timeout_and_a_gone_waiter_keeps_no_slot(
    settings: Settings,
) -> None:
    pool = RawPool(settings.resolved_database_url, size=1, timeout_s=0.3)
    try:
        assert (await pool.fetchrow("SELECT 1 AS one"))["one"] == 1
        async with pool.connection():
            began = time.monotonic()
            with pytest.raises(Unavailable, match="free in time"):
                await pool.fetchrow("SELECT 1")
            waited = time.monotonic() - began
            assert 0.25 <= waited < 2.0
            # A waiter cancelled while it waits (as a request is when its client leaves).
            gone = asyncio.create_task(pool.fetchrow("SELECT 1"))
            # In its wait (nothing public shows it), well inside the pool's 0.3 s timeout.
            await asyncio.sleep(0.05)
            gone.cancel()
            with pytest.raises(asyncio.CancelledError):
                await gone
        # The held connection is back and nobody else took the one slot: the next
        # statement runs at once, and the pool still has exactly one slot.
        began = time.monotonic()
        assert (await pool.fetchrow("SELECT 2 AS two"))["two"] == 2
        assert time.monotonic() - began < 0.25
        async with pool.connection():
            with pytest.raises(Unavailable):
                await pool.fetchrow("SELECT 3")
    finally:
        await pool.close()
