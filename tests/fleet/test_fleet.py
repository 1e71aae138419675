"""tierq as a fleet (tests/fleet/conftest.py): nine hosts, nothing shared on disk. Files
cross hosts through the object store; jobs through the balancer reach both replicas; a
worker host cut off mid-run hands its jobs to the other and its late results are fenced;
the Redis primary fails over to its replica mid-run; nothing accepted is lost or billed
twice."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from sqlalchemy import text

from tests.fleet.conftest import Fleet
from tests.helpers import admit_retrying, wait_for
from tierq.models.db import Database

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"


def _client(fleet: Fleet, host: str, timeout: float = 30) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=fleet.url(host),
        headers={"Authorization": f"Bearer {fleet.key}"},
        timeout=timeout,
    )


def _job(max_tokens: int = 8) -> dict[str, Any]:
    return {
        "tier": "standard",
        "messages": [{"role": "user", "content": "Tell me about fleets."}],
        "max_tokens": max_tokens,
    }


async def _admit(c: httpx.AsyncClient, body: dict[str, Any], key: str, seconds: float = 60) -> str:
    """Admit a job, retrying while the fleet (or the balancer, 502) refuses for a moment."""
    return await admit_retrying(c, body, key, time.monotonic() + seconds, passing=(502, 503))


async def _query(fleet: Fleet, sql: str) -> dict[str, Any]:
    """`SELECT key, value ...` on the services host's PostgreSQL, as a dict."""
    db = Database(fleet.database_url)
    try:
        async with db.session() as s:
            return {str(k): v for k, v in (await s.execute(text(sql))).all()}
    finally:
        await db.close()


async def _billed(fleet: Fleet) -> dict[str, Any]:
    """Usage records per job."""
    return await _query(fleet, "SELECT job_id, count(*) FROM usage_records GROUP BY 1")


async def _workers(fleet: Fleet) -> dict[str, Any]:
    """The worker each job ran on (last)."""
    return await _query(fleet, "SELECT id, worker_id FROM jobs")


async def _served_by_replica(fleet: Fleet) -> dict[str, int]:
    """Requests HAProxy sent to each API replica (its stats page, as CSV)."""
    async with httpx.AsyncClient(timeout=5) as h:
        got = await h.get(f"http://{fleet.host('lb').address}:8404/stats;csv")
    head, *rows = got.text.lstrip("# ").splitlines()
    names = head.split(",")
    served = {}
    for row in rows:
        values = dict(zip(names, row.split(","), strict=False))
        if values.get("pxname") == "apis" and values.get("svname", "").startswith("api"):
            served[values["svname"]] = int(values.get("stot") or 0)
    return served


async def test_a_batch_crosses_hosts_and_jobs_reach_both_replicas(fleet: Fleet) -> None:
    """Uploaded through api1, validated and expanded on the Celery host, its output read
    through api2; jobs through the balancer all succeed, served by both replicas."""
    lines = [
        json.dumps(
            {
                "custom_id": f"l{i}",
                "method": "POST",
                "url": CHAT,
                "body": {
                    "model": "SmolLM2-135M-Instruct",
                    "messages": [{"role": "user", "content": f"hi {i}"}],
                    "max_tokens": 4,
                },
            }
        )
        for i in range(30)
    ]
    first = AsyncOpenAI(base_url=f"{fleet.url('api1')}/v1", api_key=fleet.key, max_retries=0)
    second = AsyncOpenAI(base_url=f"{fleet.url('api2')}/v1", api_key=fleet.key, max_retries=0)
    upload = await first.files.create(
        file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch"
    )
    batch = await first.batches.create(
        input_file_id=upload.id, endpoint=CHAT, completion_window="24h"
    )
    deadline = time.monotonic() + 120
    while (batch := await second.batches.retrieve(batch.id)).status not in (
        "completed",
        "failed",
        "expired",
        "cancelled",
    ):
        assert time.monotonic() < deadline, f"batch still {batch.status}:\n{fleet.logs()}"
        await asyncio.sleep(0.5)
    assert batch.status == "completed" and batch.output_file_id, batch
    output = (await second.files.content(batch.output_file_id)).text.splitlines()
    assert sorted(json.loads(row)["custom_id"] for row in output) == sorted(
        f"l{i}" for i in range(30)
    )
    for name in ("api1", "api2", "celery"):  # nothing of it on any host's disk
        assert not (fleet.host(name).folder / "state" / "files").exists(), name

    async with _client(fleet, "lb") as c:
        ids = await asyncio.gather(*(_admit(c, _job(), f"lb-{i}") for i in range(20)))
        done = await asyncio.gather(*(wait_for(c, j, timeout=60) for j in ids))
    assert {j["status"] for j in done} == {"succeeded"}
    ran_on = await _workers(fleet)
    assert {ran_on[j] for j in ids} == {"w1", "w2"}  # both worker hosts took work
    served = await _served_by_replica(fleet)
    assert served.get("api1", 0) > 0 and served.get("api2", 0) > 0, served
    for name in ("api1", "api2", "celery"):  # no model here: the fleet's tokenizer, fetched
        fetched = fleet.host(name).folder / "state" / "fleet-models" / "SmolLM2-135M-Instruct"
        assert list(fetched.glob("*/tokenizer.json")), name


async def test_a_worker_host_cut_off_hands_its_jobs_over_and_its_late_results_are_fenced(
    fleet: Fleet,
) -> None:
    w1 = fleet.host("w1")
    async with _client(fleet, "lb") as c:
        ids = await asyncio.gather(*(_admit(c, _job(120), f"cut-{i}") for i in range(12)))
        deadline = time.monotonic() + 60
        while True:  # some of them running on w1
            jobs = {j: (await c.get(f"/v1/jobs/{j}")).json()["status"] for j in ids}
            ran_on = await _workers(fleet)
            on_w1 = [j for j in ids if jobs[j] == "running" and ran_on.get(j) == "w1"]
            if on_w1:
                break
            assert time.monotonic() < deadline, jobs
            await asyncio.sleep(0.2)
        w1.cut()
        try:
            done = await asyncio.gather(*(wait_for(c, j, timeout=120) for j in ids))
        finally:
            w1.reconnect()
        await asyncio.sleep(8)  # the old runs come back and try to settle
        again = [(await c.get(f"/v1/jobs/{j}")).json() for j in ids]
    assert {j["status"] for j in done} == {"succeeded"}, done
    ran_on = await _workers(fleet)
    assert all(ran_on[j] == "w2" for j in on_w1), {j: ran_on[j] for j in on_w1}  # handed over
    assert [(j["status"], j["result"]) for j in again] == [(j["status"], j["result"]) for j in done]
    billed = await _billed(fleet)
    assert all(billed.get(j) == 1 for j in ids), {j: billed.get(j) for j in ids}


async def test_sse_followed_through_the_balancer_survives_its_replicas_death(
    fleet: Fleet,
) -> None:
    """A job's events followed through HAProxy; the replica serving them SIGKILLed mid-
    stream; the client reconnects through the balancer with Last-Event-ID and gets the
    rest from the other replica: every event once, in order, ending with the job."""
    events: list[dict[str, Any]] = []
    async with _client(fleet, "lb", timeout=30) as c:
        job = await _admit(c, {**_job(150), "tier": "interactive"}, "sse-1")
        served_by = ""
        current: dict[str, Any] = {}
        deadline = time.monotonic() + 120
        while not events or events[-1]["event"] not in ("done", "error"):
            assert time.monotonic() < deadline, events[-3:]
            headers = {"Last-Event-ID": events[-1]["id"]} if events else {}
            try:
                async with c.stream("GET", f"/v1/jobs/{job}/events", headers=headers) as resp:
                    assert resp.status_code == 200, await resp.aread()
                    if not served_by:
                        served_by = resp.headers["x-served-by"]
                    async for line in resp.aiter_lines():
                        line = line.rstrip("\r")
                        if not line:
                            if "event" in current:
                                events.append(current)
                                if (
                                    len(events) == 5
                                    and fleet.host(served_by).procs["api"].poll() is None
                                ):
                                    fleet.host(served_by).procs["api"].kill()  # mid-stream
                            current = {}
                        elif not line.startswith(":"):
                            field, _, value = line.partition(":")
                            current[field] = value.removeprefix(" ")
            except httpx.TransportError:
                current = {}
                await asyncio.sleep(0.3)
        final = (await c.get(f"/v1/jobs/{job}")).json()
    fleet.start_api(fleet.host(served_by))  # back for the tests after this one
    assert fleet.host(served_by).procs["api"].poll() is None
    assert [int(e["id"]) for e in events] == list(range(1, len(events) + 1))  # once, in order
    assert len(events) > 6 and events[-1]["event"] == "done"
    text_seen = "".join(json.loads(e["data"])["text"] for e in events[:-1])
    assert text_seen == final["result"]["text"]
    deadline = time.monotonic() + 60
    async with httpx.AsyncClient(timeout=2) as h:
        while True:  # the restarted replica ready again
            with contextlib.suppress(httpx.HTTPError):
                if (await h.get(f"{fleet.url(served_by)}/readyz")).status_code == 200:
                    break
            assert time.monotonic() < deadline, fleet.host(served_by).log("api")
            await asyncio.sleep(0.5)


async def test_the_redis_primary_fails_over_mid_run_and_nothing_accepted_is_lost(
    fleet: Fleet,
) -> None:
    redis = fleet.redis
    assert redis is not None
    async with _client(fleet, "lb", timeout=10) as c:

        async def paced(i: int) -> str:
            await asyncio.sleep(i * 0.1)
            return await _admit(c, _job(), f"failover-{i}", seconds=90)

        submitting = asyncio.gather(*(paced(i) for i in range(50)))
        await asyncio.sleep(2)
        old = redis.primary_port()
        redis.kill(redis.node(old))
        ids = await submitting
        done = await asyncio.gather(*(wait_for(c, j, timeout=120) for j in ids))
    assert redis.primary_port() != old
    assert {j["status"] for j in done} == {"succeeded"}, [
        j for j in done if j["status"] != "succeeded"
    ][:3]
    billed = await _billed(fleet)
    assert all(billed.get(j) == 1 for j in ids)
