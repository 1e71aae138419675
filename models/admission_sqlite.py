"""Admission's fast path on the embedded SQLite database: one transaction, one thread hop.

aiosqlite runs each statement on its connection's thread: a statement is a hop there and
back, and the exact path (services/admission.py: a session, the ORM) makes nine of them
while it holds SQLite's one write lock. On an idle machine a hop costs microseconds; beside
the CPU engine, which keeps both of this machine's cores busy, each waits for a core, and
`tierq bench overhead` saw 64 admissions take 1.6 to 2.5 s — the last job then starts that
much after the first and the whole run ends that much later.

Here the same checks run as `models.admission.ADMIT` makes them on PostgreSQL, for a tenant
without quotas for the job's tier and a request without an Idempotency-Key (everything
else takes the exact path), in one `BEGIN IMMEDIATE` transaction on a connection of their
own, on one thread of their own: one hop per admission, and the admissions that arrive
while one transaction runs share the next one's COMMIT (models.db.LocalWriter: under
load the WAL's fsync is most of what a commit costs). SQLite's write lock, taken at
BEGIN, is what PostgreSQL's row locks are there: every read after it sees every commit
before it, and nothing commits beside it, so a suspension or a revocation that committed
first refuses the job, one that comes later waits for it. Nothing is written unless the
job is admitted; the job's row and its transition are committed when `admit` returns.
The statements are SQLAlchemy Core on the synchronous pysqlite dialect, so that values are
stored exactly as the ORM path stores them (Money as text, datetimes, JSON).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime
from decimal import Decimal

from sqlalchemy import Connection, exists, func, insert, literal, or_, select
from sqlalchemy.orm import Session

from models import jobs, prices
from models import quotas as quota_repo
from models.admission import Outcome
from models.db import LocalWriter
from models.jobs import NewJob
from models.records import JobRecord
from models.tables import ApiKey, Job, JobTransition, Quota, Tenant
from tierq.states import JobStatus
from tierq.tiers import Tier


async def admit(
    local: LocalWriter,
    job_id: str,
    new: NewJob,
    key_id: str | None,
    created_at: datetime,
    default_max_queued: int,
    batch_discount: Decimal,
) -> Outcome:
    """What `models.admission.admit` answers on PostgreSQL, in one hop to the SQLite
    file's writer thread. Not for a request with an Idempotency-Key (the exact path
    answers those)."""
    assert new.idempotency_key is None
    return await local.run(
        _admit, job_id, new, key_id, created_at, default_max_queued, batch_discount
    )


def _admit(
    conn: Connection,
    job_id: str,
    new: NewJob,
    key_id: str | None,
    created_at: datetime,
    default_max_queued: int,
    batch_discount: Decimal,
) -> Outcome:
    """In the writer's transaction (LocalWriter: BEGIN IMMEDIATE, SQLite's write lock,
    held since before the first read)."""
    tier = new.tier.value
    status = conn.execute(
        select(Tenant.status).where(Tenant.id == new.tenant_id)
    ).scalar_one_or_none()
    key_ok = True
    if key_id is not None:
        key = conn.execute(
            select(ApiKey.revoked_at).where(ApiKey.id == key_id, ApiKey.tenant_id == new.tenant_id)
        ).one_or_none()
        key_ok = key is not None and key[0] is None
    limited = or_(*(getattr(Quota, f).is_not(None) for f in quota_repo.ADMISSION_FIELDS))
    quotas = bool(
        conn.execute(
            select(
                exists().where(
                    Quota.tenant_id == new.tenant_id,
                    Quota.tier.in_((quota_repo.ALL_TIERS, tier)),
                    limited,
                )
            )
        ).scalar()
    )
    waiting = (
        select(literal(1))
        .where(
            Job.tenant_id == new.tenant_id,
            Job.status == JobStatus.QUEUED.value,
            Job.batch_id.is_(None),
        )
        .limit(default_max_queued)
        .subquery()
    )
    queued = int(conn.execute(select(func.count()).select_from(waiting)).scalar() or 0)
    admitted = (
        status == "active"
        and key_ok
        and not quotas
        and (default_max_queued == 0 or queued < default_max_queued)
    )
    if not admitted:
        return Outcome(None, status, key_ok, quotas, queued)
    price_in, price_out = _price(conn, new.model, new.tier, batch_discount)
    priced = replace(new, input_price=price_in, output_price=price_out)
    values = jobs.row_values(priced, job_id, created_at)
    conn.execute(insert(Job).values(values))
    conn.execute(
        insert(JobTransition).values(job_id=job_id, status=values["status"], at=created_at)
    )
    return Outcome(
        JobRecord.from_row(jobs.new_row(priced, job_id, created_at)),
        status,
        key_ok,
        quotas,
        queued,
    )


def _price(
    conn: Connection, model: str, tier: Tier, batch_discount: Decimal
) -> tuple[Decimal, Decimal]:
    """The price in force, by the rule `models.prices.current_price` applies (nothing
    priced: 0)."""
    with Session(bind=conn) as s:  # joins the writer's transaction; reads only
        own = s.execute(prices.latest_query(model, tier.value)).scalar_one_or_none()
        standard = None
        if own is None and tier == Tier.BATCH:
            query = prices.latest_query(model, Tier.STANDARD.value)
            standard = s.execute(query).scalar_one_or_none()
        found = prices.in_force(model, tier, own, standard, batch_discount)
    if found is None:
        return Decimal(0), Decimal(0)
    return found.input_per_million, found.output_per_million
