"""Billing roll-ups run by Celery beat: the usage ledger into monthly invoices."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from models import billing
from models.db import Database


def months_to_roll(now: datetime) -> list[str]:
    """The current month and the one before it."""
    this = now.strftime("%Y-%m")
    last = (now.replace(day=1) - timedelta(days=1)).strftime("%Y-%m")
    return [last, this]


async def roll_up_invoices(db: Database, period: str | None = None) -> list[str]:
    """Returns "<period>:<tenant>" for every invoice written or confirmed."""
    done: list[str] = []
    for month in [period] if period else months_to_roll(datetime.now(UTC)):
        # One aggregate over the month, read outside the transaction that writes the
        # invoices (on SQLite that one holds the write lock every job's ending waits for).
        async with db.session() as s:
            usage = await billing.month_usage(s, month)
        async with db.transaction() as s:
            done += [f"{month}:{tenant}" for tenant in await billing.write_invoices(s, usage)]
    return done
