"""The admin API, quotas enforced at admission, prices, the usage ledger and invoices —
against the real PostgreSQL and Redis, with the simulated engine where jobs must run."""

from __future__ import annotations

import asyncio
import csv
import io
import json
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from tests.conftest import Platform
from tests.helpers import (
    admin,
    admit_as,
    assert_openai_error,
    client,
    jobs_of,
    new_tenant,
    until_async,
    wait_for,
)
from tierq.api.app import build_app
from tierq.models import billing
from tierq.models.tables import UsageDay, UsageHour, UsageRecord
from tierq.workers.engine.simulated_engine import CostModel

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
JOB = {"prompt": "hi", "max_tokens": 5}


def reserved(settings: Any) -> int:
    """What JOB reserves at admission: its prompt's bound (the tokenizer's count, plus a
    BOS and an EOS it may get) plus max_tokens."""
    from tierq.core.token_count import for_settings

    return for_settings(settings).reserve(None, JOB["prompt"], JOB["max_tokens"])  # type: ignore[arg-type]


async def test_the_admin_api_takes_only_the_admin_key(platform: Platform, tenant_key: str) -> None:
    async with httpx.AsyncClient(base_url=platform.url) as anon:
        assert_openai_error(await anon.get("/admin/tenants"), 401)
    async with client(platform.url, tenant_key) as tenant:
        assert_openai_error(await tenant.get("/admin/tenants"), 403, "permission_denied")
        assert_openai_error(await tenant.put("/admin/prices", json={}), 403)
    async with client(platform.url, "not-the-admin-key") as wrong:
        assert_openai_error(await wrong.get("/admin/tenants"), 401, "invalid_api_key")
    async with admin(platform) as a:
        assert (await a.get("/admin/tenants")).status_code == 200
        spec = (await a.get("/openapi.json")).json()
    assert {"/admin/tenants", "/admin/tenants/{tenant_id}/quota", "/admin/prices"} <= set(
        spec["paths"]
    )
    placeholder = platform.settings.model_copy(update={"admin_api_key": "changeme"})
    with pytest.raises(RuntimeError, match="placeholder"):
        build_app(placeholder)
    build_app(placeholder.model_copy(update={"embedded_default": True}))  # allowed there


async def test_tenants_and_keys_take_effect_on_the_running_api(platform: Platform) -> None:
    tenant_id, key = await new_tenant(
        platform, allowed_tiers=["standard", "batch"], default_tier="standard", weight=2
    )
    async with admin(platform) as a:
        dup = await a.post(
            "/admin/tenants",
            json={"name": (await a.get(f"/admin/tenants/{tenant_id}")).json()["name"]},
        )
        assert_openai_error(dup, 409, "tenant_exists")
        bad = await a.patch(f"/admin/tenants/{tenant_id}", json={"default_tier": "interactive"})
        assert_openai_error(bad, 400)
        patched = (await a.patch(f"/admin/tenants/{tenant_id}", json={"weight": 3})).json()
        assert patched["weight"] == 3 and patched["allowed_tiers"] == ["standard", "batch"]
        listed = [t["id"] for t in (await a.get("/admin/tenants")).json()["data"]]
        assert tenant_id in listed
    policy = json.loads(await platform.r.hget(platform.dispatcher.names.tenant_policy, tenant_id))
    assert policy["weight"] == 3  # published for the dispatcher

    async with client(platform.url, key) as t:
        assert (await t.post("/v1/jobs", json=JOB)).status_code == 202
        refused = await t.post("/v1/jobs", json={**JOB, "tier": "interactive"})
        assert_openai_error(refused, 403, "tier_not_allowed")
    async with admin(platform) as a:
        keys = (await a.get(f"/admin/tenants/{tenant_id}/keys")).json()["data"]
        assert len(keys) == 1 and keys[0]["last_used_at"] is not None
        assert "key" not in keys[0] and key.startswith(keys[0]["prefix"])
        revoked = (await a.delete(f"/admin/keys/{keys[0]['id']}")).json()
        assert revoked["revoked_at"] is not None
    async with client(platform.url, key) as t:  # at once, on the running API
        assert_openai_error(await t.get("/v1/jobs"), 401)

    async with admin(platform) as a:
        second = (await a.post(f"/admin/tenants/{tenant_id}/keys")).json()
    async with client(platform.url, second["key"]) as t:
        queued = (await t.post("/v1/jobs", json=JOB)).json()  # no worker: it stays queued
    async with admin(platform) as a:
        suspended = (await a.post(f"/admin/tenants/{tenant_id}/suspend")).json()
        assert suspended["status"] == "suspended"
    async with client(platform.url, second["key"]) as t:
        assert_openai_error(await t.get("/v1/jobs"), 401)
    statuses = {j.id: j.status for j in await jobs_of(platform, tenant_id)}
    assert statuses[queued["id"]] == "cancelled"  # suspension cancels queued work
    async with admin(platform) as a:
        assert (await a.post(f"/admin/tenants/{tenant_id}/resume")).json()["status"] == "active"
    async with client(platform.url, second["key"]) as t:
        assert (await t.get("/v1/jobs")).status_code == 200
    async with admin(platform) as a:
        assert (await a.delete(f"/admin/tenants/{tenant_id}")).json()["deleted"] is True
        assert_openai_error(await a.get(f"/admin/tenants/{tenant_id}"), 404)
        assert tenant_id not in [t["id"] for t in (await a.get("/admin/tenants")).json()["data"]]
    async with client(platform.url, second["key"]) as t:
        assert_openai_error(await t.get("/v1/jobs"), 401)


# "R" is replaced by what JOB reserves (ten jobs' worth), "C" by the most it may cost.
LIMITS: dict[str, tuple[dict[str, Any], str]] = {
    "requests_per_minute": ({"requests_per_minute": 10}, "rate_limit_exceeded"),
    "tokens_per_minute": ({"tokens_per_minute": "R"}, "rate_limit_exceeded"),
    "max_queued": ({"max_queued": 10}, "quota_exceeded"),
    "token_budget": ({"token_budget": "R", "budget_period": "day"}, "budget_exceeded"),
    # each job may cost (prompt x 1.00 + 5 x 2.00) / 1e6
    "spend_budget": ({"spend_budget": "C"}, "budget_exceeded"),
    "per-tier requests_per_minute": (
        {"requests_per_minute": 10, "tier": "standard"},
        "rate_limit_exceeded",
    ),
}


@pytest.mark.parametrize("limit", list(LIMITS))
async def test_100_concurrent_submissions_against_a_limit_of_10_admit_exactly_10(
    platform: Platform, limit: str
) -> None:
    quota, code = LIMITS[limit]
    each = reserved(platform.settings)
    cost = (Decimal(each - 5) * Decimal("1.00") + 5 * Decimal("2.00")) / 1_000_000
    ten = {"R": 10 * each, "C": str(10 * cost)}
    quota = {k: ten.get(v, v) if isinstance(v, str) else v for k, v in quota.items()}
    tenant_id, key = await new_tenant(platform)
    async with admin(platform) as a:
        assert (
            await a.put(
                "/admin/prices",
                json={
                    "model": MODEL,
                    "tier": "standard",
                    "input_per_million": "1.00",
                    "output_per_million": "2.00",
                },
            )
        ).status_code == 200
        resp = await a.put(f"/admin/tenants/{tenant_id}/quota", json=quota)
        assert resp.status_code == 200, resp.text
    async with client(platform.url, key) as t:
        answers = await asyncio.gather(*(t.post("/v1/jobs", json=JOB) for _ in range(100)))
        other_tier = await t.post("/v1/jobs", json={**JOB, "tier": "interactive"})
    statuses = [r.status_code for r in answers]
    assert statuses.count(202) == 10 and statuses.count(429) == 90, statuses
    for refused in (r for r in answers if r.status_code == 429):
        assert_openai_error(refused, 429, code)
        assert int(refused.headers["retry-after"]) >= 1
    jobs = await jobs_of(platform, tenant_id)
    standard = [j for j in jobs if j.tier == "standard"]
    assert len(standard) == 10  # nothing written for a refused request...
    stream = platform.dispatcher.names.tier_stream("standard", tenant_id)
    assert await platform.r.xlen(stream) == 10  # ...and nothing enqueued
    # A per-tier quota leaves the other tiers alone; a tenant-wide one holds them too
    # (but for money: the interactive tier has no price here, so it costs nothing).
    free_elsewhere = limit.startswith("per-tier") or limit == "spend_budget"
    assert other_tier.status_code == (202 if free_elsewhere else 429)
    async with admin(platform) as a:
        shown = (await a.get(f"/admin/tenants/{tenant_id}/quota")).json()["data"]
    usage = shown[0]["usage"]
    in_scope = 10 + (free_elsewhere and not limit.startswith("per-tier"))
    assert usage["queued"] == in_scope  # the quota's scope: all tiers, or its own
    assert usage["requests_last_minute"] >= 10


async def test_max_running_caps_how_many_of_a_tenants_jobs_run_at_once(platform: Platform) -> None:
    capped_id, capped_key = await new_tenant(platform)
    free_id, free_key = await new_tenant(platform)
    async with admin(platform) as a:
        await a.put(f"/admin/tenants/{capped_id}/quota", json={"max_running": 2})
    platform.start_dispatcher()
    await platform.start_worker("w1", cost=CostModel(slots=8))  # real-time speed
    # Interactive: all 8 slots are open to both, so the other tenant's 4 can run beside the
    # capped tenant's 2 whatever the order the dispatcher sees them in.
    body = {"prompt": "a story", "max_tokens": 60, "tier": "interactive"}
    async with client(platform.url, capped_key) as c, client(platform.url, free_key) as f:
        capped = [(await c.post("/v1/jobs", json=body)).json()["id"] for _ in range(6)]
        free = [(await f.post("/v1/jobs", json=body)).json()["id"] for _ in range(4)]
        peak_capped = peak_free = 0
        for _ in range(200):
            jobs = await jobs_of(platform, capped_id)
            peak_capped = max(peak_capped, sum(j.status == "running" for j in jobs))
            others = await jobs_of(platform, free_id)
            peak_free = max(peak_free, sum(j.status == "running" for j in others))
            if all(j.status == "succeeded" for j in jobs + others):
                break
            await asyncio.sleep(0.05)
        finals = [await wait_for(c, i, timeout=60) for i in capped]
        finals += [await wait_for(f, i, timeout=60) for i in free]
    assert all(j["status"] == "succeeded" for j in finals)
    assert peak_capped == 2  # capped, and used up to the cap
    assert peak_free > 2  # another tenant is not held to it


async def test_ledger_and_invoice_match_the_engines_tokens_exactly_despite_duplicates(
    platform: Platform,
) -> None:
    tenant_id, key = await new_tenant(platform)
    other_id, other_key = await new_tenant(platform)
    price_a = {
        "model": MODEL,
        "tier": "standard",
        "input_per_million": "0.15",
        "output_per_million": "0.60",
    }
    price_b = {**price_a, "input_per_million": "0.2", "output_per_million": "0.8"}
    async with admin(platform) as a, client(platform.url, key) as t:
        await a.put("/admin/prices", json=price_a)
        first = [
            (await t.post("/v1/jobs", json={"prompt": f"q{i}", "max_tokens": 9})).json()
            for i in range(6)
        ]
        await a.put("/admin/prices", json=price_b)  # for jobs admitted from now on
        second = [
            (await t.post("/v1/jobs", json={"prompt": f"r{i}", "max_tokens": 9})).json()
            for i in range(6)
        ]
        prices = (await a.get("/admin/prices")).json()["data"]
        assert [(p["tier"], p["input_per_million"]) for p in prices] == [("standard", "0.2")]
        # Every job is delivered twice: its stream entry, duplicated.
        stream = platform.dispatcher.names.tier_stream("standard", tenant_id)
        for _entry_id, fields in await platform.r.xrange(stream):
            await platform.r.xadd(stream, fields)
        assert await platform.r.xlen(stream) == 24
        platform.start_dispatcher()
        await platform.start_worker("w1")
        done = [await wait_for(t, j["id"]) for j in first + second]
        assert all(j["status"] == "succeeded" for j in done)
        inbox = platform.dispatcher.names.inbox("w1")

        async def consumed() -> bool:  # taken off the stream, and skipped by the worker
            return await platform.r.xlen(stream) == 0 and await platform.r.xlen(inbox) == 0

        await until_async(consumed, "the duplicates consumed and skipped", 5)

    async with platform.db.session() as s:
        records = list(
            (
                await s.execute(select(UsageRecord).where(UsageRecord.tenant_id == tenant_id))
            ).scalars()
        )
        jobs = {j.id: j for j in await jobs_of(platform, tenant_id)}
    assert sorted(r.job_id for r in records) == sorted(jobs)  # one record per job, once
    expected = Decimal(0)
    for r in records:
        job = jobs[r.job_id]
        assert (r.prompt_tokens, r.completion_tokens) == (job.prompt_tokens, job.completion_tokens)
        price_in, price_out = (
            (Decimal("0.15"), Decimal("0.60"))
            if r.job_id in {j["id"] for j in first}
            else (Decimal("0.2"), Decimal("0.8"))
        )
        assert (r.input_price, r.output_price) == (price_in, price_out)  # as admitted
        cost = (r.prompt_tokens * price_in + r.completion_tokens * price_out) / Decimal(1_000_000)
        assert r.cost == cost and isinstance(r.cost, Decimal)
        expected += cost
    tokens = sum((j.prompt_tokens or 0) + (j.completion_tokens or 0) for j in jobs.values())

    # The day and hour sums the job endings kept (several at once on one row) are the
    # records': a rebuild from the records writes them again as they are.
    async def sums(table: type[UsageDay] | type[UsageHour]) -> list[tuple[object, ...]]:
        async with platform.db.session() as s:
            rows = await s.execute(select(table).where(table.tenant_id == tenant_id))
            return sorted(
                (
                    d.day if isinstance(d, UsageDay) else d.hour,
                    d.tier,
                    d.model,
                    d.requests,
                    d.prompt_tokens,
                    d.completion_tokens,
                    d.cost,
                )
                for d in rows.scalars()
            )

    kept, hours = await sums(UsageDay), await sums(UsageHour)
    async with platform.db.transaction() as s:
        assert await billing.rebuild_days(s, tenant_id) == len(kept)
    assert (await sums(UsageDay), await sums(UsageHour)) == (kept, hours)
    for rows in (kept, hours):
        assert sum(d[3] for d in rows) == 12  # type: ignore[misc]
        assert sum((d[6] for d in rows), Decimal(0)) == expected  # type: ignore[misc]

    async with admin(platform) as a:
        report = (
            await a.get(f"/admin/tenants/{tenant_id}/usage", params={"group_by": "tier,model"})
        ).json()
        assert Decimal(report["total"]["cost"]) == expected
        assert report["total"]["total_tokens"] == tokens
        assert [(r["tier"], r["model"], r["requests"]) for r in report["data"]] == [
            ("standard", MODEL, 12)
        ]
        today = datetime.now(UTC).strftime("%Y-%m-%d")
        daily = (await a.get(f"/admin/tenants/{tenant_id}/usage", params={"from": today})).json()
        assert [r["day"] for r in daily["data"]] == [today]
        assert_openai_error(
            await a.get(f"/admin/tenants/{tenant_id}/usage", params={"group_by": "week"}), 400
        )

        period = datetime.now(UTC).strftime("%Y-%m")
        once = (await a.post("/admin/invoices/rollup", params={"period": period})).json()
        twice = (await a.post("/admin/invoices/rollup", params={"period": period})).json()
        assert once["data"] == twice["data"]  # reproducible: running it twice changes nothing
        invoice = (
            await a.get("/admin/invoices", params={"tenant": tenant_id, "period": period})
        ).json()["data"]
        assert len(invoice) == 1 and Decimal(invoice[0]["cost"]) == expected
        assert invoice[0]["prompt_tokens"] + invoice[0]["completion_tokens"] == tokens
        exported = (
            await a.get("/admin/invoices.csv", params={"tenant": tenant_id, "period": period})
        ).text
        rows = list(csv.DictReader(io.StringIO(exported)))
        assert [Decimal(r["cost"]) for r in rows if r["tier"] == "total"] == [expected]
    async with client(platform.url, key) as t, client(platform.url, other_key) as o:
        own = (await t.get("/v1/usage", params={"group_by": "model"})).json()
        assert Decimal(own["total"]["cost"]) == expected
        theirs = (await o.get("/v1/usage")).json()
        assert theirs["total"]["requests"] == 0 and theirs["tenant_id"] == other_id


async def test_no_tenant_reaches_another_tenants_jobs_files_batches_or_usage(
    platform: Platform,
) -> None:
    _a_id, a_key = await new_tenant(platform)
    _b_id, b_key = await new_tenant(platform)
    line = {
        "custom_id": "x",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    }
    async with client(platform.url, a_key) as a:
        job = (await a.post("/v1/jobs", json=JOB)).json()
        file = (
            await a.post(
                "/v1/files",
                files={"file": ("in.jsonl", json.dumps(line).encode() + b"\n")},
                data={"purpose": "batch"},
            )
        ).json()
        batch = (
            await a.post(
                "/v1/batches",
                json={
                    "input_file_id": file["id"],
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                },
            )
        ).json()
    async with client(platform.url, b_key) as b:
        for method, path in (
            ("GET", f"/v1/jobs/{job['id']}"),
            ("POST", f"/v1/jobs/{job['id']}/cancel"),
            ("GET", f"/v1/jobs/{job['id']}/events"),
            ("GET", f"/v1/files/{file['id']}"),
            ("GET", f"/v1/files/{file['id']}/content"),
            ("DELETE", f"/v1/files/{file['id']}"),
            ("GET", f"/v1/batches/{batch['id']}"),
            ("POST", f"/v1/batches/{batch['id']}/cancel"),
        ):
            assert_openai_error(await b.request(method, path), 404)
        assert (await b.get("/v1/jobs")).json()["data"] == []
        assert (await b.get("/v1/files")).json()["data"] == []
        assert (await b.get("/v1/batches")).json()["data"] == []
        assert (await b.get("/v1/usage")).json()["total"]["requests"] == 0
        assert_openai_error(await b.get(f"/admin/tenants/{_a_id}/usage"), 403)
    async with client(platform.url, a_key) as a:
        assert (await a.get(f"/v1/jobs/{job['id']}")).json()["status"] == "queued"


async def test_the_batch_tier_pays_the_standard_price_less_the_discount(platform: Platform) -> None:
    _tenant_id, key = await new_tenant(platform)
    async with admin(platform) as a:
        await a.put(
            "/admin/prices",
            json={
                "model": MODEL,
                "tier": "standard",
                "input_per_million": "0.30",
                "output_per_million": "1.20",
            },
        )
        derived = [p for p in (await a.get("/admin/prices")).json()["data"] if p["tier"] == "batch"]
        assert derived == []  # only prices that were set are listed
    platform.start_dispatcher()
    await platform.start_worker("w1")
    async with client(platform.url, key) as t:
        job = (await t.post("/v1/jobs", json={**JOB, "tier": "batch"})).json()
        assert (await wait_for(t, job["id"]))["status"] == "succeeded"
    async with platform.db.session() as s:
        record = await s.get(UsageRecord, job["id"])
    assert record is not None
    assert (record.input_price, record.output_price) == (Decimal("0.150"), Decimal("0.600"))
    assert record.cost == (
        record.prompt_tokens * Decimal("0.15") + record.completion_tokens * Decimal("0.6")
    ) / Decimal(1_000_000)


async def test_operators_use_the_admin_cli(platform: Platform) -> None:
    from typer.testing import CliRunner

    from tierq.cli.main import app

    runner = CliRunner()
    args = ["--url", platform.url, "--admin-key", platform.settings.admin_api_key or ""]

    def run(*argv: str) -> str:
        result = runner.invoke(app, ["admin", *argv, *args])
        assert result.exit_code == 0, result.output
        return result.output

    async def cli(*argv: str) -> str:  # the platform serves from this event loop
        return await asyncio.to_thread(run, *argv)

    created = json.loads(await cli("tenant", "create", "cli-tenant", "--weight", "2"))
    tenant_id, key = created["id"], created["key"]["key"]
    assert created["weight"] == 2
    assert "cli-tenant" in await cli("tenant", "list")
    quota = json.loads(await cli("quota", "set", tenant_id, "--rpm", "1"))
    assert quota["requests_per_minute"] == 1 and quota["max_queued"] is None
    async with client(platform.url, key) as t:
        assert (await t.post("/v1/jobs", json=JOB)).status_code == 202
        assert_openai_error(await t.post("/v1/jobs", json=JOB), 429, "rate_limit_exceeded")
    second = json.loads(await cli("key", "create", tenant_id))
    assert second["key"].startswith(second["prefix"])
    revoked = json.loads(await cli("key", "revoke", second["id"]))
    assert revoked["revoked_at"] is not None
    async with client(platform.url, second["key"]) as t:
        assert_openai_error(await t.get("/v1/jobs"), 401)
    assert json.loads(await cli("tenant", "suspend", tenant_id))["status"] == "suspended"
    async with client(platform.url, key) as t:
        assert_openai_error(await t.get("/v1/jobs"), 401)
    assert "total" in await cli("usage", tenant_id, "--group-by", "tier")
    async with admin(platform) as a:  # per-tenant series: behind the admin key
        metrics = (await a.get("/admin/metrics")).text
    assert (
        f'tierq_tenant_jobs_refused_total{{code="rate_limit_exceeded",tenant="{tenant_id}",tier="standard"}}'
        in metrics
    )
    assert f'tierq_tenant_jobs_admitted_total{{tenant="{tenant_id}",tier="standard"}}' in metrics


@pytest.mark.parametrize("with_quota", [False, True])
async def test_a_suspension_committed_after_authentication_still_refuses_the_job(
    platform: Platform, with_quota: bool
) -> None:
    """Admission reads the tenant's status under a lock on its row, in the transaction that
    inserts the job — not the snapshot authentication took a moment earlier."""
    from tierq.models import tenants as tenant_repo
    from tierq.services.requests import JobCreate, Refused

    tenant_id, key = await new_tenant(platform)
    if with_quota:
        async with admin(platform) as a:
            await a.put(f"/admin/tenants/{tenant_id}/quota", json={"requests_per_minute": 100})
    async with platform.db.session() as s:
        owner = await tenant_repo.owner_of_key(s, key)
    assert owner is not None and owner.tenant.status == "active"  # authenticated
    async with admin(platform) as a:
        assert (await a.post(f"/admin/tenants/{tenant_id}/suspend")).status_code == 200
    body = JobCreate(messages=[{"role": "user", "content": "hi"}], max_tokens=8)  # type: ignore[list-item]
    with pytest.raises(Refused) as refused:
        await admit_as(platform, owner.tenant, body)
    assert refused.value.status == 403 and refused.value.code == "tenant_suspended"
    assert await jobs_of(platform, tenant_id) == []
