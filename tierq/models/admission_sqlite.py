"""Admission's fast path on the embedded SQLite database: one transaction, one thread hop.

aiosqlite runs each statement on its connection's thread: a statement is a hop there and
back, and the exact path (tierq/models/admission_exact.py: a session, the ORM) makes nine of them
while it holds SQLite's one write lock. On an idle machine a hop costs microseconds; beside
the CPU engine, which keeps every core busy, each hop waits for a core, so a burst of
admissions holds the lock, one after another, for as many waits: its last job starts that
much after its first (`tierq bench overhead` measures it against the engine alone).

Here the checks `tierq_admit` makes on PostgreSQL (tierq/models/admission.py) run for a
tenant without quotas for the job's tier, a replay of an Idempotency-Key answered first
(a tenant with quotas takes the exact path, tierq/models/admission_exact.py), in one `BEGIN
IMMEDIATE` transaction on a connection of their own, on one thread of their own: one hop per
admission, and the admissions that arrive while one transaction runs share the next one's
COMMIT (models.db.LocalWriter: under load the WAL's fsync is most of what a commit costs).
SQLite's write lock, taken at BEGIN, is what PostgreSQL's row locks are there: every read
after it sees every commit before it, and nothing commits beside it, so a suspension or a
revocation that committed first refuses the job, one that comes later waits for it. Nothing
is written unless the job is admitted; the job's row and its transition are committed when
`admit` returns. The statements are SQLAlchemy Core on the synchronous pysqlite dialect, so
that values are stored exactly as the ORM path stores them (Money as text, datetimes, JSON),
built once with bound parameters (`_statements`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from decimal import Decimal
from functools import cache

from sqlalchemy import (
    BindParameter,
    Connection,
    Integer,
    bindparam,
    exists,
    func,
    insert,
    inspect,
    literal,
    or_,
    select,
)
from sqlalchemy.sql.expression import Executable

from tierq.core.states import JobStatus
from tierq.core.tiers import Tier
from tierq.models import jobs, prices
from tierq.models import quotas as quota_repo
from tierq.models.admission import Admission, status_as_read
from tierq.models.db import LocalWriter
from tierq.models.records import JobRecord
from tierq.models.tables import ApiKey, Job, JobTransition, Quota, Tenant


@dataclass(frozen=True)
class Outcome:
    """What the transaction found. `job` is set when it admitted one; otherwise the first
    reason not to: a replay of an Idempotency-Key (`replay`, the job it made), the
    tenant's status (None: no such tenant), the key's, quotas that apply (take the exact
    path), or the queue bound."""

    job: JobRecord | None
    tenant_status: str | None
    key_ok: bool
    quotas: bool
    queued: int
    replay: str | None = None  # the job the request's Idempotency-Key made before
    same_request: bool = True  # ...for a request with this body

    @property
    def status(self) -> str | None:
        return status_as_read(self.tenant_status, self.key_ok)


async def admit(local: LocalWriter, a: Admission) -> Outcome:
    """What `tierq_admit` answers on PostgreSQL for a tenant without quotas, in one hop to
    the SQLite file's writer thread."""
    return await local.run(_admit, a)


def _admit(conn: Connection, a: Admission) -> Outcome:
    """In the writer's transaction (LocalWriter: BEGIN IMMEDIATE, SQLite's write lock,
    held since before the first read)."""
    new, default_max_queued = a.new, a.default_max_queued
    q = _statements()
    tier = new.tier.value
    tenant = {"tenant_id": new.tenant_id}
    if new.idempotency_key is not None:
        # A replay is answered with the job the key made, before any check (no quota is
        # charged twice). Under the write lock no request with the key commits meanwhile.
        made = conn.execute(q.replay, {**tenant, "key": new.idempotency_key}).one_or_none()
        if made is not None:
            same = made.request_hash == new.request_hash
            return Outcome(None, None, True, False, 0, replay=made.id, same_request=same)
    status = conn.execute(q.tenant_status, tenant).scalar_one_or_none()
    key_ok = True
    if a.key_id is not None:
        key = conn.execute(q.key_revoked, {**tenant, "key_id": a.key_id}).one_or_none()
        key_ok = key is not None and key[0] is None
    quotas = bool(conn.execute(q.quotas, {**tenant, "tier": tier}).scalar())
    cap = {**tenant, "cap": default_max_queued}
    queued = int(conn.execute(q.queued, cap).scalar() or 0)
    admitted = (
        status == "active"
        and key_ok
        and not quotas
        and (default_max_queued == 0 or queued < default_max_queued)
    )
    if not admitted:
        return Outcome(None, status, key_ok, quotas, queued)
    price_in, price_out = _price(conn, q, new.model, new.tier, a.batch_discount)
    priced = replace(new, input_price=price_in, output_price=price_out)
    values = jobs.row_values(priced, a.job_id, a.created_at)
    conn.execute(q.insert_job, {q.job_columns[name]: value for name, value in values.items()})
    conn.execute(
        q.insert_transition, {"job_id": a.job_id, "status": values["status"], "at": a.created_at}
    )
    return Outcome(
        jobs.new_record(priced, a.job_id, a.created_at),
        status,
        key_ok,
        quotas,
        queued,
    )


def _price(
    conn: Connection, q: _Statements, model: str, tier: Tier, batch_discount: Decimal
) -> tuple[Decimal, Decimal]:
    """The price in force, by the rule `models.prices.current_price` applies (nothing
    priced: 0)."""
    own = conn.execute(q.latest_price, {"model": model, "tier": tier.value}).one_or_none()
    standard = None
    if own is None and tier == Tier.BATCH:
        standard = conn.execute(
            q.latest_price, {"model": model, "tier": Tier.STANDARD.value}
        ).one_or_none()
    found = prices.in_force(model, tier, own, standard, batch_discount)
    if found is None:
        return Decimal(0), Decimal(0)
    return found.input_per_million, found.output_per_million


@dataclass(frozen=True)
class _Statements:
    """`_admit`'s statements, built once: SQLAlchemy then finds each compiled form in its
    cache by the statement's memoised key. Built afresh per admission, the expressions and
    their cache keys would cost more CPU than running the statements, in a writer thread
    that admits one at a time."""

    replay: Executable
    tenant_status: Executable
    key_revoked: Executable
    quotas: Executable
    queued: Executable
    latest_price: Executable
    insert_job: Executable
    insert_transition: Executable
    # The ORM's attribute names (`jobs.row_values`) -> the table's column keys, which an
    # INSERT's parameters name (`metadata_` is the column `metadata`).
    job_columns: dict[str, str]


@cache
def _statements() -> _Statements:
    tenant_id: BindParameter[str] = bindparam("tenant_id")
    limited = or_(*(getattr(Quota, f).is_not(None) for f in quota_repo.ADMISSION_FIELDS))
    waiting = (
        select(literal(1))
        .where(
            Job.tenant_id == tenant_id,
            Job.status == JobStatus.QUEUED.value,
            Job.batch_id.is_(None),
        )
        .limit(bindparam("cap", type_=Integer))
        .subquery()
    )
    latest = prices.latest_query(bindparam("model"), bindparam("tier"))
    return _Statements(
        replay=select(Job.id, Job.request_hash).where(
            Job.tenant_id == tenant_id, Job.idempotency_key == bindparam("key")
        ),
        tenant_status=select(Tenant.status).where(Tenant.id == tenant_id),
        key_revoked=select(ApiKey.revoked_at).where(
            ApiKey.id == bindparam("key_id"), ApiKey.tenant_id == tenant_id
        ),
        quotas=select(
            exists().where(
                Quota.tenant_id == tenant_id,
                or_(Quota.tier == quota_repo.ALL_TIERS, Quota.tier == bindparam("tier")),
                limited,
            )
        ),
        queued=select(func.count()).select_from(waiting),
        latest_price=latest,
        insert_job=insert(Job),
        insert_transition=insert(JobTransition),
        job_columns={a.key: a.columns[0].key for a in inspect(Job).column_attrs},
    )
