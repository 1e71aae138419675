"""Admission on an SQLite file (tierq/models/admission_sqlite.py) as only SQLite does it: one
transaction on a thread of its own, whose writes share commits; the rows it writes read back
by the ORM exactly as it answered them, at the prices the ORM finds; the queue bound under a
burst. What every store answers alike (replays, refusals, quotas) is the job store's
contract (tests/job_store_contract.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Awaitable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, event

from tierq import migrations
from tierq.core.ids import new_id
from tierq.core.tiers import Tier
from tierq.models import admission_sqlite
from tierq.models import jobs as job_repo
from tierq.models import prices as price_repo
from tierq.models import quotas as quota_repo
from tierq.models import tenants as tenant_repo
from tierq.models.admission import Admission, Answer
from tierq.models.db import Database, LocalWriter, Unavailable
from tierq.models.records import JobRecord
from tierq.models.store import SqlJobStore
from tierq.models.tables import Base, utcnow

MODEL = "m"
DISCOUNT = Decimal("0.5")


async def _database(tmp_path: Path) -> tuple[Database, LocalWriter]:
    """A migrated SQLite file: the database, and a writer of its own on it (as the job
    store opens on a file, tierq/models/store/sql.py)."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'admission.db'}"
    await asyncio.to_thread(migrations.upgrade, url)
    return Database(url), LocalWriter(url)


async def _close(db: Database, local: LocalWriter) -> None:
    await local.close()
    await db.close()


async def _tenant(db: Database) -> tuple[str, str]:
    async with db.transaction() as s:
        tenant = await tenant_repo.create_tenant(s, new_id("name"))
        key = await tenant_repo.issue_key(s, tenant.id)
    return tenant.id, key.id


def _new(tenant_id: str, tier: Tier = Tier.STANDARD) -> job_repo.NewJob:
    return job_repo.NewJob(
        tenant_id=tenant_id,
        tier=tier,
        model=MODEL,
        messages=[{"role": "user", "content": "héllo"}],
        prompt=None,
        params={"max_tokens": 8, "temperature": 0.0},
        metadata={"k": "v"},
        reserved_tokens=42,
    )


async def _admit(
    local: LocalWriter,
    tenant_id: str,
    key_id: str | None,
    tier: Tier = Tier.STANDARD,
    bound: int = 0,
) -> Answer:
    request = Admission(new_id("job"), _new(tenant_id, tier), key_id, utcnow(), bound, DISCOUNT)
    return await admission_sqlite.admit(local, request, counted=False)


async def _one_group(local: LocalWriter, *writes: Awaitable[Any]) -> list[Any]:
    """The writes' answers (or errors), the writer held busy until all are queued: they
    make one group, in the order given."""
    held = threading.Event()
    local._thread.submit(held.wait, 10)
    gathered = asyncio.gather(*writes, return_exceptions=True)
    await asyncio.sleep(0.2)
    held.set()
    return list(await gathered)


async def _counts(db: Database, tenant_id: str) -> dict[tuple[str, str], int]:
    async with db.session() as s:
        return await job_repo.tenant_job_counts(s, tenant_id)


async def test_admitted_jobs_read_back_as_answered_at_the_prices_of_the_orm_path(
    tmp_path: Path,
) -> None:
    db, local = await _database(tmp_path)
    async with db.transaction() as s:
        await price_repo.set_price(s, MODEL, "standard", Decimal("0.37"), Decimal("1.1"))
        await price_repo.set_price(s, MODEL, "interactive", Decimal("2.50"), Decimal("1.1"))
    tenant_id, key_id = await _tenant(db)
    for tier in Tier:
        outcome = await _admit(local, tenant_id, key_id, tier)
        job = outcome.job
        assert job is not None and outcome.status == "active" and not outcome.quotas
        async with db.session() as s:
            expected = await price_repo.current_price(s, MODEL, tier, DISCOUNT)
            stored = await job_repo.get_job(s, job.id)
        assert expected is not None
        assert (job.input_price, job.output_price) == (
            expected.input_per_million,
            expected.output_per_million,
        )
        assert isinstance(stored, JobRecord)
        assert stored == job  # every field, as the ORM reads the row back
        assert stored.messages == [{"role": "user", "content": "héllo"}]
    assert await _counts(db, tenant_id) == {(t.value, "queued"): 1 for t in Tier}
    # A model without a price costs nothing.
    async with db.transaction() as s:
        other = await tenant_repo.create_tenant(s, "other")
    unpriced = dataclasses.replace(_new(other.id), model="x")
    free = await admission_sqlite.admit(
        local, Admission(new_id("job"), unpriced, None, utcnow(), 0, DISCOUNT), counted=False
    )
    assert free.job is not None and (free.job.input_price, free.job.output_price) == (0, 0)
    await _close(db, local)


async def test_the_queue_bound_holds_under_a_concurrent_burst_on_one_thread(
    tmp_path: Path,
) -> None:
    """64 admissions at once against a bound of 40: exactly 40 admitted (each reads the
    count under the write lock), each with its transition; every statement ran on the
    writer's one thread."""
    db, local = await _database(tmp_path)
    tenant_id, key_id = await _tenant(db)
    threads: set[str] = set()
    run = local._thread.submit

    def seen(fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
        return run(lambda: (threads.add(threading.current_thread().name), fn(*args, **kwargs))[1])

    local._thread.submit = seen  # type: ignore[method-assign]
    outcomes = await asyncio.gather(
        *(_admit(local, tenant_id, key_id, bound=40) for _ in range(64))
    )
    admitted = [o.job for o in outcomes if o.job is not None]
    refused = [o for o in outcomes if o.job is None]
    assert len(admitted) == 40 and len(refused) == 24
    assert all(o.queued == 40 and o.status == "active" for o in refused)
    assert await _counts(db, tenant_id) == {("standard", "queued"): 40}
    async with db.session() as s:
        for job in admitted:
            assert job is not None
            history = await job_repo.transitions(s, job.id)
            assert [status for status, *_ in history] == ["queued"]
    assert len(threads) == 1 and next(iter(threads)).startswith("tierq-sqlite-writer")
    await _close(db, local)


async def test_a_burst_shares_commits_and_a_write_that_raises_is_rolled_back_alone(
    tmp_path: Path,
) -> None:
    """LocalWriter's group commit: 64 writes at once take far fewer COMMITs than 64. With
    the writer held busy, three writes make one group: the one that inserted a row and
    then raised leaves nothing, the writes before and after it in the same transaction
    stand, and its caller gets its error."""
    db, local = await _database(tmp_path)
    tenant_id, _key = await _tenant(db)
    commits = 0

    def counted(_conn: object) -> None:
        nonlocal commits
        commits += 1

    event.listen(local.engine, "commit", counted)
    outcomes = await asyncio.gather(*(_admit(local, tenant_id, None) for _ in range(64)))
    assert all(o.job is not None for o in outcomes)
    assert commits < 32, commits

    class Boom(Exception):
        pass

    def admit_then_raise(conn: Connection) -> None:
        doomed = Admission("job_doomed", _new(tenant_id), None, utcnow(), 0, DISCOUNT)
        admission_sqlite.admit_in(conn, doomed, False)
        raise Boom

    commits = 0
    results = await _one_group(
        local,
        _admit(local, tenant_id, None),
        local.run(admit_then_raise),
        _admit(local, tenant_id, None),
    )
    assert commits == 1  # one group, one transaction
    assert isinstance(results[1], Boom)
    assert all(isinstance(r, Answer) and r.job is not None for r in (results[0], results[2]))
    async with db.session() as s:
        assert await job_repo.get_job(s, "job_doomed") is None
    assert await _counts(db, tenant_id) == {("standard", "queued"): 66}
    await _close(db, local)


async def test_a_group_sqlite_rolled_back_whole_answers_every_write_with_the_error(
    tmp_path: Path,
) -> None:
    """Where SQLite rolls the whole transaction back itself (a full disk, an I/O error;
    here a write that does it), no write of the group stands, so none is answered as
    written — the one before it included."""
    db, local = await _database(tmp_path)
    tenant_id, _key = await _tenant(db)

    def roll_back_all(conn: Connection) -> None:
        conn.exec_driver_sql("ROLLBACK")
        raise OSError("disk I/O error")

    results = await _one_group(
        local,
        _admit(local, tenant_id, None),
        local.run(roll_back_all),
        _admit(local, tenant_id, None),
    )
    assert all(isinstance(r, Exception) for r in results), results
    assert await _counts(db, tenant_id) == {}
    # The writer goes on: the next write has a transaction of its own.
    assert (await _admit(local, tenant_id, None)).job is not None
    await _close(db, local)


async def test_a_closed_writer_refuses_at_once(tmp_path: Path) -> None:
    db, local = await _database(tmp_path)
    tenant_id, _key = await _tenant(db)
    await _close(db, local)
    for _ in range(2):  # neither waits forever
        with pytest.raises(Unavailable):
            await asyncio.wait_for(_admit(local, tenant_id, None), 5)


async def test_an_in_memory_database_admits_by_the_same_statements_without_a_writer() -> None:
    """An in-memory database is one per connection: no writer thread opens it beside the
    engine, and the store runs the same rule in the engine's own transaction."""
    for url in ("sqlite+aiosqlite://", "sqlite+aiosqlite:///:memory:"):
        memory = Database(url)
        async with memory.engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
        async with memory.transaction() as s:
            tenant = await tenant_repo.create_tenant(s, "t")
            await quota_repo.set_quota(s, tenant.id, "*", requests_per_minute=1)
        store = SqlJobStore(memory)
        assert store._local is None
        request = Admission(new_id("job"), _new(tenant.id), None, utcnow(), 0, DISCOUNT)
        assert (await store.admit(request, counted=False)).count_first
        admitted = await store.admit(request, counted=True)
        assert admitted.job is not None and await store.get(admitted.job.id) == admitted.job
        again = dataclasses.replace(request, job_id=new_id("job"))
        refused = await store.admit(again, counted=True)
        assert refused.job is None and [held for *_, held in refused.quotas] == [False]
        # Admissions at once, on the one connection every session shares: one at a time.
        async with memory.transaction() as s:
            await quota_repo.set_quota(s, tenant.id, "*", requests_per_minute=4)
        burst = [dataclasses.replace(request, job_id=new_id("job")) for _ in range(10)]
        answers = await asyncio.gather(*(store.admit(a, counted=True) for a in burst))
        assert sum(a.job is not None for a in answers) == 3
        await store.close()
        await memory.close()
