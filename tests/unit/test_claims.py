"""Claims of many jobs in one transaction (workers/claims.py), on a SQLite file: a burst goes
in few transactions, each claim as `start_job` alone would answer it, and a claim that fails
fails alone."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import migrations
from models import jobs as job_repo
from models import tenants as tenant_repo
from models.db import Database
from models.records import JobRecord
from tierq.tiers import Tier
from workers.claims import Claims


async def _database(tmp_path: Path, jobs: int) -> tuple[Database, list[str]]:
    url = f"sqlite+aiosqlite:///{tmp_path / 'claims.db'}"
    await asyncio.to_thread(migrations.upgrade, url)
    db = Database(url)
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
        ids = [(await job_repo.create_job(s, new))[0].id for _ in range(jobs)]
    return db, ids


async def test_a_burst_of_claims_shares_transactions_and_each_gets_its_own_answer(
    tmp_path: Path,
) -> None:
    db, ids = await _database(tmp_path, 30)
    claims = Claims(db, "w1", max_deliveries=3)
    transactions = 0
    begin = db.transaction

    def counting() -> Any:
        nonlocal transactions
        transactions += 1
        return begin()

    db.transaction = counting  # type: ignore[method-assign]
    try:
        got = await asyncio.gather(*(claims.claim(i) for i in [*ids, "unknown"]))
    finally:
        db.transaction = begin  # type: ignore[method-assign]
    assert [g.id for g in got[:-1] if g is not None] == ids and got[-1] is None
    assert all(g.deliveries == 1 and g.worker_id == "w1" for g in got[:-1] if g is not None)
    assert transactions <= 2  # the first alone, the rest together
    await db.close()


async def test_a_claim_that_fails_fails_alone(tmp_path: Path) -> None:
    db, ids = await _database(tmp_path, 5)
    claims = Claims(db, "w1", max_deliveries=3)
    start = claims._start

    async def broken(s: Any, job_id: str) -> JobRecord | None:
        if job_id == ids[2]:
            raise RuntimeError("this one is broken")
        return await start(s, job_id)

    claims._start = broken  # type: ignore[method-assign]
    got = await asyncio.gather(*(claims.claim(i) for i in ids), return_exceptions=True)
    assert isinstance(got[2], RuntimeError)
    assert [g.id for g in got if isinstance(g, JobRecord)] == ids[:2] + ids[3:]
    await db.close()
