"""The dispatcher loop: tier streams in, worker inboxes out, the policy in between.

Each tier's queue is sharded per tenant (`stream:<tier>:<tenant>`), plus one head-of-tier
stream for preempted jobs. The loop reads a bounded read-ahead from every shard with one
consumer group, asks the policy which jobs go to which worker against each worker's free
slots (capacity less the entries in its inbox, which live until the worker lets their
job go; for standard and batch work the ceiling: capacity less the interactive-only ones),
then for each assignment XADDs the job to the worker's inbox and acknowledges the source
entry — in one transaction; entries leave the read-ahead only once it committed. Workers
report each job's real token count on the `served` stream; the policy corrects its
accounting with it. When interactive work waits and every slot is taken, the policy may
name lower-tier jobs to preempt on workers whose engine cannot do it itself; the loop
tells their workers.
When there is nothing to do it waits on the wake list (pushed by admission and by workers
that freed a slot). It also reclaims the inboxes of workers whose heartbeat stopped.

Recovery: at start, and after every lost connection, the read-ahead is rebuilt from the
group's pending entries (every one, page by page), and the running jobs (which tenant
`max_running` counts) from the workers' inboxes — nothing it needs lives
only in this process's memory. An unreachable Redis is waited out with backoff.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis

from tierq.core import clock, metrics, tracing
from tierq.core.aio import being_cancelled
from tierq.core.messages import FAULT_UNIT, Heartbeat, JobMessage, Served, fault_share
from tierq.core.queue import claim_all, live_workers, read_group
from tierq.core.redis_conn import is_unavailable as redis_unavailable
from tierq.core.redis_names import DISPATCH_GROUP, WORKER_GROUP, RedisNames
from tierq.core.retry import Backoff
from tierq.core.settings import Settings
from tierq.core.tiers import TIER_ORDER, Tier
from tierq.dispatcher.allowance import offered
from tierq.dispatcher.capacity import (
    ArrivalRate,
    ServedRate,
    TokensPerJob,
    Waiting,
    desired_workers,
)
from tierq.dispatcher.leadership import Leadership, LeaseLost
from tierq.dispatcher.observe import Observer, policy_shares
from tierq.dispatcher.policy import (
    Assignment,
    EnginePriorityPolicy,
    FcfsPolicy,
    Policy,
    PolicyConfig,
    QueuedJob,
    RunningJob,
    TierqPolicy,
    WorkerSlots,
)

log = logging.getLogger(__name__)

TENANT_POLICY_REFRESH_S = 1.0
STATE_SAVE_S = 1.0  # how often the leader saves its policy's accounting for a successor
STANDBY_MARGIN_S = 0.02  # a standby tries for the lease this long after it would expire
CAPACITY_EVERY_S = 1.0  # how often the leader works out tierq_desired_workers
READY_PER_ROUND = 10_000  # most streams a read round takes from the ready set (the rest wait)
SWEEP_EVERY_S = 1.0  # how often the leader looks at the next SWEEP_BATCH shards (see _sweep)
SWEEP_BATCH = 1000


def slo_from_settings(settings: Settings) -> dict[Tier, float]:
    """Each tier's deadline from admission."""
    return {
        Tier.INTERACTIVE: settings.slo_interactive_s,
        Tier.STANDARD: settings.slo_standard_s,
        Tier.BATCH: settings.slo_batch_s,
    }


def policy_from_settings(settings: Settings) -> Policy:
    if settings.dispatch_policy == "fcfs":
        return FcfsPolicy()
    if settings.dispatch_policy == "engine-priority":
        return EnginePriorityPolicy()
    return TierqPolicy(
        PolicyConfig(
            min_share={
                Tier.STANDARD: settings.min_share_standard,
                Tier.BATCH: settings.min_share_batch,
            },
            window_s=settings.share_window_s,
            slo_s=slo_from_settings(settings),
            urgency_fraction=settings.urgency_fraction,
            tenant_weights=dict(settings.tenant_weights),  # refreshed from tenant_policy
            max_preemptions=settings.max_preemptions,
            affinity_slack=settings.affinity_slack,
            affinity_lookahead=settings.affinity_lookahead,
        )
    )


@dataclass
class Buffered:
    job: QueuedJob
    msg: JobMessage
    stream: str


class Dispatcher:
    def __init__(
        self,
        settings: Settings,
        r: aioredis.Redis,
        consumer: str = "dispatcher",
        policy: Policy | None = None,
    ) -> None:
        self.settings = settings
        self.r = r
        self.consumer = consumer
        self.names = RedisNames(settings.redis_prefix)
        self.policy = policy or policy_from_settings(settings)
        # tier -> tenant -> (stream, entry id) -> buffered job (dicts keep read order)
        self.buffers: dict[Tier, dict[str, dict[tuple[str, str], Buffered]]] = {
            t: {} for t in TIER_ORDER
        }
        # The same jobs as the policy takes them: tier -> tenant -> jobs in dispatch order
        # (preempted ones first, then by age), and per tier the tenants whose jobs changed
        # since the policy's last round (None: look at every tenant).
        self.ordered: dict[Tier, dict[str, list[QueuedJob]]] = {t: {} for t in TIER_ORDER}
        self._changed: dict[Tier, set[str]] | None = None
        self._capped: dict[Tier, set[str]] = {}  # the capped tenants of the last round
        self.running: dict[str, RunningJob] = {}
        self.preempting: set[str] = set()
        self._streams: set[str] = set()  # streams whose consumer group exists
        self._unread: set[str] = set()  # streams that may hold entries not read yet
        self._swept_at = 0.0
        self._sweep_tier = 0  # the tier and SSCAN cursor the sweep goes on from
        self._sweep_cursor = 0
        self._buffered: dict[str, int] = {}  # stream -> entries of it in the buffers
        # tier -> jobs in the read-ahead and their estimated tokens (kept, not walked)
        self._queued_jobs: Counter[Tier] = Counter()
        self._queued_cost: Counter[Tier] = Counter()
        # stream -> id after which its pending entries (read before a restart or a lost
        # connection) are still to be re-read; absent once they all were
        self._history: dict[str, str] = {}
        self._recovering = False
        self._connected_at = time.monotonic()
        self._served_cursor = "0-0"
        self.max_running: dict[str, dict[str, int]] = {}  # tenant -> scope -> cap
        self._policy_read_at = 0.0
        self._stop = asyncio.Event()
        self.leadership = Leadership(r, self.names, settings.dispatch_lease_s)
        self._state_saved_at = 0.0
        self._carry_on = False  # restore the saved accounting at the next recovery
        self._saturated = False  # jobs waited at the last capacity count
        self._workers_alive = 0
        self._stream_tier: dict[str, Tier] = {}  # source stream -> its tier
        self.served_rate = ServedRate(settings.share_window_s)
        self.arrival_rate = ArrivalRate(settings.share_window_s)
        self.tokens_per_job = TokensPerJob(settings.share_window_s)
        self._capacity_at = 0.0
        self.desired_workers = 0
        self.decision_seconds: list[float] = []  # for benchmarks; bounded below
        self.observer = Observer(settings, r, self.names)

    def request_stop(self) -> None:
        self._stop.set()

    # --- streams ------------------------------------------------------------------------
    async def _scan(self) -> None:
        """Every source stream (each tier's head-of-tier stream and its tenants' shards),
        its consumer group made where this process has not seen it, all to be read: at
        (re)covery only, from their pending entries (a round reads the ones given entries
        since, from the ready set)."""
        async with self.r.pipeline(transaction=False) as pipe:
            for tier in TIER_ORDER:
                pipe.smembers(self.names.tier_tenants(tier))
            members = await pipe.execute()
        streams = [self.names.preempted_stream(t) for t in TIER_ORDER]
        for tier, tenants in zip(TIER_ORDER, members, strict=True):
            streams += [self.names.tier_stream(tier, tenant) for tenant in sorted(tenants)]
        await self._groups_for(streams)
        self._unread.update(streams)

    async def _groups_for(self, streams: list[str]) -> None:
        """The dispatchers' consumer group on each stream this process has not seen, in one
        round trip; after a restart or a lost connection its pending entries are read first."""
        new = [s for s in streams if s not in self._streams]
        if not new:
            return
        async with self.r.pipeline(transaction=False) as pipe:
            for stream in new:
                pipe.xgroup_create(stream, DISPATCH_GROUP, id="0", mkstream=True)
            made = await pipe.execute(raise_on_error=False)
        for stream, result in zip(new, made, strict=True):
            if isinstance(result, Exception) and "BUSYGROUP" not in str(result):
                raise result
            self._stream_tier[stream] = self.names.source_tier(stream)
            self._streams.add(stream)
            if self._recovering:  # entries read before a restart or a lost connection
                self._history[stream] = "0"

    async def _sweep(self) -> None:
        """A slow walk over every shard, SWEEP_BATCH of them every SWEEP_EVERY_S: one whose
        newest entry is past its group's last delivered one joins the shards to read. It
        finds what the ready set would have named for an entry added without it (an API or
        worker of an older version during an upgrade), within a sweep of every shard."""
        now = time.monotonic()
        if now - self._swept_at < SWEEP_EVERY_S:
            return
        self._swept_at = now
        tier = TIER_ORDER[self._sweep_tier]
        start = self._sweep_cursor
        cursor, tenants = await self.r.sscan(
            self.names.tier_tenants(tier), start, count=SWEEP_BATCH
        )
        streams = [self.names.tier_stream(tier, str(t)) for t in tenants]
        if start == 0:
            streams.append(self.names.preempted_stream(tier))
        self._sweep_cursor = int(cursor)
        if not self._sweep_cursor:
            self._sweep_tier = (self._sweep_tier + 1) % len(TIER_ORDER)
        await self._groups_for(streams)
        async with self.r.pipeline(transaction=False) as pipe:
            for stream in streams:
                pipe.xinfo_groups(stream)
                pipe.xrevrange(stream, count=1)
            got = await pipe.execute(raise_on_error=False)
        for i, stream in enumerate(streams):
            groups, newest = got[2 * i], got[2 * i + 1]
            if isinstance(groups, Exception) or isinstance(newest, Exception) or not newest:
                continue
            delivered = next(
                (g["last-delivered-id"] for g in groups if g["name"] == DISPATCH_GROUP), "0-0"
            )
            if _entry_order(newest[0][0]) > _entry_order(delivered):
                self._unread.add(stream)

    async def _take_ready(self) -> None:
        """The streams given entries since the last take, as ones to read."""
        ready = await self.leadership.take_ready(READY_PER_ROUND)
        if ready:
            await self._groups_for(ready)
            self._unread.update(ready)

    async def _active_streams(self) -> list[str]:
        """The source streams that hold entries: those with some in the read-ahead, those
        with some still unread (the ready set's too: no round may have read lately, with
        no worker to hand work to), and the head-of-tier streams."""
        await self._take_ready()
        active = set(self._buffered) | self._unread
        active.update(self.names.preempted_stream(t) for t in TIER_ORDER)
        return sorted(active)

    def _forget_buffers(self) -> None:
        """After a lost connection: the read-ahead is rebuilt from the pending entries."""
        self.buffers = {t: {} for t in TIER_ORDER}
        self.ordered = {t: {} for t in TIER_ORDER}
        self._changed = None
        self._buffered.clear()
        self._queued_jobs.clear()
        self._queued_cost.clear()
        self._streams.clear()
        self._history.clear()
        self._unread.clear()
        self._recovering = True

    async def _read(self) -> None:
        """Top up the read-ahead of the shards that may hold entries it lacks, with one
        XREADGROUP (COUNT applies per stream), each once its read-ahead is down to half:
        its pending entries first, page by page (after a recovery), then new ones. Those are
        the shards given entries since the last round (every XADD to a shard joins the
        ready set, taken here as the leader), those whose last read filled their read-ahead,
        and after a recovery every one — so a round costs what arrived and what is still
        unread, not every tenant that ever queued work."""
        self._recovering = False
        await self._take_ready()
        ahead = self.settings.dispatch_read_ahead
        want = {
            s: self._history.get(s, ">")
            for s in self._unread
            if self._buffered.get(s, 0) <= ahead // 2
        }
        if not want:
            return
        got = await self.leadership.read_group(DISPATCH_GROUP, self.consumer, want, ahead)
        seen = {stream: entries for stream, entries in got}
        for stream, start in want.items():
            entries = seen.get(stream, [])
            if start == ">":
                if len(entries) < ahead:  # read to its end: nothing unread until more come
                    self._unread.discard(stream)
            elif len(entries) < ahead:
                del self._history[stream]  # every pending entry is back in the read-ahead
            else:
                self._history[stream] = entries[-1][0]
        for stream, entries in got:
            for entry_id, fields in entries:
                if not fields:
                    await self.r.xack(stream, DISPATCH_GROUP, entry_id)
                    continue
                self._buffer(stream, entry_id, JobMessage.decode(fields))

    def _buffer(self, stream: str, entry_id: str, msg: JobMessage) -> None:
        """An entry read into the read-ahead (once: a page read again adds nothing). Kept
        by stream and id: two streams may give one id in the same millisecond."""
        job = QueuedJob(
            entry_id,
            msg.job_id,
            msg.tier,
            msg.tenant_id,
            msg.enqueued_at,
            msg.cost,
            msg.preemptions,
            msg.prefix,
            stream,
        )
        shard = self.buffers[msg.tier].setdefault(msg.tenant_id, {})
        if (stream, entry_id) in shard:
            return
        shard[(stream, entry_id)] = Buffered(job, msg, stream)
        self._buffered[stream] = self._buffered.get(stream, 0) + 1
        self._queued_jobs[msg.tier] += 1
        self._queued_cost[msg.tier] += job.cost
        queue = self.ordered[msg.tier].setdefault(msg.tenant_id, [])
        bisect.insort(queue, job, key=_dispatch_key)  # after equals: read order
        self._changed_tenant(msg.tier, msg.tenant_id)

    def _changed_tenant(self, tier: Tier, tenant: str) -> None:
        if self._changed is not None:
            self._changed[tier].add(tenant)

    def _drop(self, job: QueuedJob) -> None:
        """A job out of the read-ahead (handed off)."""
        gone = self.buffers[job.tier][job.tenant_id].pop((job.stream, job.entry_id))
        self._buffered[gone.stream] -= 1
        if not self._buffered[gone.stream]:
            del self._buffered[gone.stream]
        self._queued_jobs[job.tier] -= 1
        self._queued_cost[job.tier] -= job.cost
        queue = self.ordered[job.tier][job.tenant_id]
        queue.remove(job)
        if not queue:
            del self.ordered[job.tier][job.tenant_id]
            del self.buffers[job.tier][job.tenant_id]

    def _queues(self) -> tuple[dict[Tier, Any], dict[Tier, set[str]] | None]:
        """The read-ahead as the policy sees it: each tenant's jobs in dispatch order, cut
        to what its max_running still allows (tierq/dispatcher/allowance.py), and per tier the
        tenants whose jobs changed since the policy's last round (None: every tenant may
        have); the count of changed tenants starts again."""
        views, capped = offered(self.ordered, self.running.values(), self.max_running)
        changed = self._changed
        if changed is not None:
            # A capped tenant's offer moves with what runs; one capped last round and not
            # now (its cap lifted or moved) is offered its whole queue again.
            for tier, tenants in capped.items():
                changed[tier] |= tenants | self._capped.get(tier, set())
        self._capped = capped
        self._changed = {t: set() for t in TIER_ORDER}
        return views, changed

    def decide(self, slots: list[WorkerSlots], now: float) -> list[Assignment]:
        """The policy's round over the read-ahead (no I/O)."""
        queues, changed = self._queues()
        if isinstance(self.policy, TierqPolicy):
            return self.policy.assign(queues, slots, now, changed)
        return self.policy.assign(queues, slots, now)

    async def _refresh_tenant_policy(self, now: float) -> None:
        """Tenant weights and max_running, as the admin API (and Celery) publish them."""
        if now - self._policy_read_at < TENANT_POLICY_REFRESH_S:
            return
        self._policy_read_at = now
        raw: Any = await self.r.hgetall(self.names.tenant_policy)
        weights: dict[str, float] = dict(self.settings.tenant_weights)
        caps: dict[str, dict[str, int]] = {}
        for tenant, value in (raw or {}).items():
            try:
                policy = json.loads(value)
            except ValueError:
                continue
            weights[tenant] = float(policy.get("weight", 1.0))
            if policy.get("max_running"):
                caps[tenant] = {k: int(v) for k, v in policy["max_running"].items()}
        self.max_running = caps
        if isinstance(self.policy, TierqPolicy):
            live = self.policy.config.tenant_weights
            if isinstance(live, dict):
                live.clear()
                live.update(weights)

    # --- workers ------------------------------------------------------------------------
    async def _free_slots(self, alive: list[Heartbeat]) -> list[WorkerSlots]:
        usable = [hb for hb in alive if not hb.draining and hb.engine_ok]
        if not usable:
            return []
        async with self.r.pipeline(transaction=False) as pipe:
            for hb in usable:
                pipe.xlen(self.names.inbox(hb.worker_id))
            loads = await pipe.execute()
        slots = []
        for hb, load in zip(usable, loads, strict=True):
            free = hb.capacity - int(load)
            # Standard and batch work is admitted only below the ceiling: `reserve` slots
            # are interactive work's alone — beyond the engine's where it preempts for
            # priority, else kept free among them (and backed up by aborting lower tiers).
            slots.append(
                WorkerSlots(hb.worker_id, free, free - hb.reserve, hb.engine_preempts, hb.capacity)
            )
        return slots

    # --- the loop -----------------------------------------------------------------------
    async def run(self) -> None:
        """Stand by until this dispatcher holds the lease, dispatch while it holds it, and
        give it up when stopped (a standby takes over at once)."""
        keeper = asyncio.create_task(self._keep_lease())
        try:
            await self._run()
        finally:
            keeper.cancel()
            with contextlib.suppress(Exception):  # Redis gone: the lease runs out alone
                await self.leadership.release()

    async def _keep_lease(self) -> None:
        """Renew the lease every third of its time while it is held, in a task of its own
        (the loop may wait on its wake list meanwhile). A process that is paused or hung
        renews nothing, and loses the lease."""
        while True:
            await asyncio.sleep(self.settings.dispatch_lease_s / 3)
            if not self.leadership.held:
                continue
            try:
                if not await self.leadership.renew():
                    log.warning("another dispatcher took the lease; standing by")
            except Exception:
                if being_cancelled():
                    raise
                log.warning("could not renew the lease", exc_info=True)

    async def _stand_by(self) -> None:
        """Wait (or for a stop) before trying for the lease again: until just after the
        holder's lease would run out unrenewed, at most a third of the lease time — so a
        leader that stopped renewing is replaced as soon as its lease ends."""
        wait = min(self.settings.dispatch_lease_s / 3, self.leadership.left_s + STANDBY_MARGIN_S)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), max(wait, STANDBY_MARGIN_S))

    async def _run(self) -> None:
        last_reclaim = 0.0
        recovered = False
        backoff = Backoff(0.1, self.settings.outage_retry_max_s)
        dead_after = self.settings.worker_dead_after_s
        last_tick = time.monotonic()
        while not self._stop.is_set():
            tick = time.monotonic()
            if tick - last_tick > dead_after / 2:
                # This loop stood still (Redis hung, this process was paused): the workers'
                # heartbeats may have stood still with it. Give them dead_after again.
                log.warning("the dispatcher stalled for %.1f s", tick - last_tick)
                self._connected_at = tick
            last_tick = tick
            try:
                if not self.leadership.held:
                    recovered = False
                    # A standby's signal is 0: the leader's alone counts (max() over them).
                    metrics.DESIRED_WORKERS.labels(self.settings.served_model_name).set(0)
                    self.observer.clear()
                    if not await self.leadership.acquire():
                        await self._stand_by()
                        continue
                    log.info("this dispatcher leads (epoch %d)", self.leadership.epoch)
                    self._carry_on = True
                if not recovered:
                    await self._recover()
                    recovered = True
                await clock.refresh(self.r)
                alive, dead = await live_workers(
                    self.r, self.names, self.settings.worker_dead_after_s
                )
                now = clock.now()
                # Right after (re)connecting, heartbeats written during an outage may not
                # be there yet: a worker is judged dead only after a full dead_after of
                # this process seeing Redis, so an outage does not cost live generations.
                settled = time.monotonic() - self._connected_at >= dead_after
                if dead and settled and now - last_reclaim > 1.0:
                    await self.reclaim(dead)
                    last_reclaim = now
                await self._take_served_reports()
                await self._sweep()
                await self._refresh_tenant_policy(now)
                await self._save_state(now)
                await self._publish_capacity(now, alive)
                await self._observe(now, alive)
                moved = await self.step(alive)
                backoff.reset()
                if moved == 0:
                    await self.r.blpop(
                        [self.names.dispatch_wake], timeout=self.settings.dispatch_idle_wait_s
                    )
            except LeaseLost:
                # Another dispatcher leads: what this one read stays pending for it.
                log.warning("this dispatcher lost the lease; standing by")
                self._forget_buffers()
                recovered = False
            except Exception as exc:
                if being_cancelled():  # redis-py may turn a cancelled read into this
                    raise
                delay = backoff.next_s()
                if redis_unavailable(exc):
                    log.warning("Redis unreachable; retrying in %.2f s", delay, exc_info=True)
                elif isinstance(exc, redis.ResponseError) and "NOGROUP" in str(exc):
                    log.warning("a consumer group vanished (%s); recovering", exc)
                else:
                    raise
                await asyncio.sleep(delay)
                recovered = False  # a restarted Redis has no groups; re-read what is pending

    async def _recover(self) -> None:
        """Rebuild what this process knows from Redis: the read-ahead from the pending
        entries (read by `_read` page by page), and the jobs that run, from the inboxes."""
        self._forget_buffers()
        await self._scan()
        self._connected_at = time.monotonic()
        # Reports from before now concern jobs the inboxes below no longer hold.
        last: Any = await self.r.xrevrange(self.names.served, count=1)
        self._served_cursor = str(last[0][0]) if last else "0-0"
        alive, _ = await live_workers(self.r, self.names, self.settings.worker_dead_after_s)
        now = clock.now()
        running: dict[str, RunningJob] = {}
        for hb in alive:
            entries: Any = await self.r.xrange(self.names.inbox(hb.worker_id))
            for _entry_id, fields in entries:
                if fields:
                    msg = JobMessage.decode(fields)
                    running[msg.job_id] = RunningJob(
                        msg.job_id, msg.tier, hb.worker_id, now, msg.preemptions, msg.tenant_id
                    )
        self.running = running
        self.preempting &= set(running)
        if self._carry_on:
            # Newly leading: the policy's accounting as the last leader saved it, so shares
            # and fairness carry on (after a mere reconnect, this process's own is newer).
            saved = await self.r.get(self.names.dispatch_state)
            if saved:
                self.policy.restore(json.loads(saved))
            self._carry_on = False
        log.info("dispatcher recovered: %d jobs running on %d workers", len(running), len(alive))

    async def _save_state(self, now: float) -> None:
        """The policy's accounting, for the next leader (fenced: only the leader's counts)."""
        if now - self._state_saved_at < STATE_SAVE_S:
            return
        self._state_saved_at = now
        snapshot = json.dumps(self.policy.snapshot(), separators=(",", ":"))
        await self.leadership.save(self.names.dispatch_state, snapshot)

    async def _publish_capacity(self, now: float, alive: list[Heartbeat]) -> None:
        """tierq_desired_workers from what waits in each tier (every shard's length, at the
        mean estimated cost of the tier's jobs in the read-ahead), what runs, and the
        tokens a worker served per second lately (tierq/dispatcher/capacity.py)."""
        if now - self._capacity_at < CAPACITY_EVERY_S:
            return
        self._capacity_at = now
        streams = await self._active_streams()  # every shard with entries, read yet or not
        async with self.r.pipeline(transaction=False) as pipe:
            for stream in streams:
                pipe.xlen(stream)
            lengths = await pipe.execute()
        jobs: Counter[Tier] = Counter()
        for stream, length in zip(streams, lengths, strict=True):
            jobs[self._stream_tier[stream]] += int(length)
        held, cost = self._queued_jobs, self._queued_cost
        every = sum(held.values())
        fallback = sum(cost.values()) / every if every else float(self.settings.max_model_len // 4)
        waiting = [
            Waiting(
                tier, jobs[tier], jobs[tier] * (cost[tier] / held[tier] if held[tier] else fallback)
            )
            for tier in TIER_ORDER
        ]
        self.arrival_rate.tick(now, int(await self.r.get(self.names.arrivals) or 0))
        per_job = self.tokens_per_job.mean(now)
        capacities = sorted(hb.capacity for hb in alive)
        slots = capacities[len(capacities) // 2] if capacities else self.settings.max_num_seqs
        self._saturated = any(w.jobs > 0 for w in waiting)
        self._workers_alive = len(alive)
        self.desired_workers = desired_workers(
            waiting,
            len(self.running),
            slots,
            self.served_rate.per_worker(now),
            slo_from_settings(self.settings),
            self.arrival_rate.per_second() * (per_job or 0.0),
        )
        metrics.DESIRED_WORKERS.labels(self.settings.served_model_name).set(self.desired_workers)

    async def _observe(self, now: float, alive: list[Heartbeat]) -> None:
        """The SLO gauges (tierq/dispatcher/observe.py), once a second."""
        if self.observer.due(now):
            streams = await self._active_streams()
            shares = policy_shares(self.policy, now)
            await self.observer.publish(now, streams, self._stream_tier, alive, shares)

    async def _take_served_reports(self) -> None:
        got: Any = await self.r.xread({self.names.served: self._served_cursor}, count=1000)
        now = clock.now()
        for _stream, entries in got or []:
            for entry_id, fields in entries:
                self._served_cursor = entry_id
                report = Served.decode(fields)
                self.running.pop(report.job_id, None)
                self.preempting.discard(report.job_id)
                if self._saturated:  # a worker's capacity shows only while work waits
                    self.served_rate.add(now, report.actual, self._workers_alive)
                if report.outcome == "succeeded":
                    self.tokens_per_job.add(now, report.actual)
                correction = report.actual - report.estimated
                if correction:
                    self.policy.charge(report.tier, report.tenant_id, correction, now)

    async def step(self, alive: list[Heartbeat]) -> int:
        """One round: read ahead, decide, hand out, maybe preempt. Returns jobs moved."""
        slots = await self._free_slots(alive)
        if not slots:
            return 0
        await self._read()
        now = clock.now()
        started = time.perf_counter()
        decisions = self.decide(slots, now) if any(w.free > 0 for w in slots) else []
        elapsed = time.perf_counter() - started
        if decisions:
            metrics.DISPATCH_DECISION.observe(elapsed)
            if len(self.decision_seconds) < 100_000:
                self.decision_seconds.append(elapsed)
            handed = [
                (d, self.buffers[d.job.tier][d.job.tenant_id][(d.job.stream, d.job.entry_id)])
                for d in decisions
            ]
            # One script, fenced by the lease: all of them or, another leading, none; a
            # job whose worker left (or began draining) since `alive` was read stays.
            with tracing.dispatching([(b.msg, d.job.entry_id, d.worker_id) for d, b in handed]):
                moved = await self.leadership.hand_off(
                    DISPATCH_GROUP,
                    [
                        (
                            d.worker_id,
                            self.names.inbox(d.worker_id),
                            b.stream,
                            d.job.entry_id,
                            b.msg.encode(),
                        )
                        for d, b in handed
                    ],
                )
            # Committed: only now do the entries leave the read-ahead (a failed hand-off
            # leaves them pending, and they are read again after the reconnect; one left
            # by the script stays in the read-ahead for the next round).
            left = [d for (d, _), ok in zip(handed, moved, strict=True) if not ok]
            if left:
                log.info("%d jobs not handed off: their worker left or is draining", len(left))
                for d in left:  # not served after all: the policy's charge goes back
                    self.policy.charge(d.job.tier, d.job.tenant_id, -d.job.cost, now)
                    self._changed_tenant(d.job.tier, d.job.tenant_id)
            for (d, _b), ok in zip(handed, moved, strict=True):
                if not ok:
                    continue
                self._drop(d.job)
                metrics.JOBS_DISPATCHED.labels(d.job.tier.value).inc()
                self.running[d.job.job_id] = RunningJob(
                    d.job.job_id, d.job.tier, d.worker_id, now, d.job.preemptions, d.job.tenant_id
                )
            decisions = [d for d, ok in zip(decisions, moved, strict=True) if ok]
        await self._maybe_preempt(slots, decisions)
        return len(decisions)

    async def _maybe_preempt(self, slots: list[WorkerSlots], decisions: list[Assignment]) -> None:
        waiting = self._queued_jobs[Tier.INTERACTIVE]
        if not waiting:
            return
        taken = Counter(d.worker_id for d in decisions)
        after = [dataclasses.replace(w, free=w.free - taken[w.worker_id]) for w in slots]
        victims = self.policy.preempt(
            waiting,
            [r for r in self.running.values() if r.job_id not in self.preempting],
            after,
            len(self.preempting),
        )
        if not victims:
            return
        await self.leadership.publish(
            [(self.names.preempt_channel(v.worker_id), v.job_id) for v in victims]
        )
        for victim in victims:
            self.preempting.add(victim.job_id)
            log.info("preempting %s on %s", victim.job_id, victim.worker_id)

    # --- dead workers -------------------------------------------------------------------
    async def reclaim(self, dead: list[Heartbeat]) -> None:
        """Move every entry of a dead worker's inbox back to its tier's stream."""
        for hb in dead:
            inbox = self.names.inbox(hb.worker_id)
            moved = 0
            # What each job it ran is charged when claimed again: nothing when the worker
            # was stopping as planned (a drain cut short), else a share of its crash.
            charge = 0 if hb.draining and hb.engine_ok else fault_share(len(hb.jobs))
            try:
                # Entries the worker had read but not finished: claim them (atomically, so
                # two dispatchers never both move one), then requeue; then the unread ones.
                for entry_id, fields in await claim_all(self.r, inbox, WORKER_GROUP, self.consumer):
                    moved += await self._requeue(inbox, entry_id, fields, charge)
                while True:
                    got = await read_group(
                        self.r, WORKER_GROUP, self.consumer, {inbox: ">"}, count=100
                    )
                    entries = got[0][1] if got else []
                    if not entries:
                        break
                    for entry_id, fields in entries:
                        moved += await self._requeue(inbox, entry_id, fields, charge)
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                # The inbox lost its group (Redis restarted under the worker): every entry
                # it still has is unclaimed by anyone; move them all.
                leftover: Any = await self.r.xrange(inbox)
                for entry_id, fields in leftover:
                    moved += await self._requeue(inbox, entry_id, dict(fields or {}), charge)
            await self.leadership.forget_worker(inbox, hb.worker_id)
            for job_id in [j for j, r in self.running.items() if r.worker_id == hb.worker_id]:
                del self.running[job_id]
                self.preempting.discard(job_id)
            if moved:
                metrics.JOBS_RECLAIMED.inc(moved)
            log.warning("worker %s is dead; %d jobs moved back to their tiers", hb.worker_id, moved)

    async def _requeue(
        self, inbox: str, entry_id: str, fields: dict[str, str], charge: int = FAULT_UNIT
    ) -> int:
        """Fenced: a leader that lost its lease mid-reclaim moves nothing (the new leader
        claims the same entries and moves each once). `charge`: what the job's delivery
        there is charged should it be found unsettled (it ran there)."""
        stream = None
        if fields:
            msg = JobMessage.decode(fields)
            stream = self.names.tier_stream(msg.tier, msg.tenant_id)
            fields = dataclasses.replace(msg, unsettled_charge=charge).encode()
        await self.leadership.requeue(WORKER_GROUP, inbox, entry_id, stream, fields)
        return 1 if fields else 0


def _dispatch_key(job: QueuedJob) -> tuple[bool, float]:
    """Preempted jobs first (back at the head of their tier), then by age (allowance's
    `dispatch_order`)."""
    return (job.preemptions == 0, job.enqueued_at)


def _entry_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id (`<ms>-<seq>`) as a pair that orders as Redis orders them."""
    ms, _, seq = str(entry_id).partition("-")
    return int(ms), int(seq or 0)
