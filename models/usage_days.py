"""The ledger's day sums (`usage_days`): one row per tenant, UTC day, tier and model,
added to in the transaction that writes each usage record, so that a report's whole days
and a month's invoice read a few rows a day instead of every record (models.billing).

Money stays Decimal: a day's cost is an exact string (models.tables.MoneySum), added to in
Python under the row's lock. A job's ending takes its spend counters' locks first and its
day's row last, always in that order (no deadlock between two endings of one tenant); the
day's row adds no wait of its own, since every ending that locks it already waits for the
same tenant and tier's spend counters."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Context, localcontext

from sqlalchemy import select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from models.tables import UsageDay, UsageRecord

# A day's cost is exact whatever its digits (models.tables.MoneySum has no length).
_EXACT = Context(prec=200)


def day_of(at: datetime) -> str:
    """The UTC day a record written at `at` is summed in, as `YYYY-MM-DD`."""
    return (at.astimezone(UTC) if at.tzinfo else at).date().isoformat()  # 4-digit years


def add(s: Session, record: UsageRecord) -> None:
    """Add one usage record to its day's row (in the caller's transaction). Synchronous,
    like the job's final transition it is written with (`Database.write`)."""
    key = {
        "tenant_id": record.tenant_id,
        "day": day_of(record.created_at),
        "tier": record.tier,
        "model": record.model,
    }
    dialect = s.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    s.execute(insert(UsageDay).values(**key).on_conflict_do_nothing())
    cost = s.execute(select(UsageDay.cost).filter_by(**key).with_for_update()).scalar_one()
    with localcontext(_EXACT):
        cost += record.cost
    # A Core UPDATE that always writes the cost: the ORM skips a column whose new value
    # compares equal (0 + 0.000000), and the sum would lose its trailing zeros.
    s.execute(
        update(UsageDay)
        .filter_by(**key)
        .values(
            requests=UsageDay.requests + 1,
            prompt_tokens=UsageDay.prompt_tokens + record.prompt_tokens,
            completion_tokens=UsageDay.completion_tokens + record.completion_tokens,
            cost=cost,
        )
        .execution_options(synchronize_session=False)
    )
