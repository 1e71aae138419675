"""A `tierq bench` command run as a real subprocess (its own services, the platform's
processes), its JSON line read from the last line of stdout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import PG_ADMIN_URL

ROOT = Path(__file__).resolve().parents[2]


def run_bench(command: str, *args: str, timeout_s: float = 300) -> dict[str, Any]:
    env = {**os.environ, "DATABASE_URL": PG_ADMIN_URL}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierq", "bench", command, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # SIGINT first: the bench then kills every process group it started.
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"bench {command} ran past {timeout_s} s:\n{err[-5000:]}")
    assert proc.returncode == 0, err[-5000:]
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines, err[-5000:]
    result: dict[str, Any] = json.loads(lines[-1])
    return result
