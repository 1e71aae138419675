"""Bounds that keep one tenant from filling shared Redis: a default max_queued, a cap on
unfinished batches, and replay buffers bounded in bytes and in time once a job is over.

Real PostgreSQL and Redis, the API under uvicorn, the simulated engine where jobs run.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.conftest import Platform
from tests.helpers import (
    admin,
    assert_openai_error,
    client,
    new_tenant,
    read_sse,
    until,
    until_async,
    wait_for,
    waiting_on_a_lock,
)
from tests.integration.batch_helpers import jsonl, line, sdk
from tierq.core.states import BatchStatus

pytestmark = pytest.mark.integration

JOB = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.mark.with_settings(default_max_queued=3)
async def test_a_tenant_without_its_own_max_queued_gets_the_default(platform: Platform) -> None:
    _plain, key = await new_tenant(platform)
    roomy, roomy_key = await new_tenant(platform)
    async with admin(platform) as a:
        resp = await a.put(f"/admin/tenants/{roomy}/quota", json={"max_queued": 5})
        assert resp.status_code == 200
    async with client(platform.url, key) as c, client(platform.url, roomy_key) as r:
        answers = [await c.post("/v1/jobs", json=JOB) for _ in range(4)]
        assert [x.status_code for x in answers] == [202, 202, 202, 429]
        assert_openai_error(answers[-1], 429, "quota_exceeded")
        assert "at most 3" in answers[-1].json()["error"]["message"]
        # the tenant's own quota replaces the default
        mine = [(await r.post("/v1/jobs", json=JOB)).status_code for _ in range(6)]
        assert mine == [202] * 5 + [429]
        # a queued job that ends makes room
        await c.post(f"/v1/jobs/{answers[0].json()['id']}/cancel")
        assert (await c.post("/v1/jobs", json=JOB)).status_code == 202


@pytest.mark.with_settings(max_batches_per_tenant=2)
async def test_a_tenant_may_have_only_so_many_batches_unfinished(platform: Platform) -> None:
    _tenant, key = await new_tenant(platform)
    _other, other_key = await new_tenant(platform)
    api = sdk(platform, key)
    upload = await api.files.create(file=("in.jsonl", jsonl([line("a")])), purpose="batch")

    async def create() -> httpx.Response:
        async with client(platform.url, key) as h:
            return await h.post(
                "/v1/batches",
                json={
                    "input_file_id": upload.id,
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                },
            )

    # created at once: the cap is checked under the tenant's lock, so exactly 2 pass
    answers = await asyncio.gather(*(create() for _ in range(5)))
    assert sorted(a.status_code for a in answers) == [200, 200, 429, 429, 429]
    async with client(platform.url, key) as h:
        listed = (await h.get("/v1/batches")).json()["data"]
        refused = await create()
        assert_openai_error(refused, 429, "too_many_batches")
        assert int(refused.headers["retry-after"]) >= 1
        # another tenant has its own allowance
        other = sdk(platform, other_key)
        theirs = await other.files.create(file=("in.jsonl", jsonl([line("b")])), purpose="batch")
        made = await other.batches.create(
            input_file_id=theirs.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert made.status == "validating"
        # a cancelled batch no longer counts once it is cancelled
        await api.batches.cancel(listed[0]["id"])
        async with platform.db.transaction() as s:
            from tierq.models import batches as batch_repo

            await batch_repo.transition(
                s, listed[0]["id"], BatchStatus.CANCELLED, (BatchStatus.CANCELLING,)
            )
        again = await create()
        assert again.status_code == 200, again.text


@pytest.mark.with_settings(replay_max_bytes=300, replay_done_ttl_s=7)
async def test_a_replay_buffer_is_bounded_in_bytes_and_in_time(running: Platform) -> None:
    _tenant, key = await new_tenant(running)
    names = running.dispatcher.names
    async with client(running.url, key) as c:
        job_id = (await c.post("/v1/jobs", json={**JOB, "max_tokens": 120})).json()["id"]
        live = await read_sse(c, f"/v1/jobs/{job_id}/events")
        final = await wait_for(c, job_id)
        text = final["result"]["text"]
        # a live follower got every delta in full
        assert "".join(e["data"].get("text", "") for e in live if e["event"] == "delta") == text
        buffered = await running.r.lrange(names.job_events(job_id), 0, -1)
        kept = sum(len(x) for x in buffered)
        assert len(buffered) == len(live)  # the ids stay in step
        assert kept < 300 + 80 * len(buffered)  # placeholders past the bound
        # a late follower replays placeholders past the bound, then the whole result
        again = await read_sse(c, f"/v1/jobs/{job_id}/events")
        assert [e["id"] for e in again] == [e["id"] for e in live]
        assert any(e["data"].get("replay_truncated") for e in again if e["event"] == "delta")
        assert again[-1]["event"] == "done" and again[-1]["data"]["result"]["text"] == text
        # once over, the buffer lives replay_done_ttl_s, not replay_ttl_s
        ttl = await running.r.ttl(names.job_events(job_id))
        assert 0 < ttl <= 7


@pytest.mark.with_settings(
    db_pool_size=3, db_max_overflow=0, db_pool_timeout_s=1.0, admission_concurrency_per_tenant=1
)
async def test_one_tenants_burst_cannot_take_every_database_connection(
    platform: Platform,
) -> None:
    """A tenant with quotas is admitted one request at a time (its row lock). Its burst
    waits at the gate, not on pooled connections: another tenant is still served."""
    from tierq.models import tenants as tenant_repo

    noisy, noisy_key = await new_tenant(platform)
    _quiet, quiet_key = await new_tenant(platform)
    async with admin(platform) as a:
        resp = await a.put(f"/admin/tenants/{noisy}/quota", json={"requests_per_minute": 1000})
        assert resp.status_code == 200
    async with client(platform.url, noisy_key) as n, client(platform.url, quiet_key) as q:
        # The noisy tenant's row lock held from outside: its admissions block in PostgreSQL.
        async with platform.db.transaction() as s:
            await tenant_repo.lock_tenant(s, noisy)
            burst = [asyncio.create_task(n.post("/v1/jobs", json=JOB)) for _ in range(10)]

            await until_async(
                lambda: waiting_on_a_lock(platform),
                "an admission of the burst blocked on its row lock",
            )
            quiet = await q.post("/v1/jobs", json=JOB)
            assert quiet.status_code == 202, quiet.text
            assert not any(t.done() for t in burst)
            assert await waiting_on_a_lock(
                platform
            )  # one at the lock (the rest at the gate), all still waiting
        answers = await asyncio.gather(*burst)
    assert [a.status_code for a in answers] == [202] * 10


async def test_a_batch_line_leaves_only_its_final_event_in_redis(running: Platform) -> None:
    """A batch's lines are read from its output file, not followed live: a line's job
    streams no deltas, so its replay buffer holds the final event alone (with the result)."""
    from datetime import UTC, datetime, timedelta

    from tierq.core.queue import enqueue
    from tierq.models import batches as batch_repo

    tenant_id, key = await new_tenant(running)
    async with running.db.transaction() as s:
        batch = await batch_repo.create_batch(
            s,
            tenant_id,
            "/v1/chat/completions",
            "file-x",
            "24h",
            None,
            datetime.now(UTC) + timedelta(hours=1),
        )
        started = await batch_repo.transition(
            s, batch.id, BatchStatus.IN_PROGRESS, (BatchStatus.VALIDATING,)
        )
        assert started is not None
        line = batch_repo.BatchLine(
            line=0,
            custom_id="a",
            model=running.settings.served_model_name,
            messages=[{"role": "user", "content": "hi"}],
            prompt=None,
            params={"max_tokens": 40},
            reserved_tokens=80,
        )
        (job,) = await batch_repo.expand(s, started, [line], 1, 10) or []
    await enqueue(running.r, running.dispatcher.names, job.to_message())
    async with client(running.url, key) as c:
        final = await wait_for(c, job.id)
    assert final["status"] == "succeeded" and final["result"]["text"]
    # the final event is written after the row commits, so a poll may see the row first
    events = running.dispatcher.names.job_events(job.id)
    buffered: list[str] = []

    async def read() -> bool:
        buffered[:] = await running.r.lrange(events, 0, -1)
        return any('"kind":"done"' in e for e in buffered)

    await until_async(read, "the job's final event in its replay buffer", 10)
    assert len(buffered) == 1 and '"kind":"done"' in buffered[0]


@pytest.mark.with_settings(admission_concurrency_per_tenant=1)
async def test_a_tenants_chat_is_admitted_before_its_waiting_backlog(platform: Platform) -> None:
    """A tenant's admissions wait at the gate by tier: an interactive job sent after its
    own batch backlog is admitted right after the admission under way, not behind it."""
    from sqlalchemy import select

    from tierq.models import tenants as tenant_repo
    from tierq.models.tables import Job

    tenant, key = await new_tenant(platform)
    async with admin(platform) as a:
        resp = await a.put(f"/admin/tenants/{tenant}/quota", json={"requests_per_minute": 1000})
        assert resp.status_code == 200
    assert platform.server is not None
    gate = platform.server.config.app.state.admission_gate
    async with client(platform.url, key) as c:
        async with platform.db.transaction() as s:
            await tenant_repo.lock_tenant(s, tenant)  # the first admission blocks there
            backlog = [
                asyncio.create_task(c.post("/v1/jobs", json={**JOB, "tier": "batch"}))
                for _ in range(6)
            ]
            await until_async(
                lambda: waiting_on_a_lock(platform), "a batch admission blocked on the row lock"
            )
            await until(lambda: gate.waiting(tenant) == 5, "the rest of the backlog at the gate")
            chat = asyncio.create_task(c.post("/v1/jobs", json={**JOB, "tier": "interactive"}))
            await until(lambda: gate.waiting(tenant) == 6, "the chat at the gate")
        answers = await asyncio.gather(*backlog, chat)
    assert [r.status_code for r in answers] == [202] * 7
    async with platform.db.session() as s:
        rows = (
            await s.execute(
                select(Job.id, Job.tier).where(Job.tenant_id == tenant).order_by(Job.created_at)
            )
        ).all()
    order = [row.tier for row in rows]
    assert order == ["batch", "interactive"] + ["batch"] * 5, order
