"""`tierq bench soak`: a long mixed day of a fleet's work, with its everyday faults.

The processes `tierq run` starts (API, dispatcher, several workers, Celery), each in its
own session and supervised by the bench, on a scratch PostgreSQL database and a
redis-server of the bench's own, with the SIMULATED engine (a cost model, not a model:
no real tokens; the figures say so). For `duration` seconds, seeded, three tenants:
submit native jobs of three tiers (every `follow_every`th followed over SSE), submit long
jobs and cancel them after a moment, stream chats and hang up after the first tokens,
and upload small batches. Meanwhile, one fault every `fault_every` seconds, each kind
once per round in a seeded order: a worker restarted (SIGTERM: drained, handed back), a
worker killed (SIGKILL), every pub/sub connection dropped (`CLIENT KILL TYPE pubsub`:
the cancel and token channels), Redis restarted empty.

Measured, from the client's answers, the processes and then the database:
- `accepted`: jobs the API accepted, with every line of the accepted batches;
  `succeeded`; `failed_by_platform`: accepted jobs that failed (nothing in this load is
  the tenant's fault), by code in `failed`; `dead_lettered`: of those,
  `max_deliveries_exceeded`; `lost`: accepted jobs unfinished when the run ends;
- `cancel_latency_p99_s`: from a cancel's answer to the moment its run was billed (the
  worker stopped it); cancels of jobs still queued never ran and are not counted;
- `billed_tokens`: the ledger's tokens for these jobs; `served_tokens`: what they were
  served — for a succeeded job its prompt and the tokens of its result's text (the
  simulated engine writes " tok1 tok2 ... tokN"), for any other its recorded usage;
  `double_billed`: jobs with more than one usage record, or billed more than served;
- `api_p99_ms`: the client's latency of the API's answers (submissions, cancels, batch
  creation; not streams);
- `rss_growth_mb_per_h`: the steepest growth of any process's resident memory, a least-
  squares slope over its samples after the first fifth of the run, in MB an hour, of
  every process that lived through it (the API, the dispatcher, Celery's, and the first
  worker, which the faults never stop; a restarted worker is a new process whose whole
  life is warm-up); `rss_mb_per_h` per component.

Targets: failed_by_platform = 0, dead_lettered = 0, double_billed = 0, lost = 0, billed =
served, cancel p99 <= 2 s, memory growth <= 20 MB an hour (only meaningful over a long
run: a minute's slope is mostly warm-up). Logs go to stderr; one JSON line last on stdout.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import random
import re
import signal
import statistics
import sys
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil
from sqlalchemy import func, select

from benchmarks.harness import (
    RETRY_S,
    TERMINAL,
    Fault,
    RedisServer,
    ScratchPlatform,
    Supervisor,
    error_code,
    fault_env,
    fault_schedule,
    platform_children,
    retry_after,
    sse_events,
    wait_terminal,
)
from tierq.core.settings import Settings
from tierq.models.db import Database
from tierq.models.tables import Batch, Job, UsageRecord
from tierq.services.bootstrap import ensure_tenant_key

log = logging.getLogger("tierq.bench.soak")

REDIS_PREFIX = "tierq-soak"
FAULT_KINDS = ("sigterm_worker", "kill_worker", "pubsub_drop", "redis_restart")
TIERS = ("interactive", "standard", "batch")
TIER_WEIGHTS = (3, 5, 2)
TENANTS = ("soak-a", "soak-b", "soak-c")
TOKEN = re.compile(r" tok\d+")
# The figures the issue asks of a soak, first in its JSON line.
HEADLINE = (
    "accepted",
    "succeeded",
    "failed_by_platform",
    "dead_lettered",
    "cancel_latency_p99_s",
    "billed_tokens",
    "served_tokens",
    "double_billed",
    "api_p99_ms",
    "rss_growth_mb_per_h",
)
MODEL = "SmolLM2-135M-Instruct"
CANCEL_TARGET_S = 2.0
RSS_TARGET_MB_PER_H = 20.0
RSS_EVERY_S = 2.0
WARM_S = 30.0  # of a process's life, not counted in its memory's growth
SUBMIT_GRACE_S = 15.0


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 600.0
    seed: int = 0
    rate: float = 6.0  # submissions per second (jobs, cancels, hang-ups)
    workers: int = 3
    fault_every_s: float = 10.0
    cancel_every: int = 8  # every Nth submission is a long job, cancelled after a moment
    hangup_every: int = 10  # every Nth is a streamed chat whose client hangs up
    follow_every: int = 6  # every Nth plain job is followed over SSE
    batch_every_s: float = 15.0
    batch_lines: int = 20
    settle_s: float = 90.0
    max_num_seqs: int = 16
    keep_logs: bool = False
    fault_kinds: tuple[str, ...] = FAULT_KINDS  # a subset, to tell which one costs what


@dataclass
class Tracked:
    kind: str  # job, cancel, hangup
    max_tokens: int
    cancelled_at: float | None = None  # wall clock of the cancel's answer


@dataclass
class Load:
    client: httpx.AsyncClient
    cfg: SoakConfig
    keys: list[str]
    submit_deadline: float  # monotonic
    follow_deadline: float
    rng: random.Random = field(init=False)
    tracked: dict[str, Tracked] = field(default_factory=dict)
    batches: list[str] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)
    refused: Counter[str] = field(default_factory=Counter)
    unanswered: int = 0
    streams_unended: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.cfg.seed * 7 + 1)  # its own: faults do not shift it

    def spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def call(self, method: str, path: str, **kw: Any) -> httpx.Response | None:
        """One API call, retried after connection errors, 429, 503 and 5xx until the
        submission deadline; None if never answered otherwise."""
        while time.monotonic() < self.submit_deadline:
            sent = time.monotonic()
            try:
                resp = await self.client.request(method, path, **kw)
            except httpx.HTTPError:
                await asyncio.sleep(RETRY_S)
                continue
            self.latencies_ms.append((time.monotonic() - sent) * 1000)
            if resp.status_code in (429, 503) or resp.status_code >= 500:
                await asyncio.sleep(retry_after(resp))
                continue
            return resp
        self.unanswered += 1
        return None

    async def run(self, duration_s: float) -> None:
        start = time.monotonic()
        self.spawn(self._batches(start + duration_s))
        for i in itertools.count():
            at = start + i / self.cfg.rate
            if at - start >= duration_s:
                return
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            key = self.keys[self.rng.randrange(len(self.keys))]
            if i % self.cfg.hangup_every == self.cfg.hangup_every - 1:
                self.spawn(self._hangup(key))
            elif i % self.cfg.cancel_every == self.cfg.cancel_every - 1:
                self.spawn(self._job(i, key, "cancel", 400, self.rng.uniform(0.3, 3.0)))
            else:
                self.spawn(self._job(i, key, "job", self.rng.randint(8, 48), None))

    async def _job(
        self, i: int, key: str, kind: str, max_tokens: int, cancel_after: float | None
    ) -> None:
        tier = self.rng.choices(TIERS, TIER_WEIGHTS)[0]
        body = {
            "tier": tier,
            "messages": [{"role": "user", "content": f"Soak job {i}: count for me."}],
            "max_tokens": max_tokens,
        }
        headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": f"soak-{i}"}
        resp = await self.call("POST", "/v1/jobs", json=body, headers=headers)
        if resp is None:
            return
        if not resp.is_success:
            self.refused[error_code(resp)] += 1
            return
        job_id = resp.json()["id"]
        self.tracked[job_id] = Tracked(kind, max_tokens)
        if cancel_after is not None:
            await asyncio.sleep(cancel_after)
            auth = {"Authorization": f"Bearer {key}"}
            done = await self.call("POST", f"/v1/jobs/{job_id}/cancel", headers=auth)
            if done is not None and done.is_success and done.json()["status"] == "cancelled":
                self.tracked[job_id].cancelled_at = time.time()
        elif i % self.cfg.follow_every == 0:
            await self._follow(job_id, key)

    async def _follow(self, job_id: str, key: str) -> None:
        """Follow a job's events to its end, reconnecting with Last-Event-ID."""
        last: str | None = None
        while time.monotonic() < self.follow_deadline:
            headers = {"Authorization": f"Bearer {key}"}
            if last is not None:
                headers["Last-Event-ID"] = last
            with contextlib.suppress(httpx.HTTPError):
                async with self.client.stream(
                    "GET", f"/v1/jobs/{job_id}/events", headers=headers, timeout=30
                ) as resp:
                    async for event in sse_events(resp):
                        last = event.get("id", last)
                        if event.get("event") in ("done", "error"):
                            return
            await asyncio.sleep(RETRY_S)
        self.streams_unended += 1

    async def _hangup(self, key: str) -> None:
        """A streamed chat whose client goes away after its first tokens: the job ends
        cancelled, billed for what ran."""
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 300,
            "stream": True,
        }
        headers = {"Authorization": f"Bearer {key}"}
        with contextlib.suppress(httpx.HTTPError):
            async with self.client.stream(
                "POST", "/v1/chat/completions", json=body, headers=headers, timeout=30
            ) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    self.refused[error_code(resp)] += 1
                    return
                contents = 0
                async for event in sse_events(resp):
                    data = event.get("data", "")
                    if not data.startswith("{"):
                        continue
                    chunk = json.loads(data)
                    job_id = "job_" + chunk["id"].split("job_", 1)[1]
                    self.tracked.setdefault(job_id, Tracked("hangup", 300))
                    if any(c.get("delta", {}).get("content") for c in chunk["choices"]):
                        contents += 1
                    if contents >= 2:
                        return  # leaving the block closes the connection

    async def _batches(self, until: float) -> None:
        for n in itertools.count():
            if time.monotonic() >= until:
                return
            key = self.keys[n % len(self.keys)]
            lines = [
                {
                    "custom_id": f"soak-{n}-{k}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": MODEL,
                        "messages": [{"role": "user", "content": f"Batch {n} line {k}."}],
                        "max_tokens": 8,
                    },
                }
                for k in range(self.cfg.batch_lines)
            ]
            data = "".join(json.dumps(x) + "\n" for x in lines).encode()
            auth = {"Authorization": f"Bearer {key}"}
            up = await self.call(
                "POST",
                "/v1/files",
                files={"file": ("soak.jsonl", data)},
                data={"purpose": "batch"},
                headers=auth,
            )
            if up is not None and up.is_success:
                body = {
                    "input_file_id": up.json()["id"],
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                }
                made = await self.call("POST", "/v1/batches", json=body, headers=auth)
                if made is not None and made.is_success:
                    self.batches.append(made.json()["id"])
                elif made is not None:
                    self.refused[error_code(made)] += 1
            await asyncio.sleep(self.cfg.batch_every_s)


# --- faults and memory --------------------------------------------------------------------


async def _faults(
    cfg: SoakConfig, sup: Supervisor, redis_server: RedisServer, faults: list[Fault]
) -> None:
    async def act(kind: str, fault: Fault, rng: random.Random) -> None:
        if kind == "pubsub_drop":
            fault.detail = f"{await redis_server.kill_clients('pubsub')} connections"
        elif kind == "redis_restart":
            await redis_server.restart()
        else:
            # The first worker is never stopped (when there are others): its memory is
            # measured over the whole run, as every other process's is.
            workers = sup.names("worker")[1:] or sup.names("worker")
            fault.target = workers[rng.randrange(len(workers))]
            sig = signal.SIGTERM if kind == "sigterm_worker" else signal.SIGKILL
            sup.kill(fault.target, sig)

    await fault_schedule(cfg.fault_kinds, cfg.seed, cfg.fault_every_s, cfg.duration_s, act, faults)


async def _sample_memory(
    sup: Supervisor, samples: dict[tuple[str, int], list[tuple[float, float]]]
) -> None:
    """Every RSS_EVERY_S: each child's resident memory (with its process tree), by
    (component, pid)."""
    while True:
        for name, child in sup.children.items():
            if child.proc is None or child.proc.poll() is not None:
                continue
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(child.proc.pid)
                rss = root.memory_info().rss + sum(
                    p.memory_info().rss for p in root.children(recursive=True)
                )
                samples[(name, child.proc.pid)].append((time.monotonic(), rss / 2**20))
        await asyncio.sleep(RSS_EVERY_S)


def _slope_mb_per_h(points: list[tuple[float, float]]) -> float | None:
    if len(points) < 5 or points[-1][0] - points[0][0] < 30:
        return None
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var * 3600


# --- the run --------------------------------------------------------------------------------


async def run_soak(base: Settings, cfg: SoakConfig) -> dict[str, Any]:
    wall_start = time.monotonic()
    tag = f"soak_{cfg.seed}_{uuid.uuid4().hex[:8]}"
    async with ScratchPlatform(base, "soak", "simulated", REDIS_PREFIX, tag, cfg.keep_logs) as p:
        keys = [await ensure_tenant_key(p.settings, name, None) for name in TENANTS]
        env = {**fault_env(p.settings, p.admin_key, cfg.max_num_seqs), "BATCH_TICK_S": "1"}
        children = platform_children(
            p.settings, p.logs, env, cfg.workers, lambda i, name: {"WORKER_ID": f"soak-{name}"}
        )
        sup = p.start(*children)
        await p.wait_ready()
        log.info("ready in %.1f s; %.0f s of load", time.monotonic() - wall_start, cfg.duration_s)
        result = await _drive(cfg, p.url, keys, sup, p.redis, p.database())
        result["wall_s"] = round(time.monotonic() - wall_start, 1)
        p.completed = True
        return result


async def _drive(
    cfg: SoakConfig,
    url: str,
    keys: list[str],
    sup: Supervisor,
    redis_server: RedisServer,
    db: Database,
) -> dict[str, Any]:
    faults: list[Fault] = []
    memory: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    load_start = time.monotonic()
    load_end = load_start + cfg.duration_s
    settle_deadline = load_end + cfg.settle_s
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=10) as client:
        load = Load(client, cfg, keys, load_end + SUBMIT_GRACE_S, settle_deadline)
        background = [
            asyncio.create_task(_faults(cfg, sup, redis_server, faults)),
            asyncio.create_task(_sample_memory(sup, memory)),
        ]
        try:
            await load.run(cfg.duration_s)
            await background[0]
            log.info(
                "load over: %d jobs and %d batches accepted; settling",
                len(load.tracked),
                len(load.batches),
            )
            await _wait_batches(db, load.batches, settle_deadline)
            ids = list(load.tracked) + await _batch_jobs(db, load.batches)
            await wait_terminal(db, ids, settle_deadline)
            # The last hang-ups' and followers' connections end with their jobs.
            pending = set(load.tasks)
            if pending:
                await asyncio.wait(pending, timeout=max(1.0, settle_deadline - time.monotonic()))
        finally:
            for task in [*background, *load.tasks]:
                task.cancel()
            await asyncio.gather(*background, *load.tasks, return_exceptions=True)
    return await _figures(cfg, load, ids, faults, sup, memory, load_start, db)


async def _batch_jobs(db: Database, batches: list[str]) -> list[str]:
    if not batches:
        return []
    async with db.session() as s:
        rows = await s.execute(select(Job.id).where(Job.batch_id.in_(batches)))
        return [r for (r,) in rows]


async def _wait_batches(db: Database, batches: list[str], deadline: float) -> None:
    done = {"completed", "failed", "expired", "cancelled"}
    while time.monotonic() < deadline and batches:
        async with db.session() as s:
            statuses = (await s.execute(select(Batch.status).where(Batch.id.in_(batches)))).all()
        if all(status in done for (status,) in statuses):
            return
        await asyncio.sleep(1.0)


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


async def _figures(
    cfg: SoakConfig,
    load: Load,
    ids: list[str],
    faults: list[Fault],
    sup: Supervisor,
    memory: dict[tuple[str, int], list[tuple[float, float]]],
    load_start: float,
    db: Database,
) -> dict[str, Any]:
    async with db.session() as s:
        jobs = {
            row.id: row
            for row in (
                await s.execute(
                    select(
                        Job.id,
                        Job.status,
                        Job.error_code,
                        Job.prompt_tokens,
                        Job.completion_tokens,
                        Job.result_text,
                        Job.started_at,
                    ).where(Job.id.in_(ids))
                )
            ).all()
        }
        usage = {
            job_id: (n, prompt or 0, completion or 0, first)
            for job_id, n, prompt, completion, first in (
                await s.execute(
                    select(
                        UsageRecord.job_id,
                        func.count(),
                        func.sum(UsageRecord.prompt_tokens),
                        func.sum(UsageRecord.completion_tokens),
                        func.min(UsageRecord.created_at),
                    )
                    .where(UsageRecord.job_id.in_(ids))
                    .group_by(UsageRecord.job_id)
                )
            ).all()
        }
    status: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    lost = 0
    billed = served = 0
    double_billed: list[str] = []
    cancel_latencies: list[float] = []
    for job_id in ids:
        row = jobs.get(job_id)
        if row is None or row.status not in TERMINAL:
            lost += 1
            continue
        status[row.status] += 1
        if row.status == "failed":
            failed[row.error_code or "none"] += 1
        n, prompt, completion, billed_at = usage.get(job_id, (0, 0, 0, None))
        billed += prompt + completion
        if row.status == "succeeded":
            serves = (row.prompt_tokens or 0) + len(TOKEN.findall(row.result_text or ""))
        else:
            serves = (row.prompt_tokens or 0) + (row.completion_tokens or 0)
        served += serves
        if n > 1 or prompt + completion > serves:
            double_billed.append(job_id)
        tracked = load.tracked.get(job_id)
        if tracked is not None and tracked.cancelled_at is not None and billed_at is not None:
            cancel_latencies.append(max(0.0, billed_at.timestamp() - tracked.cancelled_at))
    warm = load_start + cfg.duration_s / 5
    slopes: dict[str, float] = {}
    for (name, _pid), points in memory.items():
        # A process's own first WARM_S (imports, pools, caches filling) are not growth;
        # nor is the short life of a restarted worker (born after the warm-up: its
        # minutes are its own warm-up, not a trend).
        born = points[0][0]
        counted = [p for p in points if p[0] >= max(warm, born + WARM_S)]
        slope = _slope_mb_per_h(counted) if born + WARM_S <= warm else None
        if slope is not None:
            # Its trace a minute apart: a curve that flattens is warm-up, a line is growth.
            minutes = {int((t - born) // 60): mb for t, mb in points}
            log.info(
                "memory of %s (pid %d): %.0f -> %.0f MB over %.0f s counted, %.1f MB/h; "
                "by minute: %s",
                name,
                _pid,
                counted[0][1],
                counted[-1][1],
                counted[-1][0] - counted[0][0],
                slope,
                " ".join(f"{mb:.1f}" for _, mb in sorted(minutes.items())),
            )
            component = name.split("-")[0]
            slopes[component] = max(slopes.get(component, slope), slope)
    cancel_p99 = _p99(cancel_latencies)
    api_p99 = _p99(load.latencies_ms)
    rss = max(slopes.values()) if slopes else None
    result: dict[str, Any] = {
        "accepted": len(ids),
        "succeeded": status["succeeded"],
        "failed_by_platform": sum(failed.values()),
        "dead_lettered": failed["max_deliveries_exceeded"],
        "cancel_latency_p99_s": None if cancel_p99 is None else round(cancel_p99, 3),
        "billed_tokens": billed,
        "served_tokens": served,
        "double_billed": len(double_billed),
        "api_p99_ms": None if api_p99 is None else round(api_p99, 1),
        "rss_growth_mb_per_h": None if rss is None else round(rss, 1),
        "engine": "simulated (cost model, not a real model)",
        "seed": cfg.seed,
        "duration_s": cfg.duration_s,
        "workers": cfg.workers,
        "lost": lost,
        "cancelled": status["cancelled"],
        "cancels_measured": len(cancel_latencies),
        "failed": dict(sorted(failed.items())),
        "by_kind": dict(sorted(Counter(t.kind for t in load.tracked.values()).items())),
        "batches": len(load.batches),
        "refused": dict(load.refused),
        "never_answered": load.unanswered,
        "streams_unended": load.streams_unended,
        "faults": dict(sorted(Counter(f.kind for f in faults).items())),
        "unplanned_exits": dict(sorted(sup.unplanned.items())),
        "rss_mb_per_h": {k: round(v, 1) for k, v in sorted(slopes.items())},
        "double_billed_ids": double_billed[:10],
    }
    result["targets_met"] = (
        result["accepted"] > 0
        and result["failed_by_platform"] == 0
        and result["dead_lettered"] == 0
        and result["double_billed"] == 0
        and lost == 0
        and billed == served
        and (cancel_p99 is None or cancel_p99 <= CANCEL_TARGET_S)
        and (rss is None or rss <= RSS_TARGET_MB_PER_H)
    )
    print("\n== tierq bench soak", file=sys.stderr)
    for name in (*HEADLINE, "lost", "faults", "targets_met"):
        print(f"  {name:24} {result[name]}", file=sys.stderr)
    return result
