"""Admission's fast path (models/admission.py: one statement on PostgreSQL) against the
exact path (api/jobs/service.py `_admit_exact`): the same jobs, prices, refusals and
idempotency, on real PostgreSQL and Redis."""

from __future__ import annotations

import asyncio
from decimal import Decimal

import pytest
from sqlalchemy import text

from models import jobs as job_repo
from models import prices as price_repo
from tests.conftest import Platform
from tests.helpers import admin, admit_as, client, new_tenant
from tierq import metrics
from tierq.tiers import Tier

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def _statements(path: str) -> float:
    return metrics.ADMISSION_STATEMENTS.labels(path=path)._value.get()


async def _job_prices(platform: Platform, job_id: str) -> tuple[Decimal | None, Decimal | None]:
    async with platform.db.session() as s:
        job = await job_repo.get_job(s, job_id)
    assert job is not None
    return job.input_price, job.output_price


async def test_the_fast_path_prices_every_tier_as_the_exact_path(platform: Platform) -> None:
    """A tier's own price; the batch tier without one pays the standard price less the
    discount (computed in SQL on the fast path, in Python on the exact one); a model
    without a price costs 0. A tenant with a quota takes the exact path: both agree."""
    model = platform.settings.served_model_name
    async with admin(platform) as a:
        price = {"model": model, "input_per_million": "0.37", "output_per_million": "1.1"}
        assert (await a.put("/admin/prices", json={**price, "tier": "standard"})).is_success
        interactive = {**price, "tier": "interactive", "input_per_million": "2.50"}
        assert (await a.put("/admin/prices", json=interactive)).is_success
    _fast_tenant, fast_key = await new_tenant(platform)
    exact_tenant, exact_key = await new_tenant(platform)
    async with admin(platform) as a:
        quota = {"requests_per_minute": 1000}
        assert (await a.put(f"/admin/tenants/{exact_tenant}/quota", json=quota)).is_success
    seen: dict[str, dict[str, tuple[Decimal | None, Decimal | None]]] = {}
    for path, key in (("fast", fast_key), ("exact", exact_key)):
        before = _statements("exact")
        async with client(platform.url, key) as c:
            for tier in ("interactive", "standard", "batch"):
                resp = await c.post("/v1/jobs", json={**CHAT, "tier": tier})
                assert resp.status_code == 202, resp.text
                seen.setdefault(path, {})[tier] = await _job_prices(platform, resp.json()["id"])
        took_exact = _statements("exact") - before
        assert took_exact == (3 if path == "exact" else 0)
    assert seen["fast"] == seen["exact"]
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
    from api.errors import APIError
    from models import tenants as tenant_repo
    from tierq.requests import JobCreate

    tenant_id, key = await new_tenant(platform)
    async with platform.db.session() as s:
        owner = await tenant_repo.owner_of_key(s, key)
    assert owner is not None
    async with platform.db.transaction() as s:
        await tenant_repo.update_tenant(s, tenant_id, status=status)
    before = _statements("fast")
    body = JobCreate.model_validate(CHAT)
    with pytest.raises(APIError) as refused:
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
    path admits; a limit admission checks sends the job the exact way."""
    tenant_id, key = await new_tenant(platform)
    async with admin(platform) as a:
        quota = {"max_running": 2}
        assert (await a.put(f"/admin/tenants/{tenant_id}/quota", json=quota)).is_success
        batch_only = {"tier": "batch", "requests_per_minute": 100}
        resp = await a.put(f"/admin/tenants/{tenant_id}/quota", json=batch_only)
        assert resp.is_success, resp.text
    async with client(platform.url, key) as c:
        before = _statements("exact")
        assert (await c.post("/v1/jobs", json={**CHAT, "tier": "standard"})).status_code == 202
        assert _statements("exact") == before
        assert (await c.post("/v1/jobs", json={**CHAT, "tier": "batch"})).status_code == 202
        assert _statements("exact") == before + 1


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
