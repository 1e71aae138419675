"""What an API process keeps fresh outside its requests, every REFRESH_S: its offset to
the deployment's one clock (tierq.core.clock: the times admission writes) and what the
fleet serves (tierq.core.fleet: the models and context lengths admission checks a request
against). Each throttles itself and keeps its last reading while Redis is away."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from tierq.core import clock, fleet
from tierq.core.redis_names import RedisNames
from tierq.core.settings import Settings

REFRESH_S = 2.0


async def keep_fresh(r: aioredis.Redis, names: RedisNames, settings: Settings) -> None:
    """Run until cancelled."""
    while True:
        await asyncio.sleep(REFRESH_S)
        await clock.refresh(r)
        await fleet.refresh(r, names, settings)
