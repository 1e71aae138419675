"""The dispatcher loop: tier streams in, worker inboxes out, the policy in between.

It reads each tier's stream with a consumer group (a bounded read-ahead per tier), asks
the pure policy which jobs go to which worker against each worker's free slots (advertised
capacity less the entries already in its inbox), then for each assignment XADDs the job to
the worker's inbox and acknowledges the tier entry in one transaction. When there is
nothing to do it waits on the wake list (pushed by admission and by workers that freed a
slot) with a short timeout. It also reclaims the inboxes of workers whose heartbeat stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import redis
import redis.asyncio as aioredis

from dispatcher.policy import QueuedJob, WorkerSlots, assign
from tierq import metrics
from tierq.messages import Heartbeat, JobMessage
from tierq.queue import claim_all, live_workers, read_group
from tierq.redis_names import DISPATCH_GROUP, WORKER_GROUP, RedisNames
from tierq.settings import Settings
from tierq.tiers import TIER_ORDER, Tier

log = logging.getLogger(__name__)


class Dispatcher:
    def __init__(self, settings: Settings, r: aioredis.Redis, consumer: str = "dispatcher") -> None:
        self.settings = settings
        self.r = r
        self.consumer = consumer
        self.names = RedisNames(settings.redis_prefix)
        self.buffers: dict[Tier, dict[str, tuple[QueuedJob, JobMessage]]] = {
            t: {} for t in TIER_ORDER
        }
        self._stop = asyncio.Event()

    def request_stop(self) -> None:
        self._stop.set()

    async def _ensure_groups(self) -> None:
        for tier in TIER_ORDER:
            with contextlib.suppress(redis.ResponseError):  # BUSYGROUP: it exists
                await self.r.xgroup_create(
                    self.names.tier_stream(tier), DISPATCH_GROUP, id="0", mkstream=True
                )

    async def run(self) -> None:
        await self._ensure_groups()
        await self._read_tiers("0")  # entries this dispatcher held when it last stopped
        last_reclaim = 0.0
        while not self._stop.is_set():
            try:
                now = time.time()
                alive, dead = await live_workers(
                    self.r, self.names, self.settings.worker_dead_after_s
                )
                if dead and now - last_reclaim > 1.0:
                    await self.reclaim(dead)
                    last_reclaim = now
                moved = await self.step(alive)
            except redis.ConnectionError:
                log.warning("Redis unreachable; retrying", exc_info=True)
                await asyncio.sleep(1.0)
                with contextlib.suppress(redis.RedisError):
                    await self._ensure_groups()  # a restarted Redis has no groups
                continue
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                await self._ensure_groups()
                continue
            if moved == 0:
                await self.r.blpop(
                    [self.names.dispatch_wake], timeout=self.settings.dispatch_idle_wait_s
                )

    async def _read_tiers(self, start: str) -> None:
        want = {
            self.names.tier_stream(t): start
            for t in TIER_ORDER
            if len(self.buffers[t]) < self.settings.dispatch_read_ahead
        }
        if not want:
            return
        got = await read_group(
            self.r, DISPATCH_GROUP, self.consumer, want, count=self.settings.dispatch_read_ahead
        )
        for stream, entries in got:
            for entry_id, fields in entries:
                if not fields:
                    await self.r.xack(stream, DISPATCH_GROUP, entry_id)
                    continue
                msg = JobMessage.decode(fields)
                job = QueuedJob(entry_id, msg.job_id, msg.tier, msg.tenant_id, msg.enqueued_at)
                self.buffers[msg.tier][entry_id] = (job, msg)

    async def _free_slots(self, alive: list[Heartbeat]) -> list[WorkerSlots]:
        usable = [hb for hb in alive if not hb.draining]
        if not usable:
            return []
        async with self.r.pipeline(transaction=False) as pipe:
            for hb in usable:
                pipe.xlen(self.names.inbox(hb.worker_id))
            lengths = await pipe.execute()
        return [
            WorkerSlots(hb.worker_id, hb.capacity - int(n))
            for hb, n in zip(usable, lengths, strict=True)
        ]

    async def step(self, alive: list[Heartbeat]) -> int:
        """One round: read ahead, decide, hand out. Returns how many jobs moved."""
        slots = await self._free_slots(alive)
        if not any(w.free > 0 for w in slots):
            return 0
        await self._read_tiers(">")
        queues = {t: [job for job, _ in self.buffers[t].values()] for t in TIER_ORDER}
        started = time.perf_counter()
        decisions = assign(queues, slots)
        metrics.DISPATCH_DECISION.observe(time.perf_counter() - started)
        if not decisions:
            return 0
        async with self.r.pipeline(transaction=True) as pipe:
            for d in decisions:
                _, msg = self.buffers[d.job.tier].pop(d.job.entry_id)
                pipe.xadd(self.names.inbox(d.worker_id), msg.encode())  # type: ignore[arg-type]
                pipe.xack(self.names.tier_stream(d.job.tier), DISPATCH_GROUP, d.job.entry_id)
                pipe.xdel(self.names.tier_stream(d.job.tier), d.job.entry_id)
                metrics.JOBS_DISPATCHED.labels(d.job.tier.value).inc()
            await pipe.execute()
        return len(decisions)

    async def reclaim(self, dead: list[Heartbeat]) -> None:
        """Move every entry of a dead worker's inbox back to its tier's stream."""
        for hb in dead:
            inbox = self.names.inbox(hb.worker_id)
            moved = 0
            # Entries the worker had read but not finished: claim them (atomically, so two
            # dispatchers never both move one), then requeue; then the entries it never read.
            for entry_id, fields in await claim_all(self.r, inbox, WORKER_GROUP, self.consumer):
                moved += await self._requeue(inbox, entry_id, fields)
            while True:
                got = await read_group(self.r, WORKER_GROUP, self.consumer, {inbox: ">"}, count=100)
                entries = got[0][1] if got else []
                if not entries:
                    break
                for entry_id, fields in entries:
                    moved += await self._requeue(inbox, entry_id, fields)
            async with self.r.pipeline(transaction=True) as pipe:
                pipe.delete(inbox)
                pipe.hdel(self.names.workers, hb.worker_id)
                await pipe.execute()
            if moved:
                metrics.JOBS_RECLAIMED.inc(moved)
            log.warning("worker %s is dead; %d jobs moved back to their tiers", hb.worker_id, moved)

    async def _requeue(self, inbox: str, entry_id: str, fields: dict[str, str]) -> int:
        async with self.r.pipeline(transaction=True) as pipe:
            if fields:
                msg = JobMessage.decode(fields)
                pipe.xadd(self.names.tier_stream(msg.tier), msg.encode())  # type: ignore[arg-type]
            pipe.xack(inbox, WORKER_GROUP, entry_id)
            pipe.xdel(inbox, entry_id)
            await pipe.execute()
        return 1 if fields else 0
