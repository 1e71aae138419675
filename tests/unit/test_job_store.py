"""The job store's contract (tests/job_store_contract.py) on the two stores that need no
service: the in-memory one, and SQLite's on a file (the embedded default's, through its
writer thread). PostgreSQL's runs it in tests/integration/test_job_store.py."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.job_store_contract import JobStoreContract, MakeTenants, SqlJobStoreContract
from tierq import migrations
from tierq.core.ids import new_id
from tierq.models.db import Database
from tierq.models.store import JobStore, MemoryJobStore


@pytest.fixture(scope="session")
def migrated_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An SQLite file migrated to head, once: each test copies it."""
    path = tmp_path_factory.mktemp("job-store") / "template.db"
    migrations.upgrade(f"sqlite+aiosqlite:///{path}")
    return path


class TestMemoryJobStore(JobStoreContract):
    @pytest.fixture
    async def store(self) -> AsyncIterator[JobStore]:
        store = MemoryJobStore()
        yield store
        await store.close()

    @pytest.fixture
    def tenants(self) -> MakeTenants:
        async def make(n: int) -> list[str]:
            return [new_id("ten") for _ in range(n)]

        return make


class TestSqliteJobStore(SqlJobStoreContract):
    @pytest.fixture
    async def db(self, migrated_sqlite: Path, tmp_path: Path) -> AsyncIterator[Database]:
        path = tmp_path / "jobs.db"
        await asyncio.to_thread(shutil.copy, migrated_sqlite, path)
        db = Database(f"sqlite+aiosqlite:///{path}")
        yield db
        await db.close()
