"""Spend counters: a tenant's ledger summed per tier over each day, month and all time,
kept in the transaction that writes each usage record. A budget check reads at most one
row per tier — O(1) however long the ledger grows — instead of summing the ledger.

Money stays Decimal: counters are stored as exact strings (models.tables.Money) and
added to in Python under the rows' locks, always in the same order (no deadlock between
two writers of one tenant)."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

from sqlalchemy import Connection, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from tierq.models.tables import SpendCounter, utcnow

TOTAL = "total"


def period_keys(at: datetime) -> tuple[str, str, str]:
    """The day, the month and all time that a record written at `at` (UTC) falls in."""
    at = at.astimezone(UTC)
    return f"day:{at:%Y-%m-%d}", f"month:{at:%Y-%m}", TOTAL


def period_key(period: str, now: datetime) -> str:
    """The counter of a budget period ("day", "month" or "total") that holds `now`."""
    day, month, total = period_keys(now)
    return {"day": day, "month": month}.get(period, total)


def add(
    s: Session,
    tenant_id: str,
    tier: str,
    tokens: int,
    cost: Decimal,
    at: datetime | None = None,
) -> None:
    """Add one usage record's tokens and cost to its counters (in the caller's transaction).
    Synchronous, like the job's final transition it is written with (the job store's `finish`,
    tierq/models/store/sql.py)."""
    keys = period_keys(at or utcnow())
    dialect = s.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    s.execute(
        insert(SpendCounter)
        .values(
            [
                {
                    "tenant_id": tenant_id,
                    "tier": tier,
                    "period_key": k,
                    "tokens": 0,
                    "cost": Decimal(0),
                }
                for k in keys
            ]
        )
        .on_conflict_do_nothing()
    )
    stmt = (
        select(SpendCounter)
        .where(
            SpendCounter.tenant_id == tenant_id,
            SpendCounter.tier == tier,
            SpendCounter.period_key.in_(keys),
        )
        .order_by(SpendCounter.period_key)
        .with_for_update()
    )
    for row in s.execute(stmt).scalars():
        row.tokens += tokens
        row.cost += cost
    s.flush()


async def spent(
    s: AsyncSession, tenant_id: str, tier: str | None, period: str, now: datetime
) -> tuple[int, Decimal]:
    """`spent_in`, in an async session's transaction."""
    return await s.run_sync(lambda ss: spent_in(ss.connection(), tenant_id, tier, period, now))


def spent_in(
    conn: Connection, tenant_id: str, tier: str | None, period: str, now: datetime
) -> tuple[int, Decimal]:
    """Tokens and cost of the tenant's ledger over the budget period holding `now`, in one
    tier (or all of them: `tier` None). Synchronous, so that SQLite's admission reads it on
    its writer's thread (tierq/models/admission_sqlite.py)."""
    stmt = select(SpendCounter.tokens, SpendCounter.cost).where(
        SpendCounter.tenant_id == tenant_id,
        SpendCounter.period_key == period_key(period, now),
    )
    if tier is not None:
        stmt = stmt.where(SpendCounter.tier == tier)
    tokens, cost = 0, Decimal(0)
    for row_tokens, row_cost in conn.execute(stmt).all():
        tokens += int(row_tokens)
        cost += row_cost
    return tokens, cost
