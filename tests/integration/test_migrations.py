"""Alembic: upgrade head, downgrade base, upgrade head — on PostgreSQL and on SQLite.

After each upgrade the schema must be exactly what the ORM declares (autogenerate finds
nothing to do), so the migrations and the models cannot drift apart.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect
from sqlalchemy.engine import Connection

import migrations
from models.db import make_engine
from models.tables import Base
from tests.conftest import PG_ADMIN_URL, _admin

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


def test_round_trip_on_postgresql() -> None:
    name = f"tierq_migrate_{uuid.uuid4().hex[:8]}"
    asyncio.run(_admin(f'CREATE DATABASE "{name}"'))
    try:
        _round_trip(PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}")
    finally:
        asyncio.run(_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
