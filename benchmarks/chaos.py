"""`tierq bench chaos`: does an accepted job survive crashes, and how fast does work resume?

A seeded chaos run against real PostgreSQL (a scratch database, dropped at the end) and a
redis-server of the bench's own (no persistence, so that restarting it loses everything):
the very processes `tierq run` starts (launch.supervisor.components: API, dispatcher, worker,
Celery processes), each in its own session and supervised by this bench (restarted when
they exit), with extra workers beside the first. A steady mixed load of native jobs
(three tiers, small `max_tokens`, an Idempotency-Key per job, retried with the same key
after a connection error or a 5xx) runs for `duration` seconds, while a seeded schedule
(one fault every `fault_every` seconds, each kind once per round of six) SIGKILLs the API,
the dispatcher, a worker or a Celery process, cuts every Redis client connection
(`CLIENT KILL TYPE normal`), or restarts Redis empty; the workers' engines also
fail a fraction of requests (tierq/workers/engine/faulty_engine.py), including dying outright. A
sample
of jobs is followed over SSE as a browser would (reconnecting with Last-Event-ID).

Measured, from the client's answers and then the database:
- `accepted`: jobs the API answered 2xx; `succeeded`; `failed` by error code ("none" for
  a failure without one); `lost`: accepted jobs still unfinished when the run ends;
- `double_billed`: jobs with more than one usage record, or whose usage counts more
  tokens than the job itself reports (or than its max_tokens);
- `double_streamed`: followers that saw an event id twice, or (simulated engine, whose
  text is " tok1 tok2 ... tokN") a token twice in the concatenated deltas; `stream_gaps`:
  followers whose deltas miss part of the job's final text (no target, but worth a look);
- `max_recovery_s`: for each fault, the time to the first job finished after it; the max
  (`max_new_job_recovery_s`: to the first job admitted after the fault that finished).
A process that exits unbidden (a worker whose engine died, a crash) counts as a fault too.

Targets: lost = 0, double_billed = 0, double_streamed = 0, every failure with a code, and
max_recovery_s <= 15 on the simulated engine. The default engine is the SIMULATED one (a
cost model, not a model: no real tokens are generated) and the figures say so; `--engine
vllm` runs the real engine with the bundled model. Logs go to stderr; one JSON line is
printed last on stdout.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import logging
import random
import re
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import redis.asyncio as aioredis
from sqlalchemy import func, select

from benchmarks.harness import (
    RETRY_S,
    TERMINAL,
    Fault,
    RedisServer,
    ScratchPlatform,
    Supervisor,
    as_json,
    error_code,
    fault_env,
    fault_schedule,
    platform_children,
    retry_after,
    sse_events,
    wait_terminal,
)
from tierq.core.settings import Settings
from tierq.launch.supervisor import Child
from tierq.models.db import Database
from tierq.models.tables import Job, JobTransition, UsageRecord
from tierq.services.bootstrap import ensure_tenant_key

REDIS_PREFIX = "tierq-chaos"

log = logging.getLogger("tierq.bench.chaos")

FAULT_KINDS = (
    "kill_api",
    "kill_dispatcher",
    "kill_worker",
    "kill_celery",
    "client_kill",
    "redis_restart",
)
TIERS = ("interactive", "standard", "batch")
TIER_WEIGHTS = (3, 5, 2)
TENANTS = ("chaos-a", "chaos-b")
RECOVERY_TARGET_S = 15.0

SUBMIT_GRACE_S = 15.0  # a submission still unanswered at the load's end keeps retrying this long
TOKEN = re.compile(r" tok(\d+)")


@dataclass(frozen=True)
class ChaosConfig:
    duration_s: float = 60.0
    seed: int = 0
    engine: str = "simulated"
    rate: float = 8.0  # jobs submitted per second
    fault_every_s: float = 4.0
    workers: int = 2  # worker processes (each hosts an engine)
    engine_fault_rate: float = 0.02
    settle_s: float = 60.0  # after the load: how long accepted jobs may take to finish
    follow_every: int = 4  # every Nth job is followed over SSE
    max_num_seqs: int = 16
    max_tokens: tuple[int, int] = (8, 32)
    keep_logs: bool = False


@dataclass
class Followed:
    """What one SSE follower saw of one job."""

    job_id: str
    ids: list[int] = field(default_factory=list)
    text: str = ""
    terminal: str | None = None
    final_text: str | None = None
    connects: int = 0
    repeated_id: bool = False

    def saw(self, event: dict[str, str]) -> None:
        raw_id = event.get("id", "")
        if raw_id.isdigit():
            seq = int(raw_id)
            if self.last_id is not None and seq <= self.last_id:
                self.repeated_id = True
            self.ids.append(seq)
        kind = event.get("event", "message")
        data = as_json(event.get("data", ""))
        if kind == "delta":
            self.text += str(data.get("text", ""))
        elif kind in ("done", "error"):
            self.terminal = kind
            result = data.get("result") or {}
            self.final_text = result.get("text") if isinstance(result, dict) else None

    @property
    def last_id(self) -> int | None:
        return max(self.ids) if self.ids else None

    def repeated_token(self) -> bool:
        """The simulated engine streams " tok1 tok2 ... tokN": a number seen twice is a
        delta delivered twice."""
        numbers = TOKEN.findall(self.text)
        return len(numbers) != len(set(numbers))

    def gap(self, simulated: bool) -> bool:
        """A delta went missing: the deltas of a finished stream are not the job's whole
        text, or (simulated engine) not exactly " tok1 ... tokN"."""
        if self.doubled(simulated):
            return False
        finished = self.terminal == "done" and self.final_text is not None
        if finished and self.text != self.final_text:
            return True
        n = len(TOKEN.findall(self.text))
        return simulated and self.text != "".join(f" tok{k}" for k in range(1, n + 1))

    def doubled(self, simulated: bool) -> bool:
        return self.repeated_id or (simulated and self.repeated_token())

    def describe(self, simulated: bool) -> dict[str, Any]:
        """What a reader needs to see why this stream was counted as a problem."""
        return {
            "job_id": self.job_id,
            "doubled": self.doubled(simulated),
            "ids": _span(self.ids),
            "connects": self.connects,
            "text": self.text[:300],
            "final_text": None if self.final_text is None else self.final_text[:300],
        }


def _span(ids: list[int]) -> str:
    """A run of consecutive ids as "1..19", any other list as itself (40 ids at most)."""
    if ids and ids == list(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}..{ids[-1]}"
    return ",".join(map(str, ids[:40]))


@dataclass
class Accepted:
    index: int
    tier: str
    max_tokens: int


class Load:
    """The steady mixed load: one bounded submitter per job, and SSE followers."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        cfg: ChaosConfig,
        keys: list[str],
        submit_deadline: float,
        follow_deadline: float,
    ) -> None:
        self.client = client
        self.cfg = cfg
        self.keys = keys
        self.rng = random.Random(cfg.seed * 7 + 1)  # its own stream: faults do not shift it
        self.submit_deadline = submit_deadline  # monotonic
        self.follow_deadline = follow_deadline
        self.accepted: dict[str, Accepted] = {}
        self.refused: Counter[str] = Counter()
        self.unanswered = 0  # submissions never accepted before their deadline
        self.retries = 0
        self.followed: list[Followed] = []
        self.submitters: set[asyncio.Task[None]] = set()
        self.followers: set[asyncio.Task[None]] = set()

    async def run(self, duration_s: float) -> None:
        start = time.monotonic()
        for i in itertools.count():
            at = start + i / self.cfg.rate
            if at - start >= duration_s:
                return
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            tier = self.rng.choices(TIERS, TIER_WEIGHTS)[0]
            max_tokens = self.rng.randint(*self.cfg.max_tokens)
            key = self.keys[self.rng.randrange(len(self.keys))]
            task = asyncio.create_task(self._submit(i, tier, max_tokens, key))
            self.submitters.add(task)
            task.add_done_callback(self.submitters.discard)

    async def _submit(self, i: int, tier: str, max_tokens: int, key: str) -> None:
        body = {
            "tier": tier,
            "messages": [{"role": "user", "content": f"Chaos job {i}: count for me."}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        headers = {
            "Authorization": f"Bearer {key}",
            "Idempotency-Key": f"chaos-{self.cfg.seed}-{i}",
        }
        for attempt in itertools.count(1):
            if time.monotonic() > self.submit_deadline:
                self.unanswered += 1
                return
            if attempt > 1:
                self.retries += 1
            try:
                resp = await self.client.post("/v1/jobs", json=body, headers=headers)
            except httpx.HTTPError:
                await asyncio.sleep(RETRY_S)
                continue
            if resp.is_success:
                job_id = resp.json()["id"]
                self.accepted[job_id] = Accepted(i, tier, max_tokens)
                if i % self.cfg.follow_every == 0:
                    task = asyncio.create_task(self._follow(job_id, key))
                    self.followers.add(task)
                    task.add_done_callback(self.followers.discard)
                return
            if resp.status_code in (429, 503) or resp.status_code >= 500:
                await asyncio.sleep(retry_after(resp))
                continue
            self.refused[error_code(resp)] += 1  # a refusal is final: not retried
            return

    async def _follow(self, job_id: str, key: str) -> None:
        """Follow the job's events to its terminal one, as a browser's EventSource does:
        after any disconnect, connect again with Last-Event-ID."""
        seen = Followed(job_id)
        self.followed.append(seen)
        timeout = httpx.Timeout(10.0, connect=3.0, read=30.0)
        while seen.terminal is None and time.monotonic() < self.follow_deadline:
            headers = {"Authorization": f"Bearer {key}", "Accept": "text/event-stream"}
            if seen.last_id is not None:
                headers["Last-Event-ID"] = str(seen.last_id)
            seen.connects += 1
            with contextlib.suppress(httpx.HTTPError):  # a lost stream: reconnect below
                async with self.client.stream(
                    "GET", f"/v1/jobs/{job_id}/events", headers=headers, timeout=timeout
                ) as resp:
                    if resp.status_code == 200:
                        await _read_events(resp, seen)
                    else:
                        await resp.aread()
            if seen.terminal is None:
                await asyncio.sleep(RETRY_S)

    async def drain(self, tasks: set[asyncio.Task[None]], timeout_s: float) -> None:
        pending = set(tasks)
        if pending:
            _, still = await asyncio.wait(pending, timeout=max(0.1, timeout_s))
            for task in still:
                task.cancel()
            await asyncio.gather(*still, return_exceptions=True)


async def _read_events(resp: httpx.Response, seen: Followed) -> None:
    async for event in sse_events(resp):
        seen.saw(event)
        if seen.terminal is not None:
            return


# --- the fault schedule ------------------------------------------------------------------


async def _faults(
    cfg: ChaosConfig, sup: Supervisor, redis_server: RedisServer, faults: list[Fault]
) -> None:
    """One fault every `fault_every_s`: each kind once per round of six, in a seeded order
    (so a short run still meets every kind), on a seeded target."""

    async def act(kind: str, fault: Fault, rng: random.Random) -> None:
        if kind == "client_kill":
            fault.detail = f"{await redis_server.kill_clients()} connections"
        elif kind == "redis_restart":
            await redis_server.restart()
        else:
            prefix = {"kill_worker": "worker", "kill_celery": "celery"}.get(kind, kind[5:])
            targets = sup.names(prefix)
            fault.target = targets[rng.randrange(len(targets))] if targets else None
            if fault.target is not None:
                sup.kill(fault.target)

    await fault_schedule(FAULT_KINDS, cfg.seed, cfg.fault_every_s, cfg.duration_s, act, faults)


# --- the run --------------------------------------------------------------------------------


def _env(cfg: ChaosConfig, settings: Settings, admin_key: str) -> dict[str, str]:
    return fault_env(settings, admin_key, cfg.max_num_seqs)


def _children(
    cfg: ChaosConfig, p: ScratchPlatform, env: dict[str, str]
) -> tuple[list[Child], dict[str, dict[str, str]]]:
    """`tierq run`'s components, with the one worker made `cfg.workers` workers whose
    engines fail a seeded fraction of requests."""

    def worker_env(i: int, name: str) -> dict[str, str]:
        return {
            "WORKER_ID": f"chaos-{name}",
            "ENGINE_FAULT_RATE": str(cfg.engine_fault_rate),
            "ENGINE_FAULT_SEED": str(cfg.seed * 1000 + i),
            "ENGINE_FAULT_KINDS": "request,validation,random,dead",
        }

    return platform_children(p.settings, p.logs, env, cfg.workers, worker_env)


async def run_chaos(base: Settings, cfg: ChaosConfig) -> dict[str, Any]:
    """The whole run: start everything, load and faults, settle, measure, tear down."""
    wall_start = time.monotonic()
    tag = f"chaos_{cfg.seed}_{uuid.uuid4().hex[:8]}"
    async with ScratchPlatform(base, "chaos", cfg.engine, REDIS_PREFIX, tag, cfg.keep_logs) as p:
        keys = [await ensure_tenant_key(p.settings, name, None) for name in TENANTS]
        sup = p.start(*_children(cfg, p, _env(cfg, p.settings, p.admin_key)))
        await p.wait_ready()
        log.info(
            "ready in %.1f s; %.0f s of load at %.1f jobs/s, a fault every %.1f s (seed %d)",
            time.monotonic() - wall_start,
            cfg.duration_s,
            cfg.rate,
            cfg.fault_every_s,
            cfg.seed,
        )
        result = await _drive(cfg, p.url, keys, sup, p.redis, p.database())
        result["wall_s"] = round(time.monotonic() - wall_start, 1)
        p.completed = True
        return result


async def _drive(
    cfg: ChaosConfig,
    url: str,
    keys: list[str],
    sup: Supervisor,
    redis_server: RedisServer,
    db: Database,
) -> dict[str, Any]:
    faults: list[Fault] = []
    started = time.time()
    load_start = time.monotonic()
    load_end = load_start + cfg.duration_s
    settle_deadline = load_end + cfg.settle_s
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    timeout = httpx.Timeout(10.0, connect=3.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        load = Load(client, cfg, keys, load_end + SUBMIT_GRACE_S, settle_deadline)
        fault_task = asyncio.create_task(_faults(cfg, sup, redis_server, faults))
        try:
            await load.run(cfg.duration_s)
            await fault_task
            log.info(
                "load over: %d accepted, %d still submitting; settling",
                len(load.accepted),
                len(load.submitters),
            )
            await load.drain(load.submitters, load_end + SUBMIT_GRACE_S + 5 - time.monotonic())
            await wait_terminal(db, list(load.accepted), settle_deadline)
            leaked = await _leaked_entries(redis_server.url, time.monotonic() + 10)
            # Followers of finished jobs end within the API's recheck interval.
            await load.drain(load.followers, min(10.0, settle_deadline - time.monotonic() + 5))
        finally:
            fault_task.cancel()
            await asyncio.gather(fault_task, return_exceptions=True)
            for task in load.submitters | load.followers:
                task.cancel()
            await asyncio.gather(*load.submitters, *load.followers, return_exceptions=True)
    ended = time.time()
    result = await _figures(cfg, load, faults + sup.exits, sup, db, started, ended)
    result["leaked_entries"] = leaked
    result["targets_met"] = result["targets_met"] and leaked == 0
    return result


async def _leaked_entries(redis_url: str, deadline: float) -> int:
    """Once every job ended: entries still in a worker's inbox (each a slot held) plus
    entries pending in any consumer group. 0 when nothing leaked; polled until the
    deadline, since the last releases follow the last finishes by a moment."""
    r = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        while True:
            leaked = 0
            async for key in r.scan_iter(match=f"{REDIS_PREFIX}:*"):
                if await r.type(key) != "stream":
                    continue
                if ":inbox:" in key:
                    leaked += int(await r.xlen(key))
                    continue
                for group in await r.xinfo_groups(key):
                    leaked += int(group["pending"])
            if leaked == 0 or time.monotonic() > deadline:
                return leaked
            await asyncio.sleep(0.5)
    finally:
        await r.aclose()


async def _figures(
    cfg: ChaosConfig,
    load: Load,
    faults: list[Fault],
    sup: Supervisor,
    db: Database,
    started: float,
    ended: float,
) -> dict[str, Any]:
    async with db.session() as s:
        jobs = (
            await s.execute(
                select(
                    Job.id,
                    Job.status,
                    Job.error_code,
                    Job.created_at,
                    Job.finished_at,
                    Job.prompt_tokens,
                    Job.completion_tokens,
                )
            )
        ).all()
        usage = (
            await s.execute(
                select(
                    UsageRecord.job_id,
                    func.count(),
                    func.sum(UsageRecord.prompt_tokens),
                    func.sum(UsageRecord.completion_tokens),
                ).group_by(UsageRecord.job_id)
            )
        ).all()
        finishes = (
            await s.execute(
                select(JobTransition.job_id)
                .where(JobTransition.status.in_(["succeeded", "failed"]))
                .group_by(JobTransition.job_id)
                .having(func.count() > 1)
            )
        ).all()
    by_id = {row.id: row for row in jobs}
    accepted = load.accepted
    status: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    lost: list[str] = []
    for job_id in accepted:
        row = by_id.get(job_id)
        if row is None or row.status not in TERMINAL:
            lost.append(job_id)
            continue
        status[row.status] += 1
        if row.status == "failed":
            failed[row.error_code or "none"] += 1

    double_billed = set()
    for job_id, count, prompt, completion in usage:
        row = by_id.get(job_id)
        acc = accepted.get(job_id)
        if row is None:
            continue  # not possible: usage_records.job_id references jobs
        if (
            count > 1
            or (row.prompt_tokens is not None and prompt > row.prompt_tokens)
            or (row.completion_tokens is not None and completion > row.completion_tokens)
            or (acc is not None and completion > acc.max_tokens)
        ):
            double_billed.add(job_id)

    simulated = cfg.engine == "simulated"
    doubled = [f for f in load.followed if f.doubled(simulated)]
    unended = [f for f in load.followed if f.terminal is None]
    gaps = [f for f in load.followed if f.terminal is not None and f.gap(simulated)]

    problems = [f.describe(simulated) for f in load.followed if f in doubled or f in gaps]
    done = [row for row in jobs if row.finished_at is not None]
    finished = sorted(row.finished_at.timestamp() for row in done)
    # (created, finished) by creation: the first job admitted after a fault that finished
    # shows the whole path working again, not just work already under way finishing.
    admitted = sorted((row.created_at.timestamp(), row.finished_at.timestamp()) for row in done)
    fault_log: list[dict[str, Any]] = []
    by_kind: dict[str, float] = {}
    e2e_max: float | None = None
    unrecovered = 0
    for fault in sorted(faults, key=lambda f: f.at):
        i = bisect.bisect_right(finished, fault.at)
        recovered = i < len(finished)
        recovery = (finished[i] if recovered else ended) - fault.at
        unrecovered += not recovered
        kind = fault.kind if fault.kind != "exit" else f"exit_{fault.target}"
        by_kind[kind] = max(by_kind.get(kind, 0.0), recovery)
        later = admitted[bisect.bisect_right(admitted, (fault.at, float("inf"))) :]
        e2e = min((f for _, f in later), default=ended) - fault.at
        e2e_max = e2e if e2e_max is None else max(e2e_max, e2e)
        fault_log.append(
            {
                "t": round(fault.at - started, 1),
                "kind": fault.kind,
                "target": fault.target,
                "detail": fault.detail,
                "recovery_s": round(recovery, 2),
                "new_job_recovery_s": round(e2e, 2),
                "recovered": recovered,
            }
        )
    max_recovery = round(max(by_kind.values()), 2) if by_kind else None
    scheduled = Counter(f.kind for f in faults if f.kind != "exit")
    result: dict[str, Any] = {
        "engine": "simulated (cost model, not a real model)" if simulated else cfg.engine,
        "seed": cfg.seed,
        "duration_s": cfg.duration_s,
        "rate": cfg.rate,
        "fault_every_s": cfg.fault_every_s,
        "workers": cfg.workers,
        "engine_fault_rate": cfg.engine_fault_rate,
        "submitted": len(accepted) + load.unanswered + sum(load.refused.values()),
        "accepted": len(accepted),
        "accepted_by_tier": dict(sorted(Counter(a.tier for a in accepted.values()).items())),
        "never_accepted": load.unanswered,
        "refused": dict(load.refused),
        "client_retries": load.retries,
        "succeeded": status["succeeded"],
        "failed": dict(sorted(failed.items())),
        "cancelled": status["cancelled"],
        "lost": len(lost),
        "lost_ids": lost[:10],
        "double_billed": len(double_billed),
        "double_finished": len(finishes),
        "double_streamed": len(doubled),
        "followed": len(load.followed),
        "streams_unended": len(unended),
        "stream_gaps": len(gaps),
        "stream_problems": problems[:5],
        "max_recovery_s": max_recovery,
        "recovery_s_by_kind": {k: round(v, 2) for k, v in sorted(by_kind.items())},
        "max_new_job_recovery_s": None if e2e_max is None else round(e2e_max, 2),
        "unrecovered_faults": unrecovered,
        "faults": dict(sorted(scheduled.items())),
        "unplanned_exits": dict(sorted(sup.unplanned.items())),
        "restarts": dict(sorted(sup.restarts.items())),
        "fault_log": fault_log,
    }
    result["targets_met"] = (
        result["accepted"] > 0
        and not lost
        and not double_billed
        and not doubled
        and "none" not in failed
        and (not simulated or max_recovery is None or max_recovery <= RECOVERY_TARGET_S)
    )
    _print_table(result)
    return result


def _print_table(result: dict[str, Any]) -> None:
    rows = [
        ("engine", result["engine"]),
        ("accepted / succeeded", f"{result['accepted']} / {result['succeeded']}"),
        ("failed by code", result["failed"]),
        ("lost (target 0)", result["lost"]),
        ("double billed (target 0)", result["double_billed"]),
        ("double streamed (target 0)", f"{result['double_streamed']} of {result['followed']}"),
        ("max recovery s (target <= 15)", result["max_recovery_s"]),
        ("recovery s by kind", result["recovery_s_by_kind"]),
        ("max new-job recovery s", result["max_new_job_recovery_s"]),
        ("faults", result["faults"]),
        ("unplanned exits", result["unplanned_exits"]),
        ("targets met", result["targets_met"]),
    ]
    print("\n== tierq bench chaos", file=sys.stderr)
    for name, value in rows:
        print(f"  {name:32} {value}", file=sys.stderr)
    print(file=sys.stderr, flush=True)
