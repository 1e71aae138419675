"""What the operator console and `tierq top` read from the database: every statement of
the overview (tierq/services/overview.py puts them together with what Redis knows).

Each query is bounded, whatever the tables hold: by an index range (jobs by status and
admission time), by a LIMIT, or by both, so the console can poll it every second or two.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from tierq.core.states import JobStatus, TenantStatus
from tierq.models import spend
from tierq.models.batches import TERMINAL as BATCH_TERMINAL
from tierq.models.batches import live_counts
from tierq.models.quotas import QuotaRecord, QuotaUsage, usage_report
from tierq.models.records import BatchRecord, TenantRecord, as_utc
from tierq.models.tables import Batch, Job, Quota, SpendCounter, Tenant

UNFINISHED = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)


@dataclass(frozen=True)
class TierJobs:
    queued: int
    running: int
    oldest_queued_at: datetime | None  # the admission of its longest-waiting job


async def tier_jobs(s: AsyncSession) -> dict[str, TierJobs]:
    """Per tier: jobs queued and running now, and when the oldest queued one was admitted."""
    stmt = (
        select(Job.tier, Job.status, func.count(), func.min(Job.created_at))
        .where(Job.status.in_(UNFINISHED))
        .group_by(Job.tier, Job.status)
    )
    counts: dict[str, dict[str, tuple[int, datetime | None]]] = {}
    for tier, status, n, oldest in (await s.execute(stmt)).all():
        counts.setdefault(tier, {})[status] = (int(n), as_utc(oldest))
    return {
        tier: TierJobs(
            queued=by.get(JobStatus.QUEUED.value, (0, None))[0],
            running=by.get(JobStatus.RUNNING.value, (0, None))[0],
            oldest_queued_at=by.get(JobStatus.QUEUED.value, (0, None))[1],
        )
        for tier, by in counts.items()
    }


@dataclass(frozen=True)
class TenantRow:
    tenant: TenantRecord
    month_tokens: int  # this calendar month's ledger (UTC), every tier
    month_cost: Decimal
    queued: int
    running: int
    quotas: list[tuple[QuotaRecord, QuotaUsage]]


async def tenants(s: AsyncSession, now: datetime, limit: int) -> tuple[list[TenantRow], int]:
    """The `limit` tenants (not deleted) that used the most tokens this month — then the
    suspended, then by name — each with its unfinished jobs and every quota's usage; and
    how many tenants there are in all."""
    month = spend.period_keys(now)[1]
    used = (
        select(
            SpendCounter.tenant_id,
            func.sum(SpendCounter.tokens).label("tokens"),
        )
        .where(SpendCounter.period_key == month)
        .group_by(SpendCounter.tenant_id)
        .subquery()
    )
    tokens = func.coalesce(used.c.tokens, 0)
    stmt = (
        select(Tenant, tokens)
        .outerjoin(used, used.c.tenant_id == Tenant.id)
        .where(Tenant.status != TenantStatus.DELETED.value)
        .order_by(tokens.desc(), (Tenant.status == TenantStatus.ACTIVE.value), Tenant.name)
        .limit(limit)
    )
    rows = (await s.execute(stmt)).all()
    total = int(
        (
            await s.execute(select(func.count()).where(Tenant.status != TenantStatus.DELETED.value))
        ).scalar_one()
    )
    ids = [t.id for t, _ in rows]
    if not ids:
        return [], total
    # Money is summed in Decimal, in Python (models.tables.Money stores strings).
    costs: dict[str, Decimal] = {}
    spent = select(SpendCounter.tenant_id, SpendCounter.cost).where(
        SpendCounter.period_key == month, SpendCounter.tenant_id.in_(ids)
    )
    for tenant_id, cost in (await s.execute(spent)).all():
        costs[tenant_id] = costs.get(tenant_id, Decimal(0)) + cost
    unfinished: dict[tuple[str, str], int] = {}
    jobs = (
        select(Job.tenant_id, Job.status, func.count())
        .where(Job.tenant_id.in_(ids), Job.status.in_(UNFINISHED))
        .group_by(Job.tenant_id, Job.status)
    )
    for tenant_id, status, n in (await s.execute(jobs)).all():
        unfinished[(tenant_id, status)] = int(n)
    with_quotas = set(
        (await s.execute(select(Quota.tenant_id).where(Quota.tenant_id.in_(ids)))).scalars()
    )
    out = []
    for row, month_tokens in rows:
        out.append(
            TenantRow(
                tenant=TenantRecord.from_row(row),
                month_tokens=int(month_tokens),
                month_cost=costs.get(row.id, Decimal(0)),
                queued=unfinished.get((row.id, JobStatus.QUEUED.value), 0),
                running=unfinished.get((row.id, JobStatus.RUNNING.value), 0),
                quotas=await usage_report(s, row.id, now) if row.id in with_quotas else [],
            )
        )
    return out, total


@dataclass(frozen=True)
class BatchRow:
    batch: BatchRecord
    completed: int  # live while it runs (its jobs counted), else as recorded
    failed: int


async def batches(
    s: AsyncSession, now: datetime, limit: int, finished_within: timedelta
) -> list[BatchRow]:
    """Unfinished batches, and those that ended within `finished_within`, newest first."""
    recent = now - finished_within
    ended = func.coalesce(Batch.completed_at, Batch.cancelled_at, Batch.failed_at, Batch.expired_at)
    stmt = (
        select(Batch)
        .where(Batch.status.not_in(BATCH_TERMINAL) | (ended >= recent))
        .order_by(Batch.created_at.desc(), Batch.id.desc())
        .limit(limit)
    )
    out = []
    for row in (await s.execute(stmt)).scalars():
        record = BatchRecord.from_row(row)
        completed, failed = await live_counts(s, record)
        out.append(BatchRow(record, completed, failed))
    return out


@dataclass(frozen=True)
class Failure:
    job_id: str
    tenant_id: str
    tier: str
    code: str | None
    message: str | None
    finished_at: datetime | None
    batch_id: str | None


async def failures(
    s: AsyncSession, now: datetime, limit: int, within: timedelta
) -> tuple[list[Failure], dict[str, int]]:
    """The latest failed jobs admitted within `within`, and the failures of the last hour
    counted by code."""
    admitted = Job.created_at >= now - within
    failed = Job.status == JobStatus.FAILED.value
    stmt = (
        select(
            Job.id,
            Job.tenant_id,
            Job.tier,
            Job.error_code,
            func.substr(Job.error_message, 1, 300),
            Job.finished_at,
            Job.batch_id,
        )
        .where(failed, admitted)
        .order_by(Job.finished_at.desc().nulls_last(), Job.id)
        .limit(limit)
    )
    latest = [
        Failure(job_id, tenant_id, tier, code, message, as_utc(finished_at), batch_id)
        for job_id, tenant_id, tier, code, message, finished_at, batch_id in (
            await s.execute(stmt)
        ).all()
    ]
    by_code = (
        select(Job.error_code, func.count())
        .where(failed, admitted, Job.finished_at >= now - timedelta(hours=1))
        .group_by(Job.error_code)
    )
    counts: dict[str, int] = {}
    for code, n in (await s.execute(by_code)).all():
        counts[code or "unknown"] = counts.get(code or "unknown", 0) + int(n)
    return latest, counts
