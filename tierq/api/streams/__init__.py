"""What an API process does for the streams it serves (SSE followers of a job, online
OpenAI requests waiting on theirs), one concern a module:

- hub.py: one Redis pub/sub connection per process, fanned out to every follower;
- slots.py: each tenant's stream slots over every API process, leased in Redis;
- access.py: closing the streams of a suspended tenant or a revoked key;
- recheck.py: the periodic database look for followers whose job went quiet (a terminal
  event lost in a failover) and keys no longer usable.

`Streams` puts them together for the app (tierq/api/app.py), started and stopped as one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import redis.asyncio as aioredis

from tierq.api.streams.access import Access
from tierq.api.streams.hub import EventHub
from tierq.api.streams.recheck import Recheck
from tierq.api.streams.slots import StreamSlots
from tierq.core.redis_names import RedisNames
from tierq.core.settings import Settings
from tierq.models.db import Database


class Streams:
    """The process's hub, slots, access watch and recheck, made and run together."""

    def __init__(
        self,
        r: aioredis.Redis,
        names: RedisNames,
        db: Database,
        settings: Settings,
        access_listeners: list[Callable[[str], None]],
    ) -> None:
        self.hub = EventHub(r, names, on_access=lambda what: self.access.heard(what))
        self.access = Access(self.hub.everyone, access_listeners)
        self.slots = StreamSlots(r, names, settings)
        self.recheck = Recheck(self.hub, self.access, db)

    async def start(self) -> None:
        await self.hub.start()
        await self.slots.start()
        await self.recheck.start()

    async def stop(self) -> None:
        """The recheck and the slots together (each bounded), then the hub they use."""
        try:
            await asyncio.gather(self.recheck.stop(), self.slots.stop())
        finally:
            await self.hub.stop()
