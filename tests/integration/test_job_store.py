"""The job store's contract (tests/job_store_contract.py) on PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest
from sqlalchemy import text

from tests.helpers import until_async
from tests.job_store_contract import RESULT, SqlAdmin, SqlJobStoreContract, admission
from tierq.core.ids import new_id
from tierq.models import quotas as quota_repo
from tierq.models import tenants as tenant_repo
from tierq.models.db import Database
from tierq.models.records import JobRecord
from tierq.models.store import SqlJobStore
from tierq.models.tables import utcnow

pytestmark = pytest.mark.integration


class TestPostgresJobStore(SqlJobStoreContract):
    @pytest.fixture
    async def db(self, pg_database: str) -> AsyncIterator[Database]:
        db = Database(pg_database)
        async with db.transaction() as s:
            await s.execute(text("TRUNCATE tenants CASCADE"))
        yield db
        await db.close()


async def test_a_job_ended_by_a_connection_other_than_its_writers_leaves_the_sums_exact(
    pg_database: str,
) -> None:
    """On PostgreSQL each connection writes its own slot of a tenant's held sums: a job
    written by one connection and ended by another is taken away in the ender's slot,
    which goes below zero, and the sums over every slot stay exact."""
    dsn = pg_database.replace("postgresql+asyncpg://", "postgresql://")
    db = Database(pg_database)
    async with db.transaction() as s:
        tenant = await tenant_repo.create_tenant(s, new_id("name"))
    conns = [await asyncpg.connect(dsn) for _ in range(2)]
    try:
        # Two connections in different slots (a backend's pid modulo 16).
        while len({await c.fetchval("SELECT pg_backend_pid() % 16") for c in conns}) < 2:
            await conns.pop().close()
            conns.append(await asyncpg.connect(dsn))
        writer, ender = conns
        insert = (
            "INSERT INTO jobs (id, tenant_id, tier, model, status, params, created_at, "
            "deliveries, preemptions, fault_charge, reserved_tokens, input_price, held_counted) "
            "VALUES ($1, $2, 'standard', 'm', 'queued', '{\"max_tokens\": 4}', now(), "
            "0, 0, 0, 10, '2', true)"
        )
        await writer.execute(insert, "job_a", tenant.id)
        await writer.execute(insert, "job_b", tenant.id)
        await ender.execute("UPDATE jobs SET status = 'cancelled' WHERE id = 'job_a'")
        rows = await ender.fetch(
            "SELECT jobs, reserved_tokens, prompt_tokens, output_tokens "
            "FROM held_reservations WHERE tenant_id = $1 ORDER BY jobs",
            tenant.id,
        )
        # The ender's slot went below zero; over every slot, job_b's reservation is held.
        assert [tuple(r) for r in rows] == [(-1, -10, -6, -4), (2, 20, 12, 8)]
        await ender.execute("DELETE FROM jobs WHERE id = 'job_b'")
        total = await ender.fetchrow(
            "SELECT sum(jobs), sum(reserved_tokens) FROM held_reservations WHERE tenant_id = $1",
            tenant.id,
        )
        assert tuple(total) == (0, 0)
    finally:
        for c in conns:
            await c.close()
        await db.close()


async def test_admissions_and_endings_of_a_tenant_with_a_budget_run_side_by_side(
    pg_database: str,
) -> None:
    """A tenant with a budget: its admissions (which hold its row, then add to a sums row)
    and its jobs' endings (which take from a sums row, then write a usage record whose
    foreign key locks its row) run at once on many connections without a deadlock, and
    the sums come out exact."""
    db = Database(pg_database)
    store = SqlJobStore(db)
    admin = SqlAdmin(db)
    try:
        async with db.transaction() as s:
            tenant = (await tenant_repo.create_tenant(s, new_id("name"))).id
        await admin.quota(tenant, "*", token_budget=10**9, budget_period="total")
        first = [await store.admit(admission(tenant), counted=True) for _ in range(40)]
        running = []
        for answer in first:
            assert answer.job is not None
            claimed = await store.claim(answer.job.id, "w1", 3)
            assert claimed is not None
            running.append(claimed)

        async def end(job: JobRecord) -> None:
            assert await store.finish(job.id, RESULT, job.deliveries) is not None

        async def admit() -> None:
            assert (await store.admit(admission(tenant), counted=True)).job is not None

        # An ending and an admission in turn, all at once.
        await asyncio.gather(*(step for job in running for step in (end(job), admit())))
        async with db.session() as s:
            tokens, _cost = await quota_repo.held_reservations(s, tenant, "*", utcnow())
        assert tokens == 40 * 10  # the 40 admitted last, queued; the first 40 ended
    finally:
        await store.close()
        await db.close()


async def test_an_ending_waits_for_the_tenant_before_it_holds_a_sums_row(
    pg_database: str,
) -> None:
    """The order that could deadlock, step by step on two connections that share a slot:
    an ending of a counted job (then a write whose foreign key locks the tenant, as a
    usage record's does) beside an admission (the tenant's row lock, then its job's sums
    row). The ending locks the tenant first, so the admission waits for it, not both for
    each other."""
    dsn = pg_database.replace("postgresql+asyncpg://", "postgresql://")
    db = Database(pg_database)
    async with db.transaction() as s:
        tenant = (await tenant_repo.create_tenant(s, new_id("name"))).id
    await db.close()
    conns: list[asyncpg.Connection] = []
    try:
        by_slot: dict[int, asyncpg.Connection] = {}
        while True:  # two connections whose backends' pids fall in one slot
            conn = await asyncpg.connect(dsn)
            conns.append(conn)
            slot = await conn.fetchval("SELECT pg_backend_pid() % 16")
            if slot in by_slot:
                ending, admitting = by_slot[slot], conn
                break
            by_slot[slot] = conn
        insert = (
            "INSERT INTO jobs (id, tenant_id, tier, model, status, params, created_at, "
            "deliveries, preemptions, fault_charge, reserved_tokens, held_counted) "
            "VALUES ($1, $2, 'standard', 'm', $3, '{}', now(), 0, 0, 0, 10, $4)"
        )
        await ending.execute(insert, "job_ran", tenant, "running", True)
        ending_tx, admitting_tx = ending.transaction(), admitting.transaction()
        await ending_tx.start()
        await ending.execute("UPDATE jobs SET status = 'succeeded' WHERE id = 'job_ran'")
        await admitting_tx.start()

        async def admit() -> None:
            await admitting.execute("SELECT 1 FROM tenants WHERE id = $1 FOR UPDATE", tenant)
            await admitting.execute(insert, "job_new", tenant, "queued", True)
            await admitting_tx.commit()

        admitted = asyncio.create_task(admit())
        pid = admitting.get_server_pid()

        async def blocked() -> bool:  # on the tenant's row, or (holding it) on a sums row
            waits = "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1"
            return bool(await ending.fetchval(waits, pid))

        await until_async(blocked, "the admission waits on a lock", 10)
        # As a usage record would: a row whose foreign key locks the tenant.
        await ending.execute(insert, "job_other", tenant, "succeeded", False)
        await ending_tx.commit()
        await asyncio.wait_for(admitted, 10)
        held = await ending.fetchval(
            "SELECT sum(jobs) FROM held_reservations WHERE tenant_id = $1", tenant
        )
        assert held == 1  # job_new
    finally:
        for c in conns:
            await c.close()
