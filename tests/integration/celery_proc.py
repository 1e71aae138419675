"""A real Celery worker (with beat) as a subprocess, configured like the test's platform."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tierq.core.settings import Settings
from tierq.workers.celery_flags import QUIET_WORKER_FLAGS


def child_env(settings: Settings, **extra: str) -> dict[str, str]:
    """The environment of a process a test starts (Celery, a dispatcher): this one's,
    pointed at the test platform's database, Redis, prefix and state folder."""
    return {
        **os.environ,
        "DATABASE_URL": settings.resolved_database_url,
        "REDIS_URL": settings.resolved_redis_url,
        "REDIS_PREFIX": settings.redis_prefix,
        "STATE_DIR": str(settings.state_dir),
        **extra,
    }


class CeleryWorker:
    def __init__(
        self, settings: Settings, pool: str = "solo", name: str = "celery", **env: str
    ) -> None:
        """`pool`: Celery's `--pool`; `prefork` runs tasks in two child processes. `name`
        tells two workers of one test apart (their logs, their beat's schedule file)."""
        self.settings = settings
        self.pool = pool
        self.name = name
        # BEAT_LEASE_S: a worker started after another one was killed (its beat holding the
        # lease) takes the beat over within 3 s (tierq/workers/beat.py).
        defaults = {
            "RECONCILE_GRACE_S": "2",
            "RECONCILE_INTERVAL_S": "2",
            "BATCH_TICK_S": "0.5",
            "BEAT_LEASE_S": "3",
        }
        self.env = child_env(settings, **{**defaults, **env})
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = Path(settings.state_dir) / f"{name}.log"

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "tierq.workers.celery_app",
                    "worker",
                    *QUIET_WORKER_FLAGS,
                    "-B",
                    f"--pool={self.pool}",
                    *(["--concurrency=2"] if self.pool == "prefork" else []),
                    "--loglevel=INFO",
                    f"--hostname={self.name}@%h",
                    "-s",
                    str(Path(self.settings.state_dir) / f"{self.name}-beat-schedule"),
                ],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def kill(self) -> None:
        """SIGKILL, as a crash or an OOM kill would: no clean shutdown, tasks unacknowledged."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def output(self) -> str:
        return self.log.read_text()[-5000:] if self.log.exists() else ""
