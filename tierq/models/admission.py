"""Admission's fast path on PostgreSQL: one statement admits a job.

Most admissions are of a tenant without quotas for the job's tier. For them one
statement, in its own implicit transaction on a raw connection (models.db.RawPool), does
what the exact path (tierq/services/admission.py: a session, the ORM, nine round trips) does:

- takes the tenant's row lock (shared, as the exact path does for a tenant without
  quotas), then the request's key's, and reads both: in READ COMMITTED a row locked is
  read in its newest version, so a suspension or a revocation that committed while the
  statement waited refuses it (each takes the tenant's exclusive lock first);
- finds whether any quota that admission checks applies to the tier (then nothing is
  written, and the caller takes the exact path, which checks them under the tenant's
  exclusive lock; max_running alone is the dispatcher's, and takes the fast path);
- counts the tenant's waiting online jobs against DEFAULT_MAX_QUEUED (up to the bound
  only), under the shared lock as the exact path does;
- finds the price in force (the batch tier without a price of its own pays the standard
  tier's times `1 - BATCH_DISCOUNT`, as models.prices.current_price);
- inserts the job and its first transition when every check passed; an Idempotency-Key
  already used inserts nothing (ON CONFLICT), and the caller takes the exact path,
  which answers the replay or the conflict.

Nothing is written unless the job is admitted, and the job's row and transition are
committed when the statement returns: the guarantees of the exact path, in one round trip.

A tenant with quotas for the tier is admitted by `admit_with_quotas`: one call of the
PL/pgSQL function `tierq_admit_with_quotas` (migration 0007), which checks every quota
under the tenant's exclusive lock and words nothing itself — the refusal is worded from
its figures by models.quotas.decide, the rule the ORM path uses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from datetime import datetime
from decimal import Decimal
from typing import Any

from tierq.core.messages import output_bound
from tierq.core.states import JobStatus
from tierq.core.tiers import Tier
from tierq.models import jobs
from tierq.models import quotas as quota_repo
from tierq.models.db import RawPool
from tierq.models.jobs import NewJob
from tierq.models.prices import MILLION
from tierq.models.records import JobRecord, as_utc
from tierq.models.spend import period_keys
from tierq.models.tenants import REVOKED

_ANY_LIMIT = " OR ".join(f"{field} IS NOT NULL" for field in quota_repo.ADMISSION_FIELDS)

# $1 tenant, $2 key id (NULL: not checked), $3 tier, $4 DEFAULT_MAX_QUEUED (0: none),
# $5 model, $6 what the batch tier pays of the standard price, $7 job id, $8 messages,
# $9 prompt, $10 params, $11 metadata, $12 Idempotency-Key, $13 request hash,
# $14 created_at, $15 reserved tokens.
ADMIT = f"""
WITH t AS (
    SELECT status FROM tenants WHERE id = $1 FOR SHARE
), k AS (
    -- After the tenant's lock (the subquery is evaluated before this row is locked): the
    -- order revocation takes them in, so the two cannot deadlock. Locked, the key is read
    -- in its newest version, as the tenant is.
    SELECT revoked_at FROM api_keys
    WHERE id = $2 AND tenant_id = (SELECT $1::text FROM t)
    FOR SHARE
), q AS (
    SELECT EXISTS (
        SELECT 1 FROM quotas
        WHERE tenant_id = $1 AND tier IN ('{quota_repo.ALL_TIERS}', $3) AND ({_ANY_LIMIT})
    ) AS found
), w AS (
    SELECT count(*) AS n FROM (
        SELECT 1 FROM jobs
        WHERE tenant_id = $1 AND status = 'queued' AND batch_id IS NULL
        LIMIT $4
    ) waiting
), p AS (
    SELECT input_per_million AS i, output_per_million AS o FROM prices
    WHERE model = $5 AND tier = $3
    ORDER BY effective_at DESC, id DESC LIMIT 1
), b AS (
    SELECT (input_per_million::numeric * $6::numeric)::text AS i,
           (output_per_million::numeric * $6::numeric)::text AS o
    FROM prices
    WHERE model = $5 AND tier = '{Tier.STANDARD.value}' AND $3 = '{Tier.BATCH.value}'
    ORDER BY effective_at DESC, id DESC LIMIT 1
), go AS (
    SELECT coalesce((SELECT i FROM p), (SELECT i FROM b), '0') AS i,
           coalesce((SELECT o FROM p), (SELECT o FROM b), '0') AS o
    FROM t
    WHERE t.status = 'active'
      AND ($2::text IS NULL OR EXISTS (SELECT 1 FROM k WHERE revoked_at IS NULL))
      AND NOT (SELECT found FROM q)
      AND ($4 = 0 OR (SELECT n FROM w) < $4)
), ins AS (
    INSERT INTO jobs (
        id, tenant_id, tier, model, status, messages, prompt, params, metadata,
        idempotency_key, request_hash, created_at, deliveries, preemptions,
        reserved_tokens, input_price, output_price
    )
    SELECT $7, $1, $3, $5, '{JobStatus.QUEUED.value}', $8::json, $9, $10::json, $11::json,
           $12, $13, $14, 0, 0, $15, go.i, go.o
    FROM go
    ON CONFLICT (tenant_id, idempotency_key) DO NOTHING
    RETURNING id, input_price, output_price
), tr AS (
    INSERT INTO job_transitions (job_id, status, at)
    SELECT id, '{JobStatus.QUEUED.value}', $14 FROM ins
)
SELECT (SELECT status FROM t) AS tenant_status,
       (SELECT revoked_at IS NULL FROM k) AS key_ok,
       (SELECT found FROM q) AS quotas,
       (SELECT n FROM w) AS queued,
       ins.id, ins.input_price, ins.output_price
FROM (SELECT 1) AS one LEFT JOIN ins ON true
"""


@dataclass(frozen=True)
class Admission:
    """One admission as every fast way in takes it (PostgreSQL's statement and function,
    SQLite's writer): the request, the key it came with, the job's id and time, and the
    settings its checks read."""

    job_id: str
    new: NewJob
    key_id: str | None
    created_at: datetime
    default_max_queued: int
    batch_discount: Decimal


@dataclass(frozen=True)
class Outcome:
    """What the statement found. `job` is set when it admitted one; otherwise the first
    reason not to: the tenant's status (None: no such tenant), the key's, quotas that
    apply (take the exact path), the queue bound, or an Idempotency-Key used before
    (take the exact path)."""

    job: JobRecord | None
    tenant_status: str | None
    key_ok: bool
    quotas: bool
    queued: int

    @property
    def status(self) -> str | None:
        return _status(self.tenant_status, self.key_ok)


def _admitted(
    new: NewJob, job_id: str, input_price: str, output_price: str, created_at: datetime
) -> JobRecord:
    """The record of the job either way in inserted, at the prices it found (as text)."""
    priced = replace(new, input_price=Decimal(input_price), output_price=Decimal(output_price))
    return jobs.new_record(priced, job_id, created_at)


def _status(tenant_status: str | None, key_ok: bool) -> str | None:
    """The tenant's status as read under its lock, or REVOKED for the request's key (as
    models.tenants.lock_tenant answers on the ORM path); None: no such tenant."""
    return REVOKED if tenant_status is not None and not key_ok else tenant_status


def _json(value: Any) -> str:
    # None as JSON null, as the ORM stores it (JSON columns evaluate None).
    return json.dumps(value, separators=(",", ":"))


def _job_args(a: Admission) -> tuple[Any, ...]:
    """$1 to $15 of both ways in: the request, its limits and the job's row."""
    new = a.new
    return (
        new.tenant_id,
        a.key_id,
        new.tier.value,
        a.default_max_queued,
        new.model,
        Decimal(1) - a.batch_discount,
        a.job_id,
        _json(new.messages),
        new.prompt,
        _json(new.params),
        _json(new.metadata),
        new.idempotency_key,
        new.request_hash,
        a.created_at,
        new.reserved_tokens,
    )


async def admit(pool: RawPool, a: Admission) -> Outcome:
    row = await pool.fetchrow(ADMIT, *_job_args(a))
    job = None
    if row["id"] is not None:
        job = _admitted(a.new, row["id"], row["input_price"], row["output_price"], a.created_at)
    return Outcome(
        job=job,
        tenant_status=row["tenant_status"],
        key_ok=a.key_id is None or bool(row["key_ok"]),
        quotas=bool(row["quotas"]),
        queued=int(row["queued"] or 0),
    )


@dataclass(frozen=True)
class QuotaOutcome:
    """What `tierq_admit_with_quotas` found. `job` is set when it admitted one; otherwise
    the tenant's status (None: no such tenant) and the key's, the default queue bound
    (`queued` is None where it did not apply), and each quota that applies with the
    figures it was checked against and whether it held. A refusal by none of these is an
    Idempotency-Key used before (the caller takes the exact path)."""

    job: JobRecord | None
    tenant_status: str | None
    key_ok: bool
    queued: int | None
    quotas: list[tuple[quota_repo.QuotaRecord, quota_repo.Figures, bool]]
    reserved_cost: Decimal

    @property
    def status(self) -> str | None:
        return _status(self.tenant_status, self.key_ok)


ADMIT_WITH_QUOTAS = (
    "SELECT tierq_admit_with_quotas("
    + ", ".join(f"${i}" for i in range(1, 20))
    + ")::text AS outcome"
)


async def admit_with_quotas(pool: RawPool, a: Admission) -> QuotaOutcome:
    """One round trip: the tenant's quotas checked under its exclusive lock and the job
    inserted when they hold (migration 0007 says how)."""
    day, month, _total = period_keys(a.created_at)
    row = await pool.fetchrow(
        ADMIT_WITH_QUOTAS,
        *_job_args(a),
        output_bound(a.new.params),
        day,
        month,
        quota_repo.BILLING_GRACE,
    )
    found = json.loads(row["outcome"])
    status = found.get("tenant_status")
    if status is None or "quotas" not in found:
        return QuotaOutcome(None, status, bool(found.get("key_ok")), None, [], Decimal(0))
    checked = []
    for f in found["quotas"]:
        quota = quota_repo.QuotaRecord(
            tenant_id=a.new.tenant_id,
            tier=f["tier"],
            requests_per_minute=f["requests_per_minute"],
            tokens_per_minute=f["tokens_per_minute"],
            max_running=None,  # the dispatcher's
            max_queued=f["max_queued"],
            token_budget=f["token_budget"],
            spend_budget=None if f["spend_budget"] is None else Decimal(f["spend_budget"]),
            budget_period=f["budget_period"],
        )
        oldest = f["minute_oldest"]
        figures = quota_repo.Figures(
            minute_requests=int(f["minute_requests"]),
            minute_tokens=int(f["minute_tokens"]),
            minute_oldest=None if oldest is None else as_utc(datetime.fromisoformat(oldest)),
            queued=int(f["queued"]),
            held_tokens=int(f["held_tokens"]),
            held_cost=Decimal(f["held_micro"]) / MILLION,
            spent_tokens=int(f["spent_tokens"]),
            spent_cost=Decimal(f["spent_cost"]),
        )
        checked.append((quota, figures, bool(f["ok"])))
    job = None
    if found["id"] is not None:
        job = _admitted(
            a.new, found["id"], found["input_price"], found["output_price"], a.created_at
        )
    return QuotaOutcome(
        job=job,
        tenant_status=status,
        key_ok=True,
        queued=found["queued"],
        quotas=checked,
        reserved_cost=Decimal(found["cost_micro"]) / MILLION,
    )
