"""Alembic: upgrade head, downgrade base, upgrade head — on PostgreSQL and on SQLite.

After each upgrade the schema must be exactly what the ORM declares (autogenerate finds
nothing to do), so the migrations and the models cannot drift apart.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect
from sqlalchemy.engine import Connection

from tests.conftest import PG_ADMIN_URL, pg_admin_sql
from tierq import migrations
from tierq.models.db import make_engine
from tierq.models.tables import Base

pytestmark = pytest.mark.integration


def _state(url: str) -> tuple[set[str], list[object]]:
    async def read() -> tuple[set[str], list[object]]:
        engine = make_engine(url)
        try:
            async with engine.connect() as conn:

                def inspect_sync(sync: Connection) -> tuple[set[str], list[object]]:
                    tables = set(inspect(sync).get_table_names())
                    diff = compare_metadata(MigrationContext.configure(sync), Base.metadata)
                    return tables, list(diff)

                return await conn.run_sync(inspect_sync)
        finally:
            await engine.dispose()

    return asyncio.run(read())


def _round_trip(url: str) -> None:
    expected = set(Base.metadata.tables) | {"alembic_version"}
    migrations.upgrade(url)
    tables, diff = _state(url)
    assert tables == expected and diff == []
    migrations.downgrade(url, "base")
    tables, _ = _state(url)
    assert tables <= {"alembic_version"}
    migrations.upgrade(url)
    tables, diff = _state(url)
    assert tables == expected and diff == []


def test_round_trip_on_sqlite(tmp_path: Path) -> None:
    _round_trip(f"sqlite+aiosqlite:///{tmp_path / 'tierq.db'}")


def _on_a_new_postgresql_database(check: Callable[[str], None]) -> None:
    name = f"tierq_migrate_{uuid.uuid4().hex[:8]}"
    asyncio.run(pg_admin_sql(f'CREATE DATABASE "{name}"'))
    try:
        check(PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}")
    finally:
        asyncio.run(pg_admin_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def test_round_trip_on_postgresql() -> None:
    _on_a_new_postgresql_database(_round_trip)


def _backfill(url: str) -> None:
    """0006 fills the spend counters, 0011 the day sums and 0015 the hour sums from the
    ledger already written: a budget's spend and a usage report read the same after the
    upgrade."""
    from datetime import UTC, datetime
    from decimal import Decimal

    from sqlalchemy import insert

    from tierq.models import billing, spend
    from tierq.models.db import Database
    from tierq.models.tables import Job, Tenant, UsageRecord

    migrations.upgrade(url, "0005")
    days = [datetime(2026, 10, 31, 23, 0, tzinfo=UTC), datetime(2026, 11, 1, 1, 0, tzinfo=UTC)]

    async def write() -> None:
        db = Database(url)
        try:
            async with db.transaction() as s:
                await s.execute(insert(Tenant).values(id="ten_1", name="one"))  # columns of then
                await s.flush()
                for i, at in enumerate(days * 2):
                    job_id = f"job_{i}"
                    tier = "standard" if i < 2 else "batch"
                    # A Core insert of the columns given: the ORM would also read back
                    # columns that later revisions add.
                    await s.execute(
                        insert(Job).values(
                            id=job_id,
                            tenant_id="ten_1",
                            tier=tier,
                            model="m",
                            status="succeeded",
                            params={},
                            created_at=at,
                        )
                    )
                    s.add(
                        UsageRecord(
                            job_id=job_id,
                            tenant_id="ten_1",
                            tier=tier,
                            model="m",
                            prompt_tokens=10,
                            completion_tokens=i,
                            cost=Decimal("0.000001") * (i + 1),
                            created_at=at,
                        )
                    )
        finally:
            await db.close()

    async def read() -> tuple[list[tuple[int, Decimal]], list[dict[str, object]], int]:
        db = Database(url)
        try:
            async with db.session() as s:
                spent = [
                    await spend.spent(s, "ten_1", None, "total", days[0]),
                    await spend.spent(s, "ten_1", None, "month", days[0]),
                    await spend.spent(s, "ten_1", None, "day", days[1]),
                    await spend.spent(s, "ten_1", "batch", "total", days[1]),
                ]
                # From the day sums alone (no bound cuts a day).
                report = await billing.usage(s, "ten_1", None, None, ("day", "tier"))
                # From the hour sums alone: 23:00 to 01:00 is two whole hours, no whole day.
                hours = await billing.usage(s, "ten_1", days[0], days[1], ())
                return spent, report.data(), hours.total().requests
        finally:
            await db.close()

    asyncio.run(write())
    migrations.upgrade(url)
    (total, october, first_nov, batch), report, hours = asyncio.run(read())
    assert hours == 2  # jobs 0 and 2, at 23:00 (those at 01:00 are past the end)
    assert total == (46, Decimal("0.000010"))  # 4 x 10 prompt + 0+1+2+3
    assert october == (10 + 0 + 10 + 2, Decimal("0.000004"))  # jobs 0 and 2
    assert first_nov == (10 + 1 + 10 + 3, Decimal("0.000006"))  # jobs 1 and 3
    assert batch == (10 + 2 + 10 + 3, Decimal("0.000007"))
    assert [
        (r["day"], r["tier"], r["requests"], r["completion_tokens"], Decimal(str(r["cost"])))
        for r in report
    ] == [
        ("2026-10-31", "batch", 1, 2, Decimal("0.000003")),  # job 2
        ("2026-10-31", "standard", 1, 0, Decimal("0.000001")),  # job 0
        ("2026-11-01", "batch", 1, 3, Decimal("0.000004")),  # job 3
        ("2026-11-01", "standard", 1, 1, Decimal("0.000002")),  # job 1
    ]


def test_spend_counters_are_filled_from_the_ledger_on_sqlite(tmp_path: Path) -> None:
    _backfill(f"sqlite+aiosqlite:///{tmp_path / 'tierq.db'}")


def test_spend_counters_are_filled_from_the_ledger_on_postgresql() -> None:
    _on_a_new_postgresql_database(_backfill)


def _held_backfill(url: str) -> None:
    """0017 counts the unfinished jobs of a tenant with a budget at the upgrade (a job's
    output bound read from its params, its prices kept, none for an ended job): a budget's
    check reads what the jobs hold, as it summed them before."""
    from datetime import UTC, datetime
    from decimal import Decimal

    from sqlalchemy import insert, text

    from tierq.models import quotas
    from tierq.models.db import Database
    from tierq.models.tables import Job, Quota, Tenant

    migrations.upgrade(url, "0016")
    jobs = [  # status, tier, params, reserved, prices
        ("queued", "standard", {"max_tokens": 16, "n": 2}, 40, ("0.5", "2")),
        ("running", "standard", {"max_tokens": 64}, 30, ("0.5", "2")),
        ("queued", "batch", {}, 12, (None, None)),
        ("succeeded", "standard", {"max_tokens": 16}, 1000, ("0.5", "2")),
        ("cancelled", "batch", {"max_tokens": 16}, 1000, ("0.5", "2")),
    ]
    now = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)

    async def write() -> None:
        db = Database(url)
        try:
            async with db.transaction() as s:
                await s.execute(insert(Tenant).values(id="ten_1", name="one"))  # columns of then
                await s.flush()
                await s.execute(insert(Tenant).values(id="ten_2", name="two"))
                await s.execute(
                    insert(Quota).values(
                        tenant_id="ten_1", tier="*", token_budget=10**6, budget_period="total"
                    )
                )
                for i, (status, tier, params, reserved, (p_in, p_out)) in enumerate(jobs * 2):
                    await s.execute(
                        insert(Job).values(
                            id=f"job_{i}",
                            tenant_id="ten_1" if i < len(jobs) else "ten_2",
                            tier=tier,
                            model="m",
                            status=status,
                            params=params,
                            created_at=now,
                            reserved_tokens=reserved,
                            input_price=None if p_in is None else Decimal(p_in),
                            output_price=None if p_out is None else Decimal(p_out),
                        )
                    )
        finally:
            await db.close()

    async def read() -> tuple[list[tuple[int, Decimal]], int, list[bool]]:
        db = Database(url)
        try:
            async with db.session() as s:
                held = [
                    await quotas.held_reservations(s, "ten_1", tier, now)
                    for tier in ("*", "standard", "batch")
                ]
                counted = await s.execute(text("SELECT count(*) FROM jobs WHERE held_counted"))
                flags = await s.execute(text("SELECT counts_held FROM tenants ORDER BY id"))
                return held, int(counted.scalar_one()), [bool(f) for (f,) in flags]
        finally:
            await db.close()

    async def jobs_left() -> int:
        db = Database(url)
        try:
            async with db.session() as s:
                return int((await s.execute(text("SELECT count(*) FROM jobs"))).scalar_one())
        finally:
            await db.close()

    asyncio.run(write())
    migrations.upgrade(url)
    after, counted, flags = asyncio.run(read())
    # ten_1's three unfinished jobs are counted; ten_2, without a budget, is not flagged.
    assert (counted, flags) == (3, [True, False])
    # A downgrade keeps every row (on SQLite, a table copied and dropped would cascade).
    migrations.downgrade(url, "0016")
    assert asyncio.run(jobs_left()) == 2 * len(jobs)
    migrations.upgrade(url)
    assert asyncio.run(read()) == (after, counted, flags)
    # 40 reserved with a bound of 32 (8 of prompt), 30 with a bound of 64 (no prompt part),
    # 12 with none; per million tokens.
    standard = (70, (8 * Decimal("0.5") + (32 + 64) * 2) / 1_000_000)
    assert after == [(82, standard[1]), standard, (12, Decimal(0))]


def test_held_reservations_are_summed_from_the_jobs_on_sqlite(tmp_path: Path) -> None:
    _held_backfill(f"sqlite+aiosqlite:///{tmp_path / 'tierq.db'}")


def test_held_reservations_are_summed_from_the_jobs_on_postgresql() -> None:
    _on_a_new_postgresql_database(_held_backfill)


def _four_hosts_at_once(url: str) -> None:
    """Four `tierq migrate` processes on a new database (four hosts of a fleet coming up),
    made to start together: the test holds the migrations' lock until all four wait on
    it, then lets go. Each waits for the one before it, every one succeeds, and the schema
    is the ORM's, at one version."""
    import os
    import subprocess
    import sys
    import time

    from sqlalchemy import text

    env = {**os.environ, "DATABASE_URL": url}
    root = Path(__file__).resolve().parents[2]
    lock = "SELECT pg_advisory_xact_lock(hashtext('tierq:migrations'))"
    waiting = (  # this database's waiters on this lock (the upper 32 bits are 0 here)
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        " AND objid::bigint = hashtext('tierq:migrations')::bigint & 4294967295"
    )

    async def run() -> list[subprocess.Popen[bytes]]:
        engine = make_engine(url)
        try:
            async with engine.connect() as holder, engine.connect() as watch:
                await holder.execute(text(lock))  # in holder's transaction, until commit
                procs = [
                    subprocess.Popen(
                        [sys.executable, "-m", "tierq", "migrate"],
                        cwd=root,
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                    )
                    for _ in range(4)
                ]
                deadline = time.monotonic() + 120
                while (await watch.execute(text(waiting))).scalar_one() < 4:
                    assert time.monotonic() < deadline, "the upgrades never waited on the lock"
                    assert all(p.poll() is None for p in procs), "an upgrade ended unlocked"
                    await watch.rollback()
                    await asyncio.sleep(0.1)
                await holder.commit()
                return procs
        finally:
            await engine.dispose()

    procs = asyncio.run(run())
    try:
        outputs = [p.communicate(timeout=180)[0].decode() for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0, 0, 0], "\n---\n".join(outputs)
    tables, diff = _state(url)
    assert tables == set(Base.metadata.tables) | {"alembic_version"} and diff == []


def test_migrations_run_once_when_hosts_start_together_on_postgresql() -> None:
    _on_a_new_postgresql_database(_four_hosts_at_once)
