"""The overview's pure parts: percentiles, served shares from the dispatcher's saved
window, and `tierq top`'s frame drawn from a hand-built overview."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from tierq.cli.top import render
from tierq.services.overview import percentiles, served_shares


def test_percentiles_by_nearest_rank() -> None:
    values = [float(v) for v in range(100, 0, -1)]  # 1..100, unsorted
    assert percentiles(values) == {"samples": 100, "p50": 50.0, "p95": 95.0, "p99": 99.0}
    assert percentiles([0.2]) == {"samples": 1, "p50": 0.2, "p95": 0.2, "p99": 0.2}
    assert percentiles([]) == {"samples": 0, "p50": None, "p95": None, "p99": None}


def test_served_shares_count_only_the_window() -> None:
    state = {
        "window": [
            [1000, "interactive", 100.0],
            [1050, "standard", 300.0],
            [1055, "batch", 100.0],
            [1056, "batch", -20.0],  # a correction: the estimate was too high
            [900, "standard", 5000.0],  # past the window
        ]
    }
    tokens, shares = served_shares(state, now=1060.0, window_s=60.0)
    assert tokens == {"interactive": 100.0, "standard": 300.0, "batch": 80.0}
    assert shares == {"interactive": 0.2083, "standard": 0.625, "batch": 0.1667}
    assert served_shares(None, 1060.0, 60.0)[1] == {
        "interactive": None,
        "standard": None,
        "batch": None,
    }


def _overview() -> dict[str, Any]:
    none = {"samples": 0, "p50": None, "p95": None, "p99": None}
    return {
        "at": 1_700_000_000.0,
        "dispatcher_leader": "host-1",
        "tiers": [
            {
                "tier": "standard",
                "queued": 40,
                "running": 8,
                "oldest_wait_s": 12.5,
                "wait_s": {"samples": 3, "p50": 0.5, "p95": 1.5, "p99": 2.0},
                "ttft_s": none,
                "served_tokens": 10.0,
                "share": 0.05,
                "min_share": 0.2,
                "slo_s": 300.0,
            }
        ],
        "workers": [
            {
                "id": "w-dead",
                "capacity": 8,
                "running": 2,
                "inbox": 2,
                "load": 0.25,
                "reserve": 0,
                "heartbeat_age_s": 30.0,
                "alive": False,
                "draining": False,
                "engine_ok": True,
            }
        ],
        "tenants": {"total": 3, "data": [{"status": "suspended"}]},
        "batches": [
            {
                "id": "batch_1",
                "tenant_id": "ten_1",
                "status": "in_progress",
                "total": 10,
                "completed": 4,
                "failed": 1,
                "progress": 0.5,
                "lines_per_s": 1.0,
                "eta_s": 5.0,
            }
        ],
        "failures": {"last_hour_by_code": {"engine_error": 2}, "latest": []},
    }


def test_top_draws_one_frame() -> None:
    console = Console(record=True, width=180, file=io.StringIO())
    console.print(render(_overview()))
    text = console.export_text()
    assert "standard" in text and "40" in text and "5.0% (min 20.0%)" in text
    assert "500 ms / 1.50 s / 2.00 s (3)" in text and "no samples" in text
    assert "w-dead" in text and "dead" in text and "host-1" in text
    assert "batch_1" in text and "5/10" in text and "5.00 s" in text
    assert "engine_error: 2" in text and "tenants: 3 (1 suspended" in text
