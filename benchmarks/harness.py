"""What the platform benchmarks (`tierq bench chaos`, `tierq bench isolation`) share: the
platform on scratch services, supervised, and the client's small helpers.

`ScratchPlatform` gives a run its own redis-server (no persistence, so that a restart
starts it empty) and a scratch PostgreSQL database (dropped at the end), settings that
point at them, and starts the very processes `tierq run` starts (launch.supervisor.components),
each in its own session, under a `Supervisor` that restarts any that exits. Leaving the
context kills every process group it started, whatever happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import random
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import redis.asyncio as aioredis
from httpx_sse import EventSource
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import create_async_engine

from benchmarks.ports import free_port
from tierq import migrations
from tierq.core.retry import Backoff
from tierq.core.settings import Settings
from tierq.launch.supervisor import Child, components
from tierq.launch.supervisor import Supervisor as PlatformSupervisor
from tierq.models.db import Database
from tierq.models.tables import Job

log = logging.getLogger("tierq.bench")

DEFAULT_PG_SERVER = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
READY_TIMEOUT_S = {"simulated": 120.0, "vllm": 900.0}
SUPERVISE_TICK_S = 0.2
QUICK_EXIT_S = 5.0  # an unplanned exit this soon after a start doubles the restart backoff
RETRY_S = 0.25  # between a client's retries (a 503's Retry-After is honoured, capped)
RETRY_AFTER_CAP_S = 2.0


@dataclass
class Fault:
    at: float  # wall clock (time.time()): compared with the database's finished_at
    kind: str
    target: str | None = None
    detail: str | None = None


async def fault_schedule(
    kinds: tuple[str, ...],
    seed: int,
    every_s: float,
    duration_s: float,
    act: Callable[[str, Fault, random.Random], Awaitable[None]],
    faults: list[Fault],
) -> None:
    """One fault every `every_s` for `duration_s`: each of `kinds` once per round, in a
    seeded order (so a short run still meets every kind); `act(kind, fault, rng)` does it
    (and may name its target and detail). A fault that could not be done is recorded so."""
    rng = random.Random(seed)
    deck: list[str] = []
    start = time.monotonic()
    for n in itertools.count(1):
        at = start + n * every_s
        if at - start >= duration_s:
            return
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        if not deck:
            deck = list(kinds)
            rng.shuffle(deck)
        kind = deck.pop()
        fault = Fault(time.time(), kind)
        try:
            await act(kind, fault, rng)
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

    async def kill_clients(self, kind: str = "normal") -> int:
        """CLIENT KILL TYPE `kind` (normal, pubsub) from a fresh admin connection (which it
        skips)."""
        async with aioredis.Redis(
            host="127.0.0.1", port=self.port, socket_connect_timeout=1, socket_timeout=2
        ) as r:
            return int(await r.execute_command("CLIENT", "KILL", "TYPE", kind))


class Supervisor(PlatformSupervisor):
    """The platform's own supervisor (tierq/launch/supervisor.py) with a bench's accounting.

    A child the bench killed is started again at once; any other exit (a worker whose
    engine died, a crash) is recorded as a fault of its own (`exits`) and the child
    started again after a backoff: half a second, doubling while it keeps exiting within
    QUICK_EXIT_S of its start. A worker's next life draws another (seeded) sequence of
    injected engine faults.
    """

    def __init__(self, children: list[Child], envs: dict[str, dict[str, str]]) -> None:
        super().__init__(
            children,
            envs,
            backoff=Backoff(0.5, 5.0, jitter=False),
            healthy_s=QUICK_EXIT_S,
            on_exit=self._exited,
            before_restart=_next_fault_seed,
        )
        self.exits: list[Fault] = []

    def _exited(self, c: Child) -> None:
        code = c.proc.returncode if c.proc is not None else None
        self.exits.append(Fault(time.time(), "exit", c.name, f"exit code {code}"))

    async def watch(self) -> None:
        while True:
            self.tick()
            await asyncio.sleep(SUPERVISE_TICK_S)


def _next_fault_seed(c: Child, env: dict[str, str]) -> None:
    """Another fault sequence for each life of a worker, still seeded."""
    if c.name.startswith("worker") and "ENGINE_FAULT_SEED" in env:
        env["ENGINE_FAULT_SEED"] = str(int(env["ENGINE_FAULT_SEED"]) + 7919)


# --- the client's side -----------------------------------------------------------------------


async def sse_events(resp: httpx.Response) -> AsyncIterator[dict[str, str]]:
    """The events of a Server-Sent Events response (httpx-sse's parser), each as
    {field: value}: `data` (a multi-line one joined with newlines), `event` where the
    event names one, and `id` where the event set one. httpx-sse keeps the last id for
    every later event, as the spec's lastEventId: an id equal to the previous event's is
    taken as not set (the platform numbers a job's events and never sends one number
    twice in a connection; an event without a number is a closed stream's error).
    Comments and keep-alives are skipped; an answer that is not an event stream (a
    refusal's JSON error) has no events."""
    if not is_event_stream(resp):
        return
    last_id = ""
    async for sse in EventSource(resp).aiter_sse():
        event = {"data": sse.data}
        if sse.event != "message":
            event["event"] = sse.event
        elif not sse.data:
            continue  # a keep-alive after an event with an id: nothing of the stream's
        if sse.id and sse.id != last_id:
            event["id"] = last_id = sse.id
        yield event


def is_event_stream(resp: httpx.Response) -> bool:
    return resp.headers.get("content-type", "").partition(";")[0].strip() == "text/event-stream"


def as_json(raw: str) -> dict[str, Any]:
    """A JSON object, or {} for anything else."""
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def retry_after(resp: httpx.Response) -> float:
    try:
        return min(RETRY_AFTER_CAP_S, max(RETRY_S, float(resp.headers.get("Retry-After", ""))))
    except ValueError:
        return RETRY_S


def error_code(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["code"] or resp.status_code)
    except (ValueError, KeyError, TypeError):
        return str(resp.status_code)


async def wait_ready(url: str, timeout_s: float, logs: Path) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url, timeout=2) as client:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get("/readyz?min_workers=1")).status_code == 200:
                    return
            await asyncio.sleep(0.5)
    raise RuntimeError(f"the platform was not ready in {timeout_s:.0f} s; see {logs}")


async def job_statuses(db: Database, ids: list[str]) -> dict[str, str]:
    async with db.session() as s:
        rows = (await s.execute(select(Job.id, Job.status).where(Job.id.in_(ids)))).all()
    return {job_id: status for job_id, status in rows}


async def wait_terminal(db: Database, ids: list[str], deadline: float) -> None:
    """Until every one of these jobs is finished, or the deadline (monotonic)."""
    while True:
        try:
            statuses = await job_statuses(db, ids)
            unfinished = [i for i in ids if statuses.get(i) not in TERMINAL]
        except OSError as exc:  # the database is not part of the chaos; say so and go on
            log.warning("reading job states failed: %s", exc)
            unfinished = ids
        if not unfinished or time.monotonic() > deadline:
            if unfinished:
                log.warning("%d accepted jobs still unfinished at the deadline", len(unfinished))
            return
        await asyncio.sleep(1.0)


# --- the platform ------------------------------------------------------------------------------


def postgres_server_url(base: Settings, bench: str) -> str:
    url = base.database_url or DEFAULT_PG_SERVER
    if not url.startswith("postgresql"):
        raise RuntimeError(
            f"tierq bench {bench} needs PostgreSQL (DATABASE_URL is {url.split(':', 1)[0]}...)"
        )
    return url


async def _admin_sql(server: str, sql: str) -> None:
    admin = create_async_engine(f"{server}/postgres", isolation_level="AUTOCOMMIT")
    try:
        async with admin.connect() as conn:
            await conn.execute(text(sql))
    finally:
        await admin.dispose()


async def scratch_database(base: Settings, workdir: Path, name: str) -> str:
    """A fresh database for one run: on the PostgreSQL server of DATABASE_URL if one is
    set (the platform's real setting), else a SQLite file."""
    url = base.database_url
    if not url or not url.startswith("postgresql"):
        return f"sqlite+aiosqlite:///{workdir / f'{name}.db'}"
    server = url.rsplit("/", 1)[0]
    await _admin_sql(server, f'CREATE DATABASE "tierq_bench_{name}"')
    return f"{server}/tierq_bench_{name}"


async def drop_scratch_database(url: str) -> None:
    if url.startswith("postgresql"):
        server, name = url.rsplit("/", 1)
        await _admin_sql(server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def base_env(settings: Settings, admin_key: str) -> dict[str, str]:
    """The environment of every process: this process's, pointed at the scratch services."""
    env = dict(os.environ)
    env.update(
        {
            "DATABASE_URL": settings.resolved_database_url,
            "REDIS_URL": settings.resolved_redis_url,
            "REDIS_PREFIX": settings.redis_prefix,
            "STATE_DIR": str(settings.state_dir),
            "API_HOST": settings.api_host,
            "API_PORT": str(settings.api_port),
            "ADMIN_API_KEY": admin_key,
            "ENGINE": settings.engine,
            "PIN_AUX_PROCESSES": "false",
            "EMBEDDED_DEFAULT": "false",
            "ENGINE_FAULT_RATE": "0",
        }
    )
    return env


def fault_env(settings: Settings, admin_key: str, max_num_seqs: int) -> dict[str, str]:
    """`base_env` with the timings of a run that faults its processes: a lost worker is
    noticed in 3 s, the reconciler looks every 2 s, a drain lasts 5 s at most."""
    env = base_env(settings, admin_key)
    env.update(
        {
            "MAX_NUM_SEQS": str(max_num_seqs),
            "HEARTBEAT_INTERVAL_S": "0.5",
            "WORKER_DEAD_AFTER_S": "3",
            "RECONCILE_INTERVAL_S": "2",
            "RECONCILE_GRACE_S": "2",
            "RECONCILE_ORPHAN_GRACE_S": "2",
            "DRAIN_TIMEOUT_S": "5",
        }
    )
    return env


def platform_children(
    settings: Settings,
    logs: Path,
    env: dict[str, str],
    workers: int,
    worker_env: Callable[[int, str], dict[str, str]],
) -> tuple[list[Child], dict[str, dict[str, str]]]:
    """`tierq run`'s components, with the one worker made `workers` workers (named
    worker-0, worker-1, ...; `worker_env(i, name)` adds to each one's environment)."""
    children: list[Child] = []
    envs: dict[str, dict[str, str]] = {}
    pids = settings.state_dir / "pids"
    for c in components(settings, logs):
        if c.name != "worker":
            children.append(c)
            envs[c.name] = dict(env)
            continue
        for i in range(workers):
            name = f"worker-{i}"
            children.append(
                dataclasses.replace(
                    c, name=name, log_path=logs / f"{name}.log", pid_path=pids / f"{name}.pid"
                )
            )
            envs[name] = {**env, **worker_env(i, name)}
    return children, envs


class ScratchPlatform:
    """`async with ScratchPlatform(...) as p:` a redis-server, a migrated scratch database
    and `p.settings` pointing at them; then `p.start(children, envs)` and
    `await p.wait_ready()`. Leaving kills everything, drops the database, and removes the
    state folder unless `keep_logs` is set or the run did not set `p.completed`."""

    def __init__(
        self, base: Settings, bench: str, engine: str, redis_prefix: str, tag: str, keep_logs: bool
    ) -> None:
        if engine not in ("simulated", "vllm"):
            raise ValueError("--engine is simulated or vllm")
        self.server_url = postgres_server_url(base, bench)
        self.base = base
        self.bench = bench
        self.engine = engine
        self.redis_prefix = redis_prefix
        self.tag = tag
        self.keep_logs = keep_logs
        self.admin_key = secrets.token_urlsafe(24)
        self.state = Path(tempfile.mkdtemp(prefix=f"tierq-{bench}-"))
        self.logs = self.state / "logs"
        self.redis = RedisServer(free_port(), self.logs / "redis.log")
        self.settings = base
        self.db_url: str | None = None
        self.sup: Supervisor | None = None
        self.completed = False
        self._db: Database | None = None
        self._watcher: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.settings.api_host}:{self.settings.api_port}"

    async def __aenter__(self) -> ScratchPlatform:
        main = asyncio.current_task()
        if main is not None:  # SIGTERM as Ctrl-C: through the exit that kills everything
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main.cancel)
        self.logs.mkdir()
        try:
            self.redis.start()
            await self.redis.wait_ready()
            self.db_url = await scratch_database(
                self.base.model_copy(update={"database_url": self.server_url}), self.state, self.tag
            )
            await asyncio.to_thread(migrations.upgrade, self.db_url)  # Alembic: its own loop
            self.settings = self.base.model_copy(
                update={
                    "database_url": self.db_url,
                    "redis_url": self.redis.url,
                    "redis_prefix": self.redis_prefix,
                    "state_dir": self.state,
                    "api_host": "127.0.0.1",
                    "api_port": free_port(),
                    "engine": self.engine,
                    "pin_aux_processes": False,
                    "embedded_default": False,
                }
            )
            if self.engine == "vllm" and not self.settings.model_path:
                from tierq.workers.engine.bundled_model import prepare_bundled_model

                await asyncio.to_thread(prepare_bundled_model, self.settings)
        except BaseException:
            await self._teardown()
            raise
        return self

    def start(self, children: list[Child], envs: dict[str, dict[str, str]]) -> Supervisor:
        self.sup = Supervisor(children, envs)
        self.sup.start_all()
        self._watcher = asyncio.create_task(self.sup.watch())
        return self.sup

    async def wait_ready(self) -> None:
        await wait_ready(self.url, READY_TIMEOUT_S[self.engine], self.logs)

    def database(self) -> Database:
        """The bench's own small pool on the scratch database (closed on leaving)."""
        assert self.db_url is not None
        if self._db is None:
            self._db = Database(self.db_url, pool_size=2, max_overflow=2)
        return self._db

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._teardown()

    async def _teardown(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        if self.sup is not None:
            self.sup.kill_all()
        self.redis.kill()
        if self._db is not None:
            await self._db.close()
        if self.db_url is not None:
            try:
                await drop_scratch_database(self.db_url)
            except Exception:
                log.exception("could not drop the scratch database %s", self.db_url)
        if self.keep_logs or not self.completed:
            log.warning("process logs kept in %s", self.logs)
        else:
            shutil.rmtree(self.state, ignore_errors=True)
