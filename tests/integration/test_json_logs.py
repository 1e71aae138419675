"""LOG_FORMAT=json on the platform (tierq/core/logs.py): one JSON object a line, and the lines
logged where a job is handled — admission, the dispatcher's hand-off, the worker's run —
carry its job_id, tenant_id, tier and trace_id. In-process platform: real PostgreSQL and
Redis, the simulated engine."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.conftest import Platform
from tests.helpers import until, until_async
from tests.integration.test_tracing import JOB_BODY
from tests.integration.test_tracing import spans as spans  # the in-memory exporter
from tierq.core import logs

pytestmark = pytest.mark.integration

# Where a job is handled, and what each logs about it (admission and the hand-off at DEBUG).
PLACES = {
    "tierq.services.admission": "job admitted",
    "tierq.core.tracing": "handing job to w1",
    "tierq.workers.worker": "the engine generated",
}


@pytest.fixture
def json_lines() -> Iterator[io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.formatter("json"))
    handler.setLevel(logging.DEBUG)
    root = logging.getLogger()
    levels = {name: logging.getLogger(name).level for name in PLACES}
    root.addHandler(handler)
    for name in PLACES:
        logging.getLogger(name).setLevel(logging.DEBUG)
    yield out
    root.removeHandler(handler)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


async def _run_job(platform: Platform, key: str) -> str:
    auth = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=platform.url, timeout=30) as client:
        resp = await client.post("/v1/jobs", json=JOB_BODY, headers=auth)
        assert resp.status_code == 202, resp.text
        job_id = str(resp.json()["id"])

        async def succeeded() -> bool:
            job = (await client.get(f"/v1/jobs/{job_id}", headers=auth)).json()
            return bool(job["status"] == "succeeded")

        await until_async(succeeded, f"{job_id} succeeded", 20)
    return job_id


def _lines_of(out: io.StringIO, job_id: str) -> dict[str, dict[str, Any]]:
    """Every line is one JSON object; the job's lines, by the place that logged them."""
    found: dict[str, dict[str, Any]] = {}
    for text in out.getvalue().splitlines():
        entry = json.loads(text)
        assert {"ts", "level", "logger", "message"} <= set(entry)
        place = PLACES.get(entry["logger"])
        if place is not None and place in entry["message"] and entry.get("job_id") == job_id:
            found[entry["logger"]] = entry
    return found


async def test_json_lines_carry_the_job_and_its_trace(
    spans: InMemorySpanExporter, running: Platform, tenant_key: str, json_lines: io.StringIO
) -> None:
    job_id = await _run_job(running, tenant_key)
    deadline = time.monotonic() + 10
    while len(found := _lines_of(json_lines, job_id)) < len(PLACES):
        assert time.monotonic() < deadline, f"lines of {job_id}: {found}\n{json_lines.getvalue()}"
        await asyncio.sleep(0.05)
    # The run's span ends once the worker has settled the job, a moment after the job
    # reads succeeded: waited for, like the lines.

    def runs() -> list[Any]:
        return [
            s
            for s in spans.get_finished_spans()
            if s.name == "tierq.run" and (s.attributes or {}).get("tierq.job_id") == job_id
        ]

    await until(lambda: bool(runs()), "the run's span never ended", 10)
    (run,) = runs()
    attributes = run.attributes or {}
    for logger, entry in found.items():
        assert entry["job_id"] == job_id, logger
        assert entry["tenant_id"] == attributes["tierq.tenant_id"], logger
        assert entry["tier"] == "interactive", logger
        assert entry["trace_id"] == f"{run.context.trace_id:032x}", logger


async def test_json_lines_carry_the_job_without_tracing(
    running: Platform, tenant_key: str, json_lines: io.StringIO
) -> None:
    job_id = await _run_job(running, tenant_key)
    deadline = time.monotonic() + 10
    while len(found := _lines_of(json_lines, job_id)) < len(PLACES):
        assert time.monotonic() < deadline, f"lines of {job_id}: {found}"
        await asyncio.sleep(0.05)
    for logger, entry in found.items():
        assert entry["job_id"] == job_id and entry["tier"] == "interactive", logger
        assert entry["tenant_id"].startswith("ten_"), logger
        assert "trace_id" not in entry, logger
