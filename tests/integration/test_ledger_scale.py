"""A month of a busy tenant's ledger — 1,000,000 usage records on the real PostgreSQL —
reported by `GET /v1/usage`, the admin usage report and the invoice roll-up: the totals
are exact (Decimal, every record counted once), the API process's memory does not grow
with the ledger, and a request the same API process serves meanwhile is answered while
four reports are in flight (the sums are the database's; the event loop only awaits them).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from decimal import Decimal
from pathlib import Path

import psutil
import pytest
from sqlalchemy import text

from tests.conftest import Platform
from tests.helpers import admin, client, new_tenant, wait_for

pytestmark = pytest.mark.integration

RECORDS = 1_000_000
MONTH = "2026-11"
# The records' shape, written by PostgreSQL itself (generate_series) and recomputed in
# Python for the expected totals: 3 tiers, 2 models, costs of varied scale.
TIERS = ("batch", "standard", "interactive")


def _prompt(g: int) -> int:
    return 10 + g % 7


def _completion(g: int) -> int:
    return 20 + g % 11


def _cost(g: int) -> Decimal:
    # micro-dollars with up to 7 places; every 1000th record a correction with 12 places
    base = Decimal(_prompt(g) * 3 + _completion(g) * 7).scaleb(-7)
    return base + (Decimal(g % 13).scaleb(-12) if g % 1000 == 0 else 0)


async def _fill(platform: Platform, tenant_id: str) -> None:
    async with platform.db.transaction() as s:
        # The job rows are not needed for the ledger's sums: their foreign keys are not
        # checked for this bulk load (a superuser's replica role), as a restore would.
        await s.execute(text("SET LOCAL session_replication_role = replica"))
        await s.execute(
            text(
                """
                INSERT INTO usage_records (job_id, tenant_id, tier, model, prompt_tokens,
                    completion_tokens, input_price, output_price, cost, created_at)
                SELECT 'job_ledger_' || g, :tenant,
                    (ARRAY['batch', 'standard', 'interactive'])[1 + g % 3],
                    'model-' || (g % 2), 10 + g % 7, 20 + g % 11, '3', '7',
                    ((10 + g % 7) * 3 + (20 + g % 11) * 7) * 0.0000001
                        + CASE WHEN g % 1000 = 0 THEN (g % 13) * 0.000000000001 ELSE 0 END,
                    timestamptz '2026-11-01 00:00:00+00' + ((g / 7) % 30) * interval '1 day'
                        + (g % 86400) * interval '1 second'
                FROM generate_series(0, :n - 1) AS g
                """
            ),
            {"tenant": tenant_id, "n": RECORDS},
        )
    async with platform.db.session() as s:
        await s.execute(text("ANALYZE usage_records"))
    # Loaded around tierq, as an import would be: its day sums are recomputed by the
    # command an operator runs (one row per day, tier and model).
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "tierq"),
        "rebuild-usage-days",
        "--tenant",
        tenant_id,
        env={**os.environ, "DATABASE_URL": platform.settings.resolved_database_url},
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0 and int(out.decode().split()[-1]) == 30 * 3 * 2


def _expected() -> tuple[dict[str, tuple[int, int, int, Decimal]], Decimal]:
    per_tier: dict[str, list[int | Decimal]] = {t: [0, 0, 0, Decimal(0)] for t in TIERS}
    for g in range(RECORDS):
        row = per_tier[TIERS[g % 3]]
        row[0] += 1
        row[1] += _prompt(g)
        row[2] += _completion(g)
        row[3] += _cost(g)
    out = {t: (int(r[0]), int(r[1]), int(r[2]), Decimal(r[3])) for t, r in per_tier.items()}
    return out, sum((r[3] for r in out.values()), Decimal(0))


def _expected_cut() -> tuple[int, Decimal]:
    """The records in [11-01 12:00, 11-30 12:00): all of days 1..28, half of 0 and 29."""
    n, cost = 0, Decimal(0)
    for g in range(RECORDS):
        day, second = (g // 7) % 30, g % 86400
        if 1 <= day <= 28 or (day == 0 and second >= 43200) or (day == 29 and second < 43200):
            n += 1
            cost += _cost(g)
    return n, cost


async def test_a_million_records_report_exactly_and_block_nothing(platform: Platform) -> None:
    tenant_id, key = await new_tenant(platform)
    await _fill(platform, tenant_id)
    expected, total_cost = await asyncio.to_thread(_expected)
    platform.start_dispatcher()
    await platform.start_worker("w1")
    month = {"from": "2026-11-01T00:00:00Z", "to": "2026-12-01T00:00:00Z"}
    async with client(platform.url, key, timeout=300) as c:
        job = (await c.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 4})).json()
        await wait_for(c, job["id"])
        rss_before = psutil.Process().memory_info().rss

        report = (await c.get("/v1/usage", params={**month, "group_by": "tier"})).json()
        by_tier = {row["tier"]: row for row in report["data"]}
        assert set(by_tier) == set(TIERS)
        for tier, (n, prompt, completion, cost) in expected.items():
            row = by_tier[tier]
            assert (row["requests"], row["prompt_tokens"], row["completion_tokens"]) == (
                n,
                prompt,
                completion,
            )
            assert Decimal(row["cost"]) == cost
        assert report["total"]["requests"] == RECORDS
        assert Decimal(report["total"]["cost"]) == total_cost

        # Four reports at once of a range that cuts its first and last days at noon (28
        # whole days from their day sums, two half days of records, ~36,000), by day,
        # tier and model, while the same process serves a tenant's job lookups, one
        # after another: none waits long.
        cut = {"from": "2026-11-01T12:00:00Z", "to": "2026-11-30T12:00:00Z"}
        cut_requests, cut_cost = await asyncio.to_thread(_expected_cut)
        reports_done = asyncio.Event()
        waits: list[float] = []

        async def a_report() -> None:
            resp = await c.get("/v1/usage", params={**cut, "group_by": "day,tier,model"})
            assert resp.status_code == 200
            assert resp.json()["total"]["requests"] == cut_requests
            assert Decimal(resp.json()["total"]["cost"]) == cut_cost
            assert len(resp.json()["data"]) == 30 * 3 * 2

        async def reports() -> None:
            await asyncio.gather(*(a_report() for _ in range(4)))
            reports_done.set()

        async def lookups() -> None:
            while not reports_done.is_set():
                sent = time.monotonic()
                assert (await c.get(f"/v1/jobs/{job['id']}")).status_code == 200
                waits.append(time.monotonic() - sent)

        started = time.monotonic()
        await asyncio.gather(reports(), lookups())
        took = time.monotonic() - started
        # The reports' sums run in PostgreSQL: a lookup meanwhile is a few milliseconds
        # (a ledger summed on the event loop held each one for seconds).
        assert waits and max(waits) < 2.0, (took, sorted(waits)[-5:])

        # The admin's report of the tenant and the month's invoice: the same totals.
        async with admin(platform) as a:
            adm = (await a.get(f"/admin/tenants/{tenant_id}/usage", params=month)).json()
            assert adm["total"] == report["total"]
            rolled = (await a.post("/admin/invoices/rollup", params={"period": MONTH})).json()
        invoice = next(i for i in rolled["data"] if i["tenant_id"] == tenant_id)
        assert invoice["requests"] == RECORDS
        assert Decimal(invoice["cost"]) == total_cost
        assert {line["tier"] for line in invoice["lines"]} == set(TIERS)
        assert len(invoice["lines"]) == 3 * 2
        # Nothing the size of the ledger was held by the API process.
        grown = psutil.Process().memory_info().rss - rss_before
        assert grown < 150 * 2**20, f"the API process grew {grown / 2**20:.0f} MB"
