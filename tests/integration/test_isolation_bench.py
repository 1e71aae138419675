"""`tierq bench isolation`, briefly: a noisy tenant within its allowance beside a quiet one
causes no server error and leaves no generated token unbilled.

Runs the benchmark in this process (its own redis-server, a scratch PostgreSQL database,
the platform's processes on the simulated engine, the noisy client in a process of its
own) for 20 s with fewer streams, and checks the figures it prints. Timing (the TTFT
ratio) is reported, not asserted: this machine's other work moves it.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from typer.testing import CliRunner

from benchmarks.isolation import IsolationConfig, run_isolation
from tests.conftest import PG_ADMIN_URL
from tierq.cli.main import app
from tierq.core.settings import Settings

pytestmark = pytest.mark.integration

TIMEOUT_S = 240  # past it the run is cancelled, which kills every process it started

FIELDS = (
    "engine",
    "duration_s",
    "interactive_ttft_p95_alone_s",
    "interactive_ttft_p95_neighbour_s",
    "interactive_ttft_p95_noise_s",
    "ttft_ratio",
    "ttft_ratio_neighbour",
    "ttft_ratio_vs_neighbour",
    "other_tenant_running_mean",
    "redis_peak_memory_mb",
    "redis_peak_clients",
    "db_pool_waits",
    "server_errors",
    "unbilled_tokens",
    "noisy",
    "bounds",
)


async def test_noise_causes_no_server_error_and_every_token_is_billed() -> None:
    cfg = IsolationConfig(duration_s=20.0, seed=1, streams=400)
    async with asyncio.timeout(TIMEOUT_S):
        result = await run_isolation(Settings(database_url=PG_ADMIN_URL), cfg)
    result = json.loads(json.dumps(result))  # what the command prints
    summary = json.dumps(result, indent=1)[:6000]
    assert all(name in result for name in FIELDS), summary
    assert result["engine"].startswith("simulated"), summary
    quiet, noisy, bounds = result["quiet_requests"], result["noisy"], result["bounds"]
    assert quiet["alone"] > 0 and quiet["neighbour"] > 0 and quiet["noise"] > 0, summary
    # The good neighbour's jobs ran, and were followed to their end over SSE.
    assert noisy["neighbour"].get("submitted", 0) > 0, summary
    assert noisy["neighbour"].get("followed to done", 0) > 0, summary
    assert result["other_tenant_running_mean"]["alone"] == 0, summary
    assert result["other_tenant_running_mean"]["neighbour"] > 0, summary
    assert noisy["streams_opened"] > 0 and noisy["jobs_accepted"] > 0, summary
    assert noisy["batches_created"] > 0 and noisy["files_uploaded"] > 0, summary
    # 12 uploads of 8 MiB against a 64 MiB quota: past it, refused with 413.
    assert any(code.startswith("413") for code in noisy["files_refused"]), summary
    assert bounds["max_streams_per_tenant"] and bounds["redis_max_connections"], summary
    assert result["jobs"]["noisy"]["unfinished"] == 0, summary  # all billed or cancelled
    assert result["jobs_that_generated"] > 0, summary
    assert result["server_errors"] == 0, summary
    assert result["unbilled_tokens"] == 0, summary


async def test_the_control_burns_the_noisy_clients_cpu_and_sends_no_noise() -> None:
    """`--control`'s second run: in the noise phase the other tenant stays a good
    neighbour, and a process of its niceness burns the share of a core it is given."""
    cfg = IsolationConfig(duration_s=20.0, seed=2, noise_cpu=0.4)
    async with asyncio.timeout(TIMEOUT_S):
        result = await run_isolation(Settings(database_url=PG_ADMIN_URL), cfg)
    summary = json.dumps(result, indent=1)[:6000]
    assert result["noise_cpu"] == 0.4, summary
    burnt = result["cpu_percent"]["noise"]["cpu burner (control)"]
    assert 25 <= burnt <= 55, summary  # 40 % of a core, give or take the sampling
    assert result["cpu_percent"]["neighbour"].get("cpu burner (control)", 0) <= 2, summary
    noisy = result["noisy"]
    assert noisy["streams_attempted"] == 0 and noisy["jobs_submitted"] == 0, summary
    assert noisy["batches_created"] == 0 and noisy["files_uploaded"] == 0, summary
    assert result["other_tenant_running_mean"]["noise"] > 0, summary  # still a neighbour
    assert result["quiet_requests"]["noise"] > 0, summary
    assert result["server_errors"] == 0 and result["unbilled_tokens"] == 0, summary


def test_the_command_is_registered() -> None:
    result = CliRunner().invoke(app, ["bench", "isolation", "--help"])
    assert result.exit_code == 0, result.output
    assert "--streams" in result.output and "--control" in result.output
