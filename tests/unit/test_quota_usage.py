"""models.quotas' usage report, its pure parts: which jobs a quota's scope covers, and the
usage as `GET /admin/tenants/{id}/quota` shows it."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

from tierq.models.quotas import QuotaUsage, in_scope

COUNTS = {
    ("standard", "queued"): 3,
    ("interactive", "queued"): 2,
    ("standard", "running"): 1,
    ("batch", "running"): 4,
}


def test_a_tenant_wide_quota_covers_every_tier() -> None:
    assert in_scope(COUNTS, "*", "queued") == 5
    assert in_scope(COUNTS, "*", "running") == 5


def test_a_per_tier_quota_covers_its_own_tier_only() -> None:
    assert in_scope(COUNTS, "standard", "queued") == 3
    assert in_scope(COUNTS, "standard", "running") == 1
    assert in_scope(COUNTS, "interactive", "running") == 0
    assert in_scope(COUNTS, "batch", "queued") == 0
    assert in_scope({}, "*", "queued") == 0


def test_usage_as_the_admin_api_shows_it() -> None:
    usage = QuotaUsage(
        requests_last_minute=7,
        tokens_last_minute=1_234,
        running=1,
        queued=3,
        period_start=datetime(2026, 11, 1, tzinfo=UTC),
        tokens_this_period=98_765,
        spend_this_period=Decimal("0.012300"),
    )
    assert usage.to_api() == {
        "requests_last_minute": 7,
        "tokens_last_minute": 1_234,
        "running": 1,
        "queued": 3,
        "period_start": 1_793_491_200,
        "tokens_this_period": 98_765,
        "spend_this_period": "0.012300",
    }


def test_a_total_budget_has_no_period_start() -> None:
    usage = QuotaUsage(0, 0, 0, 0, None, 0, Decimal(0))
    assert usage.to_api()["period_start"] is None
    assert usage.to_api()["spend_this_period"] == "0"
