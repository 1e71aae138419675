"""The job store's contract (tests/job_store_contract.py) on PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy import text

from tests.job_store_contract import SqlJobStoreContract
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
