"""The worker: reads its inbox, runs many jobs at once in one engine, streams, persists.

At-least-once: an inbox entry is acknowledged (and deleted) only after the job's result is
in the database, and the inbox's length is the worker's load: a slot is taken exactly as
long as its entry exists. A worker that dies leaves its entries behind; a restarted worker
with the same id reads its own pending entries first, and the dispatcher reclaims the inbox
of a worker whose heartbeat stopped (XAUTOCLAIM).

Every job ends through one settle path (`_settle`), whatever happened to it — succeeded,
failed with a code, cancelled, handed back (drain, preemption, a dead engine, an unknown
error with deliveries left) or superseded by a later delivery: the database transition,
the final event, the usage record, the inbox acknowledgement and the slot move together.
Writes that meet an unreachable database or Redis are retried with backoff (the
generation keeps its result meanwhile); an unknown error hands the job back for another
delivery and fails it with `engine_error` once MAX_DELIVERIES are used.

Each delivery of a job has a number (`deliveries` in the database). A run's events and its
final transition are fenced by it, so when a job runs twice (Redis lost it and the
reconciler put it back while a live worker still ran it) the older run can neither stream
nor finish: it stops as soon as it learns it was superseded.

Shutdown is two-staged: the first SIGTERM stops reading the inbox and lets running jobs
finish within the drain timeout; after it (or a second signal) the rest is aborted and
handed back to its tier's stream. A dead engine is found within ENGINE_HEALTH_INTERVAL_S:
the worker stops advertising capacity, hands every job back and exits non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

import redis
import redis.asyncio as aioredis

from tierq.core import clock, fleet, metrics, scripts, token_count, tracing
from tierq.core.aio import Detached, being_cancelled, cancel_and_wait
from tierq.core.ids import new_id
from tierq.core.messages import FAULT_UNIT, Heartbeat, JobEvent, JobMessage, Served, fault_share
from tierq.core.queue import (
    EventLog,
    Streamed,
    enqueue,
    push_latency_samples,
    read_group,
    streamed_so_far,
    wake_dispatcher,
    write_heartbeat,
)
from tierq.core.redis_conn import is_unavailable as redis_unavailable
from tierq.core.redis_conn import redis_now
from tierq.core.redis_names import WORKER_GROUP, RedisNames
from tierq.core.retry import Backoff, retrying
from tierq.core.settings import Settings
from tierq.core.states import JobStatus
from tierq.core.tiers import vllm_priority
from tierq.models import db as db_mod
from tierq.models.db import Database
from tierq.models.records import JobRecord, Progress
from tierq.models.store import JobStore, Result, SqlJobStore
from tierq.services import batch_signal
from tierq.workers import identity, observe
from tierq.workers.engine.base import Chunk, Engine, EngineDead, EngineRequestError, EngineWrapper
from tierq.workers.engine.vllm_args import build_defaults
from tierq.workers.first_steps import FirstSteps
from tierq.workers.streaming import EventPublisher

log = logging.getLogger(__name__)

T = TypeVar("T")


class Ending(StrEnum):
    """How one run of a job ended: its Outcome's kind, and what its inbox entry reports."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"  # by its tenant or an operator
    HANDED_BACK = "handed_back"  # by this worker: a drain, a dead engine, a stalled run
    PREEMPTED = "preempted"  # by the dispatcher, for higher-tier work
    RETRY = "retry"  # failed by the engine: another delivery, or failed past the limit
    SKIPPED = "skipped"  # nothing to run: finished, cancelled or unreadable meanwhile
    SUPERSEDED = "superseded"  # a later delivery of the job owns it
    DUPLICATE = "duplicate"  # a second entry of a job that runs here
    ABANDONED = "abandoned"  # its ending could not be written: the reconciler's now


# Endings after which no stream or inbox holds the job any more (its `inflight` mark goes).
_GONE = frozenset(
    {Ending.SUCCEEDED, Ending.FAILED, Ending.CANCELLED, Ending.SKIPPED, Ending.ABANDONED}
)
# Endings of an entry this run does not own: nothing is reported for the job.
_NOT_OURS = frozenset({Ending.SUPERSEDED, Ending.DUPLICATE})
# Endings whose deltas reach Redis before the database takes the ending.
_FLUSHED_FIRST = frozenset(
    {Ending.SUCCEEDED, Ending.RETRY, Ending.FAILED, Ending.PREEMPTED, Ending.HANDED_BACK}
)
# Why a run the engine stopped early stopped, when more than one asked: the first here.
_STOP_ORDER = (Ending.HANDED_BACK, Ending.PREEMPTED, Ending.CANCELLED)


@dataclass(eq=False)
class Run:
    """One delivery of a job on this worker, from its inbox entry to its settling: its
    task, the job's record once claimed, and why it was asked to stop. It ends with its
    task; nothing of it outlives the run."""

    msg: JobMessage
    entry_id: str  # the inbox entry it settles (a duplicate entry may take its place)
    task: asyncio.Task[None] = dataclasses.field(init=False)
    job: JobRecord | None = None  # the delivery this worker runs, once claimed
    # Asked of it while it ran: cancelled, handed back, preempted, superseded.
    stops: set[Ending] = dataclasses.field(default_factory=set)
    crash_charge: int = 0  # its share of the fault if the engine died running it
    settling: bool = False  # its ending is being written; a new entry starts a new run

    @property
    def job_id(self) -> str:
        return self.msg.job_id

    def stop(self, why: Ending) -> bool:
        """Note a reason to stop it; False when that reason was noted already."""
        if why in self.stops:
            return False
        self.stops.add(why)
        return True

    def why_stopped(self) -> Ending:
        """Why the engine stopped it before it finished: this worker's doing, its tenant's,
        or (retry) a reason of the engine's own."""
        return next((why for why in _STOP_ORDER if why in self.stops), Ending.RETRY)


def replay_seed(job_id: str) -> int:
    """A seed derived from the job id: a re-run after a crash samples the same tokens."""
    return int.from_bytes(hashlib.sha256(job_id.encode()).digest()[:4], "big")


def resumable(params: dict[str, Any]) -> bool:
    """Whether a run may continue after an earlier run's tokens as that run would have
    gone on (`params`: the job's own, as its tenant sent them). Not with:
    - presence or frequency penalties: the engine counts only the tokens a run generated
      itself (those it resumes after are prompt to it), so it would sample differently;
    - stop strings: the engine looks for them in the text it generates, so one begun
      before the stop and ended after it would go unseen;
    - a seed of the tenant's with sampling: the continuation would draw other random
      numbers than the uninterrupted run, and a seed promises the same output;
    - structured outputs: the engine's grammar starts at the first token it generates, so
      a continuation would begin another JSON document after the first one's start;
    - log probabilities: the tokens resumed after are prompt to the engine, which gives
      none for them;
    - n > 1 choices: the choices would each have to resume after their own tokens.
    Those jobs start again (the work thrown away is counted)."""
    if params.get("presence_penalty") or params.get("frequency_penalty") or params.get("stop"):
        return False
    if params.get("response_format") or params.get("logprobs") is not None:
        return False
    if int(params.get("n", 1)) > 1:
        return False
    sampled = float(params.get("temperature", 1.0) or 0.0) > 0
    return not (sampled and params.get("seed") is not None)


def unavailable(exc: BaseException) -> bool:
    """The database or Redis could not be reached: worth waiting for, not a job's fault."""
    return db_mod.is_unavailable(exc) or redis_unavailable(exc)


def unsent(entries: list[dict[str, Any]], skip: int) -> tuple[list[dict[str, Any]], int]:
    """Of a text's tokens' log probabilities, those followers lack: past the `skip` an
    earlier delivery streamed (by count of tokens, not of characters). Returns them and
    what is left to skip."""
    dropped = min(skip, len(entries))
    return entries[dropped:], skip - dropped


@dataclass
class Choice:
    """One of the choices after the first of a job with n > 1, as its run generates it
    (the first is the Outcome's own text, finish reason and log probabilities)."""

    index: int
    emitted: int  # characters of it that followers have (an earlier delivery streamed)
    logprobs: list[dict[str, Any]] | None  # None: not asked for
    skip: int = 0  # tokens whose log probabilities followers have (ditto)
    parts: list[str] = dataclasses.field(default_factory=list)
    produced: int = 0
    finish_reason: str | None = None
    pending: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def take(self, chunk: Chunk) -> tuple[str, list[dict[str, Any]]] | None:
        """Add the engine's chunk; what of it to stream (the text past what followers
        have, with the log probabilities not sent yet), or None."""
        self.finish_reason = chunk.finish_reason or self.finish_reason
        if self.logprobs is not None:
            self.logprobs.extend(chunk.logprobs)
            self.pending.extend(chunk.logprobs)
        if not chunk.text:
            return None
        text = chunk.text.replace("\x00", "\ufffd")  # as the first choice's (NUL)
        self.parts.append(text)
        start, self.produced = self.produced, self.produced + len(text)
        pending, self.skip = unsent(self.pending, self.skip)
        self.pending = []
        if self.produced <= self.emitted:
            return None
        fresh = text[max(0, self.emitted - start) :]
        self.emitted = self.produced
        return fresh, pending

    def result(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "text": "".join(self.parts),
            "finish_reason": self.finish_reason,
            "logprobs": self.logprobs,
        }


@dataclass
class Outcome:
    """How one run of a job ended, before it is settled."""

    kind: Ending
    code: str | None = None
    message: str | None = None
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # of the job so far: earlier runs' and this one's
    token_ids: list[int] = dataclasses.field(default_factory=list)  # the same tokens' ids
    resumed: int = 0  # of those, the tokens earlier runs generated (this one resumed after)
    logprobs: list[dict[str, Any]] | None = None  # with `logprobs` asked for: each token's
    choices: list[dict[str, Any]] | None = None  # with n > 1: the choices after the first
    first_token_at: float | None = None  # when this run streamed its first text
    # What this delivery is held against the job when it goes back, in thousandths of a
    # failed delivery (tierq/models/jobs.py `requeue_job`): a drain or a preemption costs nothing.
    charge: int = 0

    @property
    def served(self) -> int:
        """The tokens this run computed (the dispatcher's fairness counts them): none when
        it resumed and generated nothing more."""
        generated = self.completion_tokens - self.resumed
        if self.resumed and not generated:
            return 0
        return self.prompt_tokens + generated

    def progress(self, source: str) -> Progress | None:
        """What the runs so far generated, for the next run to resume after; None when
        nothing was generated or the engine did not say which tokens."""
        if not self.token_ids or len(self.token_ids) != self.completion_tokens:
            return None
        return Progress(tuple(self.token_ids), self.text, self.prompt_tokens, source)


class Worker:
    def __init__(
        self,
        settings: Settings,
        jobs: JobStore,
        r: aioredis.Redis,
        engine: Engine,
        worker_id: str | None = None,
        capacity: int | None = None,
    ) -> None:
        self.settings = settings
        self.jobs = jobs
        self.r = r
        self.engine = engine
        self.worker_id = worker_id or settings.resolved_worker_id
        self.holder = identity.holder_token()
        self._last_life: bool | None = None  # whether its last life ended as planned
        self.names = RedisNames(settings.redis_prefix)
        self.inbox = self.names.inbox(self.worker_id)
        self.events = EventLog.for_settings(r, self.names, settings)
        # Whose vocabulary kept token ids are in: the innermost engine and the model.
        base: Any = engine
        while isinstance(base, EngineWrapper):
            base = base.inner
        self.progress_source = (
            f"{base.name}:{settings.model_path or 'bundled'}:{settings.served_model_name}"
        )
        self.publisher = EventPublisher(
            self.events, self._superseded_elsewhere, settings.outage_retry_max_s
        )
        # The engine's slots, unless told otherwise (the engine-priority baseline of the QoS
        # benchmark hands everything to the engine).
        slots = capacity or settings.max_num_seqs
        # An engine that preempts for priority takes interactive work beyond its slots: such
        # a job enters the engine at once and takes a lower-tier request's slot there, so
        # lower tiers may fill every slot. Otherwise `interactive_reserve` slots (at most
        # half) stay free of lower-tier work, and the dispatcher preempts (abort, re-queue).
        self.engine_preempts = bool(getattr(engine, "preempts_for_priority", False))
        overflow = max(0, settings.interactive_overflow) if self.engine_preempts else 0
        # Advertised to the dispatcher: every job this worker may hold, and how many of
        # them only interactive work may take (its ceiling for the lower tiers).
        self.capacity = slots + overflow
        self.reserve = overflow + min(settings.interactive_reserve, slots // 2)
        self._runs: dict[str, Run] = {}  # job id -> its run here
        # Waits and TTFTs measured since the last heartbeat, (kind, tier) -> seconds: each
        # heartbeat hands them to Redis in its round trip's company (the operator console).
        self._latency: dict[tuple[str, str], list[float]] = {}
        self.first_steps = FirstSteps(SUSPECT_WAIT_S)
        self._settling: set[str] = set()  # entry ids whose run is being settled
        self._background = Detached("a worker's call in the background")  # aborts, batch pokes
        self._slot_freed = asyncio.Event()
        self._stop_reading = asyncio.Event()
        self._stopped = asyncio.Event()
        self._engine_dead = asyncio.Event()
        self._retire_if_empty = r.register_script(scripts.source("retire_inbox_if_empty"))

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
        """Serve until stopped; raise EngineDead (after handing every job back) if the
        engine dies. Cancelling this task is a crash: nothing is cleaned up."""
        try:
            await self._serve()
        finally:
            identity.release(self.holder)  # this process no longer runs it

    async def _serve(self) -> None:
        await self._retrying("register", self._register)
        tasks = [
            asyncio.create_task(self._inbox_loop(), name="inbox"),
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self._control_listener(), name="control-listener"),
            asyncio.create_task(self.publisher.run(), name="event-publisher"),
            asyncio.create_task(self._health_loop(), name="engine-health"),
            asyncio.create_task(self._cancel_watch(), name="cancel-watch"),
        ]
        stop = asyncio.create_task(self._stop_reading.wait(), name="stop")
        dead = asyncio.create_task(self._engine_dead.wait(), name="engine-dead")
        try:
            done, _ = await asyncio.wait([stop, dead, *tasks], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            for task in [stop, dead, *tasks, *(run.task for run in self._runs.values())]:
                task.cancel()
            raise
        for task in done:
            if task not in (stop, dead) and task.exception() is not None:
                for other in [stop, dead, *tasks]:
                    other.cancel()
                raise RuntimeError(f"worker task {task.get_name()} died") from task.exception()
        engine_died = self._engine_dead.is_set()
        if engine_died:
            log.error("the engine is dead: handing every job back, then exiting")
            self._stop_reading.set()
            self._stopped.set()  # no drain: nothing more can run here
        await cancel_and_wait(tasks[:1], CANCELLED_WAIT_S)  # stop reading the inbox
        stop.cancel()
        dead.cancel()
        try:
            await self._drain()
        finally:
            await cancel_and_wait(tasks[1:], CANCELLED_WAIT_S)
            with contextlib.suppress(redis.RedisError, OSError):
                await self._retire()
        if engine_died:
            raise EngineDead("the engine died; every job was handed back")

    async def _register(self) -> None:
        await self._ensure_group()
        # This worker id's last life, if it ended without retiring: a drain cut short
        # (planned: its jobs are not at fault) or a crash (each shares the fault).
        if self._last_life is None:  # once: a retried registration finds its own claim
            last: Any = await self.r.hget(self.names.workers, self.worker_id)
            self._last_life = last is not None and _planned_stop(Heartbeat.decode(last))
        planned = self._last_life
        identity.hold(self.holder)
        await identity.claim(
            self.r,
            self.names,
            self.worker_id,
            self.holder,
            self.settings.worker_dead_after_s,
            self.settings.heartbeat_interval_s / 2,
        )
        await self._heartbeat()
        # Entries this worker id held when it last died.
        await self._read_inbox("0", unsettled=0 if planned else None)

    async def _drain(self) -> None:
        await self._retrying("heartbeat", lambda: self._heartbeat(draining=True))
        if self._runs and not self._stopped.is_set():
            log.info("draining %d running jobs", len(self._runs))
            stop: asyncio.Future[Any] = asyncio.ensure_future(self._stopped.wait())
            running: asyncio.Future[Any] = asyncio.gather(
                *(run.task for run in self._runs.values()), return_exceptions=True
            )
            await asyncio.wait(
                [stop, running],
                timeout=self.settings.drain_timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
            stop.cancel()
        if self._runs:
            # Past the drain: what still runs goes back, and outages are no longer waited
            # out for long (a supervisor is waiting for this process to end).
            self._stopped.set()
            self.publisher.abandon()
            log.info("handing %d unfinished jobs back to their tiers", len(self._runs))
            for run in self._runs.values():
                run.stop(Ending.HANDED_BACK)
            for job_id in list(self._runs):
                with contextlib.suppress(Exception):  # a dead engine may refuse even this
                    await self.engine.abort(job_id)
            _, stuck = await asyncio.wait(
                [run.task for run in self._runs.values()], timeout=self.settings.drain_timeout_s
            )
            for task in stuck:  # their entries stay pending: reclaimed once we are gone
                task.cancel()
        # Entries dispatched to this inbox but never read go back as well.
        await self._retrying("hand back unread entries", self._return_unread)

    async def _return_unread(self) -> None:
        while True:
            got = await read_group(
                self.r, WORKER_GROUP, self.worker_id, {self.inbox: ">"}, count=100
            )
            entries = got[0][1] if got else []
            if not entries:
                break
            for entry_id, fields in entries:
                if not fields:
                    await self._drop_entry(entry_id)
                    continue
                msg = JobMessage.decode(fields)
                await enqueue(self.r, self.names, msg, arrival=False)
                await self._release(entry_id, msg, Ending.HANDED_BACK)

    async def _retire(self) -> None:
        """Leave the worker table — only with an empty inbox (checked and done at once, in
        Redis). An entry dispatched after the draining heartbeat went out is handed back
        first; one that still lands keeps the inbox, and the heartbeat, stale now, makes
        the dispatcher reclaim it."""
        for _ in range(3):
            if await self._retire_if_empty(
                keys=[self.inbox, self.names.workers], args=[self.worker_id]
            ):
                await wake_dispatcher(self.r, self.names)
                return
            await self._return_unread()
        log.warning("inbox %s is not empty; leaving it to the dispatcher", self.inbox)

    async def _retrying(self, what: str, op: Callable[[], Awaitable[T]]) -> T:
        """Run `op`, waiting out an unreachable database or Redis with backoff (until a
        second stop signal, once the waits pass a second); other errors propagate."""
        backoff = Backoff(0.1, self.settings.outage_retry_max_s)
        return await retrying(
            op,
            transient=unavailable,
            backoff=backoff,
            give_up=lambda: self._stopped.is_set() and backoff.waited_s > 1,
            what=what,
        )

    # --- side tasks -------------------------------------------------------------------
    async def _heartbeat(self, draining: bool = False) -> None:
        hb = Heartbeat(
            self.worker_id,
            self.capacity,
            len(self._runs),
            await redis_now(self.r),
            draining or self._engine_dead.is_set(),
            self.reserve,
            jobs=sorted(self._runs),
            engine_ok=not self._engine_dead.is_set(),
            engine_preempts=self.engine_preempts,
            holder=self.holder,
            model=self.settings.served_model_name,
            max_model_len=self.settings.max_model_len,
        )
        await write_heartbeat(self.r, self.names, hb)
        samples, self._latency = self._latency, {}
        await push_latency_samples(self.r, self.names, samples)

    async def _publish_tokenizer(self) -> None:
        """The model's tokenizer files for the hosts without its folder (tierq.core.fleet), if
        this host has them and Redis does not (at start, and again after a flush)."""
        folder = token_count.own_folder(self.settings)
        try:
            await fleet.publish_tokenizer(
                self.r, self.names, self.settings.served_model_name, folder
            )
        except Exception as exc:
            if being_cancelled():
                raise
            log.warning("could not publish the model's tokenizer: %s", exc)

    def _sample(self, kind: str, tier: str, seconds: float) -> None:
        self._latency.setdefault((kind, tier), []).append(seconds)

    async def _heartbeat_loop(self) -> None:
        published_at = -PUBLISH_EVERY_S
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            await clock.refresh(self.r)
            if time.monotonic() - published_at >= PUBLISH_EVERY_S:
                published_at = time.monotonic()
                await self._publish_tokenizer()
            try:
                await self._heartbeat(draining=self._stop_reading.is_set())
            except Exception as exc:
                if not redis_unavailable(exc) or being_cancelled():
                    raise
                log.warning("heartbeat: Redis unreachable (%s); retrying", exc)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.engine_health_interval_s)
            try:
                await self.engine.check_health()
            except EngineDead as exc:
                log.error("engine health check failed: %s", exc)
                self._engine_died()
                return

    def _engine_died(self) -> None:
        """The engine is dead: every job it ran shares the fault (any may have caused it)."""
        if not self._engine_dead.is_set():
            suspects = self.first_steps.suspects(self._runs)
            for job_id in suspects:
                self._runs[job_id].crash_charge = fault_share(len(suspects))
            log.error(
                "the engine died running %d jobs; suspected: %s",
                len(self._runs),
                ", ".join(sorted(suspects)) or "none",
            )
        self._engine_dead.set()

    async def _control_listener(self) -> None:
        """Cancellations (from the API) and preemptions (from the dispatcher); resubscribes
        after a lost connection."""
        backoff = Backoff(0.1, self.settings.outage_retry_max_s)
        while True:
            try:
                await self._listen()
            except Exception as exc:
                if not redis_unavailable(exc) or being_cancelled():
                    raise
                log.warning("control channel: Redis unreachable (%s); resubscribing", exc)
                await backoff.wait()

    async def _listen(self) -> None:
        pubsub = self.r.pubsub()
        preempt = self.names.preempt_channel(self.worker_id)
        try:
            await pubsub.subscribe(self.names.cancel_channel, preempt)
            while True:
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if msg is None:
                    continue
                job_id = str(msg["data"])
                run = self._runs.get(job_id)
                if run is None:
                    if msg["channel"] == preempt:  # addressed to this worker, yet not here
                        log.info("not preempting job %s: it does not run here", job_id)
                    continue
                if msg["channel"] != preempt:
                    log.info("aborting cancelled job %s", job_id)
                    await self._abort_cancelled(run, "notice")
                    continue
                log.info("preempting job %s", job_id)
                run.stop(Ending.PREEMPTED)
                try:
                    await self.engine.abort(job_id)
                except Exception:  # a dead engine refuses even this; the health loop acts
                    log.warning("aborting job %s failed", job_id, exc_info=True)
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    async def _cancel_watch(self) -> None:
        """The durable half of cancellation: the notice on the cancel channel is sent once
        and lost with a dropped subscription or a Redis blip, so every
        CANCEL_CHECK_INTERVAL_S the statuses of the jobs running here are read from the
        database (one statement), and a run whose job was cancelled is stopped, as the
        notice would have."""
        while True:
            await asyncio.sleep(self.settings.cancel_check_interval_s)
            claimed = [
                job_id
                for job_id, run in self._runs.items()
                if run.job is not None and Ending.CANCELLED not in run.stops
            ]
            if not claimed:
                continue
            try:
                now = await self.jobs.statuses(claimed)
            except Exception as exc:
                if not unavailable(exc) or being_cancelled():
                    raise
                log.warning("cancel watch: the database is unreachable (%s)", exc)
                continue
            for job_id, status in now.items():
                run = self._runs.get(job_id)
                if status == JobStatus.CANCELLED and run is not None:
                    log.info("aborting job %s: it was cancelled (seen in the database)", job_id)
                    await self._abort_cancelled(run, "database")

    async def _abort_cancelled(self, run: Run, seen_by: str) -> None:
        """Stop the run of a job its tenant (or an operator) cancelled, once."""
        if not run.stop(Ending.CANCELLED):
            return
        metrics.CANCELS_SEEN.labels(seen_by).inc()
        try:
            await self.engine.abort(run.job_id)
        except Exception:  # a dead engine refuses even this; the health loop acts
            log.warning("aborting job %s failed", run.job_id, exc_info=True)

    def _superseded_elsewhere(self, job_id: str) -> None:
        """A later delivery of the job runs elsewhere: stop this one (its events are refused)."""
        run = self._runs.get(job_id)
        if run is not None and run.stop(Ending.SUPERSEDED):
            self._background.spawn(self.engine.abort(job_id))

    # --- the inbox --------------------------------------------------------------------
    async def _inbox_loop(self) -> None:
        backoff = Backoff(0.1, self.settings.outage_retry_max_s)
        start = ">"
        while not self._stop_reading.is_set():
            free = self.capacity - len(self._runs)
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            try:
                if start == "0":
                    # After an error: entries read but not taken on (or released) are
                    # pending; the ones running here are recognised and skipped.
                    await self._read_inbox("0")
                    start = ">"
                await self._read_inbox(">", count=free, block_ms=1000)
                backoff.reset()
            except redis.ResponseError as exc:
                # The inbox vanished: Redis restarted, or a dispatcher took this worker for
                # dead (a long pause) and reclaimed it. Start a fresh one.
                if "NOGROUP" not in str(exc) and "UNBLOCKED" not in str(exc):
                    raise
                log.warning("inbox %s is gone (%s); recreating it", self.inbox, exc)
                await self._retrying("recreate inbox", self._ensure_group)
            except Exception as exc:
                if not redis_unavailable(exc) or being_cancelled():
                    raise
                start = "0"
                log.warning("inbox: Redis unreachable (%s); retrying", exc)
                await backoff.wait()

    async def _read_inbox(
        self,
        start: str,
        count: int | None = None,
        block_ms: int | None = None,
        unsettled: int | None = FAULT_UNIT,
    ) -> None:
        """Take on what the inbox holds from `start`. `unsettled` is the charge of a job
        that an earlier run of this worker id left unsettled (None: the read's jobs share
        one fault, their worker's crash)."""
        got = await read_group(
            self.r,
            WORKER_GROUP,
            self.worker_id,
            {self.inbox: start},
            count=count,
            block_ms=block_ms,
        )
        # Every entry read is taken on before anything else is awaited: an error below
        # must not leave one pending with nobody running it.
        done_with: list[tuple[str, JobMessage | None, Ending]] = []
        entries = got[0][1] if got else []
        if unsettled is None:
            unsettled = fault_share(sum(1 for _, fields in entries if fields))
        for entry_id, fields in entries:
            if entry_id in self._settling:
                continue  # its run is ending; the settle lets the entry go
            try:
                msg = JobMessage.decode(fields) if fields else None
            except (ValueError, TypeError, KeyError):
                log.exception("inbox entry %s is not a job; dropping it", entry_id)
                msg = None
            if msg is None:  # deleted meanwhile, or unreadable: nothing to run
                done_with.append((entry_id, None, Ending.SKIPPED))
                continue
            held = self._runs.get(msg.job_id)
            if held is not None and not held.settling:
                if held.entry_id != entry_id:
                    # The same job dispatched here again (a duplicate enqueue): keep one
                    # entry for it, so it holds one slot, and let the other go.
                    done_with.append((held.entry_id, msg, Ending.DUPLICATE))
                    held.entry_id = entry_id
                continue
            if start != ">":
                msg = dataclasses.replace(msg, unsettled_charge=unsettled)
            # A run whose ending is being written keeps its own entry: this one (the job
            # handed back and dispatched here again) starts a run of its own.
            run = Run(msg, entry_id)
            run.task = asyncio.create_task(
                tracing.run_job(self._run(run), msg, self.worker_id), name=msg.job_id
            )
            self._runs[msg.job_id] = run
        metrics.WORKER_RUNNING.set(len(self._runs))
        for entry_id, maybe_msg, outcome in done_with:
            if maybe_msg is None:
                await self._drop_entry(entry_id)
            else:
                await self._release(entry_id, maybe_msg, outcome)

    async def _drop_entry(self, entry_id: str) -> None:
        """Let go of an entry that carries no job (deleted meanwhile, or unreadable)."""
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.xack(self.inbox, WORKER_GROUP, entry_id)
            pipe.xdel(self.inbox, entry_id)
            await pipe.execute()

    async def _release(
        self, entry_id: str, msg: JobMessage, outcome: Ending, actual: int = 0
    ) -> None:
        """Let go of an inbox entry: acknowledge and delete it (which frees its slot), report
        what the job cost, and drop its `inflight` mark if nothing holds the job now."""
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.xack(self.inbox, WORKER_GROUP, entry_id)
            pipe.xdel(self.inbox, entry_id)
            if outcome not in _NOT_OURS:
                report = Served(msg.job_id, msg.tenant_id, msg.tier, msg.cost, actual, outcome)
                pipe.xadd(self.names.served, report.encode(), maxlen=100_000, approximate=True)  # type: ignore[arg-type]
            if outcome in _GONE:
                pipe.srem(self.names.inflight, msg.job_id)
            pipe.lpush(self.names.dispatch_wake, "1")
            pipe.ltrim(self.names.dispatch_wake, 0, 0)
            await pipe.execute()
        if msg.batch_id is not None and outcome in _GONE:
            # Its batch may top up its outstanding jobs, or be finished: ask Celery now.
            self._background.spawn(
                batch_signal.poke(self.settings, self.r, self.names, msg.batch_id)
            )

    # --- one job ----------------------------------------------------------------------
    async def _run(self, run: Run) -> None:
        msg = run.msg
        entry_id: str | None = None
        try:
            try:
                outcome = await self._execute(run)
            except Exception as exc:  # an unknown engine error, or a bug: another delivery
                outcome = Outcome(Ending.RETRY, "engine_error", internal_error(msg.job_id, exc))
            # From here on the entry is this run's alone: an entry for the job read from now
            # on (the job handed back and dispatched here again) starts a run of its own.
            run.settling = True
            entry_id = run.entry_id
            self._settling.add(entry_id)
            try:
                await self._settle(run, outcome, entry_id)
            except Exception:
                # The database refused the outcome for good: let the entry go; the job, still
                # unfinished there and held by nothing, is the reconciler's to put back.
                log.exception("settling job %s failed; abandoning this run", msg.job_id)
                await self._retrying(
                    "release", lambda: self._release(entry_id, msg, Ending.ABANDONED)
                )
        finally:
            if entry_id is not None:
                self._settling.discard(entry_id)
            if self._runs.get(msg.job_id) is run:  # unless a new run of the job took over
                del self._runs[msg.job_id]
                self.publisher.forget(msg.job_id)
            self._slot_freed.set()
            metrics.WORKER_RUNNING.set(len(self._runs))

    async def _start(self, msg: JobMessage) -> tuple[JobRecord | None, Ending | None]:
        """Claim the job in the database; (job, None) to run it, else (None, why not)."""
        job = await self.jobs.claim(
            msg.job_id, self.worker_id, self.settings.max_deliveries, msg.unsettled_charge
        )
        if job is not None:
            return job, None
        current = await self.jobs.get(msg.job_id)
        if current is not None and current.status in (JobStatus.QUEUED, JobStatus.RUNNING):
            return None, Ending.SUPERSEDED  # another delivery claimed it first
        if current is not None and current.status == JobStatus.FAILED:
            await self.publisher.send(msg.job_id, JobEvent("error", current.to_api()))
        return None, Ending.SKIPPED  # finished, cancelled or dead-lettered meanwhile

    async def _execute(self, run: Run) -> Outcome:
        """Claim the job, then generate it: the outcome of this run (settled by `_settle`)."""
        msg = run.msg
        claimed = await self._claim(run)
        if isinstance(claimed, Ending):
            return Outcome(claimed)
        job, already = claimed
        wait = clock.now() - msg.enqueued_at
        metrics.QUEUE_WAIT.labels(job.tier.value).observe(wait)
        self._sample("wait", job.tier.value, wait)
        observe.count_start(self.settings, job)
        return await self._generate(run, job, already)

    async def _claim(self, run: Run) -> tuple[JobRecord, Streamed] | Ending:
        """This run's claim on the job (the database's, then the event stream's delivery
        fence) and how many characters earlier deliveries streamed of each choice; or why
        it does not run (superseded, skipped)."""
        job, why_not = await self._retrying("start job", lambda: self._start(run.msg))
        if job is None:
            assert why_not is not None
            return why_not
        run.job = job
        if not await self._retrying(
            "claim delivery", lambda: self.events.claim_delivery(job.id, job.deliveries)
        ):
            return Ending.SUPERSEDED
        # What earlier deliveries streamed (read after the claim: they can add no more).
        earlier = (
            await self._retrying("replay", lambda: self.events.since(job.id, 0))
            if job.deliveries > 1
            else []
        )
        self.publisher.fence(job.id, job.deliveries, [event for _, event in earlier])
        return job, streamed_so_far([e for _, e in earlier])

    async def _generate(self, run: Run, job: JobRecord, streamed: Streamed) -> Outcome:
        """Run the job in the engine, streaming of each choice what goes beyond the text
        and log probabilities followers have (`streamed`); the outcome says how it ended."""
        already = streamed.chars.get(0, 0)
        skip = streamed.scored.get(0, 0)
        params: dict[str, Any] = dict(job.params)
        if params.get("seed") is None:
            params["seed"] = replay_seed(job.id)
        msg = run.msg
        out = Outcome(Ending.SUCCEEDED)
        text_parts: list[str] = []
        produced = 0
        keep = resumable(job.params)
        saved = job.progress if keep else None
        if saved is not None and saved.source != self.progress_source:
            log.warning(
                "job %s: its kept progress is from %s, not %s; it starts again",
                job.id,
                saved.source or "an unnamed engine",
                self.progress_source,
            )
            saved = None
        if saved is not None and job.batch_id is None and already < len(saved.text):
            # Followers lack part of what was kept (Redis lost the replay buffer meanwhile,
            # and nobody could restore it): the event numbers they hold no longer match
            # what a resumed run would write, so it starts again and streams as the first
            # run did, each delta past what they have.
            log.warning(
                "job %s: its followers lack part of its kept progress; it starts again", job.id
            )
            saved = None
        if saved is not None:
            # An earlier run stopped unfinished (preempted, handed back): continue after
            # what it generated, decoding none of it again.
            text_parts.append(saved.text)
            produced = len(saved.text)
            out.prompt_tokens = saved.prompt_tokens
            out.completion_tokens = out.resumed = len(saved.token_ids)
            out.token_ids = list(saved.token_ids)
            log.info("job %s resumes after %d generated tokens", job.id, out.resumed)
            metrics.RESUMED_TOKENS.inc(out.resumed)
        emitted = max(already, produced)
        if out.resumed and out.resumed >= int(params.get("max_tokens", 256)):
            out.text, out.finish_reason = "".join(text_parts), "length"
            return out  # it had generated everything: nothing is left to run
        first, cache_counted = True, False
        # Log probabilities of tokens not yet streamed: they go with the next delta.
        pending: list[dict[str, Any]] = []
        if params.get("logprobs") is not None:
            out.logprobs = []
        # The choices after the first (n > 1), as they come.
        others: dict[int, Choice] = {}
        # The watchdog: its deadline moves on with every chunk the engine streams.
        stall_s = self.settings.job_stall_s
        watchdog = asyncio.timeout(None)
        try:
            await self.first_steps.begin(job.id, suspect=job.fault_charge > 0)
            async with watchdog:
                loop = asyncio.get_running_loop()
                if stall_s > 0:
                    watchdog.reschedule(loop.time() + stall_s)
                async for chunk in tracing.engine_stream(
                    self.engine.generate(
                        job.id,
                        job.messages,
                        job.prompt,
                        params,
                        vllm_priority(job.tier),
                        resume=tuple(out.token_ids),
                        cache_salt=job.tenant_id,  # the prefix cache is the tenant's own
                    ),
                    job_id=job.id,
                    delivery=job.deliveries,
                    resumed_tokens=out.resumed,
                ):
                    self.first_steps.passed(job.id)
                    if stall_s > 0:
                        watchdog.reschedule(loop.time() + stall_s)
                    if chunk.cached_tokens and not cache_counted:
                        metrics.PREFIX_CACHED_TOKENS.labels(job.tier.value).inc(chunk.cached_tokens)
                        cache_counted = True
                    out.prompt_tokens = chunk.prompt_tokens
                    out.completion_tokens += chunk.new_tokens
                    if keep:
                        out.token_ids.extend(chunk.token_ids)
                    if chunk.index:  # a choice after the first
                        other = others.get(chunk.index)
                        if other is None:
                            other = others[chunk.index] = Choice(
                                chunk.index,
                                streamed.chars.get(chunk.index, 0),
                                None if out.logprobs is None else [],
                                streamed.scored.get(chunk.index, 0),
                            )
                        fresh = other.take(chunk)
                        if fresh is not None and job.batch_id is None:
                            self.publisher.delta(job.id, *fresh, index=chunk.index)
                        continue
                    out.finish_reason = chunk.finish_reason or out.finish_reason
                    if out.logprobs is not None:
                        out.logprobs.extend(chunk.logprobs)
                        pending.extend(chunk.logprobs)
                    if not chunk.text:
                        continue
                    if "\x00" in chunk.text:
                        # The model can generate NUL (a token of its vocabulary decodes to it),
                        # which PostgreSQL's text refuses: the job could never be stored. The
                        # same replacement goes to followers and to the result.
                        chunk = dataclasses.replace(
                            chunk, text=chunk.text.replace("\x00", "\ufffd")
                        )
                    if first:
                        out.first_token_at = clock.now()
                        ttft = out.first_token_at - msg.enqueued_at
                        metrics.TTFT.labels(job.tier.value).observe(ttft)
                        self._sample("ttft", job.tier.value, ttft)
                        first = False
                    text_parts.append(chunk.text)
                    start, produced = produced, produced + len(chunk.text)
                    scores, skip = unsent(pending, skip)
                    if produced > emitted:  # beyond what a previous delivery streamed
                        # A batch's lines are read from its output file, not followed live: no
                        # deltas (the final event carries the whole result), so 50,000 lines
                        # leave next to nothing in Redis.
                        if job.batch_id is None:
                            self.publisher.delta(
                                job.id, chunk.text[max(0, emitted - start) :], scores
                            )
                        emitted = produced
                    pending = []
        except EngineRequestError as exc:
            return dataclasses.replace(out, kind=Ending.FAILED, code=exc.code, message=str(exc))
        except EngineDead:
            self._engine_died()
            run.stop(Ending.HANDED_BACK)
        except Exception as exc:
            if watchdog.expired():  # the engine streamed nothing for JOB_STALL_S
                await self._stalled(run, job, out.completion_tokens - out.resumed)
            else:
                # Unknown, perhaps transient: another delivery, resuming after what this
                # one generated (kept with the job when it goes back).
                out.text = "".join(text_parts)
                return dataclasses.replace(
                    out,
                    kind=Ending.RETRY,
                    code="engine_error",
                    message=internal_error(job.id, exc),
                )
        finally:
            self.first_steps.passed(job.id)
        out.text = "".join(text_parts)
        log.info(
            "job %s: the engine generated %d tokens in this run",
            job.id,
            out.completion_tokens - out.resumed,
        )
        choices = int(params.get("n", 1))
        if choices > 1:
            out.choices = [
                others[i].result() if i in others else Choice(i, 0, None).result()
                for i in range(1, choices)
            ]
            # The run is over when every choice is: the first's reason stands for all.
            reasons = [out.finish_reason, *(c["finish_reason"] for c in out.choices)]
            if "error" in reasons:
                out.finish_reason = "error"
            elif any(r in (None, "abort") for r in reasons):
                out.finish_reason = next(r for r in reasons if r in (None, "abort"))
        if Ending.SUPERSEDED in run.stops:
            out.kind = Ending.SUPERSEDED
        elif out.finish_reason == "error":
            # vLLM ended the request itself (a request-level error, such as a grammar that
            # failed mid-run): not an answer; tried again, as a failed delivery.
            out.kind, out.code = Ending.RETRY, "engine_error"
            out.message = "the engine ended the request with an error"
        elif out.finish_reason in (None, "abort"):
            # It stopped early (a finished one stays finished, whatever marks came late).
            out.kind = run.why_stopped()
            if out.kind == Ending.RETRY:
                out.code, out.message = "engine_error", "the engine aborted it"
        return out

    async def _stalled(self, run: Run, job: JobRecord, generated: int) -> None:
        """The watchdog's hand-back of a run the engine streamed nothing for in JOB_STALL_S:
        the request goes from the engine, the job back to its queue with what it generated,
        at no charge (the engine lost it; the job did nothing wrong)."""
        metrics.JOB_STALLS.labels(job.tier.value).inc()
        log.warning(
            "job %s: no output from the engine for %.0f s (%d tokens generated in this run); "
            "aborting it in the engine and handing it back",
            job.id,
            self.settings.job_stall_s,
            generated,
        )
        run.stop(Ending.HANDED_BACK)
        try:
            async with asyncio.timeout(ABORT_TIMEOUT_S):
                await self.engine.abort(job.id)
        except Exception:  # a hung engine is the health check's to find
            log.warning("aborting stalled job %s failed", job.id, exc_info=True)

    async def _settle(self, run: Run, out: Outcome, entry_id: str) -> None:
        """The one place a run of a job ends, whatever its outcome: the database, the final
        event, the bill of a cancelled run, the inbox entry and the slot."""
        msg, job = run.msg, run.job
        delivery = job.deliveries if job is not None else None
        kind = out.kind
        if kind in _FLUSHED_FIRST:
            # Its deltas reach Redis before the database calls it finished (a follower that
            # sees it finished there finds every delta in the replay buffer) or puts it back
            # (the next delivery finds what followers have, and resumes after it).
            await self.publisher.flush(msg.job_id)
        if kind == Ending.RETRY:
            # An error of the engine on this job's request: one whole failed delivery.
            out = dataclasses.replace(out, charge=FAULT_UNIT)
            limit = self.settings.max_deliveries * FAULT_UNIT
            if job is not None and job.fault_charge + out.charge < limit:
                kind = Ending.HANDED_BACK
                log.warning("job %s goes back for another delivery: %s", msg.job_id, out.message)
            else:
                kind = Ending.FAILED
        elif kind == Ending.HANDED_BACK:
            # A dead engine shares its fault among the jobs it ran; a drain costs nothing.
            out = dataclasses.replace(out, charge=run.crash_charge)
        settled = {
            Ending.SUCCEEDED: self._ended,
            Ending.FAILED: self._ended,
            Ending.HANDED_BACK: self._handed_back_to_queue,
            Ending.PREEMPTED: self._handed_back_to_queue,
        }.get(kind)
        # True when the job's row took this run's outcome; else another ending got there
        # first (a cancel, a later delivery), and the kind says which.
        if settled is not None and not await settled(msg, out, kind, delivery):
            kind = await self._retrying("why not", lambda: self._why_not(msg.job_id, delivery))
        if kind == Ending.FAILED and out.kind == Ending.RETRY:  # its last delivery failed it
            metrics.DEAD_LETTERS.labels(msg.tier.value).inc()
        # Billed: what this run computed and what earlier runs generated that it resumed
        # after (no earlier run billed it), even if the cancel came before its first token.
        if kind == Ending.CANCELLED and job is not None and (out.served > 0 or out.resumed > 0):
            await self._retrying("bill cancelled", lambda: self._bill_cancelled(msg, out))
        await self._retrying("release", lambda: self._release(entry_id, msg, kind, out.served))

    async def _ended(
        self, msg: JobMessage, out: Outcome, kind: Ending, delivery: int | None
    ) -> bool:
        """Succeeded or failed: the job's row takes the outcome, then its final event."""
        code = out.code or "engine_error"
        message = out.message or "the engine failed"

        async def write() -> JobRecord | None:
            if kind == Ending.FAILED:
                return await self.jobs.fail(msg.job_id, code, message, delivery=delivery)
            result = Result(
                out.text,
                out.finish_reason,
                out.prompt_tokens,
                out.completion_tokens,
                out.logprobs,
                out.choices,
            )
            return await self.jobs.finish(msg.job_id, result, delivery)

        ended = await self._retrying("fail job" if kind == Ending.FAILED else "finish job", write)
        if ended is None:
            return False
        observe.count_end(
            msg.tier, msg.enqueued_at, out.first_token_at, out.completion_tokens - out.resumed
        )
        if kind == Ending.FAILED:
            metrics.JOBS_FINISHED.labels(msg.tier.value, "failed").inc()
        else:
            self._count_success(ended, out)
        await self._retrying(
            "final event", lambda: self.publisher.send(msg.job_id, _final_event(ended))
        )
        return True

    async def _handed_back_to_queue(
        self, msg: JobMessage, out: Outcome, kind: Ending, delivery: int | None
    ) -> bool:
        """Back to its tier's queue for another delivery (at the head when preempted)."""
        preempted = kind == Ending.PREEMPTED

        progress = out.progress(self.progress_source)

        why = out.message or ("preempted" if preempted else "worker handed it back")

        async def hand_back() -> bool:
            back = await self.jobs.requeue(
                msg.job_id,
                why,
                delivery,
                preempted=preempted,
                progress=progress,
                charge=out.charge,
            )
            return back is not None

        if not await self._retrying("requeue job", hand_back):
            return False
        if progress is None and out.completion_tokens > out.resumed:
            # The engine did not say which tokens it generated (or they cannot be resumed
            # after): the next run generates them again.
            metrics.PREEMPTED_TOKENS_WASTED.inc(out.completion_tokens - out.resumed)
        if preempted:
            metrics.PREEMPTIONS.labels(msg.tier.value).inc()
        again = dataclasses.replace(
            msg, preemptions=msg.preemptions + preempted, unsettled_charge=FAULT_UNIT
        )
        await self._retrying(
            "enqueue",
            lambda: enqueue(self.r, self.names, again, head_of_tier=preempted, arrival=False),
        )
        return True

    async def _bill_cancelled(self, msg: JobMessage, out: Outcome) -> None:
        """The engine did the work up to the cancellation: the tenant pays for it."""
        await self.jobs.bill_cancelled(msg.job_id, out.prompt_tokens, out.completion_tokens)

    async def _why_not(self, job_id: str, delivery: int | None) -> Ending:
        """Why a run's final transition found the job elsewhere: a later delivery owns it
        (superseded), or it ended meanwhile (cancelled by its tenant, say)."""
        current = await self.jobs.get(job_id)
        if current is None:
            return Ending.SKIPPED
        if delivery is not None and current.deliveries != delivery:
            return Ending.SUPERSEDED
        if current.status in (JobStatus.QUEUED, JobStatus.RUNNING):
            return Ending.SUPERSEDED  # put back meanwhile (the reconciler): not this run's any more
        if current.status == JobStatus.CANCELLED:
            return Ending.CANCELLED
        if current.worker_id == self.worker_id and current.status in (
            JobStatus.SUCCEEDED,
            JobStatus.FAILED,
        ):
            # This run's own commit, whose reply was lost: the final event is still owed.
            await self.publisher.send(job_id, _final_event(current))
        return Ending.SKIPPED

    def _count_success(self, job: JobRecord, out: Outcome) -> None:
        tier = job.tier.value
        metrics.JOBS_FINISHED.labels(tier, "succeeded").inc()
        metrics.count_tokens_served(job.tenant_id, tier, out.prompt_tokens, out.completion_tokens)


def internal_error(job_id: str, exc: BaseException) -> str:
    """What the tenant is told of an error inside the platform (an unknown engine error, a
    bug, SQL refused): a stable text and a reference. The detail (exception, message,
    traceback: SQL and its parameters, engine internals) goes to the operator's log and
    the job's trace under that reference, never to the job's row, the API or a batch's
    error file."""
    ref = new_id("err")
    log.error(
        "job %s: internal error %s: %s: %s",
        job_id,
        ref,
        type(exc).__name__,
        exc,
        exc_info=exc,
        extra={"error_ref": ref},
    )
    return f"The platform failed while running the job (reference {ref})."


def _planned_stop(hb: Heartbeat) -> bool:
    """Whether a worker's last heartbeat says it was stopping as planned (draining, its
    engine alive): jobs it left unsettled were cut short by the stop, not by a fault."""
    return hb.draining and hb.engine_ok


def _final_event(job: JobRecord) -> JobEvent:
    return JobEvent(
        "error" if job.status == JobStatus.FAILED else "done", job.to_api(logprobs=False)
    )


CANCELLED_WAIT_S = 5.0  # how long a stopping worker waits for its cancelled side tasks
# How often a worker checks that Redis holds its model's tokenizer (tierq.core.fleet).
PUBLISH_EVERY_S = 30.0
# How long a job charged for a crash waits for the other runs' first steps before it starts.
ABORT_TIMEOUT_S = 10.0  # how long the watchdog waits for the engine to drop a stalled run
SUSPECT_WAIT_S = 10.0


async def run_worker(
    settings: Settings,
    engine_factory: Callable[[Settings], Engine],
    install_signals: Callable[[Worker], Awaitable[None]] | None = None,
) -> None:
    """Start the engine, then serve the inbox until stopped (the `tierq worker` command).
    Raises EngineDead when the engine died (the command exits non-zero)."""
    from tierq.core.redis_conn import connect
    from tierq.workers.engine.cpu_placement import pin_off_compute

    # Redis (and its eviction policy) and the worker id are checked before the engine
    # loads its model: a worker that cannot run here says so before taking a GPU's memory.
    r = await connect(settings, role="worker")
    try:
        await identity.check(
            r,
            RedisNames(settings.redis_prefix),
            settings.resolved_worker_id,
            settings.worker_dead_after_s,
            settings.heartbeat_interval_s / 2,
        )
        engine = engine_factory(settings)
        await engine.start()
    except BaseException:
        await r.aclose()
        raise
    if build_defaults(settings).pin_aux_processes:
        # This process and vLLM's engine core off the cores vLLM bound its compute to.
        pin_off_compute()
    db = Database.for_settings(settings)
    jobs = SqlJobStore(db)
    worker = Worker(settings, jobs, r, engine)
    if install_signals is not None:
        await install_signals(worker)
    log.info(
        "worker %s ready (engine %s, %d slots)", worker.worker_id, engine.name, worker.capacity
    )
    try:
        await worker.run()
    finally:
        with contextlib.suppress(Exception):  # a dead engine may fail to shut down cleanly
            await engine.shutdown()
        await r.aclose()
        await jobs.close()
        await db.close()
