"""Billing roll-ups run by Celery beat: the usage ledger into monthly invoices."""

from __future__ import annotations

from datetime import datetime, timedelta

from tierq.core import clock
from tierq.models import billing
from tierq.models.db import Database


def months_to_roll(now: datetime) -> list[str]:
    """The current month and the one before it."""
    this = now.strftime("%Y-%m")
    last = (now.replace(day=1) - timedelta(days=1)).strftime("%Y-%m")
    return [last, this]


async def roll_up_invoices(db: Database, period: str | None = None) -> list[str]:
    """Returns "<period>:<tenant>" for every invoice written or confirmed."""
    done: list[str] = []
    for month in [period] if period else months_to_roll(clock.utcnow()):
        done += [f"{month}:{tenant}" for tenant in await billing.roll_up_month(db, month)]
    return done
