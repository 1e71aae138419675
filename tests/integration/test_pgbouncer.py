"""PostgreSQL behind Debian's PgBouncer in transaction mode (DATABASE_TRANSACTION_POOLING):
the whole platform — API, dispatcher, worker, a real Celery worker running a batch — with
its database through the pooler; and, as the control, the driver's default named
statements colliding there as soon as two clients share a server connection."""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from tests.conftest import Platform, base_settings
from tests.helpers import client, wait_for
from tests.integration.batch_helpers import finished, jsonl, line, sdk, submit
from tests.integration.celery_proc import CeleryWorker
from tests.pgbouncer_server import PgBouncer
from tierq.core.settings import Settings
from tierq.models.db import Database
from tierq.models.store import SqlJobStore

pytestmark = pytest.mark.integration


@pytest.fixture
def settings(pg_database: str, tmp_path: Path, pgbouncer: PgBouncer) -> Settings:
    """The test database, reached through the pooler."""
    name = make_url(pg_database).database or ""
    return base_settings(pg_database, tmp_path).model_copy(
        update={"database_url": pgbouncer.url(name), "database_transaction_pooling": True}
    )


def _transactions(bouncer: PgBouncer, database: str) -> int:
    rows = bouncer.admin("SHOW STATS") or []
    # database, total_xact_count, ... (PgBouncer's SHOW STATS)
    return sum(int(row[1]) for row in rows if row[0] == database)


async def test_jobs_and_a_batch_succeed_with_the_database_behind_pgbouncer(
    running: Platform, tenant_key: str, pgbouncer: PgBouncer
) -> None:
    settings = running.settings
    database = make_url(settings.resolved_database_url).database or ""
    before = _transactions(pgbouncer, database)
    body = {"tier": "standard", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with client(running.url, tenant_key) as c:
        made = await asyncio.gather(*(c.post("/v1/jobs", json=body) for _ in range(40)))
        assert all(r.status_code == 202 for r in made), [r.text for r in made][:3]
        done = await asyncio.gather(*(wait_for(c, r.json()["id"], timeout=90) for r in made))
    assert {j["status"] for j in done} == {"succeeded"}

    celery = CeleryWorker(
        settings,
        pool="prefork",  # two child processes, each with its own connections
        DATABASE_URL=settings.resolved_database_url,
        DATABASE_TRANSACTION_POOLING="true",
    )
    celery.start()
    try:
        openai = sdk(running, tenant_key)
        batch = await submit(openai, jsonl([line(f"b-{i}") for i in range(30)]))
        ended = await finished(openai, batch.id, celery)
    finally:
        celery.stop()
    assert ended.status == "completed" and ended.request_counts.completed == 30, ended
    assert "already exists" not in celery.output()
    assert _transactions(pgbouncer, database) - before > 200  # all of it went through


async def test_without_the_setting_a_cached_statement_meets_another_server_connection(
    settings: Settings, pgbouncer: PgBouncer
) -> None:
    """The control, and why the setting exists: a statement the driver prepared (and
    cached) on one server connection is not there when the client's next transaction is
    given another one — here because a second client holds the first server connection.
    With DATABASE_TRANSACTION_POOLING nothing is cached across transactions."""
    url = settings.resolved_database_url
    dsn = url.replace("postgresql+asyncpg", "postgresql")

    async def statements(db: Database, store: SqlJobStore, errors: list[str]) -> None:
        """One through the ORM, one through the job store's raw pool; what failed, in
        `errors`."""
        try:
            async with db.session() as s:
                await s.execute(text("SELECT count(*) FROM tenants"))
            await store.head("job_none", "ten_none")
        except Exception as exc:
            errors.append(str(exc))

    async def twice(pooling: bool) -> list[str]:
        db = Database(url, transaction_pooling=pooling, pool_size=1, max_overflow=0)
        store = SqlJobStore(db)
        errors: list[str] = []
        try:
            for _ in range(2):
                await statements(db, store, errors)
                # Another client takes the idle server connection and keeps it meanwhile.
                holder = await asyncpg.connect(dsn)
                held = holder.transaction()
                await held.start()
                await holder.execute("SELECT 1")
                try:
                    await statements(db, store, errors)
                finally:
                    await held.rollback()
                    await holder.close()
        finally:
            await store.close()
            await db.close()
        return errors

    assert any("does not exist" in e for e in await twice(pooling=False))
    assert await twice(pooling=True) == []
