"""Admission's values, and admission on PostgreSQL.

`Admission` is one admission as every store takes it (`JobStore.admit`): the request, the
key it came with, the job's id and time, and the settings its checks read. `Answer` is what
every store answers: the job, or what refused it with the figures each quota was checked
against, which the caller words by the rule `models.quotas.decide` states
(tierq/services/admission.py).

On PostgreSQL one call of `tierq_admit` (tierq/migrations/sql/0017_tierq_admit.sql) admits a
job, in its own implicit transaction on a raw connection (models.db.RawPool): the replay of
an Idempotency-Key, the tenant's status and the key's under the tenant's lock, the default
queue bound, every quota that applies (under the exclusive lock, against a reservation
counted by the tokenizer), the price in force, and the job's row and first transition —
the rule stated once on this backend, as tierq/models/admission_sqlite.py states it on
SQLite and tierq/models/store/memory.py in memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from datetime import datetime
from decimal import Decimal
from typing import Any

from tierq.core.messages import output_bound
from tierq.models import jobs
from tierq.models import quotas as quota_repo
from tierq.models.db import RawPool
from tierq.models.jobs import NewJob
from tierq.models.prices import MILLION
from tierq.models.records import JobRecord, as_utc
from tierq.models.spend import period_keys
from tierq.models.tenants import REVOKED


@dataclass(frozen=True)
class Admission:
    """One admission as every store takes it: the request, the key it came with, the job's
    id and time (`created_at`, also when its quotas' figures are read), and the settings
    its checks read."""

    job_id: str
    new: NewJob
    key_id: str | None
    created_at: datetime
    default_max_queued: int
    batch_discount: Decimal


def _admitted(
    new: NewJob, job_id: str, input_price: str, output_price: str, created_at: datetime
) -> JobRecord:
    """The record of the job the function inserted, at the prices it found (as text)."""
    priced = replace(new, input_price=Decimal(input_price), output_price=Decimal(output_price))
    return jobs.new_record(priced, job_id, created_at)


def status_as_read(tenant_status: str | None, key_ok: bool) -> str | None:
    """The tenant's status as read under its lock, or REVOKED for the request's key (as
    models.tenants.lock_tenant answers); None: no such tenant."""
    return REVOKED if tenant_status is not None and not key_ok else tenant_status


def _json(value: Any) -> str:
    # None as JSON null, as the ORM stores it (JSON columns evaluate None).
    return json.dumps(value, separators=(",", ":"))


def _job_args(a: Admission) -> tuple[Any, ...]:
    """$1 to $15 of `tierq_admit`'s arguments: the request, its limits and the job's row."""
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


@dataclass(frozen=True)
class Answer:
    """What a store answered (PostgreSQL: what `tierq_admit` did). `job` is set when it
    admitted one. Otherwise, in the order every store looks: `replay`, the job an
    Idempotency-Key made before (`same_request`: with this request's body); the tenant's
    status (None: no such tenant) and the key's; `count_first`, quotas apply and the
    reservation must be counted by the tokenizer first (nothing was written); the default
    queue bound (`queued`, the tenant's waiting jobs as far as counted; None where the
    bound did not apply); each quota that applies, every-tier first, with the figures it
    was checked against and whether it held (`reserved_cost`: the most the job can cost,
    what spend budgets were checked against). PostgreSQL's function reports every quota;
    SQLite and the in-memory store stop at the first that did not hold, and report no
    quota when the queue bound refused: the decision and its first reason are the same."""

    job: JobRecord | None
    tenant_status: str | None = None
    key_ok: bool = True
    replay: str | None = None
    same_request: bool = True
    count_first: bool = False
    queued: int | None = None
    quotas: list[tuple[quota_repo.QuotaRecord, quota_repo.Figures, bool]] = field(
        default_factory=list
    )
    reserved_cost: Decimal = Decimal(0)

    @property
    def status(self) -> str | None:
        return status_as_read(self.tenant_status, self.key_ok)


ADMIT = "SELECT tierq_admit(" + ", ".join(f"${i}" for i in range(1, 21)) + ")::text AS outcome"


async def admit(pool: RawPool, a: Admission, counted: bool) -> Answer:
    """One round trip: the module's docstring. `counted`: the reservation was counted by
    the served model's tokenizer (else a tenant with quotas is answered `count_first`)."""
    day, month, _total = period_keys(a.created_at)
    row = await pool.fetchrow(
        ADMIT,
        *_job_args(a),
        output_bound(a.new.params),
        day,
        month,
        quota_repo.BILLING_GRACE,
        counted,
    )
    found = json.loads(row["outcome"])
    if "replay" in found:
        return Answer(None, replay=found["replay"], same_request=bool(found["same_request"]))
    if found.get("count_first"):
        return Answer(None, count_first=True)
    status = found.get("tenant_status")
    if status is None or "quotas" not in found:
        return Answer(None, tenant_status=status, key_ok=bool(found.get("key_ok")))
    job = None
    if found["id"] is not None:
        job = _admitted(
            a.new, found["id"], found["input_price"], found["output_price"], a.created_at
        )
    return Answer(
        job=job,
        tenant_status=status,
        queued=found["queued"],
        quotas=[_checked(a.new.tenant_id, f) for f in found["quotas"]],
        reserved_cost=Decimal(found["cost_micro"]) / MILLION,
    )


def _checked(
    tenant_id: str, f: dict[str, Any]
) -> tuple[quota_repo.QuotaRecord, quota_repo.Figures, bool]:
    """One quota as the function checked it: its limits, its figures, whether it held."""
    quota = quota_repo.QuotaRecord(
        tenant_id=tenant_id,
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
    return quota, figures, bool(f["ok"])
