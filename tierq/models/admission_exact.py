"""Admission in one ORM transaction, on either backend: the way for what the single
statements (tierq/models/admission.py on PostgreSQL, tierq/models/admission_sqlite.py on an
SQLite file) leave to it — a replay of an Idempotency-Key, a tenant with quotas where no
statement checks them, and the in-memory SQLite database.

In order, in the transaction that inserts the job: a replay of the key is answered with the
job it made (no quota is charged twice); the price in force is found; the tenant's row is
locked (exclusive when a quota applies, so that its admissions are checked one at a time)
and its status and the key's read as of now, not as of authentication; the default bound on
waiting jobs and then every quota that applies are checked (`models.quotas.check`, the rule
`decide` states). Nothing is written unless the job is admitted. The outcome says why not;
the caller words the refusal (tierq/services/admission.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from decimal import Decimal

from sqlalchemy.ext.asyncio import AsyncSession

from tierq.core.messages import output_bound
from tierq.core.states import TenantStatus
from tierq.models import jobs as job_repo
from tierq.models import prices as price_repo
from tierq.models import quotas as quota_repo
from tierq.models import tenants as tenant_repo
from tierq.models.admission import Admission
from tierq.models.records import JobRecord


@dataclass(frozen=True)
class ExactOutcome:
    """`job` (and whether this call `created` it) when admitted or replayed; otherwise the
    first reason not to: the tenant's `status` as read under its lock (None: no such
    tenant; REVOKED: the request's key), the default queue bound, or a quota's refusal."""

    job: JobRecord | None
    created: bool = False
    status: str | None = TenantStatus.ACTIVE.value
    queue_bound: bool = False
    refusal: quota_repo.Refusal | None = None


async def admit(s: AsyncSession, a: Admission) -> ExactOutcome:
    """The module's docstring, in the caller's transaction. Raises
    `models.jobs.IdempotencyConflict` for a key used before with another request body."""
    new = a.new
    if new.idempotency_key is not None:
        again = await job_repo.find_by_idempotency_key(
            s, new.tenant_id, new.idempotency_key, new.request_hash
        )
        if again is not None:
            return ExactOutcome(again)
    price = await price_repo.current_price(s, new.model, new.tier, a.batch_discount)
    price_in = price.input_per_million if price else Decimal(0)
    price_out = price.output_per_million if price else Decimal(0)
    quotas = [
        q
        for q in await quota_repo.quotas_of(s, new.tenant_id)
        if q.tier in (quota_repo.ALL_TIERS, new.tier.value) and not q.empty
    ]
    # A suspension or revocation that committed meanwhile refuses the job; one that comes
    # later cancels it (suspension) or lets it finish (a revoked key).
    status = await tenant_repo.lock_tenant(
        s, new.tenant_id, exclusive=bool(quotas), key_id=a.key_id
    )
    if status != TenantStatus.ACTIVE:
        return ExactOutcome(None, status=status)
    # The default bound on what one tenant may leave waiting (and so on its share of
    # Redis). Under the shared lock, so concurrent admissions of the tenant may pass it by
    # at most their number; a quota's own max_queued is exact.
    bound = a.default_max_queued and not any(
        q.tier == quota_repo.ALL_TIERS and q.max_queued is not None for q in quotas
    )
    if bound and await quota_repo.queued_refusal(s, new.tenant_id, a.default_max_queued):
        return ExactOutcome(None, queue_bound=True)
    if quotas:
        cost = quota_repo.reservation_cost(
            new.reserved_tokens, output_bound(new.params), price_in, price_out
        )
        for quota in quotas:
            refusal = await quota_repo.check(s, quota, new.tier.value, new.reserved_tokens, cost)
            if refusal is not None:
                return ExactOutcome(None, refusal=refusal)
    priced = dataclasses.replace(new, input_price=price_in, output_price=price_out)
    job, created = await job_repo.create_job(s, priced)
    return ExactOutcome(job, created)
