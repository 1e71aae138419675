"""Batches and the jobs they expand into: every SQL statement about them.

Status changes are conditional UPDATEs, like jobs': two Celery workers that both try to
move one batch cannot both succeed, so every step of a batch can be retried safely.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from tierq.core.ids import new_id
from tierq.core.messages import output_bound
from tierq.core.states import BatchStatus, JobStatus
from tierq.core.tiers import Tier
from tierq.models.jobs import cancel_unfinished
from tierq.models.pages import after_anchor
from tierq.models.quotas import reservation_cost
from tierq.models.records import BatchRecord, JobRecord
from tierq.models.tables import Batch, Job, JobTransition, utcnow

# A batch not finished yet, and a finished one.
ACTIVE = (
    BatchStatus.VALIDATING,
    BatchStatus.IN_PROGRESS,
    BatchStatus.FINALIZING,
    BatchStatus.CANCELLING,
)
TERMINAL = (BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED)


async def create_batch(
    s: AsyncSession,
    tenant_id: str,
    endpoint: str,
    input_file_id: str,
    completion_window: str,
    metadata: dict[str, Any] | None,
    expires_at: datetime,
) -> BatchRecord:
    row = Batch(
        id=new_id("batch"),
        tenant_id=tenant_id,
        endpoint=endpoint,
        input_file_id=input_file_id,
        completion_window=completion_window,
        status=BatchStatus.VALIDATING,
        metadata_=metadata,
        created_at=utcnow(),
        expires_at=expires_at,
        request_total=0,
        request_completed=0,
        request_failed=0,
        next_line=0,
        next_offset=0,
    )
    s.add(row)
    await s.flush()
    return BatchRecord.from_row(row)


async def get_batch(
    s: AsyncSession, batch_id: str, tenant_id: str | None = None
) -> BatchRecord | None:
    stmt = select(Batch).where(Batch.id == batch_id)
    if tenant_id is not None:
        stmt = stmt.where(Batch.tenant_id == tenant_id)
    row = (await s.execute(stmt)).scalar_one_or_none()
    return None if row is None else BatchRecord.from_row(row)


async def list_batches(
    s: AsyncSession, tenant_id: str, *, after: str | None = None, limit: int = 20
) -> tuple[list[BatchRecord], bool]:
    """Newest first; `after` is the id of the last batch of the previous page."""
    stmt = select(Batch).where(Batch.tenant_id == tenant_id)
    anchor = None
    if after is not None:
        found = await get_batch(s, after, tenant_id)
        if found is None:
            return [], False
        anchor = (found.created_at, found.id)
    stmt = after_anchor(stmt, Batch.created_at, Batch.id, anchor, limit)
    rows = list((await s.execute(stmt)).scalars())
    return [BatchRecord.from_row(r) for r in rows[:limit]], len(rows) > limit


async def active_batch_ids(s: AsyncSession) -> list[str]:
    stmt = select(Batch.id).where(Batch.status.in_(ACTIVE)).order_by(Batch.created_at)
    return list((await s.execute(stmt)).scalars())


async def active_batch_reading(s: AsyncSession, file_id: str) -> str | None:
    """The id of an active batch whose input is this file, if any."""
    stmt = select(Batch.id).where(Batch.input_file_id == file_id, Batch.status.in_(ACTIVE))
    return (await s.execute(stmt.limit(1))).scalar_one_or_none()


async def transition(
    s: AsyncSession,
    batch_id: str,
    dst: BatchStatus,
    sources: Sequence[BatchStatus],
    **values: Any,
) -> BatchRecord | None:
    """Move a batch to `dst` if it is in one of `sources`; None when it was not."""
    stmt = (
        update(Batch)
        .where(Batch.id == batch_id, Batch.status.in_(list(sources)))
        .values(status=dst, **values)
        .returning(Batch)
        .execution_options(synchronize_session=False)
    )
    row = (await s.execute(stmt)).scalar_one_or_none()
    return None if row is None else BatchRecord.from_row(row)


class LeaseLost(Exception):
    """The batch's fence moved past this holder's: another Celery worker advances it now."""


async def take_fence(s: AsyncSession, batch_id: str) -> int | None:
    """Raise the batch's fence and return it: the token of the lease just taken (None: no
    such batch). It waits for the row lock of a transaction of the previous holder, so
    whatever that one commits comes before the new holder's first write."""
    stmt = (
        update(Batch)
        .where(Batch.id == batch_id)
        .values(lease_fence=Batch.lease_fence + 1)
        .returning(Batch.lease_fence)
        .execution_options(synchronize_session=False)
    )
    token = (await s.execute(stmt)).scalar_one_or_none()
    return None if token is None else int(token)


async def hold(s: AsyncSession, batch_id: str, fence: int) -> None:
    """Lock the batch's row for this transaction if its fence is still `fence`, else
    raise LeaseLost: the first statement of every transaction that advances a batch."""
    stmt = select(Batch.lease_fence).where(Batch.id == batch_id).with_for_update()
    now = (await s.execute(stmt)).scalar_one_or_none()
    if now != fence:
        raise LeaseLost(f"batch {batch_id}: fence {now}, not {fence}")


async def count_unfinished(s: AsyncSession, tenant_id: str) -> int:
    """The tenant's batches not yet completed, failed, expired or cancelled."""
    stmt = select(func.count()).where(Batch.tenant_id == tenant_id, Batch.status.not_in(TERMINAL))
    return int((await s.execute(stmt)).scalar_one())


async def mark_expired(s: AsyncSession, batch_id: str) -> bool:
    """Note that the window passed (once); the batch winds up and then becomes `expired`."""
    stmt = (
        update(Batch)
        .where(
            Batch.id == batch_id,
            Batch.status.in_((BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)),
            Batch.expired_at.is_(None),
        )
        .values(expired_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    return bool((await s.execute(stmt)).rowcount)  # type: ignore[attr-defined]


async def job_counts(s: AsyncSession, batch_id: str) -> dict[JobStatus, int]:
    stmt = select(Job.status, func.count()).where(Job.batch_id == batch_id).group_by(Job.status)
    return {JobStatus(status): int(n) for status, n in (await s.execute(stmt)).all()}


async def line_states(s: AsyncSession) -> dict[str, int]:
    """The lines of every unfinished batch by state: `pending` (not expanded into a job
    yet), else its job's status. Summed over batches, so bounded whatever their number."""
    unfinished = Batch.status.not_in(TERMINAL)
    total = (
        await s.execute(select(func.coalesce(func.sum(Batch.request_total), 0)).where(unfinished))
    ).scalar_one()
    stmt = (
        select(Job.status, func.count())
        .join(Batch, Job.batch_id == Batch.id)
        .where(unfinished)
        .group_by(Job.status)
    )
    states = {str(JobStatus(status).value): 0 for status in JobStatus}
    for status, n in (await s.execute(stmt)).all():
        states[JobStatus(status).value] = int(n)
    states["pending"] = max(0, int(total) - sum(states.values()))
    return states


async def live_counts(s: AsyncSession, batch: BatchRecord) -> tuple[int, int]:
    """(completed, failed) as request_counts shows them while the batch runs."""
    if batch.status in TERMINAL:
        return batch.request_completed, batch.request_failed
    counts = await job_counts(s, batch.id)
    return counts.get(JobStatus.SUCCEEDED, 0), counts.get(JobStatus.FAILED, 0)


@dataclass(frozen=True)
class BatchLine:
    """One input line, ready to become a job (or, when its body was refused, a failed one)."""

    line: int
    custom_id: str
    model: str
    messages: list[dict[str, Any]] | None
    prompt: str | None
    params: dict[str, Any]
    error_code: str | None = None
    error_message: str | None = None
    reserved_tokens: int = 0


async def expand(
    s: AsyncSession,
    batch: BatchRecord,
    lines: Sequence[BatchLine],
    next_line: int,
    next_offset: int,
    prices: tuple[Decimal, Decimal] = (Decimal(0), Decimal(0)),
) -> list[JobRecord] | None:
    """Insert the lines' jobs and move the cursor past them, in the caller's transaction.

    None when the cursor moved meanwhile (another expander won): the caller rolls back.
    Returns the queued jobs, for the caller to put on the stream after committing.
    """
    # The lines' jobs hold their reservations from now on: the batch's shrinks by as much.
    tokens = sum(item.reserved_tokens for item in lines if item.error_code is None)
    cost = sum(
        (
            reservation_cost(item.reserved_tokens, output_bound(item.params), *prices)
            for item in lines
            if item.error_code is None
        ),
        Decimal(0),
    )
    moved = await s.execute(
        update(Batch)
        .where(
            Batch.id == batch.id,
            Batch.status == BatchStatus.IN_PROGRESS,
            Batch.next_line == batch.next_line,
        )
        .values(
            next_line=next_line,
            next_offset=next_offset,
            reserved_tokens=max(0, batch.reserved_tokens - tokens),
            reserved_cost=max(Decimal(0), batch.reserved_cost - cost),
        )
        .execution_options(synchronize_session=False)
    )
    if not moved.rowcount:  # type: ignore[attr-defined]
        return None
    now = utcnow()
    rows: list[Job] = []
    for item in lines:
        status = JobStatus.QUEUED if item.error_code is None else JobStatus.FAILED
        row = Job(
            id=new_id("job"),
            tenant_id=batch.tenant_id,
            tier=Tier.BATCH.value,
            model=item.model,
            status=status.value,
            messages=item.messages,
            prompt=item.prompt,
            params=item.params,
            created_at=now,
            finished_at=None if item.error_code is None else now,
            error_code=item.error_code,
            error_message=item.error_message,
            deliveries=0,
            batch_id=batch.id,
            batch_line=item.line,
            custom_id=item.custom_id,
            reserved_tokens=item.reserved_tokens,
            input_price=prices[0],
            output_price=prices[1],
            held_counted=True,  # bulk work: counted in held_reservations' sums
        )
        rows.append(row)
        s.add(row)
        s.add(JobTransition(job_id=row.id, status=status.value, at=now, detail=batch.id))
    await s.flush()
    return [JobRecord.from_row(r) for r in rows if r.status == JobStatus.QUEUED.value]


async def batch_jobs(
    s: AsyncSession, batch_id: str, after_line: int, limit: int
) -> list[JobRecord]:
    """The batch's jobs in input order, one page after `after_line`."""
    stmt = (
        select(Job)
        .where(Job.batch_id == batch_id, Job.batch_line > after_line)
        .order_by(Job.batch_line)
        .limit(limit)
    )
    return [JobRecord.from_row(r) for r in (await s.execute(stmt)).scalars()]


async def stop_unfinished(
    s: AsyncSession, batch_id: str, code: str, message: str
) -> list[JobRecord]:
    """Cancel the batch's queued and running jobs (cancelled, expired), in the caller's
    transaction: the one that holds the batch's fence (`hold`), so that only the batch's
    holder winds it up. Not the job store's, whose writes are transactions of their own."""
    return await s.run_sync(cancel_unfinished, Job.batch_id == batch_id, code, message)


async def cancel_tenant_batches(s: AsyncSession, tenant_id: str) -> list[str]:
    """Move every validating or running batch of a tenant to cancelling (suspension)."""
    stmt = (
        update(Batch)
        .where(
            Batch.tenant_id == tenant_id,
            Batch.status.in_((BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)),
        )
        .values(status=BatchStatus.CANCELLING, cancelling_at=utcnow())
        .returning(Batch.id)
        .execution_options(synchronize_session=False)
    )
    return list((await s.execute(stmt)).scalars())
