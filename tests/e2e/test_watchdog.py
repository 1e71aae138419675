"""The per-job watchdog on the real engine: a run the engine goes silent on is aborted in
vLLM and handed back once, at no charge, and finishes.

`tierq run` with the real vLLM engine and the bundled model, on PostgreSQL and Redis, with
the fault injector's `stall` (ENGINE_FAULT_KINDS=stall, every request): after a few chunks
the worker receives nothing more of a request while vLLM goes on generating it, as when the
engine loses track of one. JOB_STALL_S=3 and MAX_DELIVERIES=1: a hand-back counted as a
failed delivery would dead-letter the job. Each request stalls once, so the next delivery
resumes after the tokens it has and finishes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from tests.e2e.conftest import LivePlatform, metrics_ports, pg_live
from tests.helpers import client, read_sse, wait_for
from tierq.models.db import Database

pytestmark = pytest.mark.e2e

STALL_S = 3
# Long enough that vLLM is still generating a silenced request when the watchdog aborts it.
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def stalling(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LivePlatform]:
    env = {
        **metrics_ports(),
        "ENGINE_FAULT_RATE": "1",
        "ENGINE_FAULT_KINDS": "stall",
        "JOB_STALL_S": str(STALL_S),
        "MAX_DELIVERIES": "1",
    }
    with pg_live(tmp_path_factory.mktemp("stalling"), env) as live:
        yield live


async def _worker_metrics(live: LivePlatform) -> dict[str, float]:
    """The worker's series (its metrics port: RUN_METRICS_PORT + 1), by name and labels."""
    assert live.metrics_port is not None
    async with httpx.AsyncClient(timeout=10) as h:
        body = (await h.get(f"http://127.0.0.1:{live.metrics_port + 1}/metrics")).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}"] = sample.value
    return values


def _total(values: dict[str, float], prefix: str, *labels: str) -> float:
    return sum(v for k, v in values.items() if k.startswith(prefix) and all(x in k for x in labels))


async def test_a_run_the_real_engine_goes_silent_on_is_aborted_handed_back_once_and_finishes(
    stalling: LivePlatform,
) -> None:
    before = await _worker_metrics(stalling)
    n = 3
    async with client(stalling.url, stalling.key, timeout=300) as c:
        ids = []
        for i in range(n):
            body = {
                "messages": [{"role": "user", "content": f"Tell story number {i} about a fox."}],
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            }
            resp = await c.post("/v1/jobs", json=body)
            assert resp.status_code in (200, 201, 202), resp.text
            ids.append(resp.json()["id"])
        streams = [asyncio.create_task(read_sse(c, f"/v1/jobs/{i}/events")) for i in ids]
        done = [await wait_for(c, i, timeout=240) for i in ids]
        events = [await s for s in streams]
    assert [d["status"] for d in done] == ["succeeded"] * n, done
    for job, stream in zip(done, events, strict=True):
        # The whole output, once, in order, across the hand-back.
        assert job["usage"]["completion_tokens"] == MAX_TOKENS
        assert "".join(e["data"]["text"] for e in stream[:-1]) == job["result"]["text"]
        assert [int(e["id"]) for e in stream] == list(range(1, len(stream) + 1))

    assert stalling.database_url is not None
    db = Database(stalling.database_url)
    try:
        async with db.session() as s:
            for job_id in ids:
                row = (
                    await s.execute(
                        text("SELECT deliveries, fault_charge FROM jobs WHERE id = :id"),
                        {"id": job_id},
                    )
                ).one()
                assert tuple(row) == (2, 0), (job_id, tuple(row))
                history = (
                    await s.execute(
                        text("SELECT status FROM job_transitions WHERE job_id = :id ORDER BY id"),
                        {"id": job_id},
                    )
                ).scalars()
                assert list(history) == ["queued", "running", "queued", "running", "succeeded"]
                billed = (
                    await s.execute(
                        text("SELECT count(*) FROM usage_records WHERE job_id = :id"),
                        {"id": job_id},
                    )
                ).scalar_one()
                assert billed == 1
    finally:
        await db.close()

    after = await _worker_metrics(stalling)
    stalls = _total(after, "tierq_job_stalls_total") - _total(before, "tierq_job_stalls_total")
    assert stalls == n
    # Each silent request was aborted inside vLLM, not left to run to its end there: had
    # it run on, vLLM would have generated MAX_TOKENS for it and again what the next run
    # resumed (all but the few tokens the worker had received), nearly twice MAX_TOKENS a
    # job; aborted STALL_S after it went silent, well under one and a half times.
    generated = _total(after, "vllm:generation_tokens_total")
    generated -= _total(before, "vllm:generation_tokens_total")
    assert n * MAX_TOKENS <= generated < n * MAX_TOKENS * 1.5, generated
    log = (stalling.state_dir / "logs" / "worker.log").read_text()
    for job_id in ids:
        assert f"job {job_id}: no output from the engine for {STALL_S} s" in log
