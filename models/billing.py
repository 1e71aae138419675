"""The usage ledger and invoices: every SQL statement about them.

The ledger is `usage_records`, one row per finished job (its primary key is the job id,
so a job delivered twice is recorded once), with the tokens the engine reported, the
prices the job was admitted under and the cost, all exact Decimals. Sums are taken in
Python, in Decimal, so the result is the same on PostgreSQL and SQLite.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from models.records import as_utc, unix
from models.tables import Invoice, UsageRecord, utcnow
from tierq.ids import new_id

GROUPS = ("day", "tier", "model")


@dataclass
class Totals:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: Decimal = Decimal(0)

    def add(self, row: UsageRecord) -> None:
        self.requests += 1
        self.prompt_tokens += row.prompt_tokens
        self.completion_tokens += row.completion_tokens
        self.cost += row.cost

    def to_api(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "cost": str(self.cost),
        }


async def ledger(
    s: AsyncSession,
    tenant_id: str | None,
    start: datetime | None,
    end: datetime | None,
) -> list[UsageRecord]:
    stmt = select(UsageRecord)
    if tenant_id is not None:
        stmt = stmt.where(UsageRecord.tenant_id == tenant_id)
    if start is not None:
        stmt = stmt.where(UsageRecord.created_at >= start)
    if end is not None:
        stmt = stmt.where(UsageRecord.created_at < end)
    return list((await s.execute(stmt.order_by(UsageRecord.created_at))).scalars())


def _key(row: UsageRecord, group_by: tuple[str, ...]) -> tuple[str, ...]:
    parts = []
    for g in group_by:
        if g == "day":
            parts.append((as_utc(row.created_at) or row.created_at).strftime("%Y-%m-%d"))
        elif g == "tier":
            parts.append(row.tier)
        else:
            parts.append(row.model)
    return tuple(parts)


def group(rows: Iterable[UsageRecord], group_by: tuple[str, ...]) -> list[dict[str, Any]]:
    """Rows of totals per group (sorted by its key), e.g. per day and tier."""
    totals: dict[tuple[str, ...], Totals] = defaultdict(Totals)
    for row in rows:
        totals[_key(row, group_by)].add(row)
    return [
        {**dict(zip(group_by, key, strict=True)), **t.to_api()} for key, t in sorted(totals.items())
    ]


def total(rows: Iterable[UsageRecord]) -> Totals:
    t = Totals()
    for row in rows:
        t.add(row)
    return t


# --- invoices ------------------------------------------------------------------------


def month_bounds(period: str) -> tuple[datetime, datetime]:
    year, month = (int(x) for x in period.split("-"))
    start = datetime(year, month, 1, tzinfo=UTC)
    end = datetime(year + (month == 12), month % 12 + 1, 1, tzinfo=UTC)
    return start, end


async def roll_up(s: AsyncSession, period: str) -> list[str]:
    """Write (or rewrite) every tenant's invoice for the month from the ledger; running it
    twice changes nothing. Returns the tenant ids invoiced."""
    start, end = month_bounds(period)
    by_tenant: dict[str, list[UsageRecord]] = defaultdict(list)
    for row in await ledger(s, None, start, end):
        by_tenant[row.tenant_id].append(row)
    existing = {
        inv.tenant_id: inv
        for inv in (await s.execute(select(Invoice).where(Invoice.period == period))).scalars()
    }
    for tenant_id, rows in by_tenant.items():
        t = total(rows)
        lines = group(rows, ("tier", "model"))
        inv = existing.get(tenant_id)
        if inv is None:
            inv = Invoice(id=new_id("inv"), tenant_id=tenant_id, period=period)
            s.add(inv)
        elif (
            inv.requests == t.requests
            and inv.prompt_tokens == t.prompt_tokens
            and inv.completion_tokens == t.completion_tokens
            and inv.cost == t.cost
            and inv.lines == lines
        ):
            continue  # unchanged: not even its updated_at moves
        inv.requests = t.requests
        inv.prompt_tokens = t.prompt_tokens
        inv.completion_tokens = t.completion_tokens
        inv.cost = t.cost
        inv.lines = lines
        inv.updated_at = utcnow()
    await s.flush()
    return sorted(by_tenant)


def invoice_to_api(inv: Invoice) -> dict[str, Any]:
    return {
        "id": inv.id,
        "object": "invoice",
        "tenant_id": inv.tenant_id,
        "period": inv.period,
        "requests": inv.requests,
        "prompt_tokens": inv.prompt_tokens,
        "completion_tokens": inv.completion_tokens,
        "cost": str(inv.cost),
        "lines": inv.lines,
        "updated_at": unix(inv.updated_at),
    }


async def invoices(
    s: AsyncSession, tenant_id: str | None, period: str | None
) -> list[dict[str, Any]]:
    stmt = select(Invoice)
    if tenant_id is not None:
        stmt = stmt.where(Invoice.tenant_id == tenant_id)
    if period is not None:
        stmt = stmt.where(Invoice.period == period)
    stmt = stmt.order_by(Invoice.period, Invoice.tenant_id)
    return [invoice_to_api(inv) for inv in (await s.execute(stmt)).scalars()]
