"""One policy's run of `tierq bench qos`: the real dispatcher and worker, timed arrivals.

A run gets a scratch database (migrated, dropped at the end) and its own Redis key
prefix, starts a worker and a dispatcher with the policy's settings around an engine
wrapped to record what it serves, submits the workload as the API would (a jobs row,
then the stream entry) on the compressed clock, and at the end of the arrivals stops
everything and hands what it recorded to the report. The backlog present at the start
is written before the clock starts.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis

from benchmarks.harness import drop_scratch_database, scratch_database
from benchmarks.qos_report import Recorded, Trace
from benchmarks.qos_workload import Arrival, Shape
from tierq import migrations
from tierq.core.queue import enqueue
from tierq.core.settings import Settings
from tierq.dispatcher.loop import Dispatcher, policy_from_settings
from tierq.models import jobs as job_repo
from tierq.models import tenants as tenant_repo
from tierq.models.db import Database
from tierq.models.records import JobRecord
from tierq.models.store import SqlJobStore
from tierq.workers.engine.base import Chunk, Engine, EngineWrapper
from tierq.workers.engine.simulated_engine import CostModel, SimulatedEngine
from tierq.workers.engine.vllm_scheduler import Tiering
from tierq.workers.worker import Worker

SAMPLE_S = 0.02  # how often the engine's occupancy is sampled, wall clock


class InstrumentedEngine(EngineWrapper):
    """Wraps an engine and records when each request entered it, its first token, and
    every token it served."""

    def __init__(self, inner: Engine, trace: Trace) -> None:
        super().__init__(inner, f"instrumented-{inner.name}")
        self.trace = trace
        self.active = 0

    async def observe(
        self, request_id: str, resume: Sequence[int], run: AsyncIterator[Chunk]
    ) -> AsyncIterator[Chunk]:
        self.trace.called.setdefault(request_id, time.monotonic())
        self.active += 1
        counted_prompt = False
        try:
            async for chunk in self.trace.decode.counted(request_id, resume, run):
                now = time.monotonic()
                n = chunk.new_tokens + (0 if counted_prompt else chunk.prompt_tokens)
                counted_prompt = True
                self.trace.tokens.append((now, request_id, n))
                if chunk.text:
                    self.trace.first_token.setdefault(request_id, now)
                yield chunk
        finally:
            self.active -= 1


@dataclass(frozen=True)
class Bench:
    """What every run of one `tierq bench qos` shares."""

    base: Settings
    shape: Shape
    cost: CostModel
    speedup: float
    engine_kind: str  # simulated or vllm
    redis_url: str
    workdir: Path  # for SQLite scratch databases

    def settings(self, policy_name: str, db_url: str, tag: str) -> Settings:
        """The platform's settings for one policy: the baselines get no reserve and
        vLLM's stock scheduler; the policy's windows and SLOs run on the compressed clock."""
        base, speedup = self.base, self.speedup
        baseline = policy_name != "tierq"
        return base.model_copy(
            update={
                "database_url": db_url,
                "redis_url": self.redis_url,
                "redis_prefix": f"tierq-bench-{tag}",
                "engine": self.engine_kind,
                "dispatch_policy": policy_name,
                "max_num_seqs": self.cost.slots,
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


async def run_policy(
    bench: Bench, policy_name: str, arrivals: list[Arrival], shared_engine: Engine | None = None
) -> Recorded:
    """One policy on `arrivals`, from empty queues; `shared_engine` (the real one) is
    emptied for the next run, a simulated engine is made and shut down here."""
    tag = uuid.uuid4().hex[:8]
    name = f"{policy_name.replace('-', '_')}_{tag}"
    db_url = await scratch_database(bench.base, bench.workdir, name)
    await asyncio.to_thread(migrations.upgrade, db_url)  # Alembic runs its own event loop
    run = _Run(bench, bench.settings(policy_name, db_url, tag), shared_engine)
    await run.start(policy_name, tag, {a.tenant for a in arrivals})
    try:
        t0 = await run.submit(arrivals)
    finally:
        await run.stop()
        await drop_scratch_database(db_url)
    return Recorded(run.trace, run.jobs, t0, run.dispatcher.decision_seconds, run.settings)


class _Run:
    """The components of one run, and what they recorded."""

    def __init__(self, bench: Bench, settings: Settings, shared_engine: Engine | None) -> None:
        self.bench = bench
        self.settings = settings
        self.shared_engine = shared_engine
        self.db = Database.for_settings(settings)
        self.store = SqlJobStore(self.db)
        self.r = aioredis.Redis.from_url(bench.redis_url, decode_responses=True)
        self.trace = Trace()
        inner: Engine = shared_engine or SimulatedEngine(
            bench.cost.scaled(bench.speedup),
            priority_steps=settings.engine_priority_steps,
            tiering=Tiering.from_settings(settings),
        )
        self.engine = InstrumentedEngine(inner, self.trace)
        self.dispatcher = Dispatcher(settings, self.r, policy=policy_from_settings(settings))
        self.tasks: list[asyncio.Task[None]] = []
        self.tenants: dict[str, str] = {}  # name -> tenant id
        self.jobs: dict[str, tuple[Arrival, float]] = {}  # job id -> (arrival, wall enqueued)
        self.arrived_wall: list[float] = []
        self._serial = itertools.count()

    async def start(self, policy_name: str, tag: str, tenants: set[str]) -> None:
        if self.shared_engine is None:
            await self.engine.start()
        # engine-priority: the worker takes everything and the engine queues it by priority.
        capacity = 1_000_000 if policy_name == "engine-priority" else self.bench.cost.slots
        worker = Worker(
            self.settings,
            self.store,
            self.r,
            self.engine,
            worker_id=f"bench-{tag}",
            capacity=capacity,
        )
        self.tasks = [asyncio.create_task(worker.run()), asyncio.create_task(self.dispatcher.run())]
        async with self.db.transaction() as s:
            for name in tenants:
                self.tenants[name] = (await tenant_repo.create_tenant(s, name)).id

    async def submit(self, arrivals: list[Arrival]) -> float:
        """Every arrival at its time; returns the wall clock of simulated time 0 once the
        arrivals' duration is over."""
        speedup = self.bench.speedup
        initial = [a for a in arrivals if a.at < 0.01]
        async with self.db.transaction() as s:
            backlog = [
                (a, (await s.run_sync(job_repo.create_job, self._new_job(a)))[0]) for a in initial
            ]
        t0 = time.monotonic()
        for arrival, job in backlog:
            await self._enqueue(arrival, job, t0)
        sampler = asyncio.create_task(self._sample())
        for arrival in arrivals[len(initial) :]:
            delay = t0 + arrival.at / speedup - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            async with self.db.transaction() as s:
                job, _ = await s.run_sync(job_repo.create_job, self._new_job(arrival))
            await self._enqueue(arrival, job, time.monotonic())
        end = t0 + self.bench.shape.duration_s / speedup
        await asyncio.sleep(max(0.0, end - time.monotonic()))
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
        return t0

    def _new_job(self, arrival: Arrival) -> job_repo.NewJob:
        if self.bench.engine_kind == "simulated":
            prompt = "abcd" * arrival.prompt_tokens
        else:  # distinct from its first token, so that vLLM's prefix cache cannot skip it
            prompt = f"{next(self._serial)} " + "word " * (arrival.prompt_tokens - 2)
        return job_repo.NewJob(
            tenant_id=self.tenants[arrival.tenant],
            tier=arrival.tier,
            model=self.settings.served_model_name,
            messages=None,
            prompt=prompt,
            params={"max_tokens": arrival.max_tokens, "temperature": 0.0, "ignore_eos": True},
        )

    async def _enqueue(self, arrival: Arrival, job: JobRecord, wall: float) -> None:
        self.jobs[job.id] = (arrival, wall)
        self.arrived_wall.append(wall)
        await enqueue(self.r, self.dispatcher.names, job.to_message())

    async def _sample(self) -> None:
        while True:
            now = time.monotonic()
            self.trace.samples.append((now, self.engine.active, len(self.arrived_wall)))
            await asyncio.sleep(SAMPLE_S)

    async def stop(self) -> None:
        """Stop the components, empty a shared engine, drop the run's keys, close."""
        self.dispatcher.request_stop()
        for task in self.tasks:
            task.cancel()
        for outcome in await asyncio.gather(*self.tasks, return_exceptions=True):
            if isinstance(outcome, Exception):
                print(f"warning: a component failed during the run: {outcome!r}", flush=True)
        if self.shared_engine is None:
            await self.engine.shutdown()
        else:  # the real engine serves the next run: empty it first
            for request_id in list(self.trace.called):
                await self.shared_engine.abort(request_id)
        keys = [k async for k in self.r.scan_iter(match=f"{self.settings.redis_prefix}:*")]
        if keys:
            await self.r.delete(*keys)
        await self.r.aclose()
        await self.store.close()
        await self.db.close()
