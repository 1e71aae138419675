"""Admission's one round trip on PostgreSQL (tierq/models/admission.py: `tierq_admit`, for a
tenant without quotas and, counted, for one with quotas), through the API and the service on
real PostgreSQL and Redis: prices, idempotency under concurrency, refusals under the
tenant's lock, dropped connections, and at every quota's boundary the figures and the
decision of the rule as models.quotas states it (the statements that check a batch, and that
SQLite's admission runs). What every store answers alike is the job store's contract
(tests/job_store_contract.py)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import text, update

from tests.conftest import Platform
from tests.helpers import admin, admit_as, client, new_tenant
from tierq.core import metrics
from tierq.core.tiers import Tier
from tierq.models import admission, spend
from tierq.models import jobs as job_repo
from tierq.models import prices as price_repo
from tierq.models import quotas as quota_repo
from tierq.models.store import SqlJobStore
from tierq.models.tables import Batch, Job, utcnow

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def _statements(path: str) -> float:
    return metrics.ADMISSION_STATEMENTS.labels(path=path)._value.get()


async def _job_prices(platform: Platform, job_id: str) -> tuple[Decimal | None, Decimal | None]:
    async with platform.db.session() as s:
        job = await job_repo.get_job(s, job_id)
    assert job is not None
    return job.input_price, job.output_price


async def test_both_ways_through_the_function_price_every_tier_as_the_price_repository(
    platform: Platform,
) -> None:
    """A tier's own price; the batch tier without one pays the standard price less the
    discount (computed in SQL by the function, in Python by models.prices); a model
    without a price costs 0. A tenant without quotas and one with quotas (counted
    first) get the same prices."""
    model = platform.settings.served_model_name
    async with admin(platform) as a:
        price = {"model": model, "input_per_million": "0.37", "output_per_million": "1.1"}
        assert (await a.put("/admin/prices", json={**price, "tier": "standard"})).is_success
        interactive = {**price, "tier": "interactive", "input_per_million": "2.50"}
        assert (await a.put("/admin/prices", json=interactive)).is_success
    _fast_tenant, fast_key = await new_tenant(platform)
    quota_tenant, quota_key = await new_tenant(platform)
    async with admin(platform) as a:
        quota = {"requests_per_minute": 1000}
        assert (await a.put(f"/admin/tenants/{quota_tenant}/quota", json=quota)).is_success
    seen: dict[str, dict[str, tuple[Decimal | None, Decimal | None]]] = {}
    for path, key in (("fast", fast_key), ("quotas", quota_key)):
        before = _statements("quotas")
        async with client(platform.url, key) as c:
            for tier in ("interactive", "standard", "batch"):
                resp = await c.post("/v1/jobs", json={**CHAT, "tier": tier})
                assert resp.status_code == 202, resp.text
                seen.setdefault(path, {})[tier] = await _job_prices(platform, resp.json()["id"])
        took_quotas = _statements("quotas") - before
        assert took_quotas == (3 if path == "quotas" else 0)
    assert seen["fast"] == seen["quotas"]
    async with platform.db.session() as s:
        for tier in Tier:
            expected = await price_repo.current_price(
                s, model, tier, platform.settings.batch_discount
            )
            assert expected is not None
            assert seen["fast"][tier.value] == (
                expected.input_per_million,
                expected.output_per_million,
            )
    assert seen["fast"]["batch"][0] == Decimal("0.37") * (1 - platform.settings.batch_discount)


async def test_a_model_without_a_price_costs_nothing_on_the_fast_path(platform: Platform) -> None:
    _tenant, key = await new_tenant(platform)
    async with client(platform.url, key) as c:
        resp = await c.post("/v1/jobs", json=CHAT)
    assert resp.status_code == 202
    assert await _job_prices(platform, resp.json()["id"]) == (Decimal(0), Decimal(0))


async def test_concurrent_requests_with_one_idempotency_key_make_one_job(
    platform: Platform,
) -> None:
    """Ten at once with one key: one job row and one stream entry; every answer names it.
    With another body, the key is refused (409) and nothing is written."""
    tenant_id, key = await new_tenant(platform)
    headers = {"Idempotency-Key": "same-order"}
    async with client(platform.url, key) as c:
        answers = await asyncio.gather(
            *(c.post("/v1/jobs", json=CHAT, headers=headers) for _ in range(10))
        )
        assert {r.status_code for r in answers} == {202}
        assert len({r.json()["id"] for r in answers}) == 1
        other = await c.post("/v1/jobs", json={**CHAT, "max_tokens": 9}, headers=headers)
        assert other.status_code == 409
        assert other.json()["error"]["code"] == "idempotency_key_reused"
    stream = platform.dispatcher.names.tier_stream("standard", tenant_id)
    assert await platform.r.xlen(stream) == 1
    async with platform.db.session() as s:
        assert await job_repo.tenant_job_counts(s, tenant_id) == {("standard", "queued"): 1}


@pytest.mark.parametrize("status", ["suspended", "deleted"])
async def test_a_tenant_suspended_after_authentication_is_refused_with_nothing_written(
    platform: Platform, status: str
) -> None:
    """The fast path reads the tenant's status under its lock, not the authenticated
    record's: a suspension or deletion that committed a moment before is refused (403)."""
    from tierq.models import tenants as tenant_repo
    from tierq.services.requests import JobCreate, Refused

    tenant_id, key = await new_tenant(platform)
    async with platform.db.session() as s:
        owner = await tenant_repo.owner_of_key(s, key)
    assert owner is not None
    async with platform.db.transaction() as s:
        await tenant_repo.update_tenant(s, tenant_id, status=status)
    before = _statements("fast")
    body = JobCreate.model_validate(CHAT)
    with pytest.raises(Refused) as refused:
        await admit_as(platform, owner.tenant, body, key_id=owner.key_id)
    assert (refused.value.status, refused.value.code) == (403, "tenant_suspended")
    assert _statements("fast") == before + 1
    async with platform.db.session() as s:
        assert await job_repo.tenant_job_counts(s, tenant_id) == {}
    stream = platform.dispatcher.names.tier_stream("standard", tenant_id)
    assert await platform.r.xlen(stream) == 0


async def test_the_fast_path_recovers_from_killed_database_connections(
    platform: Platform,
) -> None:
    """Every connection to the database terminated by the server (a restart, an
    administrator's pg_terminate_backend): the next admissions open fresh ones."""
    _tenant, key = await new_tenant(platform)
    async with client(platform.url, key) as c:
        assert (await c.post("/v1/jobs", json=CHAT)).status_code == 202  # a pooled connection
        async with platform.db.engine.connect() as conn:
            killed = (
                await conn.execute(
                    text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                )
            ).scalar_one()
        assert killed >= 1
        await asyncio.sleep(0.3)  # the terminations reach the clients' sockets
        for _ in range(5):
            resp = await c.post("/v1/jobs", json=CHAT)
            assert resp.status_code == 202, resp.text


async def test_quotas_admission_does_not_check_leave_the_fast_path(platform: Platform) -> None:
    """max_running is the dispatcher's, a quota of another tier does not apply: the fast
    path admits; a limit admission checks sends the job the quota way."""
    tenant_id, key = await new_tenant(platform)
    async with admin(platform) as a:
        quota = {"max_running": 2}
        assert (await a.put(f"/admin/tenants/{tenant_id}/quota", json=quota)).is_success
        batch_only = {"tier": "batch", "requests_per_minute": 100}
        resp = await a.put(f"/admin/tenants/{tenant_id}/quota", json=batch_only)
        assert resp.is_success, resp.text
    async with client(platform.url, key) as c:
        before = _statements("quotas")
        assert (await c.post("/v1/jobs", json={**CHAT, "tier": "standard"})).status_code == 202
        assert _statements("quotas") == before
        assert (await c.post("/v1/jobs", json={**CHAT, "tier": "batch"})).status_code == 202
        assert _statements("quotas") == before + 1


def _small_job(platform: Platform, tenant_id: str, **values: Any) -> job_repo.NewJob:
    return job_repo.NewJob(
        tenant_id=tenant_id,
        tier=Tier.STANDARD,
        model=platform.settings.served_model_name,
        messages=None,
        prompt="hello",
        params={"max_tokens": 4},
        reserved_tokens=20,
        **values,
    )


async def test_concurrent_requests_with_one_key_get_its_job_whatever_the_quota(
    platform: Platform,
) -> None:
    """Ten calls of `tierq_admit` at once with one Idempotency-Key (each on a connection of
    its own, as ten API processes would make them), for a tenant allowed one request a
    minute: one admits the job; the others, which waited for the tenant's lock while it
    committed and then read it in their figures, get that job back — not a refusal."""
    tenant_id, key = await new_tenant(platform)
    async with platform.db.transaction() as s:
        await quota_repo.set_quota(s, tenant_id, "*", requests_per_minute=1)
    new = _small_job(platform, tenant_id, idempotency_key="one-job", request_hash="h")
    stores = [SqlJobStore(platform.db) for _ in range(10)]
    try:
        answers = await asyncio.gather(
            *(
                store.admit(
                    admission.Admission(f"job_key_{i}", new, None, utcnow(), 0, Decimal(0)),
                    counted=True,
                )
                for i, store in enumerate(stores)
            )
        )
    finally:
        for store in stores:
            await store.close()
    admitted = [a.job.id for a in answers if a.job is not None]
    assert len(admitted) == 1, answers
    assert all(a.replay == admitted[0] and a.same_request for a in answers if a.job is None)
    async with client(platform.url, key) as c:  # the quota holds for a new job
        assert (await c.post("/v1/jobs", json=CHAT)).status_code == 429


async def test_an_uncounted_reservation_is_sent_back_with_nothing_written(
    platform: Platform,
) -> None:
    """`tierq_admit` with quotas to check and a reservation that is only a bound answers
    count_first, having written nothing; a suspended tenant is refused first."""
    tenant_id, _key = await new_tenant(platform)
    async with platform.db.transaction() as s:
        await quota_repo.set_quota(s, tenant_id, "*", requests_per_minute=100)
    new = _small_job(platform, tenant_id)

    def request() -> admission.Admission:
        return admission.Admission(f"job_{utcnow().timestamp()}", new, None, utcnow(), 0, 0)

    sent_back = await platform.jobs.admit(request(), counted=False)
    assert sent_back.count_first and sent_back.job is None
    async with platform.db.session() as s:
        assert await job_repo.tenant_job_counts(s, tenant_id) == {}
    counted = await platform.jobs.admit(request(), counted=True)
    assert counted.job is not None and not counted.count_first
    async with admin(platform) as a:
        resp = await a.post(f"/admin/tenants/{tenant_id}/suspend")
        assert resp.is_success, resp.text
    refused = await platform.jobs.admit(request(), counted=False)
    assert not refused.count_first and refused.status == "suspended"


@pytest.mark.with_settings(default_max_queued=1)
async def test_a_replay_is_answered_before_the_queue_bound(platform: Platform) -> None:
    """A retried request with its Idempotency-Key gets its job back even when the tenant's
    queue is full (by that very job); another body with the key is a 409, not a 429."""
    _tenant, key = await new_tenant(platform)
    headers = {"Idempotency-Key": "retry-me"}
    async with client(platform.url, key) as c:
        first = await c.post("/v1/jobs", json=CHAT, headers=headers)
        assert first.status_code == 202
        again = await c.post("/v1/jobs", json=CHAT, headers=headers)
        assert again.status_code == 202 and again.json()["id"] == first.json()["id"]
        other = await c.post("/v1/jobs", json={**CHAT, "max_tokens": 9}, headers=headers)
        assert other.status_code == 409
        full = await c.post("/v1/jobs", json=CHAT)
        assert full.status_code == 429 and full.json()["error"]["code"] == "quota_exceeded"


LIMITS = ("requests_per_minute", "tokens_per_minute", "max_queued", "token_budget", "spend_budget")


async def _tenant_with_history(platform: Platform) -> str:
    """A tenant whose every quota figure is non-zero: online jobs waiting, running,
    finished (its real tokens count, not its reservation), cancelled while running and not
    billed yet, in two tiers; a batch still expanding; spend in the ledger's counters."""
    tenant_id, _key = await new_tenant(platform)
    model = platform.settings.served_model_name
    now = utcnow()
    async with platform.db.transaction() as s:
        for tier, price_in, price_out in (("standard", "0.37", "1.1"), ("interactive", "2.5", "4")):
            await price_repo.set_price(s, model, tier, Decimal(price_in), Decimal(price_out))

        async def job(tier: Tier, reserved: int, price: str = "0.5") -> str:
            new = job_repo.NewJob(
                tenant_id=tenant_id,
                tier=tier,
                model=model,
                messages=[{"role": "user", "content": "hi"}],
                prompt=None,
                params={"max_tokens": reserved // 2},
                reserved_tokens=reserved,
                input_price=Decimal(price),
                output_price=Decimal("1.25"),
            )
            return (await s.run_sync(job_repo.create_job, new))[0].id

        await job(Tier.STANDARD, 100)
        await job(Tier.STANDARD, 121, "0.37")
        await job(Tier.INTERACTIVE, 90)
        running = await job(Tier.STANDARD, 300)
        await s.run_sync(job_repo.claim_job, running, "w-test", 3)
        cancelled = await job(Tier.STANDARD, 77)
        await s.run_sync(job_repo.claim_job, cancelled, "w-test", 3)
        await s.run_sync(job_repo.cancel_one, cancelled)
        finished = await job(Tier.INTERACTIVE, 400)
        await s.execute(
            update(Job)
            .where(Job.id == finished)
            .values(status="succeeded", prompt_tokens=12, completion_tokens=30, finished_at=now)
        )
        old = await job(Tier.STANDARD, 55)  # admitted over a minute ago
        await s.execute(
            update(Job).where(Job.id == old).values(created_at=now - timedelta(seconds=90))
        )
        s.add(
            Batch(
                id=f"batch_{tenant_id}",
                tenant_id=tenant_id,
                endpoint="/v1/chat/completions",
                input_file_id="file_x",
                completion_window="24h",
                status="in_progress",
                expires_at=now + timedelta(hours=24),
                reserved_tokens=640,
                reserved_cost=Decimal("0.000321"),
            )
        )
        await s.run_sync(spend.add, tenant_id, "standard", 500, Decimal("0.00123"))
        await s.run_sync(spend.add, tenant_id, "interactive", 70, Decimal("0.0002"))
    return tenant_id


def _boundary(limit: str, figures: quota_repo.Figures, reserved: int, cost: Decimal) -> object:
    """The tightest value of `limit` that still admits the job (one less refuses it)."""
    return {
        "requests_per_minute": figures.minute_requests + 1,
        "tokens_per_minute": figures.minute_tokens + reserved,
        "max_queued": figures.queued + 1,
        "token_budget": figures.spent_tokens + figures.held_tokens + reserved,
        "spend_budget": figures.spent_cost + figures.held_cost + cost,
    }[limit]


@pytest.mark.parametrize("scope", ["*", "standard"])
@pytest.mark.parametrize("limit", LIMITS)
async def test_the_quota_function_reads_and_decides_as_models_quotas_at_every_boundary(
    platform: Platform, limit: str, scope: str
) -> None:
    """For each limit, in each scope, at its boundary and one past it: `tierq_admit` reads
    the same figures as models.quotas' statements, and admits exactly when the rule
    (models.quotas.decide) does."""
    tenant_id = await _tenant_with_history(platform)
    settings = platform.settings
    model = settings.served_model_name
    new = job_repo.NewJob(
        tenant_id=tenant_id,
        tier=Tier.STANDARD,
        model=model,
        messages=[{"role": "user", "content": "hello"}],
        prompt=None,
        params={"max_tokens": 64},
        reserved_tokens=300,
    )
    period = {"budget_period": "total" if scope == "*" else "day"}
    now = utcnow()
    async with platform.db.transaction() as s:
        price = await price_repo.current_price(s, model, Tier.STANDARD, settings.batch_discount)
        assert price is not None
        cost = quota_repo.reservation_cost(
            300, 64, price.input_per_million, price.output_per_million
        )
        probe = await quota_repo.set_quota(
            s,
            tenant_id,
            scope,
            **{field: 10**9 for field in LIMITS if field != "spend_budget"},
            spend_budget=Decimal(10**9),
            **period,
        )
        figures = await quota_repo.read_figures(s, probe, now, online=True)
    assert figures.minute_requests and figures.queued and figures.held_tokens
    assert figures.held_cost and (figures.spent_tokens or scope == "standard")
    edge = _boundary(limit, figures, 300, cost)
    past = edge - (Decimal("0.000000001") if limit == "spend_budget" else 1)  # type: ignore[operator]
    for value, admits in ((past, False), (edge, True)):
        async with platform.db.transaction() as s:
            limits = {field: None for field in LIMITS} | {limit: value}
            quota = await quota_repo.set_quota(s, tenant_id, scope, **limits, **period)
            rule = await quota_repo.check(s, quota, "standard", 300, cost, now=now)
            rule_figures = await quota_repo.read_figures(s, quota, now, online=True)
        assert (rule is None) == admits
        outcome = await platform.jobs.admit(
            admission.Admission(
                f"job_{limit}_{admits}_{tenant_id[-6:]}", new, None, now, 0, settings.batch_discount
            ),
            counted=True,
        )
        assert (outcome.job is not None) == admits
        assert outcome.reserved_cost == cost
        [(read, read_figures, held)] = outcome.quotas
        assert read == quota
        assert held == admits
        assert read_figures == rule_figures
        decided = quota_repo.decide(read, read_figures, "standard", 300, cost, now)
        assert decided == rule
