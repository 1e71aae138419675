"""The job store's contract (tests/job_store_contract.py) on the two stores that need no
service: the in-memory one, and SQLite's on a file (the embedded default's, through its
writer thread). PostgreSQL's runs it in tests/integration/test_job_store.py."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from tests.job_store_contract import Admin, JobStoreContract, MakeTenants, SqlJobStoreContract
from tierq import migrations
from tierq.core.ids import new_id
from tierq.core.tiers import Tier
from tierq.models.db import Database
from tierq.models.store import MemoryJobStore


@pytest.fixture(scope="session")
def migrated_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An SQLite file migrated to head, once: each test copies it."""
    path = tmp_path_factory.mktemp("job-store") / "template.db"
    migrations.upgrade(f"sqlite+aiosqlite:///{path}")
    return path


class TestMemoryJobStore(JobStoreContract):
    @pytest.fixture
    async def store(self) -> AsyncIterator[MemoryJobStore]:
        store = MemoryJobStore()
        yield store
        await store.close()

    @pytest.fixture
    def tenants(self, store: MemoryJobStore) -> MakeTenants:
        async def make(n: int) -> list[str]:
            return [store.add_tenant(new_id("ten")) for _ in range(n)]

        return make

    @pytest.fixture
    def admin(self, store: MemoryJobStore) -> Admin:
        return MemoryAdmin(store)


class MemoryAdmin:
    """`Admin` on the in-memory store: its own setters."""

    def __init__(self, store: MemoryJobStore) -> None:
        self.store = store

    async def key(self, tenant_id: str) -> str:
        return self.store.add_key(tenant_id)

    async def revoke(self, key_id: str) -> None:
        self.store.revoke_key(key_id)

    async def suspend(self, tenant_id: str) -> None:
        self.store.set_tenant_status(tenant_id, "suspended")

    async def quota(self, tenant_id: str, tier: str, **limits: Any) -> None:
        self.store.set_quota(tenant_id, tier, **limits)

    async def price(self, model: str, tier: Tier, input_: Decimal, output: Decimal) -> None:
        self.store.set_price(model, tier, input_, output)


class TestSqliteJobStore(SqlJobStoreContract):
    @pytest.fixture
    async def db(self, migrated_sqlite: Path, tmp_path: Path) -> AsyncIterator[Database]:
        path = tmp_path / "jobs.db"
        await asyncio.to_thread(shutil.copy, migrated_sqlite, path)
        db = Database(f"sqlite+aiosqlite:///{path}")
        yield db
        await db.close()
