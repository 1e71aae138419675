"""`tierq bench chaos`, briefly: crashes and Redis restarts under load lose nothing.

Runs the real command as a subprocess (its own redis-server, a scratch PostgreSQL database,
the platform's processes on the simulated engine) and checks its JSON line.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.integration.bench_proc import run_bench

pytestmark = pytest.mark.integration

TIMEOUT_S = 300


def _run_chaos(*args: str) -> dict[str, Any]:
    return run_bench("chaos", *args, timeout_s=TIMEOUT_S)


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
