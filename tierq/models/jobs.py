"""Jobs, their state history and their usage records: every SQL statement about them.

State changes are conditional UPDATEs (`WHERE status IN <allowed sources>`), so two
processes racing on one job (a worker finishing it while its tenant cancels it, or a
job delivered twice) cannot both win; the loser sees `None` and stands down.

Writes are synchronous functions of an ORM `Session`: the job store (tierq/models/store)
runs each in a transaction of its own — on an SQLite file on its writer thread, elsewhere
through `run_sync` — and a caller that must write in its own transaction (a batch's
fenced wind-up) does the same. Reads are coroutines of an `AsyncSession`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import and_, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from tierq.core import metrics
from tierq.core.ids import new_id
from tierq.core.messages import FAULT_UNIT
from tierq.core.states import TERMINAL, JobStatus, sources_for
from tierq.core.tiers import Tier
from tierq.models import spend, usage_days
from tierq.models.pages import after_anchor
from tierq.models.prices import cost_of
from tierq.models.records import JobHead, JobRecord, Progress, Result, as_utc
from tierq.models.tables import Job, JobTransition, UsageRecord, utcnow


class IdempotencyConflict(Exception):
    """The Idempotency-Key was used before with a different request body."""


@dataclass(frozen=True)
class NewJob:
    tenant_id: str
    tier: Tier
    model: str
    messages: list[dict[str, Any]] | None
    prompt: str | None
    params: dict[str, Any]
    metadata: dict[str, Any] | None = None
    idempotency_key: str | None = None
    request_hash: str | None = None
    reserved_tokens: int = 0
    input_price: Decimal | None = None
    output_price: Decimal | None = None
    # Counted in held_reservations' sums (tables.Job.held_counted): admission sets it for
    # a tenant that `counts_held`.
    held_counted: bool = False


def _existing_by_key(s: Session, tenant_id: str, key: str) -> Job | None:
    stmt = select(Job).where(Job.tenant_id == tenant_id, Job.idempotency_key == key)
    return s.execute(stmt).scalar_one_or_none()


def create_job(s: Session, new: NewJob) -> tuple[JobRecord, bool]:
    """Insert a queued job; with an Idempotency-Key already used, return that job instead
    (`IdempotencyConflict` for another request body).

    Returns (job, created). Commits nothing: the caller owns the transaction.
    """
    if new.idempotency_key is not None:
        existing = _existing_by_key(s, new.tenant_id, new.idempotency_key)
        if existing is not None:
            if existing.request_hash != new.request_hash:
                raise IdempotencyConflict(new.idempotency_key)
            return JobRecord.from_row(existing), False
    now = utcnow()
    if new.idempotency_key is None:
        # Nothing can conflict: two plain INSERTs, without a savepoint or the ORM's flush.
        values = row_values(new, new_id("job"), now)
        s.execute(insert(Job).values(values))
        s.execute(
            insert(JobTransition).values(job_id=values["id"], status=values["status"], at=now)
        )
        return new_record(new, values["id"], now), True
    row = new_row(new, new_id("job"), now)
    try:
        with s.begin_nested():
            s.add(row)
            s.add(JobTransition(job_id=row.id, status=JobStatus.QUEUED.value, at=now))
    except IntegrityError:
        # A concurrent request with the same Idempotency-Key won the insert.
        assert new.idempotency_key is not None
        existing = _existing_by_key(s, new.tenant_id, new.idempotency_key)
        if existing is None:
            raise
        if existing.request_hash != new.request_hash:
            raise IdempotencyConflict(new.idempotency_key) from None
        return JobRecord.from_row(existing), False
    return JobRecord.from_row(row), True


def new_row(new: NewJob, job_id: str, now: datetime) -> Job:
    """The row of a job just admitted (queued, never delivered)."""
    return Job(**row_values(new, job_id, now))


def new_record(new: NewJob, job_id: str, now: datetime) -> JobRecord:
    """The record of a job just admitted, as `JobRecord.from_row(new_row(...))` reads it
    back, without building an ORM row on the way: every admission answers with it."""
    return JobRecord(
        id=job_id,
        tenant_id=new.tenant_id,
        tier=new.tier,
        model=new.model,
        status=JobStatus.QUEUED,
        messages=new.messages,
        prompt=new.prompt,
        params=dict(new.params),
        metadata=new.metadata,
        request_hash=new.request_hash,
        created_at=as_utc(now) or now,
        started_at=None,
        finished_at=None,
        result_text=None,
        finish_reason=None,
        prompt_tokens=None,
        completion_tokens=None,
        error_code=None,
        error_message=None,
        deliveries=0,
        worker_id=None,
        reserved_tokens=new.reserved_tokens,
        input_price=new.input_price,
        output_price=new.output_price,
    )


def row_values(new: NewJob, job_id: str, now: datetime) -> dict[str, Any]:
    return {
        "id": job_id,
        "tenant_id": new.tenant_id,
        "tier": new.tier.value,
        "model": new.model,
        "status": JobStatus.QUEUED.value,
        "messages": new.messages,
        "prompt": new.prompt,
        "params": new.params,
        "metadata_": new.metadata,
        "idempotency_key": new.idempotency_key,
        "request_hash": new.request_hash,
        "created_at": now,
        "deliveries": 0,
        "preemptions": 0,
        "reserved_tokens": new.reserved_tokens,
        "input_price": new.input_price,
        "output_price": new.output_price,
        "held_counted": new.held_counted,
    }


async def get_job_head(s: AsyncSession, job_id: str, tenant_id: str) -> JobHead | None:
    """The tenant's job's id and status, without loading its request or its result."""
    stmt = select(Job.status).where(Job.id == job_id, Job.tenant_id == tenant_id)
    status = (await s.execute(stmt)).scalar_one_or_none()
    return None if status is None else JobHead(job_id, tenant_id, JobStatus(status))


async def statuses(s: AsyncSession, job_ids: Sequence[str]) -> dict[str, JobStatus]:
    """The status of each of these jobs that exists, in one statement."""
    stmt = select(Job.id, Job.status).where(Job.id.in_(list(job_ids)))
    return {job_id: JobStatus(status) for job_id, status in (await s.execute(stmt)).all()}


async def get_job(s: AsyncSession, job_id: str, tenant_id: str | None = None) -> JobRecord | None:
    stmt = select(Job).where(Job.id == job_id)
    if tenant_id is not None:
        stmt = stmt.where(Job.tenant_id == tenant_id)
    row = (await s.execute(stmt)).scalar_one_or_none()
    return None if row is None else JobRecord.from_row(row)


async def list_jobs(
    s: AsyncSession,
    tenant_id: str,
    *,
    status: JobStatus | None = None,
    tier: Tier | None = None,
    after: str | None = None,
    limit: int = 20,
) -> tuple[list[JobRecord], bool]:
    """Newest first; `after` is the id of the last job of the previous page."""
    stmt = select(Job).where(Job.tenant_id == tenant_id)
    if status is not None:
        stmt = stmt.where(Job.status == status.value)
    if tier is not None:
        stmt = stmt.where(Job.tier == tier.value)
    anchor = None
    if after is not None:
        found = await get_job(s, after, tenant_id)
        if found is None:
            return [], False
        anchor = (found.created_at, found.id)
    stmt = after_anchor(stmt, Job.created_at, Job.id, anchor, limit)
    rows = list((await s.execute(stmt)).scalars())
    return [JobRecord.from_row(r) for r in rows[:limit]], len(rows) > limit


def transition(
    s: Session,
    job_id: str,
    dst: JobStatus,
    *,
    sources: Sequence[JobStatus] | None = None,
    detail: str | None = None,
    delivery: int | None = None,
    **values: Any,
) -> JobRecord | None:
    """Move a job to `dst` if it is in one of `sources` (and, given `delivery`, if that is
    still its latest delivery: a stale run of a job delivered again cannot move it);
    None when it was not. Synchronous (the job store's writer, `run_sync`)."""
    allowed = [src.value for src in (sources if sources is not None else sources_for(dst))]
    if dst in TERMINAL:
        values.setdefault("progress", None)  # nothing more resumes after it
    where = [Job.id == job_id, Job.status.in_(allowed)]
    if delivery is not None:
        where.append(Job.deliveries == delivery)
    stmt = (
        update(Job)
        .where(*where)
        .values(status=dst.value, **values)
        .returning(Job)
        .execution_options(synchronize_session=False, populate_existing=True)
    )
    row = s.execute(stmt).scalar_one_or_none()
    if row is None:
        return None
    s.add(JobTransition(job_id=job_id, status=dst.value, at=utcnow(), detail=detail))
    return JobRecord.from_row(row)


def dead_letter_message(max_deliveries: int) -> str:
    return (
        f"the job's runs failed {max_deliveries} times (engine errors, or engines and "
        "workers that died while running it)"
    )


def claim_job(
    s: Session,
    job_id: str,
    worker_id: str,
    max_deliveries: int,
    unsettled_charge: int = FAULT_UNIT,
) -> JobRecord | None:
    """Claim a job for a worker: queued -> running, or running -> running on redelivery.

    A job found running was not settled by its last delivery's worker (it vanished): that
    delivery is charged `unsettled_charge` (whoever put the entry back knows how many jobs
    shared the fault, and that a planned stop is none of the job's). Returns the job to
    run, or None when it must not run (finished, cancelled, unknown, or dead-lettered here
    because it was charged MAX_DELIVERIES failed deliveries: `fault_charge`). Synchronous,
    so that on SQLite the whole claim is one hop to the job store's writer thread.
    """
    found = s.execute(select(Job).where(Job.id == job_id)).scalar_one_or_none()
    current = None if found is None else JobRecord.from_row(found)
    if current is None or current.status not in (JobStatus.QUEUED, JobStatus.RUNNING):
        return None
    charge = current.fault_charge
    if current.status == JobStatus.RUNNING:
        charge += max(0, unsettled_charge)
    if charge >= max_deliveries * FAULT_UNIT:
        dead = transition(
            s,
            job_id,
            JobStatus.FAILED,
            sources=(current.status,),
            detail="dead-lettered",
            finished_at=utcnow(),
            fault_charge=charge,
            error_code="max_deliveries_exceeded",
            error_message=dead_letter_message(max_deliveries),
        )
        if dead is not None:  # counted as its transaction commits, but for a rare rollback
            metrics.DEAD_LETTERS.labels(current.tier.value).inc()
        return None
    values: dict[str, Any] = {
        "deliveries": current.deliveries + 1,
        "worker_id": worker_id,
        "fault_charge": charge,
    }
    if current.started_at is None:
        values["started_at"] = utcnow()
    stmt = (
        update(Job)
        .where(
            Job.id == job_id,
            Job.status == current.status.value,
            Job.deliveries == current.deliveries,
        )
        .values(status=JobStatus.RUNNING.value, **values)
        .returning(Job)
        .execution_options(synchronize_session=False, populate_existing=True)
    )
    row = s.execute(stmt).scalar_one_or_none()
    if row is None:  # someone else moved it meanwhile
        return None
    s.add(
        JobTransition(job_id=job_id, status=JobStatus.RUNNING.value, at=utcnow(), detail=worker_id)
    )
    return JobRecord.from_row(row)


def result_values(result: Result) -> dict[str, Any]:
    """The columns a run's result sets on its job as it succeeds (every store's)."""
    return {
        "finished_at": utcnow(),
        "result_text": result.text,
        "result_logprobs": result.logprobs,
        "result_choices": result.choices,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "error_code": None,
        "error_message": None,
    }


def finish_job(
    s: Session, job_id: str, result: Result, delivery: int | None = None
) -> JobRecord | None:
    """running -> succeeded with its result, and its usage record, exactly once.
    Synchronous: on SQLite the whole ending is one hop to the job store's writer thread,
    not a hop per statement holding SQLite's write lock."""
    job = transition(
        s,
        job_id,
        JobStatus.SUCCEEDED,
        sources=(JobStatus.RUNNING,),
        delivery=delivery,
        **result_values(result),
    )
    if (
        job is not None
        and result.prompt_tokens is not None
        and result.completion_tokens is not None
    ):
        # The conditional transition above admits one finisher per job; the primary key on
        # job_id would refuse a second record even if it did not.
        _record_usage(s, job, result.prompt_tokens, result.completion_tokens)
    return job


def _record_usage(s: Session, job: JobRecord, prompt_tokens: int, completion_tokens: int) -> None:
    """The ledger's row for a job, the spend counters budgets are checked against, and
    its day's sums (locked in that order: models.usage_days)."""
    record = _usage_record(job, prompt_tokens, completion_tokens)
    s.add(record)
    spend.add(
        s,
        job.tenant_id,
        job.tier.value,
        prompt_tokens + completion_tokens,
        record.cost,
        record.created_at,
    )
    usage_days.add(s, record)


def _usage_record(job: JobRecord, prompt_tokens: int, completion_tokens: int) -> UsageRecord:
    """The ledger's row for a job: its tokens at the prices it was admitted under."""
    price_in = job.input_price or Decimal(0)
    price_out = job.output_price or Decimal(0)
    return UsageRecord(
        job_id=job.id,
        tenant_id=job.tenant_id,
        tier=job.tier.value,
        model=job.model,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        input_price=price_in,
        output_price=price_out,
        cost=cost_of(prompt_tokens, completion_tokens, price_in, price_out),
        created_at=utcnow(),
    )


def bill_cancelled(
    s: Session, job_id: str, prompt_tokens: int, completion_tokens: int
) -> JobRecord | None:
    """A cancelled job is billed for what the engine did before it stopped (its prompt and
    the tokens generated): the job shows that usage, and the ledger has its row — once
    (the conditional update admits one biller; None when it is not cancelled, or billed)."""
    stmt = (
        update(Job)
        .where(
            Job.id == job_id,
            Job.status == JobStatus.CANCELLED.value,
            Job.prompt_tokens.is_(None),
        )
        .values(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
        .returning(Job)
        .execution_options(synchronize_session=False, populate_existing=True)
    )
    row = s.execute(stmt).scalar_one_or_none()
    if row is None:
        return None
    job = JobRecord.from_row(row)
    _record_usage(s, job, prompt_tokens, completion_tokens)
    # Counted as the transaction commits, but for a rare rollback.
    metrics.count_tokens_served(job.tenant_id, job.tier.value, prompt_tokens, completion_tokens)
    return job


def fail_job(
    s: Session,
    job_id: str,
    code: str,
    message: str,
    *,
    from_queued: bool = False,
    delivery: int | None = None,
) -> JobRecord | None:
    sources = (JobStatus.RUNNING, JobStatus.QUEUED) if from_queued else (JobStatus.RUNNING,)
    return transition(
        s,
        job_id,
        JobStatus.FAILED,
        sources=sources,
        delivery=delivery,
        finished_at=utcnow(),
        error_code=code,
        error_message=message,
    )


def cancel_one(s: Session, job_id: str, tenant_id: str | None = None) -> JobRecord | None:
    """queued or running -> cancelled by its tenant (the job of `tenant_id`, given one);
    None when it was neither. Kept progress is billed (`_kept_progress`)."""
    where = (
        Job.id == job_id
        if tenant_id is None
        else and_(Job.id == job_id, Job.tenant_id == tenant_id)
    )
    if tenant_id is not None and s.execute(select(Job.id).where(where)).first() is None:
        return None
    kept = _kept_progress(s, where)
    job = transition(
        s,
        job_id,
        JobStatus.CANCELLED,
        sources=(JobStatus.QUEUED, JobStatus.RUNNING),
        finished_at=utcnow(),
        error_code="cancelled",
        error_message="the job was cancelled by its tenant",
    )
    return None if job is None else _bill_kept(s, [job], kept)[0]


def _kept_progress(s: Session, where: Any) -> dict[str, Progress]:
    """The queued jobs matching `where` whose earlier runs generated tokens kept for the
    next run (preempted, or handed back): cancelling one must bill that work, which no run
    will bill now. A running job's own run bills it (tierq/workers/worker.py).

    Every unfinished job matching `where` is locked, running ones too, in id order
    (PostgreSQL; SQLite's write lock is held from BEGIN): a worker's hand-back (running ->
    queued, with its progress) that would commit between this read and the cancel waits
    instead, then finds the job cancelled and bills its run itself; a claim (queued ->
    running) waits the same way. Locked in id order before the cancel's UPDATE locks them
    in its scan's order, so two bulk cancels over the same jobs (a suspension, and the
    wind-up of one of its batches) wait for each other rather than deadlock."""
    stmt = (
        select(Job.id, Job.status, Job.progress)
        .where(where, Job.status.in_((JobStatus.QUEUED.value, JobStatus.RUNNING.value)))
        .order_by(Job.id)
        .with_for_update()
    )
    kept = {}
    for job_id, status, raw in s.execute(stmt).all():
        progress = Progress.from_json(raw) if status == JobStatus.QUEUED.value else None
        if progress is not None:
            kept[job_id] = progress
    return kept


def _bill_kept(
    s: Session, cancelled: list[JobRecord], kept: dict[str, Progress]
) -> list[JobRecord]:
    """The cancelled jobs, those of them with kept progress billed for it (prompt and the
    tokens generated), as a cancelled run is billed."""
    out = []
    for job in cancelled:
        progress = kept.get(job.id)
        billed = None
        if progress is not None:
            billed = bill_cancelled(s, job.id, progress.prompt_tokens, len(progress.token_ids))
        out.append(billed or job)
    return out


def requeue_job(
    s: Session,
    job_id: str,
    detail: str,
    delivery: int | None = None,
    *,
    preempted: bool = False,
    progress: Progress | None = None,
    charge: int = 0,
) -> JobRecord | None:
    """running -> queued: a worker hands the job back (drain, preemption, an engine error,
    a dead engine) or it was found orphaned. `charge` is what this delivery is held
    against the job, in thousandths of a failed one: nothing for a drain or a preemption
    (it is counted); a share for a dead engine; one for an engine error or an orphan.
    `progress`, what the runs so far generated, replaces the kept one (the next delivery
    resumes after it); without it the kept one stays."""
    values: dict[str, Any] = {"preemptions": Job.preemptions + 1} if preempted else {}
    if charge > 0:
        values["fault_charge"] = Job.fault_charge + charge
    if progress is not None:
        values["progress"] = progress.to_json()
    return transition(
        s,
        job_id,
        JobStatus.QUEUED,
        sources=(JobStatus.RUNNING,),
        detail=detail,
        delivery=delivery,
        **values,
    )


async def unfinished_jobs(
    s: AsyncSession,
    older_than: datetime,
    limit: int = 1000,
    after: tuple[datetime, str] | None = None,
) -> list[JobRecord]:
    """Queued or running jobs created before `older_than` (the reconciler's candidates),
    oldest first, one page after `after` (the (created_at, id) of the previous page's last)."""
    stmt = select(Job).where(
        Job.status.in_([JobStatus.QUEUED.value, JobStatus.RUNNING.value]),
        Job.created_at < older_than,
    )
    if after is not None:
        stmt = stmt.where(
            or_(Job.created_at > after[0], and_(Job.created_at == after[0], Job.id > after[1]))
        )
    stmt = stmt.order_by(Job.created_at, Job.id).limit(limit)
    return [JobRecord.from_row(r) for r in (await s.execute(stmt)).scalars()]


async def transitions(s: AsyncSession, job_id: str) -> list[tuple[str, str | None]]:
    stmt = select(JobTransition).where(JobTransition.job_id == job_id).order_by(JobTransition.id)
    return [(r.status, r.detail) for r in (await s.execute(stmt)).scalars()]


async def usage_for_job(s: AsyncSession, job_id: str) -> list[UsageRecord]:
    return list(
        (await s.execute(select(UsageRecord).where(UsageRecord.job_id == job_id))).scalars()
    )


def cancel_unfinished(s: Session, where: Any, code: str, message: str) -> list[JobRecord]:
    """Cancel every queued or running job matching `where`, each with its transition;
    returns the cancelled jobs (tierq/services/cancellation.py announces them). A queued one with
    kept progress is billed for it. Synchronous, as the job store's writes are
    (`JobStore.cancel_all`); a batch's wind-up runs it in its fenced transaction."""
    kept = _kept_progress(s, where)
    stmt = (
        update(Job)
        .where(where, Job.status.in_((JobStatus.QUEUED.value, JobStatus.RUNNING.value)))
        .values(
            status=JobStatus.CANCELLED.value,
            finished_at=utcnow(),
            error_code=code,
            error_message=message,
            progress=None,  # nothing more resumes after it
        )
        .returning(Job)
        .execution_options(synchronize_session=False)
    )
    stopped = [JobRecord.from_row(row) for row in s.execute(stmt).scalars()]
    now = utcnow()
    for job in stopped:
        s.add(JobTransition(job_id=job.id, status=JobStatus.CANCELLED.value, at=now, detail=code))
    s.flush()
    return _bill_kept(s, stopped, kept) if kept else stopped


def cancel_tenant_jobs(s: Session, tenant_id: str, code: str, message: str) -> list[JobRecord]:
    """Cancel every queued or running job of a tenant (suspension, deletion)."""
    return cancel_unfinished(s, Job.tenant_id == tenant_id, code, message)


async def tenant_job_counts(s: AsyncSession, tenant_id: str) -> dict[tuple[str, str], int]:
    """(tier, status) -> jobs, for the tenant's queued and running jobs."""
    stmt = (
        select(Job.tier, Job.status, func.count())
        .where(
            Job.tenant_id == tenant_id,
            Job.status.in_((JobStatus.QUEUED.value, JobStatus.RUNNING.value)),
        )
        .group_by(Job.tier, Job.status)
    )
    return {(tier, status): int(n) for tier, status, n in (await s.execute(stmt)).all()}
