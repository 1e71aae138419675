"""The SQL job store's own properties (tierq/models/store/sql.py), on an SQLite file and on
PostgreSQL, beyond the contract every store keeps (tests/job_store_contract.py).

Claims of many jobs at once: on an SQLite file each claim is one hop to the store's writer
thread and a burst shares few COMMITs; on PostgreSQL a burst goes in few transactions.
Either way each claim gets the answer `claim_job` alone would give, and a claim that fails
fails alone.

A job's ending, many at once: each bills its job exactly once — its ledger row and the
spend counters — and a stale or repeated ending writes nothing. A queued job whose earlier
runs' tokens were kept (preempted, handed back) is billed for them when it is cancelled, by
any cancel path, and once when the cancel races the worker's hand-back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, text

from tierq import migrations
from tierq.core.states import JobStatus
from tierq.core.tiers import Tier
from tierq.models import jobs as job_repo
from tierq.models import spend
from tierq.models import tenants as tenant_repo
from tierq.models.db import Database
from tierq.models.records import JobRecord, Progress
from tierq.models.store import Result, SqlJobStore

pytestmark = pytest.mark.integration


@pytest.fixture(params=["sqlite", "postgresql"])
async def database(
    request: pytest.FixtureRequest, tmp_path: Path, pg_database: str
) -> AsyncIterator[Database]:
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'claims.db'}"
        await asyncio.to_thread(migrations.upgrade, url)
    else:
        url = pg_database
    db = Database(url)
    if request.param == "postgresql":
        async with db.transaction() as s:
            await s.execute(text("TRUNCATE tenants CASCADE"))
    yield db
    await db.close()


@pytest.fixture
async def store(database: Database) -> AsyncIterator[SqlJobStore]:
    store = SqlJobStore(database)
    yield store
    await store.close()


async def _jobs(db: Database, jobs: int) -> list[str]:
    async with db.transaction() as s:
        tenant = await tenant_repo.create_tenant(s, "t")
        new = job_repo.NewJob(
            tenant_id=tenant.id,
            tier=Tier.BATCH,
            model="m",
            messages=None,
            prompt="x",
            params={"max_tokens": 3},
        )
        return [(await s.run_sync(job_repo.create_job, new))[0].id for _ in range(jobs)]


async def test_a_burst_of_claims_shares_transactions_and_each_gets_its_own_answer(
    database: Database, store: SqlJobStore
) -> None:
    db = database
    ids = await _jobs(db, 30)
    commits = 0

    def counted(*_: Any) -> None:
        nonlocal commits
        commits += 1

    # On SQLite the writer's own connection commits; on PostgreSQL the database's engine.
    engine = store._local.engine if store._local is not None else db.engine.sync_engine
    event.listen(engine, "commit", counted)
    try:
        got = await asyncio.gather(*(store.claim(i, "w1", 3) for i in [*ids, "unknown"]))
    finally:
        event.remove(engine, "commit", counted)
    assert [g.id for g in got[:-1] if g is not None] == ids and got[-1] is None
    assert all(g.deliveries == 1 and g.worker_id == "w1" for g in got[:-1] if g is not None)
    assert 1 <= commits <= 2  # the first alone, the rest together
    async with db.session() as s:  # committed, with their transitions
        for job_id in ids:
            job = await job_repo.get_job(s, job_id)
            assert job is not None and job.status.value == "running"
        history = await s.execute(
            text("SELECT count(*) FROM job_transitions WHERE status = 'running'")
        )
        assert history.scalar() == len(ids)
    # A second claim of the same delivery does not run it again.
    again = await store.claim(ids[0], "w1", 3)
    assert again is not None and again.deliveries == 2


async def test_a_claim_that_fails_fails_alone(
    database: Database, store: SqlJobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = database
    ids = await _jobs(db, 5)
    claim = job_repo.claim_job

    def broken(s: Any, job_id: str, *args: Any) -> JobRecord | None:
        got = claim(s, job_id, *args)  # its writes are made, then rolled back
        if job_id == ids[2]:
            raise RuntimeError("this one is broken")
        return got

    monkeypatch.setattr(job_repo, "claim_job", broken)
    got = await asyncio.gather(*(store.claim(i, "w1", 3) for i in ids), return_exceptions=True)
    assert isinstance(got[2], RuntimeError)
    assert [g.id for g in got if isinstance(g, JobRecord)] == ids[:2] + ids[3:]
    async with db.session() as s:
        broken_job = await job_repo.get_job(s, ids[2])
        assert broken_job is not None and broken_job.status.value == "queued"
        assert broken_job.deliveries == 0
        for job_id in ids[:2] + ids[3:]:
            job = await job_repo.get_job(s, job_id)
            assert job is not None and job.status.value == "running"


async def _claimed(db: Database, store: SqlJobStore, jobs: int) -> list[JobRecord]:
    got = await asyncio.gather(*(store.claim(i, "w1", 3) for i in await _jobs(db, jobs)))
    assert all(g is not None for g in got)
    return [g for g in got if g is not None]


async def _billed(db: Database, job: JobRecord) -> tuple[int, int, int]:
    """The job's ledger rows, and its tenant's tokens on the all-time spend counter."""
    async with db.session() as s:
        rows = await job_repo.usage_for_job(s, job.id)
        tokens, _cost = await spend.spent(s, job.tenant_id, None, "total", job.created_at)
    return len(rows), sum(r.prompt_tokens + r.completion_tokens for r in rows), tokens


async def test_endings_at_once_bill_each_job_once(database: Database, store: SqlJobStore) -> None:
    db = database
    jobs = await _claimed(db, store, 20)
    result = Result("done", "length", 7, 3)
    ended = await asyncio.gather(*(store.finish(j.id, result, j.deliveries) for j in jobs))
    assert [e.id for e in ended if e is not None] == [j.id for j in jobs]
    assert all(e.status == JobStatus.SUCCEEDED and e.result_text == "done" for e in ended if e)
    # Again, and from a stale delivery: nothing more is written or billed.
    assert await store.finish(jobs[0].id, result, jobs[0].deliveries) is None
    assert await store.finish(jobs[1].id, result, jobs[1].deliveries - 1) is None
    rows, tokens, counted = await _billed(db, jobs[0])
    assert (rows, tokens) == (1, 10)
    assert counted == 10 * len(jobs)  # one tenant: every job on its counter, once


async def test_a_cancelled_run_is_billed_once_on_the_spend_counters(
    database: Database, store: SqlJobStore
) -> None:
    db = database
    (cancelled,) = await _claimed(db, store, 1)
    assert await store.cancel(cancelled.id) is not None
    billed = await asyncio.gather(*(store.bill_cancelled(cancelled.id, 20, 5) for _ in range(3)))
    assert sum(b is not None for b in billed) == 1
    assert await _billed(db, cancelled) == (1, 25, 25)


async def test_the_bulk_cancel_bills_the_tokens_queued_jobs_kept(
    database: Database, store: SqlJobStore
) -> None:
    # The bulk cancel (a tenant suspended; a batch cancelled or expired runs the same
    # statements) bills kept tokens as the job store's cancel does; a running job is left to
    # its own run's bill (the worker's).
    db = database
    kept, plain, busy = await _claimed(db, store, 3)
    progress = Progress((11, 12, 13, 14), "abcd", 6, "simulated:bundled:m")
    assert await store.requeue(kept.id, "preempted", kept.deliveries, progress=progress)
    assert await store.requeue(plain.id, "drain", plain.deliveries)
    stopped = await store.cancel_all(kept.tenant_id, "tenant_suspended", "x")
    assert {j.id for j in stopped} == {kept.id, plain.id, busy.id}
    usage = {j.id: j.to_api()["usage"] for j in stopped}
    assert usage[kept.id] == {"prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10}
    assert usage[plain.id] is None and usage[busy.id] is None
    assert await _billed(db, kept) == (1, 10, 10)
    assert (await _billed(db, plain))[:2] == (0, 0)
    assert (await _billed(db, busy))[:2] == (0, 0)


@pytest.mark.parametrize("cancel_by", ["tenant", "suspension", "wind-up"])
async def test_a_cancel_racing_hand_backs_bills_the_kept_tokens_once(
    database: Database, store: SqlJobStore, cancel_by: str
) -> None:
    # A worker hands each job back with 4 kept tokens while it is cancelled: by its tenant
    # (the store's cancel, job by job), all at once by a suspension (the store's bulk
    # cancel), or by the same statements in a session's transaction beside the store's
    # own writes, as a batch's wind-up runs them (on SQLite beside the writer thread's
    # connection). Whoever commits first, the tokens are billed once: by the cancel when
    # the hand-back landed first, else by the worker's run (its hand-back finds the job
    # cancelled).
    db = database
    jobs = await _claimed(db, store, 12)
    progress = Progress((1, 2, 3, 4), "abcd", 6, "simulated:bundled:m")

    async def hand_back(job: JobRecord) -> None:
        back = await store.requeue(job.id, "drain", job.deliveries, progress=progress)
        if back is None:  # cancelled first: the worker bills its run (tierq/workers/worker.py)
            await store.bill_cancelled(job.id, 6, 4)

    async def cancel(job: JobRecord) -> None:
        assert await store.cancel(job.id) is not None

    async def suspend() -> None:
        await store.cancel_all(jobs[0].tenant_id, "tenant_suspended", "x")

    async def wind_up() -> None:
        tenant_id = jobs[0].tenant_id
        async with db.transaction() as s:
            await s.run_sync(job_repo.cancel_tenant_jobs, tenant_id, "batch_cancelled", "x")

    if cancel_by == "tenant":
        await asyncio.gather(*(f(j) for j in jobs for f in (hand_back, cancel)))
    else:
        backs = [hand_back(j) for j in jobs]
        bulk = suspend() if cancel_by == "suspension" else wind_up()
        await asyncio.gather(*backs[:6], bulk, *backs[6:])
    for job in jobs:
        current = await store.get(job.id)
        assert current is not None and current.status == JobStatus.CANCELLED
        rows, tokens, _ = await _billed(db, job)
        assert (rows, tokens) == (1, 10), job.id
