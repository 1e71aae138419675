"""What a tenant's unfinished jobs hold against its budget (models.quotas.held_in), summed
by the database: equal to each job's `reservation_cost` summed in Python, whatever its
params (n absent, 0 or several; max_tokens absent; a reservation below its output bound)
and its prices (several, or none), on SQLite."""

from __future__ import annotations

import asyncio
import dataclasses
from decimal import Decimal
from pathlib import Path
from typing import Any

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
    base = NewJob(tenant.id, Tier.STANDARD, "m", None, "x", {})
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
