"""`tierq bench scale`: cache-affine placement, dispatch rate, failover and the autoscaling
signal, with many workers on real Redis and PostgreSQL (issue 13).

Everything but the engine is tierq's own code, in this one process: a redis-server of the
bench's own (no persistence) and a scratch PostgreSQL database (dropped at the end), two
dispatchers sharing the lease (`tierq/dispatcher/leadership.py`), and `--workers` workers, each
hosting a SIMULATED engine (`tierq/workers/engine/simulated_engine.py`, the cost model `tierq
calibrate` fitted to vLLM on this machine, time compressed by `--speedup`) with its
simulated prefix cache on: an LRU of `--cache-entries` prefix keys, a hit skipping the
prefill of the first PREFIX_CHARS / 4 prompt tokens.

Workload (seeded): `--tenants` tenants, each with a system prompt of about 2,000
characters and short user turns, and `--sessions` multi-turn conversations (a short
system prompt, a ~900-character first message, then turns that grow the history), all
standard tier, offered at `--load` times the workers' estimated capacity without any
cache hit: a backlog builds, and throughput is what the workers reach.

It runs the workload twice, same seed: `affine` (AFFINITY_SLACK 0.25, tierq's default:
a prefix's own ranking of the workers, bounded load) and `free_slots` (AFFINITY_SLACK 0:
the freest worker). In the affine run, once its measured window ended, the leading
dispatcher is stopped abruptly without releasing its lease — its tasks cancelled in
process, a crash modelled, not a killed process — and `failover_s` runs until the standby
hands the next job to a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from benchmarks.decode_ledger import DecodeLedger
from benchmarks.harness import (
    RedisServer,
    drop_scratch_database,
    free_port,
    postgres_server_url,
    scratch_database,
)
from tierq import migrations
from tierq.core.messages import PREFIX_CHARS
from tierq.core.queue import enqueue
from tierq.core.redis_conn import connect
from tierq.core.settings import Settings
from tierq.core.tiers import TIER_ORDER, Tier
from tierq.dispatcher.loop import Dispatcher, policy_from_settings
from tierq.models import jobs as job_repo
from tierq.models import tenants as tenant_repo
from tierq.models.db import Database
from tierq.models.store import SqlJobStore
from tierq.workers.engine.base import Chunk, Engine, EngineWrapper
from tierq.workers.engine.simulated_engine import CostModel, SimulatedEngine
from tierq.workers.engine.vllm_args import step_token_budget
from tierq.workers.engine.vllm_scheduler import Tiering
from tierq.workers.worker import Worker

log = logging.getLogger("tierq.bench.scale")

REPORT_KEYS = (
    "affine",
    "free_slots",
    "dispatches_per_s",
    "decision_us_p99",
    "idle_with_backlog",
    "failover_s",
    "preempted_tokens_wasted",
    "desired_workers",
    "needed_workers",
)
RUN_KEYS = ("prefix_hit_rate", "cached_prompt_share", "throughput_tokens_per_s")
SAMPLE_S = 0.05
WORDS = [
    "policy",
    "account",
    "invoice",
    "shipment",
    "refund",
    "customer",
    "order",
    "ticket",
    "review",
    "summary",
    "answer",
    "clause",
    "contract",
    "schedule",
    "warranty",
    "region",
    "product",
    "latency",
    "budget",
    "report",
    "quarter",
]


@dataclass(frozen=True)
class ScaleConfig:
    workers: int = 8
    slots: int = 32  # MAX_NUM_SEQS of each simulated engine
    duration_s: float = 30.0  # wall seconds of arrivals per run; the first quarter warms up
    seed: int = 1
    speedup: float = 4.0  # simulated seconds per wall second
    load: float = 1.5  # offered, in multiples of the workers' capacity without cache hits
    tenants: int = 8
    sessions: int = 32
    turns: int = 6  # per session, at most
    cache_entries: int = 6  # prefixes each simulated engine's cache holds
    lease_s: float = 5.0  # DISPATCH_LEASE_S
    engine: str = "simulated"  # or "vllm": real engines (the bundled model), time not compressed


@dataclass(frozen=True)
class Arrival:
    at: float  # wall seconds from the start
    tenant: str
    messages: tuple[tuple[str, str], ...]  # (role, content)
    max_tokens: int

    @property
    def prompt_chars(self) -> int:
        return sum(len(c) for _, c in self.messages)


def _text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:chars]


def capacity_jobs_per_s(cost: CostModel, prompt_tokens: float, max_tokens: float) -> float:
    """One engine's jobs per second with every step's token budget full and no prefix cache
    hit (simulated seconds): each job takes its prompt and one budget token a decode step."""
    per_step = cost.max_batched_tokens / (prompt_tokens + max_tokens)
    step = cost.decode_step_base_s + cost.prefill_s_per_token * cost.max_batched_tokens
    return per_step / step


def make_workload(cfg: ScaleConfig, cost: CostModel) -> list[Arrival]:
    """Seeded: the same arrivals for the same config. Half the jobs are tenants' single
    turns (a shared ~2,000-character system prompt), half turns of multi-turn sessions."""
    rng = random.Random(cfg.seed)
    systems = [
        f"You are the assistant of tenant {t}. " + _text(rng, 2000) for t in range(cfg.tenants)
    ]
    # Each session: its tenant, a short system prompt, then its history of (role, content).
    sessions: list[tuple[int, list[tuple[str, str]]]] = []
    for s in range(cfg.sessions):
        history = [
            ("system", f"Session {s}. Be brief. " + _text(rng, 120)),
            ("user", _text(rng, 900)),
        ]
        sessions.append((s % cfg.tenants, history))
    mean_prompt = 2100 / 4  # about the same for both kinds (characters / 4)
    mean_max = 16
    per_worker = capacity_jobs_per_s(cost, mean_prompt, mean_max) * cfg.speedup
    rate = cfg.load * per_worker * cfg.workers  # jobs per wall second
    arrivals: list[Arrival] = []
    turn = [0] * cfg.sessions
    # A burst that fills every slot at once (the dispatch rate is measured on it), then
    # Poisson arrivals, on past the measured window for the failover to have work.
    burst = cfg.workers * cfg.slots
    horizon = cfg.duration_s + 4 * cfg.lease_s
    t = 0.0
    while t < horizon:
        max_tokens = rng.randint(8, 24)
        if rng.random() < 0.5:
            tenant = rng.randrange(cfg.tenants)
            messages = [("system", systems[tenant]), ("user", _text(rng, rng.randint(60, 240)))]
            arrivals.append(Arrival(t, f"tenant-{tenant}", tuple(messages), max_tokens))
        else:
            s = rng.randrange(cfg.sessions)
            tenant, history = sessions[s]
            if turn[s] >= cfg.turns:  # a new conversation in its place
                history[1:] = [("user", _text(rng, 900))]
                turn[s] = 0
            if turn[s] > 0:
                history += [("assistant", _text(rng, 200)), ("user", _text(rng, 100))]
            turn[s] += 1
            arrivals.append(Arrival(t, f"tenant-{tenant}", tuple(history), max_tokens))
        t = 0.0 if len(arrivals) < burst else t + rng.expovariate(rate)
    return arrivals


# --- instruments ------------------------------------------------------------------------------


@dataclass
class Tally:
    tokens: list[tuple[float, int]] = field(default_factory=list)  # (t, prompt + generated)
    decode: DecodeLedger = field(default_factory=DecodeLedger)  # decode work done twice
    runs: int = 0  # runs that got a first chunk (so their prompt's cache lookup is known)
    hits: int = 0  # of those, runs whose prompt started with cached tokens
    prompt_tokens: int = 0
    cached_tokens: int = 0


class CountingEngine(EngineWrapper):
    """Counts what the engine served (tokens, cache hits, decode work done twice), whichever
    engine it wraps."""

    def __init__(self, inner: Engine, tally: Tally) -> None:
        super().__init__(inner, f"counting-{inner.name}")
        self.tally = tally

    @property
    def preemptions(self) -> int:
        """Preemptions for priority inside the engine (the simulated engine counts them)."""
        return int(getattr(self.inner, "preemptions", 0))

    async def observe(
        self, request_id: str, resume: Sequence[int], run: AsyncIterator[Chunk]
    ) -> AsyncIterator[Chunk]:
        generated = 0
        async for chunk in self.tally.decode.counted(request_id, resume, run):
            if generated == 0:
                self.tally.runs += 1
                self.tally.hits += chunk.cached_tokens > 0
                self.tally.prompt_tokens += chunk.prompt_tokens
                self.tally.cached_tokens += min(chunk.cached_tokens, chunk.prompt_tokens)
            n = chunk.new_tokens + (chunk.prompt_tokens if generated == 0 else 0)
            generated += chunk.new_tokens
            self.tally.tokens.append((time.monotonic(), n))
            yield chunk


class TimedDispatcher(Dispatcher):
    """The dispatcher, counting what it hands out and the time its handing rounds take."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.moved = 0
        self.busy_s = 0.0
        self.handed_at: list[float] = []

    async def step(self, alive: Any) -> int:
        started = time.perf_counter()
        moved = await super().step(alive)
        if moved:
            self.busy_s += time.perf_counter() - started
            self.moved += moved
            self.handed_at.append(time.monotonic())
        return moved


@dataclass
class Sample:
    t: float
    backlog: int  # jobs in the tier streams, not yet handed to a worker
    free_workers: int  # workers with a free slot
    free_slots: int
    desired: int  # the leader's desired_workers


# --- one run ----------------------------------------------------------------------------------


def _engine(cfg: ScaleConfig, cost: CostModel, settings: Settings) -> Engine:
    """A worker's engine: simulated (its prefix cache an LRU of prefix keys), or vLLM with
    the bundled model and its own automatic prefix cache."""
    if cfg.engine == "vllm":
        from tierq.workers.engine.vllm_engine import VllmEngine

        return VllmEngine(settings)
    return SimulatedEngine(
        cost.scaled(cfg.speedup),
        priority_steps=settings.engine_priority_steps,
        tiering=Tiering.from_settings(settings),
    )


async def _run(
    name: str,
    cfg: ScaleConfig,
    arrivals: list[Arrival],
    cost: CostModel,
    base: Settings,
    redis_url: str,
    workdir: Path,
    slack: float,
    crash: bool,
) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    db_url = await scratch_database(base, workdir, f"scale_{name}_{tag}")
    await asyncio.to_thread(migrations.upgrade, db_url)
    settings = base.model_copy(
        update={
            "database_url": db_url,
            "redis_url": redis_url,
            "redis_prefix": f"tierq-scale-{tag}",
            "engine": cfg.engine,
            "max_num_seqs": cfg.slots,
            "affinity_slack": slack,
            "dispatch_lease_s": cfg.lease_s,
            "heartbeat_interval_s": 0.25,
            "dispatch_idle_wait_s": 0.02,
            "share_window_s": base.share_window_s / cfg.speedup,
            "slo_interactive_s": base.slo_interactive_s / cfg.speedup,
            "slo_standard_s": base.slo_standard_s / cfg.speedup,
            "slo_batch_s": base.slo_batch_s / cfg.speedup,
        }
    )
    db = Database(db_url, pool_size=32, max_overflow=16)
    r = aioredis.Redis.from_url(redis_url, decode_responses=True)
    tally = Tally()
    engines: list[CountingEngine] = []
    worker_clients: list[aioredis.Redis] = []
    workers: list[Worker] = []
    for _ in range(cfg.workers):
        engines.append(CountingEngine(_engine(cfg, cost, settings), tally))
    # Real engines start together (each loads the model in its own engine-core process).
    await asyncio.gather(*(engine.start() for engine in engines))
    stores = [SqlJobStore(db) for _ in engines]  # a store a worker, as a process has
    for i, engine in enumerate(engines):
        # A client of its own, as a worker process has (bounded: a burst waits for one).
        wr = await connect(settings, role=f"w{i:02d}")
        worker_clients.append(wr)
        workers.append(
            Worker(settings, stores[i], wr, engine, worker_id=f"w{i:02d}", capacity=cfg.slots)
        )
    # Two dispatchers, each with its own connection, run as Dispatcher.run does but with
    # their tasks at hand: cancelling both models a crash (no release of the lease).
    clients = [await connect(settings, role=f"dispatcher-{i}") for i in range(2)]
    dispatchers = [
        TimedDispatcher(settings, c, consumer="dispatcher", policy=policy_from_settings(settings))
        for c in clients
    ]
    d_tasks: list[list[asyncio.Task[None]]] = []
    w_tasks: list[asyncio.Task[None]] = []
    names = dispatchers[0].names

    tenants: dict[str, str] = {}
    async with db.transaction() as s:
        for tname in sorted({a.tenant for a in arrivals}):
            tenants[tname] = (await tenant_repo.create_tenant(s, tname)).id
    streams = [names.tier_stream(Tier.STANDARD, tid) for tid in tenants.values()]
    streams += [names.preempted_stream(t) for t in TIER_ORDER]
    inboxes = [names.inbox(w.worker_id) for w in workers]
    samples: list[Sample] = []
    offered_tokens = 0.0

    def leader() -> TimedDispatcher | None:
        return next((d for d in dispatchers if d.leadership.held), None)

    async def sample() -> None:
        while True:
            async with r.pipeline(transaction=False) as pipe:
                for key in (*streams, *inboxes):
                    pipe.xlen(key)
                got = [int(x) for x in await pipe.execute()]
            backlog, loads = sum(got[: len(streams)]), got[len(streams) :]
            free = [max(0, cfg.slots - n) for n in loads]
            lead = leader()
            samples.append(
                Sample(
                    time.monotonic(),
                    backlog,
                    sum(1 for f in free if f > 0),
                    sum(free),
                    lead.desired_workers if lead else 0,
                )
            )
            await asyncio.sleep(SAMPLE_S)

    def new_job(a: Arrival) -> job_repo.NewJob:
        return job_repo.NewJob(
            tenant_id=tenants[a.tenant],
            tier=Tier.STANDARD,
            model=settings.served_model_name,
            messages=[{"role": role, "content": c} for role, c in a.messages],
            prompt=None,
            params={"max_tokens": a.max_tokens, "temperature": 0.0, "ignore_eos": True},
        )

    async def feed(t0: float, items: list[Arrival]) -> None:
        nonlocal offered_tokens
        for a in items:
            delay = t0 + a.at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            async with db.transaction() as s:
                job, _ = await s.run_sync(job_repo.create_job, new_job(a))
            await enqueue(r, names, job.to_message())
            offered_tokens += a.prompt_chars / 4 + a.max_tokens

    # Every worker's inbox and heartbeat, then the burst queued, then the dispatchers
    # started; the workers begin reading their inboxes once the burst is handed out, so
    # that the dispatch rate is the dispatcher's own, not what this one process's CPU has
    # left beside every worker claiming its jobs (in a deployment, other processes).
    for w in workers:
        await w._ensure_group()
        await w._heartbeat()

    async def heartbeats() -> None:  # alive meanwhile, as a worker's own loop keeps it
        while True:
            await asyncio.sleep(settings.heartbeat_interval_s)
            for w in workers:
                await w._heartbeat()

    beating = asyncio.create_task(heartbeats())

    burst = [a for a in arrivals if a.at == 0.0]
    async with db.transaction() as s:
        burst_jobs = [(await s.run_sync(job_repo.create_job, new_job(a)))[0] for a in burst]
    for job in burst_jobs:
        await enqueue(r, names, job.to_message())
    offered_tokens += sum(a.prompt_chars / 4 + a.max_tokens for a in burst)
    t0 = time.monotonic()
    d_tasks += [
        [asyncio.create_task(d._run()), asyncio.create_task(d._keep_lease())] for d in dispatchers
    ]
    sampler = asyncio.create_task(sample())
    feeder = asyncio.create_task(feed(t0, arrivals[len(burst) :]))
    for _ in range(12_000):  # a minute at most
        if sum(d.moved for d in dispatchers) >= len(burst):
            break
        await asyncio.sleep(0.005)
    first = min((d.handed_at[0] for d in dispatchers if d.handed_at), default=t0)
    burst_s = time.monotonic() - first
    beating.cancel()
    # Not awaited without a bound: a task cancelled while it waits for a connection of a
    # busy pool has been seen never to end (redis-py's BlockingConnectionPool).
    await asyncio.wait([beating], timeout=2)
    w_tasks += [asyncio.create_task(w.run()) for w in workers]
    warm = t0 + cfg.duration_s / 4
    end = t0 + cfg.duration_s
    await asyncio.sleep(max(0.0, warm - time.monotonic()))
    hits0, runs0 = tally.hits, tally.runs
    prompt0, cached0 = tally.prompt_tokens, tally.cached_tokens
    offered0 = offered_tokens
    await asyncio.sleep(max(0.0, end - time.monotonic()))
    hits, lookups = tally.hits - hits0, tally.runs - runs0
    prompt_tokens, cached_tokens = tally.prompt_tokens - prompt0, tally.cached_tokens - cached0
    offered_window = offered_tokens - offered0
    served = sum(n for t, n in tally.tokens if warm <= t <= end)
    window = [s for s in samples if warm <= s.t <= end]
    backlogged = [s for s in window if s.backlog > 0]
    peak = max(samples, key=lambda s: s.backlog) if samples else None
    lead = leader()
    result: dict[str, Any] = {
        "prefix_hit_rate": round(hits / lookups, 4) if lookups else 0.0,
        "cached_prompt_share": round(cached_tokens / prompt_tokens, 4) if prompt_tokens else 0.0,
        "throughput_tokens_per_s": round(served / (end - warm), 1),
        "offered_tokens_per_s": round(offered_window / (end - warm), 1),
        # As bench qos counts it: the fraction of slot time left idle while work waited.
        "idle_with_backlog": round(
            sum(s.free_slots for s in backlogged) / (len(window) * cfg.slots * cfg.workers), 4
        )
        if window
        else 0.0,
        # Stricter: the fraction of samples in which any worker had a slot free meanwhile.
        "any_free_slot_with_backlog": round(
            sum(1 for s in backlogged if s.free_workers) / len(window), 4
        )
        if window
        else 0.0,
        "backlog_peak_jobs": peak.backlog if peak else 0,
        "desired_workers_at_peak": peak.desired if peak else 0,
        # The signal in the steady state: its median over the measured window.
        "desired_workers_median": statistics.median_low(s.desired for s in window) if window else 0,
        "engine_preemptions": sum(e.preemptions for e in engines),
    }
    handed = sum(d.moved for d in dispatchers)
    busy = sum(d.busy_s for d in dispatchers)
    decisions = sorted(x for d in dispatchers for x in d.decision_seconds)
    result["dispatched"] = handed
    result["burst_jobs"] = len(burst)
    result["dispatches_per_s"] = round(len(burst) / burst_s, 1) if burst_s > 0 else 0.0
    result["dispatches_per_s_busy_rounds"] = round(handed / busy, 1) if busy else 0.0
    result["dispatches_per_s_overall"] = round(handed / (time.monotonic() - t0), 1)
    result["decision_us_p99"] = (
        round(decisions[int(0.99 * (len(decisions) - 1))] * 1e6, 1) if decisions else 0.0
    )

    if crash and lead is not None:
        standby = next(d for d in dispatchers if d is not lead)
        crashed_at = time.monotonic()
        # Its loop told to stop (it then exits without releasing: that is run()'s part) and
        # its tasks cancelled: nothing renews or releases the lease.
        lead.request_stop()
        for task in d_tasks[dispatchers.index(lead)]:
            task.cancel()
        _, alive = await asyncio.wait(d_tasks[dispatchers.index(lead)], timeout=5)
        if alive:
            log.warning("the stopped leader's tasks did not end within 5 s")
        log.info("leader stopped without releasing its lease; waiting for the standby")
        limit = crashed_at + cfg.lease_s * 4
        failover: float | None = None
        while time.monotonic() < limit:
            after = [t for t in standby.handed_at if t > crashed_at]
            if after:
                failover = after[0] - crashed_at
                break
            await asyncio.sleep(0.01)
        result["failover_s"] = round(failover, 3) if failover is not None else None

    result["preempted_tokens_wasted"] = tally.decode.wasted()
    for d in dispatchers:
        d.request_stop()
    everything = [feeder, sampler, *w_tasks, *(t for pair in d_tasks for t in pair)]
    for task in everything:
        task.cancel()
    _, left = await asyncio.wait(everything, timeout=10)
    if left:
        log.warning("%d tasks did not end within 10 s of being cancelled: %s", len(left), left)
    for engine in engines:
        await engine.shutdown()
    keys = [k async for k in r.scan_iter(match=f"{settings.redis_prefix}:*")]
    if keys:
        await r.delete(*keys)
    for c in (r, *clients, *worker_clients):
        await c.aclose()
    for store in stores:
        await store.close()
    await db.close()
    await drop_scratch_database(db_url)
    return result


def report(runs: dict[str, dict[str, Any]], cfg: ScaleConfig) -> dict[str, Any]:
    """The figures the brief asks for, from the two runs (pure)."""
    affine, free = runs["affine"], runs["free_slots"]
    per_worker = affine["throughput_tokens_per_s"] / cfg.workers
    needed = math.ceil(affine["offered_tokens_per_s"] / per_worker) if per_worker else 0
    ratio = (
        affine["throughput_tokens_per_s"] / free["throughput_tokens_per_s"]
        if free["throughput_tokens_per_s"]
        else 0.0
    )
    out: dict[str, Any] = {
        "affine": {k: affine[k] for k in RUN_KEYS},
        "free_slots": {k: free[k] for k in RUN_KEYS},
        "dispatches_per_s": affine["dispatches_per_s"],
        "decision_us_p99": affine["decision_us_p99"],
        "idle_with_backlog": affine["idle_with_backlog"],
        "any_free_slot_with_backlog": affine["any_free_slot_with_backlog"],
        "failover_s": affine.get("failover_s"),
        "preempted_tokens_wasted": affine["preempted_tokens_wasted"]
        + free["preempted_tokens_wasted"],
        "desired_workers": affine["desired_workers_median"],
        "needed_workers": needed,
    }
    failover = out["failover_s"]
    out["targets"] = {
        "affine_throughput_x": round(ratio, 3),
        "affine_1.3x_met": ratio >= 1.3,
        "idle_with_backlog_le_0.02_met": out["idle_with_backlog"] <= 0.02,
        "failover_le_6s_met": failover is not None and failover <= 6.0,
        "dispatches_2000_per_s_met": out["dispatches_per_s"] >= 2000,
    }
    out["_run"] = {
        **dataclasses.asdict(cfg),
        "engine": "simulated (calibrated), simulated prefix cache"
        if cfg.engine == "simulated"
        else "vllm (the bundled model, its own prefix cache), every engine on this machine",
        "prefix_chars_cached": PREFIX_CHARS,
        "detail": runs,
    }
    return out


async def run_scale(base: Settings, cfg: ScaleConfig) -> dict[str, Any]:
    log.setLevel(logging.INFO)  # its progress on stderr; the platform's own at WARNING
    server = postgres_server_url(base, "scale")
    base = base.model_copy(update={"database_url": server})
    cost = dataclasses.replace(
        CostModel.load(),
        slots=cfg.slots,
        max_batched_tokens=step_token_budget(base),
        prefix_cache_entries=cfg.cache_entries,
    )
    if cfg.engine == "vllm":
        cfg = dataclasses.replace(cfg, speedup=1.0)  # real engines run in real time
    arrivals = make_workload(cfg, cost)
    log.info("%d arrivals over %.0f s, %d workers", len(arrivals), cfg.duration_s, cfg.workers)
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="tierq-scale-") as tmp:
        workdir = Path(tmp)
        redis = RedisServer(free_port(), workdir / "redis.log")
        redis.start()
        try:
            await redis.wait_ready()
            for name, slack, crash in (
                ("affine", base.affinity_slack or 0.25, True),
                ("free_slots", 0.0, False),
            ):
                log.info("running %s (affinity_slack %s) ...", name, slack)
                runs[name] = await _run(
                    name, cfg, arrivals, cost, base, redis.url, workdir, slack, crash
                )
                log.info("%s: %s", name, runs[name])
        finally:
            with contextlib.suppress(Exception):
                redis.kill()
    return report(runs, cfg)
