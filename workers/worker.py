"""The worker: reads its inbox, runs many jobs at once in one engine, streams, persists.

At-least-once: an inbox entry is acknowledged (and deleted) only after the job's result is
in the database. A worker that dies leaves its entries behind; a restarted worker with the
same id reads its own pending entries first, and the dispatcher reclaims the inbox of a
worker whose heartbeat stopped (XAUTOCLAIM). Results and usage are written once per job
id (conditional state transitions), so running a job twice is harmless.

Shutdown is two-staged: the first SIGTERM stops reading the inbox and lets running jobs
finish within the drain timeout; after it (or a second signal) the rest is aborted and
handed back to its tier's stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis
import redis.asyncio as aioredis

from models import jobs as job_repo
from models.db import Database
from tierq import batch_signal, metrics
from tierq.messages import Heartbeat, JobEvent, JobMessage, Served
from tierq.queue import (
    EventLog,
    enqueue,
    read_group,
    wake_dispatcher,
    write_heartbeat,
)
from tierq.redis_names import WORKER_GROUP, RedisNames
from tierq.settings import Settings
from tierq.states import JobStatus
from tierq.tiers import vllm_priority
from workers.engine import Engine, EngineRequestError
from workers.streaming import EventPublisher

log = logging.getLogger(__name__)


def replay_seed(job_id: str) -> int:
    """A seed derived from the job id: a re-run after a crash samples the same tokens."""
    return int.from_bytes(hashlib.sha256(job_id.encode()).digest()[:4], "big")


class Worker:
    def __init__(
        self,
        settings: Settings,
        db: Database,
        r: aioredis.Redis,
        engine: Engine,
        worker_id: str | None = None,
        capacity: int | None = None,
    ) -> None:
        self.settings = settings
        self.db = db
        self.r = r
        self.engine = engine
        self.worker_id = worker_id or settings.resolved_worker_id
        self.names = RedisNames(settings.redis_prefix)
        self.inbox = self.names.inbox(self.worker_id)
        self.events = EventLog(r, self.names, settings.replay_ttl_s)
        self.publisher = EventPublisher(self.events)
        # Slots advertised to the dispatcher: the engine's, unless told otherwise (the
        # engine-priority baseline of the QoS benchmark hands everything to the engine).
        self.capacity = capacity or settings.max_num_seqs
        # Slots standard and batch work never take; at most half of them.
        self.reserve = min(settings.interactive_reserve, self.capacity // 2)
        self._tasks: dict[str, asyncio.Task[None]] = {}  # job id -> its task
        self._entries: dict[str, str] = {}  # job id -> inbox entry id
        self._cancelled: set[str] = set()
        self._handed_back: set[str] = set()
        self._preempted: set[str] = set()
        self._background: set[asyncio.Task[None]] = set()  # batch advance requests
        self._slot_freed = asyncio.Event()
        self._stop_reading = asyncio.Event()
        self._stopped = asyncio.Event()

    # --- lifecycle --------------------------------------------------------------------
    def request_stop(self) -> None:
        """First call: drain. Second call: stop now, handing running jobs back."""
        if self._stop_reading.is_set():
            self._stopped.set()
        self._stop_reading.set()

    async def _ensure_group(self) -> None:
        with contextlib.suppress(redis.ResponseError):  # BUSYGROUP: it exists
            await self.r.xgroup_create(self.inbox, WORKER_GROUP, id="0", mkstream=True)

    async def run(self) -> None:
        """Serve until stopped. Cancelling this task is a crash: nothing is cleaned up."""
        await self._ensure_group()
        await self._heartbeat()
        await self._read_inbox("0")  # entries this worker id held when it last died
        tasks = [
            asyncio.create_task(self._inbox_loop(), name="inbox"),
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self._control_listener(), name="control-listener"),
            asyncio.create_task(self.publisher.run(), name="event-publisher"),
        ]
        stop = asyncio.create_task(self._stop_reading.wait(), name="stop")
        try:
            done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            for task in [stop, *tasks, *self._tasks.values()]:
                task.cancel()
            raise
        for task in done:
            if task is not stop and task.exception() is not None:
                for other in [stop, *tasks]:
                    other.cancel()
                raise RuntimeError(f"worker task {task.get_name()} died") from task.exception()
        tasks[0].cancel()  # stop reading the inbox
        await asyncio.gather(tasks[0], return_exceptions=True)
        try:
            await self._drain()
        finally:
            for task in tasks[1:]:
                task.cancel()
            await asyncio.gather(*tasks[1:], return_exceptions=True)
            await self.r.hdel(self.names.workers, self.worker_id)
            await wake_dispatcher(self.r, self.names)

    async def _drain(self) -> None:
        await self._heartbeat(draining=True)
        if self._tasks:
            log.info("draining %d running jobs", len(self._tasks))
            stop: asyncio.Future[Any] = asyncio.ensure_future(self._stopped.wait())
            running: asyncio.Future[Any] = asyncio.gather(
                *self._tasks.values(), return_exceptions=True
            )
            await asyncio.wait(
                [stop, running],
                timeout=self.settings.drain_timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
            stop.cancel()
        if self._tasks:
            log.info("handing %d unfinished jobs back to their tiers", len(self._tasks))
            self._handed_back.update(self._tasks)
            for job_id in list(self._tasks):
                await self.engine.abort(job_id)
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        # Entries dispatched to this inbox but never read go back as well.
        while True:
            got = await read_group(
                self.r, WORKER_GROUP, self.worker_id, {self.inbox: ">"}, count=100
            )
            entries = got[0][1] if got else []
            if not entries:
                break
            for entry_id, fields in entries:
                msg = JobMessage.decode(fields)
                await self._hand_back(entry_id, msg, "unread at shutdown")
        if await self.r.xlen(self.inbox) == 0:
            await self.r.delete(self.inbox)

    # --- side tasks -------------------------------------------------------------------
    async def _heartbeat(self, draining: bool = False) -> None:
        hb = Heartbeat(
            self.worker_id, self.capacity, len(self._tasks), time.time(), draining, self.reserve
        )
        await write_heartbeat(self.r, self.names, hb)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            await self._heartbeat(draining=self._stop_reading.is_set())

    async def _control_listener(self) -> None:
        """Cancellations (from the API) and preemptions (from the dispatcher)."""
        pubsub = self.r.pubsub()
        preempt = self.names.preempt_channel(self.worker_id)
        await pubsub.subscribe(self.names.cancel_channel, preempt)
        try:
            while True:
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if msg is None:
                    continue
                job_id = str(msg["data"])
                if job_id not in self._tasks:
                    continue
                if msg["channel"] == preempt:
                    log.info("preempting job %s", job_id)
                    self._preempted.add(job_id)
                else:
                    log.info("aborting cancelled job %s", job_id)
                    self._cancelled.add(job_id)
                await self.engine.abort(job_id)
        finally:
            await pubsub.aclose()

    # --- the inbox --------------------------------------------------------------------
    async def _inbox_loop(self) -> None:
        while not self._stop_reading.is_set():
            free = self.capacity - len(self._tasks)
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            try:
                await self._read_inbox(">", count=free, block_ms=1000)
            except redis.ResponseError as exc:
                # The inbox vanished: Redis restarted, or a dispatcher took this worker for
                # dead (a long pause) and reclaimed it. Start a fresh one.
                if "NOGROUP" not in str(exc) and "UNBLOCKED" not in str(exc):
                    raise
                log.warning("inbox %s is gone (%s); recreating it", self.inbox, exc)
                await self._ensure_group()

    async def _read_inbox(
        self, start: str, count: int | None = None, block_ms: int | None = None
    ) -> None:
        got = await read_group(
            self.r,
            WORKER_GROUP,
            self.worker_id,
            {self.inbox: start},
            count=count,
            block_ms=block_ms,
        )
        for entry_id, fields in got[0][1] if got else []:
            if not fields:  # a pending entry whose body was deleted: nothing to run
                await self.r.xack(self.inbox, WORKER_GROUP, entry_id)
                continue
            msg = JobMessage.decode(fields)
            if msg.job_id in self._tasks:
                continue
            self._entries[msg.job_id] = entry_id
            self._tasks[msg.job_id] = asyncio.create_task(self._run(entry_id, msg), name=msg.job_id)
        metrics.WORKER_RUNNING.set(len(self._tasks))

    async def _done_with_entry(
        self, entry_id: str, msg: JobMessage, outcome: str, actual_tokens: int = 0
    ) -> None:
        """Let go of an inbox entry: acknowledge it, free its slot, report what it cost."""
        report = Served(msg.job_id, msg.tenant_id, msg.tier, msg.cost, actual_tokens, outcome)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.xack(self.inbox, WORKER_GROUP, entry_id)
            pipe.xdel(self.inbox, entry_id)
            pipe.hincrby(self.names.worker_load(self.worker_id), msg.tier.value, -1)
            pipe.xadd(self.names.served, report.encode(), maxlen=100_000, approximate=True)  # type: ignore[arg-type]
            if outcome not in ("preempted", "handed_back"):
                pipe.srem(self.names.inflight, msg.job_id)
            pipe.lpush(self.names.dispatch_wake, "1")
            pipe.ltrim(self.names.dispatch_wake, 0, 0)
            await pipe.execute()
        if msg.batch_id is not None and outcome not in ("preempted", "handed_back"):
            # Its batch may top up its outstanding jobs, or be finished: ask Celery now.
            task = asyncio.create_task(
                batch_signal.poke(self.settings, self.r, self.names, msg.batch_id)
            )
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _hand_back(
        self, entry_id: str, msg: JobMessage, why: str, tokens: int = 0, preempted: bool = False
    ) -> None:
        """Put a job back on its tier's stream (preempted: at its head), then let go of it."""
        async with self.db.transaction() as s:
            await job_repo.requeue_job(s, msg.job_id, why)
        if preempted:
            again = dataclasses.replace(msg, preemptions=msg.preemptions + 1)
            await enqueue(self.r, self.names, again, head_of_tier=True)
        else:
            await enqueue(self.r, self.names, msg)
        await self._done_with_entry(
            entry_id, msg, "preempted" if preempted else "handed_back", tokens
        )

    # --- one job ----------------------------------------------------------------------
    async def _run(self, entry_id: str, msg: JobMessage) -> None:
        try:
            await self._run_job(entry_id, msg)
        except Exception:
            log.exception("job %s failed in the worker; leaving it for redelivery", msg.job_id)
        finally:
            self._tasks.pop(msg.job_id, None)
            self._entries.pop(msg.job_id, None)
            self._cancelled.discard(msg.job_id)
            self._handed_back.discard(msg.job_id)
            self._preempted.discard(msg.job_id)
            self._slot_freed.set()
            metrics.WORKER_RUNNING.set(len(self._tasks))

    async def _run_job(self, entry_id: str, msg: JobMessage) -> None:
        async with self.db.transaction() as s:
            job = await job_repo.start_job(
                s, msg.job_id, self.worker_id, self.settings.max_deliveries + msg.preemptions
            )
        if job is None:  # finished, cancelled or dead-lettered meanwhile: nothing to run
            async with self.db.session() as s:
                current = await job_repo.get_job(s, msg.job_id)
            if current is not None and current.status == JobStatus.FAILED:
                await self.publisher.send(msg.job_id, JobEvent("error", current.to_api()))
            await self._done_with_entry(entry_id, msg, "skipped")
            return
        redelivered = job.deliveries > 1
        already = await self._streamed_text(job.id) if redelivered else ""
        params: dict[str, Any] = dict(job.params)
        if params.get("seed") is None:
            params["seed"] = replay_seed(job.id)
        metrics.QUEUE_WAIT.labels(job.tier.value).observe(time.time() - msg.enqueued_at)

        text_parts: list[str] = []
        emitted = len(already)
        produced = 0
        completion_tokens = 0
        prompt_tokens = 0
        finish_reason: str | None = None
        first = True
        try:
            async for chunk in self.engine.generate(
                job.id, job.messages, job.prompt, params, vllm_priority(job.tier)
            ):
                prompt_tokens = chunk.prompt_tokens
                completion_tokens += chunk.new_tokens
                finish_reason = chunk.finish_reason or finish_reason
                if chunk.text:
                    if first:
                        metrics.TTFT.labels(job.tier.value).observe(time.time() - msg.enqueued_at)
                        first = False
                    text_parts.append(chunk.text)
                    start, produced = produced, produced + len(chunk.text)
                    if produced > emitted:  # beyond what a previous delivery streamed
                        self.publisher.delta(job.id, chunk.text[max(0, emitted - start) :])
                        emitted = produced
        except EngineRequestError as exc:
            await self._finish(entry_id, msg, JobStatus.FAILED, exc.code, str(exc))
            return
        served = prompt_tokens + completion_tokens
        if msg.job_id in self._handed_back:
            await self._hand_back(entry_id, msg, "worker shutting down", served)
            return
        if msg.job_id in self._preempted and finish_reason in (None, "abort"):
            # Its partial output is discarded in the engine; a client following the job
            # loses nothing: the re-run streams only what goes beyond what it already has.
            await self._hand_back(entry_id, msg, "preempted", served, preempted=True)
            return
        if finish_reason in (None, "abort"):  # cancelled by its tenant (the API closed it)
            await self._done_with_entry(entry_id, msg, "cancelled", served)
            return
        async with self.db.transaction() as s:
            finished = await job_repo.finish_job(
                s,
                job.id,
                status=JobStatus.SUCCEEDED,
                text="".join(text_parts),
                finish_reason=finish_reason,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
            )
        if finished is not None:
            metrics.JOBS_FINISHED.labels(job.tier.value, "succeeded").inc()
            metrics.TOKENS_SERVED.labels(job.tier.value, "prompt").inc(prompt_tokens)
            metrics.TOKENS_SERVED.labels(job.tier.value, "completion").inc(completion_tokens)
            served_by = metrics.TENANT_TOKENS_SERVED
            served_by.labels(job.tenant_id, job.tier.value, "prompt").inc(prompt_tokens)
            served_by.labels(job.tenant_id, job.tier.value, "completion").inc(completion_tokens)
            await self.publisher.send(job.id, JobEvent("done", finished.to_api()))
        await self._done_with_entry(entry_id, msg, "succeeded", served)

    async def _finish(
        self, entry_id: str, msg: JobMessage, status: JobStatus, code: str, message: str
    ) -> None:
        async with self.db.transaction() as s:
            failed = await job_repo.fail_job(s, msg.job_id, code, message)
        if failed is not None:
            metrics.JOBS_FINISHED.labels(msg.tier.value, status.value).inc()
            await self.publisher.send(msg.job_id, JobEvent("error", failed.to_api()))
        await self._done_with_entry(entry_id, msg, "failed")

    async def _streamed_text(self, job_id: str) -> str:
        """The text a previous delivery of this job already streamed to clients."""
        parts = [
            e.data.get("text", "")
            for _, e in await self.events.since(job_id, 0)
            if e.kind == "delta"
        ]
        return "".join(parts)


async def run_worker(
    settings: Settings,
    engine_factory: Callable[[Settings], Engine],
    install_signals: Callable[[Worker], Awaitable[None]] | None = None,
) -> None:
    """Start the engine, then serve the inbox until stopped (the `tierq worker` command)."""
    from tierq.redis_conn import connect

    engine = engine_factory(settings)
    await engine.start()
    db = Database(settings.resolved_database_url)
    r = await connect(settings)
    worker = Worker(settings, db, r, engine)
    if install_signals is not None:
        await install_signals(worker)
    log.info(
        "worker %s ready (engine %s, %d slots)", worker.worker_id, engine.name, worker.capacity
    )
    try:
        await worker.run()
    finally:
        await engine.shutdown()
        await r.aclose()
        await db.close()
