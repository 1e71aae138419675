"""End-to-end fixtures: `tierq run` as a real process tree with the real vLLM engine."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from benchmarks.ports import free_port, free_ports
from tests.conftest import PG_ADMIN_URL, REDIS_TEST_URL, pg_admin_sql
from tierq import migrations

READY_TIMEOUT_S = 420


@dataclass
class LivePlatform:
    url: str
    key: str
    state_dir: Path
    proc: subprocess.Popen[bytes]
    output: Path
    database_url: str | None
    redis_prefix: str = "tierq"
    metrics_port: int | None = None  # RUN_METRICS_PORT: the dispatcher's; +1 the worker's

    def pid_of(self, component: str) -> int:
        return int((self.state_dir / "pids" / f"{component}.pid").read_text())

    def processes(self) -> list[psutil.Process]:
        """The supervisor and everything it started (children run in their own sessions)."""
        pids = [self.proc.pid]
        for pid_file in (self.state_dir / "pids").glob("*.pid"):
            with contextlib.suppress(ValueError, OSError):
                pids.append(int(pid_file.read_text()))
        procs: list[psutil.Process] = []
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc = psutil.Process(pid)
                procs.append(proc)
                procs.extend(proc.children(recursive=True))
        return procs

    def stop(self, timeout: float = 60) -> list[psutil.Process]:
        """Ctrl-C, as a user would; returns the processes still alive afterwards."""
        before = self.processes()
        self.proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout)
        # Its children a moment more to go (a zombie counts as gone: its parent reaps it).
        _gone, alive = psutil.wait_procs(before, timeout=1)
        return [p for p in alive if _alive(p)]

    def kill_everything(self) -> None:
        for p in self.processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def start_platform(tmp: Path, env_extra: dict[str, str]) -> LivePlatform:
    port = int(env_extra.get("API_PORT") or free_port())
    state = tmp / "state"
    env = {
        **os.environ,
        "STATE_DIR": str(state),
        "API_PORT": str(port),
        "HEARTBEAT_INTERVAL_S": "0.5",
        "WORKER_DEAD_AFTER_S": "5",
        "RECONCILE_INTERVAL_S": "5",
        "MAX_NUM_SEQS": "16",
        **env_extra,
    }
    for name in ("DATABASE_URL", "REDIS_URL"):
        if name not in env_extra:
            env.pop(name, None)
    output = tmp / "tierq-run.out"
    with open(output, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tierq", "run"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    live = LivePlatform(
        url,
        "",
        state,
        proc,
        output,
        env_extra.get("DATABASE_URL"),
        env_extra.get("REDIS_PREFIX", "tierq"),
        int(env_extra["RUN_METRICS_PORT"]) if "RUN_METRICS_PORT" in env_extra else None,
    )
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"tierq run exited early:\n{output.read_text()[-4000:]}")
        if "tierq is ready" in output.read_text():
            break
        if time.monotonic() > deadline:
            live.kill_everything()
            logs = "".join(p.read_text()[-3000:] for p in (state / "logs").glob("*.log"))
            raise RuntimeError(f"tierq run not ready in {READY_TIMEOUT_S} s:\n{logs}")
        time.sleep(1)
    live.key = (state / "dev-api-key").read_text().strip()
    assert httpx.get(f"{url}/readyz?min_workers=1", timeout=5).status_code == 200
    return live


@contextlib.contextmanager
def pg_live(tmp: Path, env_extra: dict[str, str] | None = None) -> Iterator[LivePlatform]:
    """`tierq run` against the real PostgreSQL (a database of its own) and Redis (a prefix
    of its own); afterwards nothing it started may be left running."""
    name = f"tierq_e2e_{uuid.uuid4().hex[:8]}"
    asyncio.run(pg_admin_sql(f'CREATE DATABASE "{name}"'))
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    migrations.upgrade(url)
    # On shared services `tierq run` makes no tenant: the operator's first one, as the
    # docs say (docs/operators/running.md, `tierq create-tenant`), where start_platform reads its key.
    state = tmp / "state"
    state.mkdir(parents=True, exist_ok=True)
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "tierq",
            "create-tenant",
            "dev",
            "--key-file",
            str(state / "dev-api-key"),
        ],
        env={**os.environ, "DATABASE_URL": url, "STATE_DIR": str(state)},
        capture_output=True,
        text=True,
    )
    assert made.returncode == 0, made.stderr
    live = start_platform(
        tmp,
        {
            "DATABASE_URL": url,
            "REDIS_URL": REDIS_TEST_URL,
            "REDIS_PREFIX": f"tierq-e2e-{uuid.uuid4().hex[:8]}",
            **(env_extra or {}),
        },
    )
    try:
        yield live
    finally:
        left = live.stop()
        live.kill_everything()
        asyncio.run(pg_admin_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    assert left == [], f"processes left behind: {left}"


def metrics_ports() -> dict[str, str]:
    """RUN_METRICS_PORT's five ports and, after them, API_PORT: six that do not collide."""
    first = free_ports(6)
    return {"RUN_METRICS_PORT": str(first), "API_PORT": str(first + 5)}


# The admin API's key of `pg_platform` (with real service URLs, `tierq run` makes none).
PG_ADMIN_KEY = f"e2e-admin-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def pg_platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LivePlatform]:
    """`tierq run` against the real PostgreSQL and Redis, serving its metrics ports."""
    env = {**metrics_ports(), "ADMIN_API_KEY": PG_ADMIN_KEY}
    with pg_live(tmp_path_factory.mktemp("pg-platform"), env) as live:
        yield live


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
