"""The ledger's day and hour sums (`usage_days`, `usage_hours`): one row per tenant, UTC
day (hour), tier and model, added to in the transaction that writes each usage record, so
that a report's whole days and a month's invoice read a few rows a day, and a report's
bound inside a day the whole hours, instead of every record (models.billing).

Money stays Decimal: a day's cost is an exact string (models.tables.MoneySum), added to in
Python under the row's lock. A job's ending takes its spend counters' locks first, then its
day's row, then its hour's, always in that order (no deadlock between two endings of one
tenant); these rows add no wait of their own, since every ending that locks them already
waits for the same tenant and tier's spend counters."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Context, localcontext

from sqlalchemy import select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from tierq.models.tables import UsageDay, UsageHour, UsageRecord

# A day's cost is exact whatever its digits (models.tables.MoneySum has no length).
_EXACT = Context(prec=200)


def day_of(at: datetime) -> str:
    """The UTC day a record written at `at` is summed in, as `YYYY-MM-DD`."""
    return (at.astimezone(UTC) if at.tzinfo else at).date().isoformat()  # 4-digit years


def hour_of(at: datetime) -> str:
    """The UTC hour a record written at `at` is summed in, as `YYYY-MM-DDTHH`."""
    at = at.astimezone(UTC) if at.tzinfo else at
    return f"{at.date().isoformat()}T{at.hour:02d}"


def add(s: Session, record: UsageRecord) -> None:
    """Add one usage record to its day's row and its hour's (in the caller's transaction).
    Synchronous, like the job's final transition it is written with (the job store's `finish`,
    tierq/models/store/sql.py)."""
    common = {"tenant_id": record.tenant_id, "tier": record.tier, "model": record.model}
    _add(s, UsageDay, {**common, "day": day_of(record.created_at)}, record)
    _add(s, UsageHour, {**common, "hour": hour_of(record.created_at)}, record)


def _add(
    s: Session, table: type[UsageDay] | type[UsageHour], key: dict[str, str], record: UsageRecord
) -> None:
    dialect = s.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    s.execute(insert(table).values(**key).on_conflict_do_nothing())
    cost = s.execute(select(table.cost).filter_by(**key).with_for_update()).scalar_one()
    with localcontext(_EXACT):
        cost += record.cost
    # A Core UPDATE that always writes the cost: the ORM skips a column whose new value
    # compares equal (0 + 0.000000), and the sum would lose its trailing zeros.
    s.execute(
        update(table)
        .filter_by(**key)
        .values(
            requests=table.requests + 1,
            prompt_tokens=table.prompt_tokens + record.prompt_tokens,
            completion_tokens=table.completion_tokens + record.completion_tokens,
            cost=cost,
        )
        .execution_options(synchronize_session=False)
    )
