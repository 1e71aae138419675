"""Budgets hold under concurrency: batches reserve every line they will run, atomically
with every other reservation of the tenant; generated tokens are billed, hang-ups
included; the spend counters budgets read always equal the ledger.

Real PostgreSQL and Redis, a real Celery worker, the API under uvicorn, the simulated
engine (its prompts counted by the served model's tokenizer, as admission counts them).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from tests.conftest import ADMIN_KEY, Platform
from tests.helpers import client, until_async
from tests.integration.batch_helpers import finished, jsonl, line, sdk, submit
from tests.integration.celery_proc import CeleryWorker
from tierq.models import spend
from tierq.models.tables import Batch, Job, SpendCounter, UsageRecord

pytestmark = pytest.mark.integration

TERMINAL_BATCH = ("completed", "failed", "expired", "cancelled")


@pytest.fixture
async def celery(platform: Platform) -> AsyncIterator[CeleryWorker]:
    # Two jobs of a batch at a time: most of its lines wait unexpanded, held by the batch.
    worker = CeleryWorker(platform.settings, BATCH_MAX_OUTSTANDING="2")
    worker.start()
    yield worker
    worker.stop()


async def budgeted_tenant(platform: Platform, **quota: Any) -> tuple[str, str]:
    async with client(platform.url, ADMIN_KEY) as a:
        tenant = (await a.post("/admin/tenants", json={"name": "budgeted"})).json()
        key = (await a.post(f"/admin/tenants/{tenant['id']}/keys")).json()["key"]
        resp = await a.put(f"/admin/tenants/{tenant['id']}/quota", json=quota)
        assert resp.status_code == 200, resp.text
    return tenant["id"], key


async def ledger_of(platform: Platform, tenant_id: str) -> list[UsageRecord]:
    async with platform.db.session() as s:
        stmt = select(UsageRecord).where(UsageRecord.tenant_id == tenant_id)
        return list((await s.execute(stmt)).scalars())


async def assert_counters_match_the_ledger(platform: Platform, tenant_id: str) -> None:
    rows = await ledger_of(platform, tenant_id)
    async with platform.db.session() as s:
        total = await spend.spent(s, tenant_id, None, "total", rows[0].created_at)
        counters = list(
            (
                await s.execute(select(SpendCounter).where(SpendCounter.tenant_id == tenant_id))
            ).scalars()
        )
    tokens = sum(r.prompt_tokens + r.completion_tokens for r in rows)
    cost = sum((r.cost for r in rows), Decimal(0))
    assert total == (tokens, cost)
    assert {c.period_key.split(":")[0] for c in counters} == {"day", "month", "total"}


async def test_a_line_that_reserves_nothing_cannot_run(
    platform: Platform, celery: CeleryWorker
) -> None:
    """A field the run strips (service_tier) made a line reserve nothing and still run:
    12 lines that way billed 2.9 times a budget of 200. The reservation now parses each
    line exactly as it will run."""
    _tenant, key = await budgeted_tenant(platform, token_budget=200, budget_period="total")
    api = sdk(platform, key)
    batch = await submit(api, jsonl([line(f"x{i}", service_tier="x") for i in range(12)]))
    done = await finished(api, batch.id, celery)
    assert done.status == "failed", done
    assert done.errors is not None
    assert [e.code for e in done.errors.data] == ["budget_exceeded"]
    async with platform.db.session() as s:
        jobs = (await s.execute(select(Job).where(Job.batch_id == batch.id))).scalars().all()
    assert list(jobs) == []


async def _stream_and_hang_up(c: httpx.AsyncClient, chunks: int | None) -> int:
    """A streamed chat request; hang up after `chunks` content chunks (None: read it all).
    Returns the HTTP status."""
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 64,
        "stream": True,
    }
    async with c.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return resp.status_code
        seen = 0
        async for raw in resp.aiter_lines():
            if raw.startswith("data: {") and '"content"' in raw:
                seen += 1
                if chunks is not None and seen >= chunks:
                    break
    return 200


@pytest.mark.with_settings(files_max_concurrent_uploads=0)  # its five uploads go at once
async def test_batches_and_online_jobs_at_once_never_pass_the_budget(
    running: Platform, celery: CeleryWorker
) -> None:
    budget = 1500
    tenant_id, key = await budgeted_tenant(running, token_budget=budget, budget_period="total")
    api = sdk(running, key)
    files = [jsonl([line(f"b{b}-{i}", f"Question {i}?") for i in range(6)]) for b in range(5)]
    async with client(running.url, key, timeout=60) as c:
        results = await asyncio.gather(
            *(submit(api, data) for data in files),
            *(_stream_and_hang_up(c, 3 if i % 2 else None) for i in range(10)),
            return_exceptions=True,
        )
    batches = [b for b in results[:5]]
    statuses = results[5:]
    assert not any(isinstance(x, BaseException) for x in results), results
    assert set(statuses) <= {200, 429}, statuses
    done = [await finished(api, b.id, celery, timeout=120) for b in batches]  # type: ignore[union-attr]
    assert {d.status for d in done} <= {"completed", "failed"}

    async def jobs_of_tenant() -> list[Job]:
        async with running.db.session() as s:
            return list((await s.execute(select(Job).where(Job.tenant_id == tenant_id))).scalars())

    # Wait for every job of the tenant to end, and every hung-up one to be billed.
    async def settled() -> bool:
        jobs = await jobs_of_tenant()
        return all(j.status in ("succeeded", "failed", "cancelled") for j in jobs) and all(
            j.prompt_tokens is not None for j in jobs if j.status == "cancelled" and j.started_at
        )

    await until_async(settled, "jobs still unfinished or unbilled after 20 s", 20)
    jobs = await jobs_of_tenant()
    ledger = await ledger_of(running, tenant_id)
    spent = sum(r.prompt_tokens + r.completion_tokens for r in ledger)
    assert spent <= budget, (spent, budget)
    # Some of it was refused (the test is not vacuous), and much of it ran.
    refused = statuses.count(429) + sum(1 for d in done if d.status == "failed")
    assert refused >= 1, (statuses, [d.status for d in done])
    assert spent >= budget // 3, spent
    # Every job that generated tokens is billed for them, once.
    by_job = {r.job_id: r for r in ledger}
    assert len(by_job) == len(ledger)
    for job in jobs:
        if job.status == "cancelled" and job.started_at is not None:
            assert job.prompt_tokens is not None  # its worker recorded what it did
        if job.completion_tokens:
            record = by_job[job.id]
            assert (record.prompt_tokens, record.completion_tokens) == (
                job.prompt_tokens,
                job.completion_tokens,
            )
    assert any(j.status == "cancelled" and j.completion_tokens for j in jobs)  # hang-ups
    await assert_counters_match_the_ledger(running, tenant_id)
    # Nothing of a finished batch is still held against the budget.
    async with running.db.session() as s:
        held = (
            await s.execute(
                select(Batch.status, Batch.reserved_tokens).where(Batch.tenant_id == tenant_id)
            )
        ).all()
    for status, _reserved in held:
        assert status in TERMINAL_BATCH


async def test_the_spend_is_read_from_counters_not_the_ledger(platform: Platform) -> None:
    """The counters are what admission reads: one that says the budget is spent refuses
    the next job even though the ledger is empty (and one that says nothing is spent lets
    it through)."""
    tenant_id, key = await budgeted_tenant(platform, token_budget=1000, budget_period="day")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    async with client(platform.url, key) as c:
        assert (await c.post("/v1/jobs", json=body)).status_code == 202
        async with platform.db.transaction() as s:
            await s.run_sync(spend.add, tenant_id, "standard", 990, Decimal(0))
        refused = await c.post("/v1/jobs", json=body)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "budget_exceeded"
    assert "990 used" in refused.json()["error"]["message"]


async def test_a_job_cancelled_while_it_ran_holds_its_reservation_until_billed(
    platform: Platform,
) -> None:
    """Between a cancel and the worker's bill of what the job generated, the job still
    holds its reservation: a job admitted in that window cannot take the budget past it."""
    from datetime import UTC, datetime, timedelta

    from tierq.models import quotas as quota_repo

    tenant_id, key = await budgeted_tenant(platform, token_budget=10_000, budget_period="total")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 500}
    async with client(platform.url, key) as c:
        job_id = (await c.post("/v1/jobs", json=body)).json()["id"]
    assert await platform.jobs.claim(job_id, "w-test", 3)  # as a worker claims it
    now = datetime.now(UTC)

    async def held() -> int:
        async with platform.db.session() as s:
            tokens, _cost = await quota_repo.held_reservations(s, tenant_id, "*", now)
        return tokens

    reserved = await held()
    assert reserved > 500
    assert await platform.jobs.cancel(job_id)
    assert await held() == reserved  # cancelled, not yet billed: still held
    # ...and not for ever: a worker that died with it bills nothing
    async with platform.db.session() as s:
        later = now + quota_repo.BILLING_GRACE + timedelta(seconds=1)
        assert (await quota_repo.held_reservations(s, tenant_id, "*", later))[0] == 0
    assert await platform.jobs.bill_cancelled(job_id, 20, 300)
    assert await held() == 0  # billed: the ledger holds it now
    async with platform.db.session() as s:
        assert await spend.spent(s, tenant_id, None, "total", now) == (320, Decimal(0))


async def test_a_job_of_n_choices_reserves_and_holds_max_tokens_for_each(
    platform: Platform,
) -> None:
    """Output at 1 a token, a spend budget of 100, no worker (jobs stay queued, holding
    their reservations): a job of n = 3 x 30 tokens holds 90; 5 more fit, 10 more do not.
    What a waiting job holds is counted by the admission function itself (`tierq_admit`:
    max_tokens x n), not only when the job is admitted."""
    async with client(platform.url, ADMIN_KEY) as a:
        price = {
            "model": platform.settings.served_model_name,
            "tier": "standard",
            "input_per_million": "0",
            "output_per_million": "1000000",
        }
        assert (await a.put("/admin/prices", json=price)).status_code == 200
    _, key = await budgeted_tenant(platform, spend_budget="100")
    chat = {"messages": [{"role": "user", "content": "hi"}], "tier": "standard"}
    async with client(platform.url, key) as c:
        too_many = await c.post("/v1/jobs", json={**chat, "max_tokens": 30, "n": 4})
        assert too_many.status_code == 429, too_many.text  # 120 > 100 on its own
        assert too_many.json()["error"]["code"] == "budget_exceeded", too_many.text
        held = await c.post("/v1/jobs", json={**chat, "max_tokens": 30, "n": 3})
        assert held.status_code in (200, 201, 202), held.text
        fits = await c.post("/v1/jobs", json={**chat, "max_tokens": 5})
        assert fits.status_code in (200, 201, 202), fits.text
        over = await c.post("/v1/jobs", json={**chat, "max_tokens": 10})
        assert over.status_code == 429, over.text
        assert over.json()["error"]["code"] == "budget_exceeded", over.text
