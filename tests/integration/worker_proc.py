"""`tierq worker` as a real process on the simulated engine (the engine is not the
subject), against a test platform's database and Redis: for tests that stop, kill and
restart workers with real signals."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.conftest import Platform

ROOT = Path(__file__).resolve().parents[2]


class WorkerProcess:
    """`tierq worker` on the simulated engine, against the test's database and Redis."""

    def __init__(
        self,
        platform: Platform,
        worker_id: str,
        log: Path,
        extra_env: dict[str, str] | None = None,
        args: tuple[str, ...] = (),
    ) -> None:
        s = platform.settings
        env = {
            **os.environ,
            "DATABASE_URL": s.resolved_database_url,
            "REDIS_URL": s.redis_url or "",
            "REDIS_PREFIX": s.redis_prefix,
            "ENGINE": "simulated",
            "WORKER_ID": worker_id,
            "HEARTBEAT_INTERVAL_S": "0.2",
            "DRAIN_TIMEOUT_S": "0.5",
            "MAX_NUM_SEQS": "8",
            "MAX_DELIVERIES": str(s.max_deliveries),
            "PIN_AUX_PROCESSES": "false",
            "STATE_DIR": str(s.state_dir),
            **(extra_env or {}),
        }
        self.worker_id = worker_id
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tierq", "worker", *args],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    async def exited(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"worker {self.worker_id} still running; see {self.log}")
            await asyncio.sleep(0.05)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL its process group and whatever it started in groups of their own."""
        if self.proc.poll() is None:
            descendants = psutil.Process(self.proc.pid).children(recursive=True)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            for child in descendants:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()


async def registered(platform: Platform, worker_id: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not await platform.r.hexists(platform.dispatcher.names.workers, worker_id):
        if time.monotonic() > deadline:
            raise AssertionError(f"worker {worker_id} never sent a heartbeat")
        await asyncio.sleep(0.05)
