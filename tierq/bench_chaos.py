"""`tierq bench chaos`: does an accepted job survive crashes, and how fast does work resume?

A seeded chaos run against real PostgreSQL (a scratch database, dropped at the end) and a
redis-server of the bench's own (no persistence, so that restarting it loses everything):
the very processes `tierq run` starts (tierq.embedded.components: API, dispatcher, worker,
Celery processes), each in its own session and supervised by this bench (restarted when
they exit), with extra workers beside the first. A steady mixed load of native jobs
(three tiers, small `max_tokens`, an Idempotency-Key per job, retried with the same key
after a connection error or a 5xx) runs for `duration` seconds, while a seeded schedule
(one fault every `fault_every` seconds, each kind once per round of six) SIGKILLs the API,
the dispatcher, a worker or a Celery process, cuts every Redis client connection
(`CLIENT KILL TYPE normal`), or restarts Redis empty; the workers' engines also
fail a fraction of requests (workers/faulty_engine.py), including dying outright. A sample
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
import dataclasses
import itertools
import json
import logging
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis
from sqlalchemy import func, select

import migrations
from models.db import Database
from models.tables import Job, JobTransition, UsageRecord
from tierq.bench_qos import _drop_scratch_database, _scratch_database
from tierq.bootstrap import ensure_tenant_key
from tierq.embedded import Child, components
from tierq.settings import Settings

REDIS_PREFIX = "tierq-chaos"

log = logging.getLogger("tierq.bench.chaos")

DEFAULT_PG_SERVER = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
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
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
RECOVERY_TARGET_S = 15.0

SUBMIT_GRACE_S = 15.0  # a submission still unanswered at the load's end keeps retrying this long
RETRY_S = 0.25  # between a client's retries (a 503's Retry-After is honoured, capped)
RETRY_AFTER_CAP_S = 2.0
SUPERVISE_TICK_S = 0.2
QUICK_EXIT_S = 5.0  # an unplanned exit this soon after a start doubles the restart backoff
READY_TIMEOUT_S = {"simulated": 120.0, "vllm": 900.0}
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
class Fault:
    at: float  # wall clock (time.time()): compared with the database's finished_at
    kind: str
    target: str | None = None
    detail: str | None = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """The bench's own redis-server: no persistence, so a restart starts it empty."""

    def __init__(self, port: int, log_path: Path) -> None:
        self.port = port
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--save", "", "--appendonly", "no", "--daemonize", "no"]
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def kill(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            r = aioredis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=1)
            try:
                await r.ping()
                return
            except (aioredis.RedisError, OSError) as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start; see {self.log_path}") from exc
            finally:
                await r.aclose()
            await asyncio.sleep(0.05)

    async def restart(self) -> None:
        self.kill()
        self.start()
        await self.wait_ready()

    async def kill_clients(self) -> int:
        """CLIENT KILL TYPE normal from a fresh admin connection (which it skips)."""
        async with aioredis.Redis(
            host="127.0.0.1", port=self.port, socket_connect_timeout=1, socket_timeout=2
        ) as r:
            return int(await r.execute_command("CLIENT", "KILL", "TYPE", "normal"))


class Supervisor:
    """Starts every component, restarts any that exits, and kills process groups on demand.

    A child the fault schedule killed is restarted at once; any other exit (a worker whose
    engine died, a crash) is recorded as a fault of its own and restarted after a backoff
    that doubles while it keeps failing quickly.
    """

    def __init__(self, children: list[Child], envs: dict[str, dict[str, str]]) -> None:
        self.children = {c.name: c for c in children}
        self.envs = envs
        self.planned: set[str] = set()
        self.restarts: Counter[str] = Counter()
        self.unplanned: Counter[str] = Counter()
        self.exits: list[Fault] = []
        self._due: dict[str, float] = {}  # name -> when to start it again (monotonic)
        self._backoff: dict[str, float] = {}

    def names(self, prefix: str) -> list[str]:
        return [n for n in self.children if n == prefix or n.startswith(prefix + "-")]

    def start_all(self) -> None:
        for c in self.children.values():
            self._start(c)

    def _start(self, c: Child) -> None:
        c.start(self.envs[c.name])
        log.info("started %s (pid %s)", c.name, c.proc.pid if c.proc else "?")

    def kill(self, name: str) -> None:
        c = self.children[name]
        if c.proc is not None and c.proc.poll() is None:
            self.planned.add(name)
            c.signal_group(signal.SIGKILL)

    def tick(self) -> None:
        now = time.monotonic()
        for name, c in self.children.items():
            if c.proc is None or name in self._due or c.proc.poll() is None:
                continue
            _kill_group(c)  # whatever is left of its group (vLLM's engine core, say)
            if name in self.planned:
                self.planned.discard(name)
                self._due[name] = now
                continue
            self.unplanned[name] += 1
            self.exits.append(Fault(time.time(), "exit", name, f"exit code {c.proc.returncode}"))
            quick = now - c.started_at < QUICK_EXIT_S
            backoff = min(5.0, 2 * self._backoff.get(name, 0.25)) if quick else 0.5
            self._backoff[name] = backoff
            self._due[name] = now + backoff
            log.warning(
                "%s exited with %s (not killed by the bench); restarting in %.1f s; see %s",
                name,
                c.proc.returncode,
                backoff,
                c.log_path,
            )
        for name, due in list(self._due.items()):
            if now >= due:
                del self._due[name]
                c = self.children[name]
                c.restarts += 1
                self.restarts[name] += 1
                if name.startswith("worker"):
                    # Another fault sequence for each life of a worker, still seeded.
                    env = self.envs[name]
                    env["ENGINE_FAULT_SEED"] = str(int(env["ENGINE_FAULT_SEED"]) + 7919)
                self._start(c)
                log.info("restarted %s (restart %d)", name, c.restarts)

    async def watch(self) -> None:
        while True:
            self.tick()
            await asyncio.sleep(SUPERVISE_TICK_S)

    def stop_all(self) -> None:
        """SIGKILL every process group and reap it: nothing is left behind."""
        for c in self.children.values():
            c.signal_group(signal.SIGKILL)
        for c in self.children.values():
            if c.proc is not None:
                c.proc.wait()
                _kill_group(c)
            c.pid_path.unlink(missing_ok=True)


def _kill_group(c: Child) -> None:
    """SIGKILL what is left of an exited child's process group (Child.signal_group only
    signals a child that is still running)."""
    if c.proc is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(c.proc.pid, signal.SIGKILL)


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
        data = _json(event.get("data", ""))
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


def _json(raw: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


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
                await asyncio.sleep(_retry_after(resp))
                continue
            self.refused[_error_code(resp)] += 1  # a refusal is final: not retried
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
    event: dict[str, str] = {}
    async for line in resp.aiter_lines():
        line = line.rstrip("\r")
        if not line:
            if event:
                seen.saw(event)
                if seen.terminal is not None:
                    return
            event = {}
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        event[name] = event[name] + "\n" + value if name == "data" and name in event else value


def _retry_after(resp: httpx.Response) -> float:
    try:
        return min(RETRY_AFTER_CAP_S, max(RETRY_S, float(resp.headers.get("Retry-After", ""))))
    except ValueError:
        return RETRY_S


def _error_code(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["code"] or resp.status_code)
    except (ValueError, KeyError, TypeError):
        return str(resp.status_code)


# --- the fault schedule ------------------------------------------------------------------


async def _faults(
    cfg: ChaosConfig, sup: Supervisor, redis_server: RedisServer, faults: list[Fault]
) -> None:
    """One fault every `fault_every_s`: each kind once per round of six, in a seeded order
    (so a short run still meets every kind), on a seeded target."""
    rng = random.Random(cfg.seed)
    deck: list[str] = []
    start = time.monotonic()
    for n in itertools.count(1):
        at = start + n * cfg.fault_every_s
        if at - start >= cfg.duration_s:
            return
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        if not deck:
            deck = list(FAULT_KINDS)
            rng.shuffle(deck)
        kind = deck.pop()
        fault = Fault(time.time(), kind)
        try:
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
        except (aioredis.RedisError, OSError, RuntimeError) as exc:
            fault.detail = f"not done: {exc}"
            log.warning("fault %s could not be done: %s", kind, exc)
        faults.append(fault)
        log.info(
            "fault %d: %s%s%s",
            n,
            kind,
            f" {fault.target}" if fault.target else "",
            f" ({fault.detail})" if fault.detail else "",
        )


# --- the run --------------------------------------------------------------------------------


def _postgres_server_url(base: Settings) -> str:
    url = base.database_url or DEFAULT_PG_SERVER
    if not url.startswith("postgresql"):
        raise RuntimeError(
            f"tierq bench chaos needs PostgreSQL (DATABASE_URL is {url.split(':', 1)[0]}...)"
        )
    return url


def _env(cfg: ChaosConfig, settings: Settings, redis_url: str, admin_key: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "DATABASE_URL": settings.resolved_database_url,
            "REDIS_URL": redis_url,
            "REDIS_PREFIX": settings.redis_prefix,
            "STATE_DIR": str(settings.state_dir),
            "API_HOST": settings.api_host,
            "API_PORT": str(settings.api_port),
            "ADMIN_API_KEY": admin_key,
            "ENGINE": cfg.engine,
            "MAX_NUM_SEQS": str(cfg.max_num_seqs),
            "HEARTBEAT_INTERVAL_S": "0.5",
            "WORKER_DEAD_AFTER_S": "3",
            "RECONCILE_INTERVAL_S": "2",
            "RECONCILE_GRACE_S": "2",
            "RECONCILE_ORPHAN_GRACE_S": "2",
            "DRAIN_TIMEOUT_S": "5",
            "PIN_AUX_PROCESSES": "false",
            "EMBEDDED_DEFAULT": "false",
            "ENGINE_FAULT_RATE": "0",
        }
    )
    return env


def _children(
    cfg: ChaosConfig, settings: Settings, logs: Path, env: dict[str, str]
) -> tuple[list[Child], dict[str, dict[str, str]]]:
    """`tierq run`'s components, with the one worker made `cfg.workers` workers."""
    children: list[Child] = []
    envs: dict[str, dict[str, str]] = {}
    pids = settings.state_dir / "pids"
    for c in components(settings, logs):
        if c.name != "worker":
            children.append(c)
            envs[c.name] = dict(env)
            continue
        for i in range(cfg.workers):
            name = f"worker-{i}"
            children.append(
                dataclasses.replace(
                    c, name=name, log_path=logs / f"{name}.log", pid_path=pids / f"{name}.pid"
                )
            )
            envs[name] = {
                **env,
                "WORKER_ID": f"chaos-{name}",
                "ENGINE_FAULT_RATE": str(cfg.engine_fault_rate),
                "ENGINE_FAULT_SEED": str(cfg.seed * 1000 + i),
                "ENGINE_FAULT_KINDS": "request,validation,random,dead",
            }
    return children, envs


async def _wait_ready(url: str, timeout_s: float, logs: Path) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url, timeout=2) as client:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get("/readyz")).status_code == 200:
                    return
            await asyncio.sleep(0.5)
    raise RuntimeError(f"the platform was not ready in {timeout_s:.0f} s; see {logs}")


async def _statuses(db: Database, ids: list[str]) -> dict[str, str]:
    async with db.session() as s:
        rows = (await s.execute(select(Job.id, Job.status).where(Job.id.in_(ids)))).all()
    return {job_id: status for job_id, status in rows}


async def _wait_terminal(db: Database, ids: list[str], deadline: float) -> None:
    """Until every accepted job is finished, or the deadline (monotonic)."""
    while True:
        try:
            statuses = await _statuses(db, ids)
            unfinished = [i for i in ids if statuses.get(i) not in TERMINAL]
        except OSError as exc:  # the database is not part of the chaos; say so and go on
            log.warning("reading job states failed: %s", exc)
            unfinished = ids
        if not unfinished or time.monotonic() > deadline:
            if unfinished:
                log.warning("%d accepted jobs still unfinished at the deadline", len(unfinished))
            return
        await asyncio.sleep(1.0)


async def run_chaos(base: Settings, cfg: ChaosConfig) -> dict[str, Any]:
    """The whole run: start everything, load and faults, settle, measure, tear down."""
    if cfg.engine not in ("simulated", "vllm"):
        raise ValueError("--engine is simulated or vllm")
    wall_start = time.monotonic()
    server_url = _postgres_server_url(base)
    main = asyncio.current_task()
    if main is not None:  # SIGTERM as Ctrl-C: through the `finally` that kills everything
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main.cancel)
    state = Path(tempfile.mkdtemp(prefix="tierq-chaos-"))
    logs = state / "logs"
    logs.mkdir()
    redis_server = RedisServer(_free_port(), logs / "redis.log")
    db_url: str | None = None
    db: Database | None = None
    sup: Supervisor | None = None
    completed = False
    try:
        redis_server.start()
        await redis_server.wait_ready()
        tag = f"chaos_{cfg.seed}_{uuid.uuid4().hex[:8]}"
        db_url = await _scratch_database(
            base.model_copy(update={"database_url": server_url}), state, tag
        )
        await asyncio.to_thread(migrations.upgrade, db_url)  # Alembic runs its own loop
        settings = base.model_copy(
            update={
                "database_url": db_url,
                "redis_url": redis_server.url,
                "redis_prefix": REDIS_PREFIX,
                "state_dir": state,
                "api_host": "127.0.0.1",
                "api_port": _free_port(),
                "engine": cfg.engine,
                "pin_aux_processes": False,
                "embedded_default": False,
            }
        )
        keys = [await ensure_tenant_key(settings, name, None) for name in TENANTS]
        if cfg.engine == "vllm" and not settings.model_path:
            from tierq.bundled_model import prepare_bundled_model

            await asyncio.to_thread(prepare_bundled_model, settings)
        env = _env(cfg, settings, redis_server.url, secrets.token_urlsafe(24))
        children, envs = _children(cfg, settings, logs, env)
        sup = Supervisor(children, envs)
        sup.start_all()
        url = f"http://{settings.api_host}:{settings.api_port}"
        watcher = asyncio.create_task(sup.watch())
        try:
            await _wait_ready(url, READY_TIMEOUT_S[cfg.engine], logs)
            log.info(
                "ready in %.1f s; %.0f s of load at %.1f jobs/s, a fault every %.1f s (seed %d)",
                time.monotonic() - wall_start,
                cfg.duration_s,
                cfg.rate,
                cfg.fault_every_s,
                cfg.seed,
            )
            db = Database(db_url, pool_size=2, max_overflow=2)
            result = await _drive(cfg, url, keys, sup, redis_server, db)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        result["wall_s"] = round(time.monotonic() - wall_start, 1)
        completed = True
        return result
    finally:
        if sup is not None:
            sup.stop_all()
        redis_server.kill()
        if db is not None:
            await db.close()
        if db_url is not None:
            try:
                await _drop_scratch_database(db_url)
            except Exception:
                log.exception("could not drop the scratch database %s", db_url)
        if cfg.keep_logs or not completed:
            log.warning("process logs kept in %s", logs)
        else:
            shutil.rmtree(state, ignore_errors=True)


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
            await _wait_terminal(db, list(load.accepted), settle_deadline)
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
