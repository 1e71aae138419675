"""Stream slots: each tenant may hold `max_streams_per_tenant` open streams and waiting
online requests over every API process.

A slot is a member of the tenant's sorted set in Redis whose score is the end of its
lease. This process renews its slots' leases while it holds them, so the slots of a
process that dies are let go after `stream_lease_s`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from collections import defaultdict
from dataclasses import dataclass

import redis.asyncio as aioredis

from tierq.core import scripts
from tierq.core.aio import cancel_and_wait, raise_if_cancelled
from tierq.core.redis_conn import with_retries
from tierq.core.redis_names import RedisNames
from tierq.core.settings import Settings

log = logging.getLogger(__name__)

STOP_S = 5.0  # how long a stop waits for the renewals and the releases under way


class TooManyStreams(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"at most {limit} streams per tenant")
        self.limit = limit


@dataclass(eq=False)
class Slot:
    slots: StreamSlots
    tenant_id: str
    member: str
    released: bool = False

    def release(self) -> None:
        """Let the slot go. Not awaited by the caller: a stream's clean-up runs while its
        response is being cancelled (where every await is cancelled again), so the ZREM
        runs in a task of the slots' own; if Redis is away, the lease lets the slot go."""
        if self.released:
            return
        self.released = True
        self.slots.forget(self.tenant_id, self.member)


class StreamSlots:
    def __init__(self, r: aioredis.Redis, names: RedisNames, settings: Settings) -> None:
        self.r = r
        self.names = names
        self.settings = settings
        self.held: dict[str, set[str]] = defaultdict(set)  # tenant -> members renewed here
        # Slots let go and not yet removed from Redis: tenant -> members. One task removes
        # them, all that gathered while its last round trip was under way in the next: a
        # storm of streams closing costs a round trip per turn, not one per stream.
        self._letting_go: dict[str, set[str]] = defaultdict(set)
        self._removing: asyncio.Task[None] | None = None
        self._renewing: asyncio.Task[None] | None = None
        self._acquire = r.register_script(scripts.source("stream_slot_acquire"))
        self._renew = r.register_script(scripts.source("stream_slots_renew"))

    async def start(self) -> None:
        self._renewing = asyncio.create_task(self._renew_leases(), name="stream-slot-leases")

    async def stop(self) -> None:
        """Stop renewing and let every slot still held go (the lease would, later)."""
        if self._renewing is not None:
            await cancel_and_wait([self._renewing], STOP_S)
        if self._removing is not None:
            await asyncio.wait([self._removing], timeout=STOP_S)
        for tenant_id, members in list(self.held.items()):
            self._letting_go[tenant_id].update(members)
        self.held.clear()
        with contextlib.suppress(Exception):
            await self._remove(self._take_letting_go())

    def refuse_if_full_here(self, tenant_id: str) -> None:
        """TooManyStreams when this process alone holds all of the tenant's slots: known
        without asking Redis (a storm of streams past the cap is refused cheaply)."""
        limit = self.settings.max_streams_per_tenant
        if len(self.held.get(tenant_id, ())) >= limit:
            raise TooManyStreams(limit)

    async def take(self, tenant_id: str) -> Slot:
        """One of the tenant's stream slots; TooManyStreams at its cap."""
        self.refuse_if_full_here(tenant_id)
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
        self.held[tenant_id].add(member)  # renewed from now on
        return Slot(self, tenant_id, member)

    def forget(self, tenant_id: str, member: str) -> None:
        """No longer renewed here, and removed from Redis by the removing task."""
        held = self.held.get(tenant_id)
        if held is not None:
            held.discard(member)
            if not held:
                del self.held[tenant_id]
        self._letting_go[tenant_id].add(member)
        if self._removing is None or self._removing.done():
            self._removing = asyncio.create_task(self._remove_all(), name="stream-slot-release")

    def _take_letting_go(self) -> dict[str, set[str]]:
        taken, self._letting_go = self._letting_go, defaultdict(set)
        return taken

    async def _remove_all(self) -> None:
        """Remove the slots let go, a round trip for all that gathered, until none is left.
        A failure is logged: the slots' leases let them go."""
        while self._letting_go:
            try:
                await self._remove(self._take_letting_go())
            except Exception as exc:
                raise_if_cancelled(exc)
                log.warning("could not let stream slots go (their leases will): %s", exc)

    async def _remove(self, members: dict[str, set[str]]) -> None:
        if not members:
            return
        if len(members) == 1:  # the usual case: one command, no pipeline to build
            ((tenant_id, gone),) = members.items()
            await self.r.zrem(self.names.tenant_streams(tenant_id), *gone)
            return
        async with self.r.pipeline(transaction=False) as pipe:
            for tenant_id, gone in members.items():
                pipe.zrem(self.names.tenant_streams(tenant_id), *gone)
            await pipe.execute()

    def retry_after_s(self) -> int:
        """What a refusal at the cap tells the client to wait (Retry-After): a tenth of a
        slot's lease, at least 1 s."""
        return max(1, math.ceil(self.settings.stream_lease_s / 10))

    async def _renew_leases(self) -> None:
        period = max(0.5, self.settings.stream_lease_s / 3)
        while True:
            await asyncio.sleep(period)
            held = {t: list(m) for t, m in self.held.items() if m}
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
