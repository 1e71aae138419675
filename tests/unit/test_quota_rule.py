"""models.quotas.decide: the one rule every store's admission decides or words its refusals
by (SQLite's and the in-memory store's judge by it; PostgreSQL's function compares the same
figures the same way), checked on its own."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest

from tierq.models.quotas import Figures, QuotaRecord, decide

NOW = datetime(2026, 11, 30, 13, 0, 30, tzinfo=UTC)


def quota(tier: str = "*", **limits: Any) -> QuotaRecord:
    values: dict[str, Any] = {
        "requests_per_minute": None,
        "tokens_per_minute": None,
        "max_running": None,
        "max_queued": None,
        "token_budget": None,
        "spend_budget": None,
        "budget_period": "month",
    }
    values.update(limits)
    return QuotaRecord(tenant_id="ten_1", tier=tier, **values)


def test_no_limit_admits_whatever_the_figures() -> None:
    busy = Figures(10**6, 10**9, NOW, 10**6, 10**9, Decimal(10**6), 10**9, Decimal(10**6))
    assert decide(quota(max_running=1), busy, "standard", 10**6, Decimal(1), NOW) is None


@pytest.mark.parametrize(
    ("limits", "figures", "at_limit"),
    [
        # requests: refused once the window holds as many as the limit
        ({"requests_per_minute": 5}, Figures(minute_requests=4), Figures(minute_requests=5)),
        # tokens: the job's reservation counts; exactly at the limit is admitted
        ({"tokens_per_minute": 1000}, Figures(minute_tokens=900), Figures(minute_tokens=901)),
        ({"max_queued": 3}, Figures(queued=2), Figures(queued=3)),
        # budgets: spent + held + this job
        (
            {"token_budget": 1000},
            Figures(spent_tokens=600, held_tokens=300),
            Figures(spent_tokens=600, held_tokens=301),
        ),
        (
            {"spend_budget": Decimal("0.01")},
            Figures(spent_cost=Decimal("0.006"), held_cost=Decimal("0.003")),
            Figures(spent_cost=Decimal("0.006"), held_cost=Decimal("0.0030000001")),
        ),
    ],
)
def test_each_limit_admits_up_to_its_value_and_refuses_past_it(
    limits: dict[str, Any], figures: Figures, at_limit: Figures
) -> None:
    q = quota(**limits)
    # the job: 100 tokens reserved, costing 0.001
    assert decide(q, figures, "standard", 100, Decimal("0.001"), NOW) is None
    refusal = decide(q, at_limit, "standard", 100, Decimal("0.001"), NOW)
    assert refusal is not None
    expected = {
        "requests_per_minute": "rate_limit_exceeded",
        "tokens_per_minute": "rate_limit_exceeded",
        "max_queued": "quota_exceeded",
        "token_budget": "budget_exceeded",
        "spend_budget": "budget_exceeded",
    }[next(iter(limits))]
    assert refusal.code == expected


def test_a_rate_limit_says_when_the_oldest_request_leaves_the_window() -> None:
    figures = Figures(minute_requests=2, minute_oldest=NOW - timedelta(seconds=45))
    refusal = decide(quota(requests_per_minute=2), figures, "standard", 1, Decimal(0), NOW)
    assert refusal is not None and refusal.retry_after_s == 15
    # no admission in the window to wait for (a limit of 0): one second
    empty = decide(quota(requests_per_minute=0), Figures(), "standard", 1, Decimal(0), NOW)
    assert empty is not None and empty.retry_after_s == 1


def test_a_budget_says_when_its_period_ends_and_what_it_counted() -> None:
    figures = Figures(spent_tokens=90, held_tokens=5)
    day = quota(token_budget=100, budget_period="day")
    refusal = decide(day, figures, "standard", 10, Decimal(0), NOW)
    assert refusal is not None
    assert refusal.retry_after_s == 11 * 3600 - 30  # to midnight UTC
    assert "90 used, 5 reserved, 10 requested" in refusal.message
    total = decide(
        quota(token_budget=100, budget_period="total"), figures, "x", 10, Decimal(0), NOW
    )
    assert total is not None and total.retry_after_s == 3600  # a total never resets


def test_a_tier_quota_names_its_tier_and_the_first_broken_limit_wins() -> None:
    q = quota("batch", requests_per_minute=1, token_budget=1)
    figures = Figures(minute_requests=1, spent_tokens=1)
    refusal = decide(q, figures, "batch", 1, Decimal(0), NOW)
    assert refusal is not None and refusal.code == "rate_limit_exceeded"
    assert "for the batch tier" in refusal.message


def test_offline_admission_checks_budgets_only() -> None:
    q = quota(requests_per_minute=0, max_queued=0, token_budget=10)
    full = Figures(minute_requests=10, queued=10)
    assert decide(q, full, "batch", 5, Decimal(0), NOW, online=False) is None
    over = decide(q, full, "batch", 11, Decimal(0), NOW, online=False)
    assert over is not None and over.code == "budget_exceeded"
