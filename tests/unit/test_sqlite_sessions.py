"""Sessions on an SQLite file: one that reads (`Database.session`) takes no write lock, so
it reads beside a writer that holds it; one that writes (`Database.transaction`) takes it
at BEGIN."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

from sqlalchemy import func, select, text

from tierq import migrations
from tierq.models.db import Database
from tierq.models.tables import Job


async def test_a_read_session_reads_beside_a_held_write_lock(tmp_path: Path) -> None:
    path = tmp_path / "tierq.db"
    url = f"sqlite+aiosqlite:///{path}"
    await asyncio.to_thread(migrations.upgrade, url)
    db = Database(url)
    writer = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        writer.execute("BEGIN IMMEDIATE")  # another process's write transaction, open

        async def read() -> int:
            async with db.session() as s:
                return int((await s.execute(select(func.count()).select_from(Job))).scalar_one())

        assert await asyncio.wait_for(read(), 5) == 0  # busy_timeout would be 30 s
        await asyncio.wait_for(db.ping(), 5)
        writer.execute("ROLLBACK")
        async with db.transaction() as s:  # a writer's BEGIN IMMEDIATE, once it is free
            mode = (await s.execute(text("PRAGMA journal_mode"))).scalar_one()
        assert mode == "wal"
    finally:
        writer.close()
        await db.close()
