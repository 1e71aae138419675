"""Claiming jobs in the database, many in one transaction.

A worker claims each job it takes from its inbox (queued -> running, its delivery counted)
before running it. An inbox read hands it many jobs at once — a burst of 64 is common — and
on SQLite (the embedded default) every transaction is a commit that waits for the single
writer, the API's admissions among them. So claims that arrive while one transaction is in
flight wait for it and then go together in the next: a lone claim goes at once, a burst
costs a few commits instead of one each. Each claim is the same `start_job` as alone, and
if a shared transaction fails, each of its claims is tried again in a transaction of its
own, so one job's failure never becomes another's.

On an SQLite file the claims go to the database's writer thread instead
(`Database.write`): each is one hop, and the claims that arrive while one transaction runs
share the next (a savepoint each, one COMMIT). Through aiosqlite, a shared transaction made
three hops per claim while it held SQLite's write lock, each waiting for this process's
event loop, which the engine's front end keeps busy: a burst's claims held the lock for
half a second and every admission in the API waited for them.
"""

from __future__ import annotations

import asyncio

from sqlalchemy.ext.asyncio import AsyncSession

from tierq.core.messages import FAULT_UNIT
from tierq.models import jobs as job_repo
from tierq.models.db import Database
from tierq.models.records import JobRecord

Pending = tuple[str, int, "asyncio.Future[JobRecord | None]"]  # job id, unsettled charge


class Claims:
    def __init__(self, db: Database, worker_id: str, max_deliveries: int) -> None:
        self.db = db
        self.worker_id = worker_id
        self.max_deliveries = max_deliveries
        self._pending: list[Pending] = []
        self._draining: asyncio.Task[None] | None = None

    async def claim(self, job_id: str, unsettled_charge: int = FAULT_UNIT) -> JobRecord | None:
        """The job to run, or None when it must not run (see `job_repo.claim_job`, which
        charges an unsettled earlier delivery `unsettled_charge`)."""
        if self.db.local is not None:
            return await self.db.write(
                job_repo.claim_job, job_id, self.worker_id, self.max_deliveries, unsettled_charge
            )
        future: asyncio.Future[JobRecord | None] = asyncio.get_running_loop().create_future()
        self._pending.append((job_id, unsettled_charge, future))
        if self._draining is None or self._draining.done():
            self._draining = asyncio.create_task(self._drain(), name="claims")
        return await future

    async def _drain(self) -> None:
        batch: list[Pending] = []
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                batch = [p for p in batch if not p[2].done()]  # callers gone
                if len(batch) == 1:
                    await self._one(*batch[0])
                    continue
                try:
                    async with self.db.transaction() as s:
                        claimed = [await self._start(s, job_id, c) for job_id, c, _ in batch]
                except Exception:
                    for pending in batch:  # alone, each succeeds or fails on its own
                        await self._one(*pending)
                    continue
                for (_, _, future), job in zip(batch, claimed, strict=True):
                    if not future.done():
                        future.set_result(job)
        finally:  # cancelled (the loop is closing): nobody may wait for ever
            for _, _, future in [*batch, *self._pending]:
                if not future.done():
                    future.cancel()

    async def _one(
        self, job_id: str, unsettled_charge: int, future: asyncio.Future[JobRecord | None]
    ) -> None:
        try:
            async with self.db.transaction() as s:
                job = await self._start(s, job_id, unsettled_charge)
        except Exception as exc:
            if not future.done():
                future.set_exception(exc)
            return
        if not future.done():
            future.set_result(job)

    async def _start(self, s: AsyncSession, job_id: str, unsettled_charge: int) -> JobRecord | None:
        return await job_repo.start_job(
            s, job_id, self.worker_id, self.max_deliveries, unsettled_charge
        )
