"""The worker's writes, on an SQLite file and on PostgreSQL.

Claims of many jobs at once (tierq/workers/claims.py): on an SQLite file each claim is one hop
to the database's writer thread and a burst shares few COMMITs; on PostgreSQL a burst goes
in few transactions. Either way each claim gets the answer `claim_job` alone would give,
and a claim that fails fails alone.

A job's ending (`Database.write` of `finish_job`, `bill_cancelled`, `requeue_job`): many at
once, each bills its job exactly once — its ledger row and the spend counters — and a
stale or repeated ending writes nothing. A queued job whose earlier runs' tokens were kept
(preempted, handed back) is billed for them when it is cancelled, by any cancel path."""

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
from tierq.workers.claims import Claims

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
        return [(await job_repo.create_job(s, new))[0].id for _ in range(jobs)]


async def test_a_burst_of_claims_shares_transactions_and_each_gets_its_own_answer(
    database: Database,
) -> None:
    db = database
    ids = await _jobs(db, 30)
    claims = Claims(db, "w1", max_deliveries=3)
    commits = 0

    def counted(*_: Any) -> None:
        nonlocal commits
        commits += 1

    engine = db.local.engine if db.local is not None else db.engine.sync_engine
    event.listen(engine, "commit", counted)
    try:
        got = await asyncio.gather(*(claims.claim(i) for i in [*ids, "unknown"]))
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
    again = await claims.claim(ids[0])
    assert again is not None and again.deliveries == 2


async def test_a_claim_that_fails_fails_alone(
    database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = database
    ids = await _jobs(db, 5)
    claims = Claims(db, "w1", max_deliveries=3)
    claim = job_repo.claim_job

    def broken(s: Any, job_id: str, *args: Any) -> JobRecord | None:
        got = claim(s, job_id, *args)  # its writes are made, then rolled back
        if job_id == ids[2]:
            raise RuntimeError("this one is broken")
        return got

    monkeypatch.setattr(job_repo, "claim_job", broken)
    got = await asyncio.gather(*(claims.claim(i) for i in ids), return_exceptions=True)
    assert isinstance(got[2], RuntimeError)
    assert [g.id for g in got if isinstance(g, JobRecord)] == ids[:2] + ids[3:]
    async with db.session() as s:
        broken_job = await job_repo.get_job(s, ids[2])
        assert broken_job is not None and broken_job.status.value == "queued"
        assert broken_job.deliveries == 0
        for job_id in ids[:2] + ids[3:]:
            job = await job_repo.get_job(s, job_id)
            assert job is not None and job.status.value == "running"


async def _claimed(db: Database, jobs: int) -> list[JobRecord]:
    claims = Claims(db, "w1", max_deliveries=3)
    got = await asyncio.gather(*(claims.claim(i) for i in await _jobs(db, jobs)))
    assert all(g is not None for g in got)
    return [g for g in got if g is not None]


async def _billed(db: Database, job: JobRecord) -> tuple[int, int, int]:
    """The job's ledger rows, and its tenant's tokens on the all-time spend counter."""
    async with db.session() as s:
        rows = await job_repo.usage_for_job(s, job.id)
        tokens, _cost = await spend.spent(s, job.tenant_id, None, "total", job.created_at)
    return len(rows), sum(r.prompt_tokens + r.completion_tokens for r in rows), tokens


async def test_endings_at_once_bill_each_job_once(database: Database) -> None:
    db = database
    jobs = await _claimed(db, 20)

    def finish(job: JobRecord, delivery: int) -> Any:
        return db.write(
            lambda s: job_repo.finish_job(
                s,
                job.id,
                status=JobStatus.SUCCEEDED,
                text="done",
                finish_reason="length",
                prompt_tokens=7,
                completion_tokens=3,
                delivery=delivery,
            )
        )

    ended = await asyncio.gather(*(finish(j, j.deliveries) for j in jobs))
    assert [e.id for e in ended if e is not None] == [j.id for j in jobs]
    assert all(e.status == JobStatus.SUCCEEDED and e.result_text == "done" for e in ended if e)
    # Again, and from a stale delivery: nothing more is written or billed.
    assert await finish(jobs[0], jobs[0].deliveries) is None
    assert await finish(jobs[1], jobs[1].deliveries - 1) is None
    rows, tokens, counted = await _billed(db, jobs[0])
    assert (rows, tokens) == (1, 10)
    assert counted == 10 * len(jobs)  # one tenant: every job on its counter, once


async def test_a_cancelled_job_is_billed_once_and_a_requeue_counts_its_preemption(
    database: Database,
) -> None:
    db = database
    cancelled, preempted = await _claimed(db, 2)
    async with db.transaction() as s:
        assert await job_repo.cancel_job(s, cancelled.id) is not None
    billed = await asyncio.gather(
        *(db.write(job_repo.bill_cancelled, cancelled.id, 20, 5) for _ in range(3))
    )
    assert sum(b is not None for b in billed) == 1
    assert await _billed(db, cancelled) == (1, 25, 25)
    back = await db.write(
        lambda s: job_repo.requeue_job(
            s, preempted.id, "preempted", preempted.deliveries, preempted=True
        )
    )
    assert back is not None and back.status == JobStatus.QUEUED and back.preemptions == 1
    # A requeue of a delivery that is no longer running writes nothing.
    assert await db.write(job_repo.requeue_job, preempted.id, "again", preempted.deliveries) is None
    assert await _billed(db, preempted) == (0, 0, 25)


async def test_cancelling_a_queued_job_bills_the_tokens_its_earlier_runs_kept(
    database: Database,
) -> None:
    # Preempted after generating 4 tokens of a 6-token prompt, their ids kept for the next
    # run; then cancelled while queued: no run will bill those tokens, the cancel does.
    db = database
    kept, fresh, by_tenant, plain = await _claimed(db, 4)
    progress = Progress((11, 12, 13, 14), "abcd", 6, "simulated:bundled:m")
    for job in (kept, by_tenant):
        back = await db.write(
            lambda s, job=job: job_repo.requeue_job(
                s, job.id, "preempted", job.deliveries, preempted=True, progress=progress
            )
        )
        assert back is not None and back.progress == progress
    # Handed back without progress (nothing kept): cancelling it bills nothing.
    assert await db.write(job_repo.requeue_job, fresh.id, "drain", fresh.deliveries) is not None

    async with db.transaction() as s:
        cancelled = await job_repo.cancel_job(s, kept.id)
    assert cancelled is not None and cancelled.status == JobStatus.CANCELLED
    assert cancelled.to_api()["usage"] == {
        "prompt_tokens": 6,
        "completion_tokens": 4,
        "total_tokens": 10,
    }
    assert cancelled.progress is None
    async with db.transaction() as s:
        assert await job_repo.cancel_job(s, kept.id) is None  # twice: nothing more
        assert await job_repo.cancel_job(s, fresh.id) is not None
    assert await _billed(db, kept) == (1, 10, 10)
    assert (await _billed(db, fresh))[:2] == (0, 0)

    # The bulk path (a tenant suspended, a batch cancelled or expired) bills the same way;
    # a running job is left to its own run's bill (the worker's).
    async with db.transaction() as s:
        stopped = await job_repo.cancel_tenant_jobs(s, kept.tenant_id, "tenant_suspended", "x")
    assert {j.id for j in stopped} == {by_tenant.id, plain.id}
    usage = {j.id: j.to_api()["usage"] for j in stopped}
    assert usage[by_tenant.id] == {"prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10}
    assert usage[plain.id] is None
    assert await _billed(db, by_tenant) == (1, 10, 20)
    assert (await _billed(db, plain))[:2] == (0, 0)


async def test_a_cancel_racing_a_hand_back_bills_the_kept_tokens_once(database: Database) -> None:
    # A worker hands each job back with 4 kept tokens while its tenant cancels it. Whoever
    # commits first, the tokens are billed once: by the cancel when the hand-back landed
    # first, else by the worker's run (its hand-back finds the job cancelled).
    db = database
    jobs = await _claimed(db, 12)
    progress = Progress((1, 2, 3, 4), "abcd", 6, "simulated:bundled:m")

    async def hand_back(job: JobRecord) -> None:
        back = await db.write(
            lambda s: job_repo.requeue_job(
                s, job.id, "drain", job.deliveries, preempted=False, progress=progress
            )
        )
        if back is None:  # cancelled first: the worker bills its run (tierq/workers/worker.py)
            await db.write(job_repo.bill_cancelled, job.id, 6, 4)

    async def cancel(job: JobRecord) -> None:
        async with db.transaction() as s:
            assert await job_repo.cancel_job(s, job.id) is not None

    await asyncio.gather(*(f(j) for j in jobs for f in (hand_back, cancel)))
    for job in jobs:
        rows, tokens, _ = await _billed(db, job)
        assert (rows, tokens) == (1, 10), job.id
