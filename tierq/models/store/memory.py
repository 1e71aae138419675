"""The job store in this process's memory: the rules of `SqlJobStore` over dicts, for tests
that exercise a worker's or a service's logic and not a database. Nothing is kept past the
process, and nothing is shared with another one.

Each method changes the store without awaiting in between, so on one event loop it is as
atomic as a transaction is on the database.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any

from tierq.core import metrics
from tierq.core.ids import new_id
from tierq.core.messages import FAULT_UNIT
from tierq.core.states import TERMINAL, JobStatus, sources_for
from tierq.models.jobs import (
    IdempotencyConflict,
    NewJob,
    dead_letter_message,
    new_record,
    result_values,
)
from tierq.models.prices import cost_of
from tierq.models.records import JobHead, JobRecord, Progress, Result
from tierq.models.store.base import Usage
from tierq.models.tables import utcnow


class MemoryJobStore:
    def __init__(self) -> None:
        self._jobs: dict[str, JobRecord] = {}
        self._keys: dict[tuple[str, str], str] = {}  # (tenant, Idempotency-Key) -> job id
        self._history: dict[str, list[tuple[str, str | None]]] = {}
        self._ledger: dict[str, Usage] = {}

    async def create(self, new: NewJob) -> tuple[JobRecord, bool]:
        if new.idempotency_key is not None:
            found = self._keys.get((new.tenant_id, new.idempotency_key))
            if found is not None:
                existing = self._jobs[found]
                if existing.request_hash != new.request_hash:
                    raise IdempotencyConflict(new.idempotency_key)
                return existing, False
        job = new_record(new, new_id("job"), utcnow())
        self._jobs[job.id] = job
        self._history[job.id] = [(JobStatus.QUEUED.value, None)]
        if new.idempotency_key is not None:
            self._keys[(new.tenant_id, new.idempotency_key)] = job.id
        return job, True

    async def get(self, job_id: str, tenant_id: str | None = None) -> JobRecord | None:
        job = self._jobs.get(job_id)
        if job is None or (tenant_id is not None and job.tenant_id != tenant_id):
            return None
        return job

    async def head(self, job_id: str, tenant_id: str) -> JobHead | None:
        job = await self.get(job_id, tenant_id)
        return None if job is None else JobHead(job.id, job.tenant_id, job.status)

    async def statuses(self, job_ids: Sequence[str]) -> dict[str, JobStatus]:
        return {i: self._jobs[i].status for i in job_ids if i in self._jobs}

    async def unfinished(
        self, older_than: datetime, limit: int = 1000, after: tuple[datetime, str] | None = None
    ) -> list[JobRecord]:
        found = sorted(
            (
                job
                for job in self._jobs.values()
                if job.status in (JobStatus.QUEUED, JobStatus.RUNNING)
                and job.created_at < older_than
                and (after is None or (job.created_at, job.id) > after)
            ),
            key=lambda job: (job.created_at, job.id),
        )
        return found[:limit]

    async def usage(self, job_id: str) -> list[Usage]:
        row = self._ledger.get(job_id)
        return [] if row is None else [row]

    async def transitions(self, job_id: str) -> list[tuple[str, str | None]]:
        return list(self._history.get(job_id, []))

    async def claim(
        self,
        job_id: str,
        worker_id: str,
        max_deliveries: int,
        unsettled_charge: int = FAULT_UNIT,
    ) -> JobRecord | None:
        current = self._jobs.get(job_id)
        if current is None or current.status not in (JobStatus.QUEUED, JobStatus.RUNNING):
            return None
        charge = current.fault_charge
        if current.status == JobStatus.RUNNING:
            charge += max(0, unsettled_charge)
        if charge >= max_deliveries * FAULT_UNIT:
            self._move(
                current,
                JobStatus.FAILED,
                "dead-lettered",
                finished_at=utcnow(),
                fault_charge=charge,
                error_code="max_deliveries_exceeded",
                error_message=dead_letter_message(max_deliveries),
            )
            metrics.DEAD_LETTERS.labels(current.tier.value).inc()
            return None
        return self._move(
            current,
            JobStatus.RUNNING,
            worker_id,
            deliveries=current.deliveries + 1,
            worker_id=worker_id,
            fault_charge=charge,
            started_at=current.started_at or utcnow(),
        )

    async def finish(
        self, job_id: str, result: Result, delivery: int | None = None
    ) -> JobRecord | None:
        job = self._transition(
            job_id,
            JobStatus.SUCCEEDED,
            (JobStatus.RUNNING,),
            delivery=delivery,
            **result_values(result),
        )
        usage = (result.prompt_tokens, result.completion_tokens)
        if job is not None and usage[0] is not None and usage[1] is not None:
            self._bill(job, usage[0], usage[1])
        return job

    async def fail(
        self,
        job_id: str,
        code: str,
        message: str,
        *,
        delivery: int | None = None,
        from_queued: bool = False,
    ) -> JobRecord | None:
        sources = (JobStatus.RUNNING, JobStatus.QUEUED) if from_queued else (JobStatus.RUNNING,)
        return self._transition(
            job_id,
            JobStatus.FAILED,
            sources,
            delivery=delivery,
            finished_at=utcnow(),
            error_code=code,
            error_message=message,
        )

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
        current = self._jobs.get(job_id)
        if current is None:
            return None
        values: dict[str, Any] = {}
        if preempted:
            values["preemptions"] = current.preemptions + 1
        if charge > 0:
            values["fault_charge"] = current.fault_charge + charge
        if progress is not None:
            values["progress"] = progress
        return self._transition(
            job_id,
            JobStatus.QUEUED,
            (JobStatus.RUNNING,),
            detail=detail,
            delivery=delivery,
            **values,
        )

    async def cancel(self, job_id: str, tenant_id: str | None = None) -> JobRecord | None:
        current = await self.get(job_id, tenant_id)
        if current is None:
            return None
        kept = current.progress if current.status == JobStatus.QUEUED else None
        job = self._transition(
            job_id,
            JobStatus.CANCELLED,
            (JobStatus.QUEUED, JobStatus.RUNNING),
            finished_at=utcnow(),
            error_code="cancelled",
            error_message="the job was cancelled by its tenant",
        )
        if job is not None and kept is not None and current.deliveries > 0:
            return await self.bill_cancelled(job_id, kept.prompt_tokens, len(kept.token_ids))
        return job

    async def bill_cancelled(
        self, job_id: str, prompt_tokens: int, completion_tokens: int
    ) -> JobRecord | None:
        current = self._jobs.get(job_id)
        if (
            current is None
            or current.status != JobStatus.CANCELLED
            or current.prompt_tokens is not None
        ):
            return None
        job = dataclasses.replace(
            current, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens
        )
        self._jobs[job_id] = job
        self._bill(job, prompt_tokens, completion_tokens)
        metrics.count_tokens_served(job.tenant_id, job.tier.value, prompt_tokens, completion_tokens)
        return job

    async def close(self) -> None:
        return None

    # --- the state machine ------------------------------------------------------------

    def _transition(
        self,
        job_id: str,
        dst: JobStatus,
        sources: Sequence[JobStatus] | None = None,
        *,
        detail: str | None = None,
        delivery: int | None = None,
        **values: Any,
    ) -> JobRecord | None:
        """`models.jobs.transition`: `dst` if the job is in one of `sources` (and, given
        `delivery`, that is still its latest delivery); None when it was not."""
        current = self._jobs.get(job_id)
        allowed = sources if sources is not None else sources_for(dst)
        if current is None or current.status not in allowed:
            return None
        if delivery is not None and current.deliveries != delivery:
            return None
        return self._move(current, dst, detail, **values)

    def _move(
        self, current: JobRecord, dst: JobStatus, detail: str | None, **values: Any
    ) -> JobRecord:
        if dst in TERMINAL:
            values.setdefault("progress", None)  # nothing more resumes after it
        job = dataclasses.replace(current, status=dst, **values)
        self._jobs[job.id] = job
        self._history[job.id].append((dst.value, detail))
        return job

    def _bill(self, job: JobRecord, prompt_tokens: int, completion_tokens: int) -> None:
        if job.id in self._ledger:  # the ledger's key: one row per job
            return
        price_in = job.input_price or Decimal(0)
        price_out = job.output_price or Decimal(0)
        cost = cost_of(prompt_tokens, completion_tokens, price_in, price_out)
        self._ledger[job.id] = Usage(job.id, job.tenant_id, prompt_tokens, completion_tokens, cost)
