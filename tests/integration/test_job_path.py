"""The job path end to end, with real PostgreSQL and Redis and the simulated engine."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence

import pytest

from tests.conftest import Platform
from tests.helpers import (
    assert_openai_error,
    client,
    read_sse,
    until,
    until_async,
    until_streamed,
    wait_for,
)
from tierq.models import jobs as job_repo
from tierq.workers.engine.base import Chunk, Engine, EngineWrapper
from tierq.workers.engine.simulated_engine import CostModel

pytestmark = pytest.mark.integration

CHAT = {"messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 12}


async def test_submit_poll_succeeds_with_result_usage_and_history(
    platform: Platform, tenant_key: str
) -> None:
    platform.start_dispatcher()
    await platform.start_worker("w1")
    async with client(platform.url, tenant_key) as c:
        resp = await c.post("/v1/jobs", json={**CHAT, "tier": "interactive"})
        assert resp.status_code == 202
        job = resp.json()
        assert job["object"] == "job" and job["status"] == "queued" and job["tier"] == "interactive"
        for absent in ("started_at", "finished_at", "result", "usage", "error"):
            assert job[absent] is None
        done = await wait_for(c, job["id"])
    assert done["status"] == "succeeded"
    assert done["result"]["finish_reason"] == "length"
    assert done["result"]["text"] == "".join(f" tok{i}" for i in range(1, 13))
    assert done["usage"]["completion_tokens"] == 12
    assert done["usage"]["total_tokens"] == done["usage"]["prompt_tokens"] + 12
    assert done["started_at"] is not None and done["finished_at"] is not None
    async with platform.db.session() as s:
        history = await job_repo.transitions(s, job["id"])
        usage = await job_repo.usage_for_job(s, job["id"])
    assert [status for status, _ in history] == ["queued", "running", "succeeded"]
    assert len(usage) == 1 and usage[0].completion_tokens == 12


async def test_many_jobs_run_concurrently_in_one_engine(
    platform: Platform, tenant_key: str
) -> None:
    platform.start_dispatcher()
    worker = await platform.start_worker("w1", cost=CostModel(slots=8))  # real-time speed
    _, _, engine = platform.workers["w1"]
    peak = 0
    async with client(platform.url, tenant_key) as c:
        posts = [
            c.post("/v1/jobs", json={**CHAT, "max_tokens": 40, "tier": "interactive"})
            for _ in range(8)
        ]
        ids = [resp.json()["id"] for resp in await asyncio.gather(*posts)]
        for _ in range(200):  # sampled often: a slot frees as its job ends
            peak = max(peak, engine.running)
            if peak >= 8:
                break
            await asyncio.sleep(0.01)
        jobs = [await wait_for(c, i) for i in ids]
    assert all(j["status"] == "succeeded" for j in jobs)
    # Continuous batching: all eight at once, in every slot of the engine.
    assert peak == platform.settings.max_num_seqs == 8 and worker.engine_preempts


@pytest.mark.with_settings(engine_preemption=False)
async def test_lower_tiers_leave_the_interactive_reserve_free(
    platform: Platform, tenant_key: str
) -> None:
    """An engine that cannot preempt for priority: the worker keeps a reserve of its slots."""
    platform.start_dispatcher()
    worker = await platform.start_worker("w1", cost=CostModel(slots=8))
    _, _, engine = platform.workers["w1"]
    assert worker.reserve == 4  # INTERACTIVE_RESERVE in these tests (at most half the slots)
    assert worker.capacity == 8 and not worker.engine_preempts
    async with client(platform.url, tenant_key) as c:
        posts = [
            c.post("/v1/jobs", json={**CHAT, "max_tokens": 60, "tier": t})
            for t in ("batch", "standard") * 5
        ]
        lower = [r.json()["id"] for r in await asyncio.gather(*posts)]
        peak = 0
        for _ in range(250):  # the four slots below the ceiling fill up, and no more
            peak = max(peak, engine.running)
            if peak >= 4:
                break
            await asyncio.sleep(0.02)
        # Nothing marks a placement declined for the reserve: a moment for a fifth to start.
        await asyncio.sleep(0.2)
        peak = max(peak, engine.running)
        assert peak == 4
        inter = (await c.post("/v1/jobs", json={**CHAT, "tier": "interactive"})).json()
        done = await wait_for(c, inter["id"])
        still_running = [(await c.get(f"/v1/jobs/{i}")).json()["status"] for i in lower]
        assert done["status"] == "succeeded"
        assert "running" in still_running  # it did not wait for the lower tiers to drain
        for i in lower:
            await wait_for(c, i)


async def test_tiers_are_served_highest_first(platform: Platform, tenant_key: str) -> None:
    async with client(platform.url, tenant_key) as c:
        batch = [
            (await c.post("/v1/jobs", json={**CHAT, "tier": "batch"})).json() for _ in range(3)
        ]
        std = (await c.post("/v1/jobs", json={**CHAT, "tier": "standard"})).json()
        inter = (await c.post("/v1/jobs", json={**CHAT, "tier": "interactive"})).json()
        platform.settings.max_num_seqs = 1  # one slot: the order of service is visible
        platform.start_dispatcher()
        await platform.start_worker("w1")
        jobs = [await wait_for(c, j["id"]) for j in [inter, std, *batch]]
    started = [j["started_at"] for j in jobs]
    finished = [j["finished_at"] for j in jobs]
    assert all(j["status"] == "succeeded" for j in jobs)
    assert started == sorted(started) and finished == sorted(finished)


async def test_list_filters_and_paginates(platform: Platform, tenant_key: str) -> None:
    async with client(platform.url, tenant_key) as c:
        ids = []
        for tier in ("batch", "standard", "batch", "interactive", "batch"):
            ids.append((await c.post("/v1/jobs", json={**CHAT, "tier": tier})).json()["id"])
        page1 = (await c.get("/v1/jobs", params={"limit": 2})).json()
        assert page1["object"] == "list" and page1["has_more"] is True
        assert [j["id"] for j in page1["data"]] == ids[::-1][:2]
        page2 = (await c.get("/v1/jobs", params={"limit": 2, "after": page1["last_id"]})).json()
        page3 = (await c.get("/v1/jobs", params={"limit": 2, "after": page2["last_id"]})).json()
        seen = [j["id"] for p in (page1, page2, page3) for j in p["data"]]
        assert seen == ids[::-1] and page3["has_more"] is False
        batch = (await c.get("/v1/jobs", params={"tier": "batch"})).json()["data"]
        assert {j["id"] for j in batch} == {ids[0], ids[2], ids[4]}
        queued = (await c.get("/v1/jobs", params={"status": "queued"})).json()["data"]
        assert len(queued) == 5
        assert (await c.get("/v1/jobs", params={"status": "succeeded"})).json()["data"] == []


async def test_a_tenant_sees_only_its_own_jobs(
    platform: Platform, tenant_key: str, other_tenant_key: str
) -> None:
    async with (
        client(platform.url, tenant_key) as mine,
        client(platform.url, other_tenant_key) as theirs,
    ):
        job = (await mine.post("/v1/jobs", json=CHAT)).json()
        for resp in (
            await theirs.get(f"/v1/jobs/{job['id']}"),
            await theirs.post(f"/v1/jobs/{job['id']}/cancel"),
            await theirs.get(f"/v1/jobs/{job['id']}/events"),
        ):
            assert resp.status_code == 404
            assert resp.json()["error"]["code"] == "job_not_found"
        assert (await theirs.get("/v1/jobs")).json()["data"] == []
        assert (await mine.get(f"/v1/jobs/{job['id']}")).status_code == 200


async def test_idempotency_key_returns_the_same_job_and_enqueues_once(
    platform: Platform, tenant_key: str
) -> None:
    async with client(platform.url, tenant_key) as c:
        headers = {"Idempotency-Key": "order-42"}
        first = await c.post("/v1/jobs", json=CHAT, headers=headers)
        async with platform.db.session() as s:
            job = await job_repo.get_job(s, first.json()["id"])
        assert job is not None
        stream = platform.dispatcher.names.tier_stream("standard", job.tenant_id)
        again = await c.post("/v1/jobs", json=CHAT, headers=headers)
        assert first.status_code == again.status_code == 202
        assert first.json()["id"] == again.json()["id"]
        assert await platform.r.xlen(stream) == 1
        other = await c.post("/v1/jobs", json={**CHAT, "max_tokens": 3}, headers=headers)
        assert other.status_code == 409
        assert other.json()["error"]["code"] == "idempotency_key_reused"
        assert await platform.r.xlen(stream) == 1


async def test_sse_streams_deltas_then_done_and_late_joiners_miss_nothing(
    platform: Platform, tenant_key: str
) -> None:
    platform.start_dispatcher()
    await platform.start_worker("w1", cost=None)
    async with client(platform.url, tenant_key) as c:
        job = (await c.post("/v1/jobs", json={**CHAT, "max_tokens": 30})).json()
        live_task = asyncio.create_task(read_sse(c, f"/v1/jobs/{job['id']}/events"))
        await until_streamed(platform, job["id"])
        late = await read_sse(c, f"/v1/jobs/{job['id']}/events")  # joins mid-stream
        live = await live_task
        after_end = await read_sse(c, f"/v1/jobs/{job['id']}/events")  # joins after the end
        resumed = await read_sse(c, f"/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": "7"})
        final = (await c.get(f"/v1/jobs/{job['id']}")).json()
    n = len(live)
    assert n >= 3  # deltas, not one lump (they merge only when steps outpace publishing)
    for events in (live, late, after_end):
        assert [e["event"] for e in events] == ["delta"] * (n - 1) + ["done"]
        assert [int(e["id"]) for e in events] == list(range(1, n + 1))
        assert "".join(e["data"]["text"] for e in events[:-1]) == final["result"]["text"]
        assert events[-1]["data"] == final
    assert late == live == after_end
    assert resumed == live[7:]


async def test_cancel_a_queued_job(platform: Platform, tenant_key: str) -> None:
    async with client(platform.url, tenant_key) as c:
        job = (await c.post("/v1/jobs", json=CHAT)).json()
        resp = await c.post(f"/v1/jobs/{job['id']}/cancel")
        assert resp.status_code == 200 and resp.json()["status"] == "cancelled"
        assert (await c.post(f"/v1/jobs/{job['id']}/cancel")).json()["status"] == "cancelled"
        platform.start_dispatcher()
        await platform.start_worker("w1")
        other = (await c.post("/v1/jobs", json=CHAT)).json()
        assert (await wait_for(c, other["id"]))["status"] == "succeeded"
        events = await read_sse(c, f"/v1/jobs/{job['id']}/events")
        final = (await c.get(f"/v1/jobs/{job['id']}")).json()
    assert (
        final["status"] == "cancelled" and final["result"] is None and final["started_at"] is None
    )
    assert [e["event"] for e in events] == ["done"] and events[0]["data"]["status"] == "cancelled"


async def test_cancel_a_running_job_aborts_it_in_the_engine(
    platform: Platform, tenant_key: str
) -> None:
    platform.start_dispatcher()
    await platform.start_worker("w1")
    _, _, engine = platform.workers["w1"]
    async with client(platform.url, tenant_key) as c:
        job = (await c.post("/v1/jobs", json={**CHAT, "max_tokens": 1500})).json()
        await wait_for(c, job["id"], ("running",))
        resp = await c.post(f"/v1/jobs/{job['id']}/cancel")
        assert resp.json()["status"] == "cancelled"
        await until(lambda: engine.running == 0, "the engine let the cancelled run go", 2)
        finished = (await c.post(f"/v1/jobs/{job['id']}/cancel")).json()
        done = await c.post("/v1/jobs", json=CHAT)
        ok = await wait_for(c, done.json()["id"])
        again = await c.post(f"/v1/jobs/{ok['id']}/cancel")
    assert finished["status"] == "cancelled"
    assert again.status_code == 409 and again.json()["error"]["code"] == "job_not_cancellable"
    async with platform.db.session() as s:
        usage = await job_repo.usage_for_job(s, job["id"])
        record = await job_repo.get_job(s, job["id"])
    # Billed for what the engine did before the abort (at most the tokens it was allowed),
    # once; an abort before any token would leave nothing to bill.
    assert record is not None and record.status.value == "cancelled"
    if usage:
        assert len(usage) == 1 and usage[0].completion_tokens == record.completion_tokens
        assert (record.completion_tokens or 0) < 1500
    else:
        assert record.completion_tokens is None


async def test_readyz_admits_without_workers_and_reports_the_fleet(
    platform: Platform, tenant_key: str
) -> None:
    """With no worker (a GPU outage, workers scaled to zero) the replica stays ready: it
    admits, and says what the fleet lacks; `?min_workers=1` is what waits for engines."""
    async with client(platform.url, None) as c, client(platform.url, tenant_key) as t:
        assert (await c.get("/healthz")).json() == {"status": "ok"}
        ready = await c.get("/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json()["workers"] == 0
        assert ready.json()["fleet"] == "no live worker heartbeat"
        assert "workers" not in ready.json()["checks"]
        waiting = await c.get("/readyz", params={"min_workers": 1})
        assert waiting.status_code == 503
        assert waiting.json()["checks"]["workers"] == "error: 0 of 1: no live worker heartbeat"
        queued = await t.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 4})
        assert queued.status_code in (200, 201, 202) and queued.json()["status"] == "queued"
        await platform.start_worker("w1")
        platform.start_dispatcher()

        async def ready() -> bool:  # its first heartbeat
            return (await c.get("/readyz", params={"min_workers": 1})).status_code == 200

        await until_async(ready, "the worker never showed up", 30)
        for path in ("/readyz", "/readyz?min_workers=1"):
            up = await c.get(path)
            assert up.status_code == 200 and up.json()["workers"] == 1, up.text
            assert up.json()["fleet"] == "ok"
        assert (await wait_for(t, queued.json()["id"]))["status"] == "succeeded"
        assert_openai_error(await c.get("/readyz", params={"min_workers": -1}), 400)
        metrics = await c.get("/metrics")
        assert metrics.status_code == 200 and "tierq_jobs_submitted_total" in metrics.text


class _NulEngine(EngineWrapper):
    """The simulated engine, its output laced with NUL: a token of the bundled model's
    vocabulary (190) decodes to it."""

    def __init__(self, inner: Engine) -> None:
        super().__init__(inner, "nul")

    async def observe(
        self, request_id: str, resume: Sequence[int], run: AsyncIterator[Chunk]
    ) -> AsyncIterator[Chunk]:
        async for chunk in run:
            yield dataclasses.replace(chunk, text=chunk.text.replace("tok", "\x00"))


async def test_generated_nul_is_stored_and_streamed_as_a_replacement_character(
    platform: Platform, tenant_key: str
) -> None:
    """PostgreSQL's text refuses NUL: a job whose output has one is stored, billed once and
    streamed with U+FFFD in its place, the same in the result and in the SSE deltas."""
    platform.start_dispatcher()
    await platform.start_worker("w1", wrap=_NulEngine)
    async with client(platform.url, tenant_key) as c:
        job = (await c.post("/v1/jobs", json={**CHAT, "max_tokens": 3})).json()
        events = await read_sse(c, f"/v1/jobs/{job['id']}/events")
        done = await wait_for(c, job["id"])
    expected = "".join(f" \ufffd{i}" for i in range(1, 4))
    assert done["status"] == "succeeded" and done["result"]["text"] == expected
    assert "".join(e["data"]["text"] for e in events if e["event"] == "delta") == expected
    async with platform.db.session() as s:
        assert len(await job_repo.usage_for_job(s, job["id"])) == 1
