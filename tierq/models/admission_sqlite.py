"""Admission on the embedded SQLite database: the whole rule in one transaction, one thread
hop.

aiosqlite runs each statement on its connection's thread: a statement is a hop there and
back, and an ORM session's admission makes about nine of them while it holds SQLite's one
write lock. On an idle machine a hop costs microseconds; beside the CPU engine, which keeps
every core busy, each hop waits for a core, so a burst of admissions holds the lock, one
after another, for as many waits: its last job starts that much after its first (`tierq
bench overhead` measures it against the engine alone).

So the rule runs as synchronous statements (`admit_in`) in one `BEGIN IMMEDIATE`
transaction on a connection and a thread of their own (models.db.LocalWriter): one hop per
admission, and the admissions that arrive while one transaction runs share the next one's
COMMIT (under load the WAL's fsync is most of what a commit costs). In the order
`tierq_admit` takes on PostgreSQL (tierq/models/admission.py): a replay of an
Idempotency-Key is answered first (no quota is charged twice); the tenant's status and the
key's; a tenant with quotas for the tier is sent back to have its reservation counted by
the tokenizer first, unless it was; the default queue bound; the price in force; every
quota that applies, each against the figures `models.quotas.figures` reads and by the rule
`models.quotas.decide` states; then the job's row and its first transition.

SQLite's write lock, taken at BEGIN, is what PostgreSQL's row locks are there: every read
after it sees every commit before it, and nothing commits beside it, so a suspension or a
revocation that committed first refuses the job, one that comes later waits for it, and a
tenant's admissions are checked against its quotas one at a time. Nothing is written unless
the job is admitted; the job's row and its transition are committed when `admit` returns.
The statements are SQLAlchemy Core on the synchronous pysqlite dialect, so that values are
stored exactly as the ORM stores them (Money as text, datetimes, JSON), built once with
bound parameters (`_statements`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from decimal import Decimal
from functools import cache

from sqlalchemy import (
    BindParameter,
    Connection,
    bindparam,
    insert,
    inspect,
    or_,
    select,
)
from sqlalchemy.sql.expression import Executable

from tierq.core.messages import output_bound
from tierq.core.states import TenantStatus
from tierq.core.tiers import Tier
from tierq.models import jobs, prices
from tierq.models import quotas as quota_repo
from tierq.models.admission import Admission, Answer
from tierq.models.db import LocalWriter
from tierq.models.tables import ApiKey, Job, JobTransition, Quota, Tenant


async def admit(local: LocalWriter, a: Admission, counted: bool) -> Answer:
    """Admission on an SQLite file, in one hop to its writer thread: the module's
    docstring. `counted`: the reservation was counted by the served model's tokenizer
    (else a tenant with quotas is answered `count_first`)."""
    return await local.run(admit_in, a, counted)


def admit_in(conn: Connection, a: Admission, counted: bool) -> Answer:
    """The rule, in the caller's transaction on `conn`: the writer's (LocalWriter: BEGIN
    IMMEDIATE, SQLite's write lock, held since before the first read), or an in-memory
    database's session's (tierq/models/store/sql.py)."""
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
            return Answer(None, replay=made.id, same_request=same)
    found = conn.execute(q.tenant_status, tenant).one_or_none()
    status, counts_held = (None, False) if found is None else found
    key_ok = True
    if a.key_id is not None:
        key = conn.execute(q.key_revoked, {**tenant, "key_id": a.key_id}).one_or_none()
        key_ok = key is not None and key[0] is None
    if status != TenantStatus.ACTIVE.value or not key_ok:
        return Answer(None, tenant_status=status, key_ok=key_ok)
    quotas = [
        quota_repo.QuotaRecord(*row)
        for row in conn.execute(q.quotas, {**tenant, "tier": tier}).all()
    ]
    if quotas and not counted:
        return Answer(None, tenant_status=status, count_first=True)
    queued = None
    # The default bound on what one tenant may leave waiting, where no quota of every tier
    # bounds it: all a bound needs is whether the tenant has that many waiting.
    if quota_repo.default_bound_applies(default_max_queued, quotas):
        queued = quota_repo.queued_jobs(
            conn, new.tenant_id, quota_repo.ALL_TIERS, cap=default_max_queued
        )
        if queued >= default_max_queued:
            return Answer(None, tenant_status=status, queued=queued)
    price_in, price_out = _price(conn, q, new.model, new.tier, a.batch_discount)
    cost = quota_repo.reservation_cost(
        new.reserved_tokens, output_bound(new.params), price_in, price_out
    )
    checked = []
    for quota in quotas:
        figures = quota_repo.figures(conn, quota, a.created_at, online=True)
        held = (
            quota_repo.decide(quota, figures, tier, new.reserved_tokens, cost, a.created_at) is None
        )
        checked.append((quota, figures, held))
        if not held:
            return Answer(
                None, tenant_status=status, queued=queued, quotas=checked, reserved_cost=cost
            )
    priced = replace(
        new, input_price=price_in, output_price=price_out, held_counted=bool(counts_held)
    )
    values = jobs.row_values(priced, a.job_id, a.created_at)
    conn.execute(q.insert_job, {q.job_columns[name]: value for name, value in values.items()})
    conn.execute(
        q.insert_transition, {"job_id": a.job_id, "status": values["status"], "at": a.created_at}
    )
    return Answer(
        jobs.new_record(priced, a.job_id, a.created_at),
        tenant_status=status,
        queued=queued,
        quotas=checked,
        reserved_cost=cost,
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
    latest_price: Executable
    insert_job: Executable
    insert_transition: Executable
    # The ORM's attribute names (`jobs.row_values`) -> the table's column keys, which an
    # INSERT's parameters name (`metadata_` is the column `metadata`).
    job_columns: dict[str, str]


# QuotaRecord's fields, in its order: a row of `quotas` is one.
_QUOTA_FIELDS = tuple(f.name for f in fields(quota_repo.QuotaRecord))


@cache
def _statements() -> _Statements:
    tenant_id: BindParameter[str] = bindparam("tenant_id")
    limited = or_(*(getattr(Quota, f).is_not(None) for f in quota_repo.ADMISSION_FIELDS))
    latest = prices.latest_query(bindparam("model"), bindparam("tier"))
    return _Statements(
        replay=select(Job.id, Job.request_hash).where(
            Job.tenant_id == tenant_id, Job.idempotency_key == bindparam("key")
        ),
        tenant_status=select(Tenant.status, Tenant.counts_held).where(Tenant.id == tenant_id),
        key_revoked=select(ApiKey.revoked_at).where(
            ApiKey.id == bindparam("key_id"), ApiKey.tenant_id == tenant_id
        ),
        quotas=select(*(getattr(Quota, f) for f in _QUOTA_FIELDS))
        .where(
            Quota.tenant_id == tenant_id,
            or_(Quota.tier == quota_repo.ALL_TIERS, Quota.tier == bindparam("tier")),
            limited,
        )
        .order_by(Quota.tier),
        latest_price=latest,
        insert_job=insert(Job),
        insert_transition=insert(JobTransition),
        job_columns={a.key: a.columns[0].key for a in inspect(Job).column_attrs},
    )
