"""What a tenant's unfinished jobs hold against its budget (models.quotas.held_in), summed
by the database: equal to each job's `reservation_cost` summed in Python, whatever its
params (n absent, 0 or several; max_tokens absent; a reservation below its output bound)
and its prices (several, or none), on SQLite; and read without the tenant's backlog.
(The running sums themselves: tests/job_store_contract.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
from decimal import Decimal
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event

from tierq import migrations
from tierq.core.messages import output_bound
from tierq.core.tiers import Tier
from tierq.models import quotas as quota_repo
from tierq.models import tenants as tenant_repo
from tierq.models.db import Database
from tierq.models.jobs import NewJob
from tierq.models.store import SqlJobStore
from tierq.models.tables import utcnow

JOBS: list[tuple[dict[str, Any], int, Decimal | None, Decimal | None]] = [
    ({"max_tokens": 16}, 40, Decimal("0.37"), Decimal("1.1")),
    ({"max_tokens": 16, "n": 3}, 90, Decimal("0.37"), Decimal("1.1")),
    ({"max_tokens": 16, "n": 0}, 20, Decimal("0.37"), Decimal("1.1")),
    ({"max_tokens": 64}, 30, Decimal("0.37"), Decimal("1.1")),  # reserves less than its bound
    ({}, 12, Decimal("2.5"), Decimal("10")),
    ({"max_tokens": 8, "n": None}, 9, None, None),
    ({"max_tokens": 5, "temperature": 0.5}, 7, Decimal("0.000001"), Decimal("123.456789")),
]


async def test_the_sums_equal_each_jobs_reservation_cost(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'held.db'}"
    await asyncio.to_thread(migrations.upgrade, url)
    db = Database(url)
    store = SqlJobStore(db)
    async with db.transaction() as s:
        tenant = await tenant_repo.create_tenant(s, "t")
        other = await tenant_repo.create_tenant(s, "other")
    base = NewJob(tenant.id, Tier.STANDARD, "m", None, "x", {}, held_counted=True)
    for params, reserved, price_in, price_out in JOBS:
        new = dataclasses.replace(
            base,
            params=params,
            reserved_tokens=reserved,
            input_price=price_in,
            output_price=price_out,
        )
        await store.create(new)
    await store.create(dataclasses.replace(base, tenant_id=other.id, reserved_tokens=1000))
    ended, _ = await store.create(dataclasses.replace(base, reserved_tokens=1000))
    assert await store.cancel(ended.id) is not None  # never ran: holds nothing
    expected_cost = sum(
        (
            quota_repo.reservation_cost(reserved, output_bound(params), price_in, price_out)
            for params, reserved, price_in, price_out in JOBS
        ),
        Decimal(0),
    )
    async with db.session() as s:
        held = await quota_repo.held_reservations(s, tenant.id, "*", utcnow())
        batch = await quota_repo.held_reservations(s, tenant.id, "batch", utcnow())
    assert held == (sum(reserved for _, reserved, _, _ in JOBS), expected_cost)
    assert batch == (0, Decimal(0))
    await store.close()
    await db.close()


async def test_a_budgets_read_of_cancelled_jobs_goes_through_their_index_on_sqlite(
    tmp_path: Path,
) -> None:
    """Beside the sums, a budget reads the jobs cancelled while they ran through their
    partial index, not by the tenant's (tenant_id, status) index and its whole history."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'plans.db'}"
    await asyncio.to_thread(migrations.upgrade, url)
    engine = create_engine(f"sqlite:///{tmp_path / 'plans.db'}")
    plans: list[str] = []

    @event.listens_for(engine, "before_cursor_execute")
    def plan(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        if "FROM jobs" in statement:
            found = conn.connection.cursor().execute(f"EXPLAIN QUERY PLAN {statement}", params)
            plans.append(" ".join(str(row[3]) for row in found))

    try:
        with engine.connect() as conn:
            for tier in ("*", "batch"):
                quota_repo.held_in(conn, "ten_x", tier, utcnow())
    finally:
        engine.dispose()
    assert len(plans) == 2
    assert all("ix_jobs_unbilled_cancel" in p for p in plans), plans
