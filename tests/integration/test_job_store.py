"""The job store's contract (tests/job_store_contract.py) on PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest
from sqlalchemy import text

from tests.job_store_contract import SqlJobStoreContract
from tierq.core.ids import new_id
from tierq.models import tenants as tenant_repo
from tierq.models.db import Database

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
    """On PostgreSQL each connection adds to its own slot of a tenant's held sums: a job
    written by one connection and ended by another, whose slot holds nothing for the
    tenant yet, is taken from a slot that holds it, not lost or made anew."""
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
            "SELECT slot, jobs, reserved_tokens, prompt_tokens, output_tokens "
            "FROM held_reservations WHERE tenant_id = $1",
            tenant.id,
        )
        assert [tuple(r)[1:] for r in rows] == [(1, 10, 6, 4)]  # job_b's, in the writer's slot
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
