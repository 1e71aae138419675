"""Per-tenant metrics: behind the admin key (`/admin/metrics`), never on the open `/metrics`,
and at most TENANT_METRICS_MAX tenant label values per process — against the real
PostgreSQL and Redis."""

from __future__ import annotations

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Platform
from tests.helpers import admin, assert_openai_error, client, new_tenant, wait_for
from tierq.core.metrics import OTHER_TENANT
from tierq.core.settings import Settings
from tierq.models.db import Database

pytestmark = pytest.mark.integration

JOB = {"prompt": "hi", "max_tokens": 5}


def samples(text: str, name: str) -> dict[frozenset[tuple[str, str]], float]:
    """The values of one counter in a Prometheus exposition, by their labels."""
    return {
        frozenset(s.labels.items()): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def by_tenant(text: str, name: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for labels, value in samples(text, name).items():
        tenant = dict(labels)["tenant"]
        totals[tenant] = totals.get(tenant, 0) + value
    return totals


async def test_tenant_series_are_behind_the_admin_key(platform: Platform) -> None:
    tenant_id, key = await new_tenant(platform)
    async with admin(platform) as a:
        await a.put(f"/admin/tenants/{tenant_id}/quota", json={"requests_per_minute": 2})
    platform.start_dispatcher()
    await platform.start_worker("w1")
    async with client(platform.url, key) as t:
        ids = [(await t.post("/v1/jobs", json=JOB)).json()["id"] for _ in range(2)]
        assert_openai_error(await t.post("/v1/jobs", json=JOB), 429, "rate_limit_exceeded")
        done = [await wait_for(t, job_id) for job_id in ids]
    assert all(j["status"] == "succeeded" for j in done), done
    completion = sum(j["usage"]["completion_tokens"] for j in done)

    async with httpx.AsyncClient(base_url=platform.url) as anon:
        open_metrics = await anon.get("/metrics")
        assert open_metrics.status_code == 200
        assert tenant_id not in open_metrics.text
        assert "tierq_tenant_" not in open_metrics.text and 'tenant="' not in open_metrics.text
        assert "tierq_jobs_submitted_total" in open_metrics.text  # the rest stay open
        assert "tierq_tokens_served_total" in open_metrics.text
        assert_openai_error(await anon.get("/admin/metrics"), 401)
    async with client(platform.url, key) as t:
        assert_openai_error(await t.get("/admin/metrics"), 403, "permission_denied")
    async with admin(platform) as a:
        resp = await a.get("/admin/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    text = resp.text
    assert by_tenant(text, "tierq_tenant_jobs_admitted_total") == {tenant_id: 2}
    refused = samples(text, "tierq_tenant_jobs_refused_total")
    assert refused == {
        frozenset({("tenant", tenant_id), ("tier", "standard"), ("code", "rate_limit_exceeded")}): 1
    }
    served = samples(text, "tierq_tenant_tokens_served_total")
    labels = frozenset({("tenant", tenant_id), ("tier", "standard"), ("kind", "completion")})
    assert served[labels] == completion > 0
    assert "tierq_jobs_submitted_total" not in text  # the untenanted series stay on /metrics


async def test_at_most_tenant_metrics_max_tenants_are_named(
    settings: Settings, db: Database, redis_client: aioredis.Redis
) -> None:
    platform = Platform(settings.model_copy(update={"tenant_metrics_max": 2}), db, redis_client)
    await platform.start_api()
    try:
        tenants = [await new_tenant(platform) for _ in range(4)]
        submitted: dict[str, int] = {}
        for n, (tenant_id, key) in enumerate(tenants, start=1):  # 1, 2, 3 and 4 jobs
            async with client(platform.url, key) as t:
                for _ in range(n):
                    assert (await t.post("/v1/jobs", json=JOB)).status_code == 202
            submitted[tenant_id] = n
        async with admin(platform) as a:
            text = (await a.get("/admin/metrics")).text
        async with httpx.AsyncClient(base_url=platform.url) as anon:
            open_text = (await anon.get("/metrics")).text
    finally:
        await platform.stop()

    admitted = by_tenant(text, "tierq_tenant_jobs_admitted_total")
    (first, _), (second, _), (third, _), (fourth, _) = tenants
    # The first two tenants counted keep their ids; the later ones share "other".
    assert admitted == {
        first: 1,
        second: 2,
        OTHER_TENANT: submitted[third] + submitted[fourth],
    }
    assert sum(admitted.values()) == sum(submitted.values()) == 10
    assert third not in text and fourth not in text
    assert not any(tenant_id in open_text for tenant_id in submitted)
