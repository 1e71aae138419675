"""`tierq bench chaos`, briefly: crashes and Redis restarts under load lose nothing.

Runs the real command as a subprocess (its own redis-server, a scratch PostgreSQL database,
the platform's processes on the simulated engine) and checks its JSON line.
"""

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

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


def _run_chaos(*args: str) -> dict[str, Any]:
    env = {**os.environ, "DATABASE_URL": PG_ADMIN_URL}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "bench", "chaos", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # SIGINT first: the bench then kills every process group it started.
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"bench chaos ran past {TIMEOUT_S} s:\n{err[-5000:]}")
    assert proc.returncode == 0, err[-5000:]
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines, err[-5000:]
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def test_chaos_run_loses_nothing_and_doubles_nothing() -> None:
    # A fault every 3 s for 20 s: each of the six kinds once, in the seed's order.
    result = _run_chaos("--duration", "20", "--seed", "3", "--fault-every", "3")
    summary = json.dumps(result, indent=1)[:6000]
    assert result["engine"].startswith("simulated")
    assert sum(result["faults"].values()) == 6, summary
    assert result["accepted"] > 0, summary
    assert result["lost"] == 0, summary
    assert result["double_billed"] == 0, summary
    assert result["double_streamed"] == 0, summary
    assert result["stream_gaps"] == 0, summary  # a follower missed no delta, Redis restarts too
    assert result["leaked_entries"] == 0, summary  # no slot held, nothing left pending
    assert "none" not in result["failed"], summary  # every failure has a code
    assert result["max_recovery_s"] is not None and result["max_recovery_s"] <= 15, summary
