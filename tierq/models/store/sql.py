"""The job store on PostgreSQL and on the embedded SQLite file.

Each change of a job's state is one of `tierq.models.jobs`' synchronous functions, run
in a transaction of its own as far as it can tell:

- on an SQLite file, one hop to the store's writer thread (`LocalWriter`): the writes
  that arrive while one transaction runs share the next one's COMMIT, each in a savepoint
  of its own. Through aiosqlite a transaction is a hop per statement, each waiting for
  this process's event loop while it holds SQLite's one write lock, which every process's
  writes — the API's admissions among them — wait for;
- elsewhere, a session's transaction (`run_sync`). A worker's claims, which an inbox
  read hands it many at once, share transactions too: claims that arrive while one is in
  flight go together in the next, each the same `claim_job` as alone; if a shared one
  fails, each of its claims is tried again alone, so that one job's failure never becomes
  another's.

Admission (`admit`), the whole rule in one step on each backend: on PostgreSQL one call of
the `tierq_admit` function; on an SQLite file one hop to the writer.

The store's own connections, beside the database's engine: on PostgreSQL a few raw
asyncpg connections (`RawPool`) for the single statements of admission's fast ways and of
`head`; on an SQLite file the writer's connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TypeVar

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from tierq.core.messages import FAULT_UNIT
from tierq.core.states import JobStatus
from tierq.models import admission, admission_sqlite
from tierq.models import jobs as repo
from tierq.models.admission import Admission, Answer
from tierq.models.db import Database, LocalWriter, RawPool, Unavailable, is_sqlite_file
from tierq.models.jobs import NewJob
from tierq.models.records import JobHead, JobRecord, Progress, Result
from tierq.models.store.base import Usage

T = TypeVar("T")


@dataclass(frozen=True)
class _Claim:
    job_id: str
    worker_id: str
    max_deliveries: int
    unsettled_charge: int
    done: asyncio.Future[JobRecord | None]


class SqlJobStore:
    """The job store on `db` (see the module's docstring); `close()` lets go of its own
    connections, not of `db`'s."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._raw: RawPool | None = None
        self._local: LocalWriter | None = None
        if db.dialect == "postgresql":
            self._raw = RawPool(db.url, db.pool_size, db.pool_timeout_s, db.transaction_pooling)
        elif db.dialect == "sqlite" and is_sqlite_file(db.url):
            self._local = LocalWriter(db.url)
        self._admitting = asyncio.Lock()  # an in-memory SQLite database's (`admit`)
        self._claims: list[_Claim] = []
        self._claiming: asyncio.Task[None] | None = None
        self._closed = False

    # --- admission --------------------------------------------------------------------

    async def admit(self, request: Admission, *, counted: bool) -> Answer:
        """The whole rule in one step: one call of `tierq_admit` on PostgreSQL
        (tierq/models/admission.py), one hop to the writer on an SQLite file
        (tierq/models/admission_sqlite.py), whose statements run in one transaction of the
        engine's on an in-memory database."""
        if self._raw is not None:
            return await admission.admit(self._raw, request, counted)
        if self._local is not None:
            return await admission_sqlite.admit(self._local, request, counted)
        # An in-memory database is one connection, which every session shares: one
        # admission at a time on it, or their transactions would interleave there.
        async with self._admitting, self.db.transaction() as s:
            return await s.run_sync(
                lambda ss: admission_sqlite.admit_in(ss.connection(), request, counted)
            )

    # --- reads ------------------------------------------------------------------------

    async def create(self, new: NewJob) -> tuple[JobRecord, bool]:
        return await self._write(repo.create_job, new)

    async def get(self, job_id: str, tenant_id: str | None = None) -> JobRecord | None:
        async with self.db.session() as s:
            return await repo.get_job(s, job_id, tenant_id)

    async def head(self, job_id: str, tenant_id: str) -> JobHead | None:
        if self._raw is None:
            async with self.db.session() as s:
                return await repo.get_job_head(s, job_id, tenant_id)
        # One statement on a raw connection: no session, no BEGIN/ROLLBACK, no pre-ping.
        # Every stream's connect reads it, and a stream storm opens thousands.
        row = await self._raw.fetchrow(
            "SELECT status FROM jobs WHERE id = $1 AND tenant_id = $2", job_id, tenant_id
        )
        return None if row is None else JobHead(job_id, tenant_id, JobStatus(row["status"]))

    async def statuses(self, job_ids: Sequence[str]) -> dict[str, JobStatus]:
        async with self.db.session() as s:
            return await repo.statuses(s, job_ids)

    async def unfinished(
        self, older_than: datetime, limit: int = 1000, after: tuple[datetime, str] | None = None
    ) -> list[JobRecord]:
        async with self.db.session() as s:
            return await repo.unfinished_jobs(s, older_than, limit, after)

    async def usage(self, job_id: str) -> list[Usage]:
        async with self.db.session() as s:
            rows = await repo.usage_for_job(s, job_id)
        return [
            Usage(r.job_id, r.tenant_id, r.prompt_tokens, r.completion_tokens, r.cost) for r in rows
        ]

    async def transitions(self, job_id: str) -> list[tuple[str, str | None]]:
        async with self.db.session() as s:
            return await repo.transitions(s, job_id)

    # --- writes -----------------------------------------------------------------------

    async def claim(
        self,
        job_id: str,
        worker_id: str,
        max_deliveries: int,
        unsettled_charge: int = FAULT_UNIT,
    ) -> JobRecord | None:
        if self._local is not None:
            return await self._write(
                repo.claim_job, job_id, worker_id, max_deliveries, unsettled_charge
            )
        if self._closed:
            raise Unavailable("the job store is closed")
        done: asyncio.Future[JobRecord | None] = asyncio.get_running_loop().create_future()
        self._claims.append(_Claim(job_id, worker_id, max_deliveries, unsettled_charge, done))
        if self._claiming is None or self._claiming.done():
            self._claiming = asyncio.create_task(self._claim_all(), name="claims")
        return await done

    async def finish(
        self, job_id: str, result: Result, delivery: int | None = None
    ) -> JobRecord | None:
        return await self._write(repo.finish_job, job_id, result, delivery)

    async def fail(
        self,
        job_id: str,
        code: str,
        message: str,
        *,
        delivery: int | None = None,
        from_queued: bool = False,
    ) -> JobRecord | None:
        def fail(s: Session) -> JobRecord | None:
            return repo.fail_job(
                s, job_id, code, message, from_queued=from_queued, delivery=delivery
            )

        return await self._write(fail)

    async def requeue(
        self,
        job_id: str,
        detail: str,
        delivery: int | None = None,
        *,
        preempted: bool = False,
        progress: Progress | None = None,
        charge: int = 0,
    ) -> JobRecord | None:
        def requeue(s: Session) -> JobRecord | None:
            return repo.requeue_job(
                s,
                job_id,
                detail,
                delivery,
                preempted=preempted,
                progress=progress,
                charge=charge,
            )

        return await self._write(requeue)

    async def cancel(self, job_id: str, tenant_id: str | None = None) -> JobRecord | None:
        return await self._write(repo.cancel_one, job_id, tenant_id)

    async def cancel_all(self, tenant_id: str, code: str, message: str) -> list[JobRecord]:
        return await self._write(repo.cancel_tenant_jobs, tenant_id, code, message)

    async def bill_cancelled(
        self, job_id: str, prompt_tokens: int, completion_tokens: int
    ) -> JobRecord | None:
        return await self._write(repo.bill_cancelled, job_id, prompt_tokens, completion_tokens)

    async def close(self) -> None:
        """Claims still in flight end first (each answered, or refused as unavailable),
        then the store's own connections are let go."""
        self._closed = True
        if self._claiming is not None:
            await asyncio.gather(self._claiming, return_exceptions=True)
        if self._raw is not None:
            await self._raw.close()
        if self._local is not None:
            await self._local.close()

    # --- how writes run -----------------------------------------------------------------

    async def _write(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(session, *args)` with a synchronous ORM session, in a transaction of its own
        as far as it can tell (the module's docstring)."""
        if self._local is not None:
            return await self._local.run(_in_session, fn, *args)
        async with self.db.transaction() as s:
            return await s.run_sync(fn, *args)

    async def _claim_all(self) -> None:
        batch: list[_Claim] = []
        try:
            while self._claims:
                batch, self._claims = self._claims, []
                batch = [c for c in batch if not c.done.done()]  # callers gone
                if len(batch) == 1:
                    await self._claim_alone(batch[0])
                    continue
                try:
                    async with self.db.transaction() as s:
                        claimed = [await s.run_sync(_claim, c) for c in batch]
                except Exception:
                    for c in batch:  # alone, each succeeds or fails on its own
                        await self._claim_alone(c)
                    continue
                for c, job in zip(batch, claimed, strict=True):
                    if not c.done.done():
                        c.done.set_result(job)
        finally:  # cancelled (the loop is closing): nobody may wait for ever
            for c in [*batch, *self._claims]:
                if not c.done.done():
                    c.done.set_exception(Unavailable("the claim was not made: the store stopped"))

    async def _claim_alone(self, c: _Claim) -> None:
        try:
            async with self.db.transaction() as s:
                job = await s.run_sync(_claim, c)
        except Exception as exc:
            if not c.done.done():
                c.done.set_exception(exc)
            return
        if not c.done.done():
            c.done.set_result(job)


def _claim(s: Session, c: _Claim) -> JobRecord | None:
    return repo.claim_job(s, c.job_id, c.worker_id, c.max_deliveries, c.unsettled_charge)


def _in_session(conn: Connection, fn: Callable[..., T], *args: object) -> T:
    """On the writer's thread: `fn` with an ORM session in the writer's transaction."""
    with Session(bind=conn, join_transaction_mode="create_savepoint") as s:
        value = fn(s, *args)
        s.commit()  # releases the session's savepoint; the writer commits the transaction
        return value
