"""Admission: the rules between a request and the queue — once, for an online request
(the native job API and OpenAI's surface) and for a batch line alike.

The path, for either:

- **parse and check** (`prepare`): the request normalised to a `JobCreate` (a batch line
  through OpenAI's protocol shapes, as an online OpenAI request is), the deployment's
  limits (`services.requests.check`), the tier the tenant may use, and the prompt's
  reservation (`reservation`, never below what the engine will bill);
- **price**: the price in force for the model and tier (a batch's lines keep the price of
  when the batch was created: `batch_prices`);
- **quota and budget**, under the tenant's row lock, by one rule (`models.quotas.decide`):
  an online job is checked as it is admitted (`submit`); a batch reserves what its whole
  file can cost before its first line runs (`batch_refusal`), so that the lines then
  expand without a check of their own and a batch is never half run.

A refusal is `services.requests.Refused` (an HTTP status and an OpenAI error code): the
API answers it in OpenAI's error shape, and a batch writes it to its error file.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from datetime import datetime
from decimal import Decimal
from typing import Any, NoReturn

import redis
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncSession

from tierq.core import fleet, logs, metrics, token_count, tracing
from tierq.core.file_store import FileStore
from tierq.core.ids import new_id
from tierq.core.queue import Enqueuer
from tierq.core.settings import Settings
from tierq.core.states import TenantStatus
from tierq.core.tiers import Tier, vllm_priority
from tierq.models import jobs as job_repo
from tierq.models import prices as price_repo
from tierq.models import quotas as quota_repo
from tierq.models import tenants as tenant_repo
from tierq.models.admission import Admission, Answer
from tierq.models.batches import BatchLine
from tierq.models.records import JobRecord, TenantRecord
from tierq.models.store import JobStore
from tierq.models.tables import utcnow
from tierq.services import openai_compat, structured
from tierq.services.batch_input import RawLine, requests_from
from tierq.services.requests import JobCreate, Refused, check, refuse_unless_fits

log = logging.getLogger(__name__)


QUEUE_RETRY_AFTER_S = 2


class _Recent:
    """Keys noted within the last `ttl_s` (at most `limit` kept): which tenants' tiers the
    store found quotas for, so that their next admissions are counted by the tokenizer
    before they reach it. A hint only: the store finds quotas itself, so a stale entry
    costs a tokenizer run, a missing one a second call."""

    def __init__(self, ttl_s: float, limit: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.limit = limit
        self._seen: dict[tuple[str, Tier], float] = {}

    def note(self, key: tuple[str, Tier]) -> None:
        if len(self._seen) >= self.limit:
            self._seen.clear()
        self._seen[key] = time.monotonic()

    def recent(self, key: tuple[str, Tier]) -> bool:
        seen = self._seen.get(key)
        return seen is not None and time.monotonic() - seen < self.ttl_s


_quotas_seen = _Recent(ttl_s=5.0)


def _refuse(
    status: int,
    message: str,
    code: str,
    param: str | None = None,
    *,
    tenant: TenantRecord | None = None,
    tier: Tier | None = None,
    retry_after_s: int | None = None,
) -> Refused:
    """An online request refused, counted (per tenant too when `tenant` is given)."""
    metrics.JOBS_REFUSED.labels(code=code).inc()
    if tenant is not None:
        label = metrics.tenant_label(tenant.id)
        metrics.TENANT_REFUSED.labels(label, tier.value if tier else "", code).inc()
    if retry_after_s is None and status in (429, 503):
        retry_after_s = QUEUE_RETRY_AFTER_S
    return Refused(status, message, code, param, retry_after_s=retry_after_s)


def tenant_refusal(status: str | None) -> Refused | None:
    """Why a request may not go on, given the tenant's status as read under its lock in the
    request's transaction (`models.tenants.lock_tenant`: REVOKED for the request's revoked
    key): its state as of now, not as of authentication a moment before."""
    if status == tenant_repo.REVOKED:
        return Refused(401, "Incorrect API key provided.", "invalid_api_key")
    if status != TenantStatus.ACTIVE:
        return Refused(403, "The tenant is suspended.", "tenant_suspended")
    return None


def refuse_unless_active(status: str | None) -> None:
    """`tenant_refusal`, raised (the Files and Batches routes' check)."""
    refusal = tenant_refusal(status)
    if refusal is not None:
        raise refusal


def request_hash(body: JobCreate) -> str:
    canonical = json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def validate(body: JobCreate, settings: Settings, tenant: TenantRecord | None = None) -> str:
    """The deployment's limits (services.requests.check), counted in the refusal metrics
    (per tenant too when `tenant` is given; the tier as the request named it, if it did)."""
    try:
        return check(body, settings)
    except Refused as exc:
        raise _refuse(
            exc.status, exc.message, exc.code, exc.param, tenant=tenant, tier=body.tier
        ) from None


def reservation(settings: Settings, body: JobCreate) -> int:
    """The tokens a job reserves, as the served model's tokenizer counts its prompt, plus
    its max_tokens: never below what the engine will bill; what quotas and budgets are
    checked against."""
    counter = token_count.for_settings(settings)
    floor, bound = counter.measure(_messages(body), body.prompt)
    refuse_unless_fits(floor, body, settings)  # the engine would refuse it after queueing
    return bound + body.output_tokens


def _messages(body: JobCreate) -> list[dict[str, Any]] | None:
    return [m.model_dump(exclude_none=True) for m in body.messages] if body.messages else None


def resolve_tier(tenant: TenantRecord, requested: Tier | None) -> Tier:
    """The tier a request runs in: the one it names, else the tenant's default; refused
    (never silently downgraded) when the tenant may not use it."""
    tier = requested or tenant.default_tier
    if tier not in tenant.allowed_tiers:
        raise _refuse(
            403,
            f"This tenant may not use the '{tier.value}' tier "
            f"(allowed: {', '.join(t.value for t in tenant.allowed_tiers) or 'none'}).",
            "tier_not_allowed",
            "tier",
        )
    return tier


async def submit(
    jobs: JobStore,
    queue: Enqueuer,
    settings: Settings,
    tenant: TenantRecord,
    body: JobCreate,
    idempotency_key: str | None,
    *,
    online: bool = False,
    key_id: str | None = None,
    gate: Callable[[str, int], AbstractAsyncContextManager[None]] | None = None,
) -> tuple[JobRecord, bool]:
    """Write the job row (the source of truth), then put it on its tier's stream (through
    the process's `Enqueuer`, which carries the jobs admitted meanwhile in the same call).

    When Redis refuses the XADD, an asynchronous job stays accepted (the reconciler enqueues
    it); an `online` one — a client waiting on the line — is cancelled and refused with 503.
    `gate` (a tenant's id and the tier's rank -> the context admitting it) bounds admissions
    of one tenant in this process, better tiers let in first (tierq/api/gate.py).
    """
    if body.response_format is not None:
        # A schema is compiled off the event loop first (the check below then finds it done).
        await asyncio.to_thread(structured.refusal, body.response_format.engine_param())
    model = validate(body, settings, tenant)
    tier = resolve_tier(tenant, body.tier)
    logs.bind(tenant_id=tenant.id, tier=tier.value)
    if idempotency_key is not None and not 0 < len(idempotency_key) <= 255:
        raise _refuse(
            400, "Idempotency-Key must be 1 to 255 characters.", "invalid_idempotency_key"
        )
    messages = _messages(body)
    # A reservation is never below what the engine will bill. Where no quota applies
    # nothing is checked against it, so it is the byte bound (no tokenizer run); where one
    # does, the store sends the request back to be counted by the served model's tokenizer
    # (`_admit`).
    reserved = token_count.BYTE_BOUND.reserve(messages, body.prompt, body.output_tokens)
    new = job_repo.NewJob(
        tenant_id=tenant.id,
        tier=tier,
        model=model,
        messages=messages,
        prompt=body.prompt,
        params=body.params(),
        metadata=body.metadata,
        idempotency_key=idempotency_key,
        # What a replay of the key is compared with: only jobs with a key need it.
        request_hash=None if idempotency_key is None else request_hash(body),
        reserved_tokens=reserved,
    )
    counted = False
    if reserved > fleet.max_model_len(settings) and token_count.for_settings(settings).exact:
        # It may not fit the context: counted now (off the event loop, for a long prompt)
        # and refused if it cannot, rather than queued for the engine to refuse.
        new, counted = await _counted(settings, new, messages, body), True
    attributes = {"tenant_id": tenant.id, "tier": tier.value}
    admitting = tracing.span("tierq.admission", attributes=attributes)
    async with _gated(gate, tenant.id, vllm_priority(tier)), admitting as span:

        async def count(unexact: job_repo.NewJob) -> job_repo.NewJob:
            return await _counted(settings, unexact, messages, body)

        job, created = await _admit(jobs, settings, tenant, key_id, new, counted, count)
        span.set(job_id=job.id, created=created)
    logs.bind(job_id=job.id)
    tracing.tag(job_id=job.id, tenant_id=tenant.id, tier=job.tier.value)  # the request's span
    log.debug("job admitted" if created else "job found by its idempotency key")
    if created:
        metrics.JOBS_SUBMITTED.labels(tier=job.tier.value).inc()
        metrics.TENANT_ADMITTED.labels(metrics.tenant_label(tenant.id), job.tier.value).inc()
        try:
            await queue.enqueue(job.to_message())
        except (redis.RedisError, OSError):
            if not online:
                # The row is committed, so the job is accepted: the reconciler enqueues it.
                log.exception("enqueue failed; the reconciler will enqueue %s", job.id)
                return job, created
            log.exception("enqueue failed; refusing the online request %s", job.id)
            await jobs.cancel(job.id)
            raise _refuse(
                503,
                "The queue is unavailable. Retry after a moment.",
                "service_unavailable",
            ) from None
    return job, created


def _gated(
    gate: Callable[[str, int], AbstractAsyncContextManager[None]] | None,
    tenant_id: str,
    rank: int,
) -> AbstractAsyncContextManager[None]:
    return gate(tenant_id, rank) if gate is not None else contextlib.nullcontext()


def _refuse_unless_active(status: str | None, tenant: TenantRecord, tier: Tier) -> None:
    """`tenant_refusal`, counted: a suspension per tenant, a revoked key not (it is not
    the tenant's doing)."""
    refusal = tenant_refusal(status)
    if refusal is None:
        return
    scoped = refusal.code == "tenant_suspended"
    raise _refuse(
        refusal.status,
        refusal.message,
        refusal.code,
        tenant=tenant if scoped else None,
        tier=tier if scoped else None,
    )


async def _counted(
    settings: Settings, new: job_repo.NewJob, messages: list[dict] | None, body: JobCreate
) -> job_repo.NewJob:
    """The job reserving its prompt as the served model's tokenizer counts it: what quotas
    are checked against."""
    counter = token_count.for_settings(settings)
    try:
        # A text far past the context is refused for the price of its first part.
        room = fleet.max_model_len(settings) - body.max_tokens
        refuse_unless_fits(
            await counter.floor_of_prefix_off_loop(messages, body.prompt, room), body, settings
        )
        floor, bound = await counter.measure_off_loop(messages, body.prompt)
        refuse_unless_fits(floor, body, settings)
    except Refused as exc:
        raise _refuse(exc.status, exc.message, exc.code, exc.param) from None
    return dataclasses.replace(new, reserved_tokens=bound + body.output_tokens)


def _admission(settings: Settings, key_id: str | None, new: job_repo.NewJob) -> Admission:
    """A new job's admission, as every store takes it."""
    return Admission(
        new_id("job"), new, key_id, utcnow(), settings.default_max_queued, settings.batch_discount
    )


async def _admit(
    jobs: JobStore,
    settings: Settings,
    tenant: TenantRecord,
    key_id: str | None,
    new: job_repo.NewJob,
    counted: bool,
    count: Callable[[job_repo.NewJob], Awaitable[job_repo.NewJob]],
) -> tuple[JobRecord, bool]:
    """The job admitted (or found by its Idempotency-Key), and whether this call created
    it; a refusal raised. `new` reserves the prompt's byte bound unless `counted` (by the
    served model's tokenizer, which `count` does): quotas are checked against a count, so
    the store sends an uncounted request of a tenant with quotas back to be counted
    (`count_first`) and it is admitted a second time. A tenant found with quotas is
    remembered for a few seconds (`_quotas_seen`): its next admissions are counted first."""
    seen = (tenant.id, new.tier)
    quotas_likely = _quotas_seen.recent(seen)
    if quotas_likely and not counted:
        new, counted = await count(new), True
    metrics.ADMISSION_STATEMENTS.labels(path="quotas" if quotas_likely else "fast").inc()
    request = _admission(settings, key_id, new)
    answer = await jobs.admit(request, counted=counted)
    if answer.count_first:
        _quotas_seen.note(seen)
        new = await count(new)
        metrics.ADMISSION_STATEMENTS.labels(path="quotas").inc()
        request = _admission(settings, key_id, new)
        answer = await jobs.admit(request, counted=True)
    return await _answered(jobs, settings, tenant, request, answer)


async def _answered(
    jobs: JobStore,
    settings: Settings,
    tenant: TenantRecord,
    request: Admission,
    answer: Answer,
) -> tuple[JobRecord, bool]:
    """What a store's answer means: the job (created, or replayed), or a refusal raised,
    worded by the rule (models.quotas.decide) from the figures the store checked."""
    new = request.new
    if answer.replay is not None:
        return await _replayed(jobs, answer.replay, answer.same_request)
    if answer.job is not None:
        return answer.job, True
    _refuse_unless_active(answer.status, tenant, new.tier)
    _refuse_if_queue_full(settings, tenant, new.tier, answer.queued)
    for quota, figures, _held in answer.quotas:
        refusal = quota_repo.decide(
            quota,
            figures,
            new.tier.value,
            new.reserved_tokens,
            answer.reserved_cost,
            request.created_at,  # when the figures were read: the minute and period
        )
        if refusal is not None:
            _refuse_quota(refusal, tenant, new.tier)
    # Every store decides by the rule on the figures it sends, so this is the store (which
    # decided under the tenant's lock: PostgreSQL's function is frozen SQL) and `decide`
    # disagreeing at a boundary. The store's decision stands; the refusal names no figure.
    log.error(
        "admission of tenant %s refused by the store for no reason the rule gives (answer %r)",
        tenant.id,
        answer,
    )
    _refuse_quota(
        quota_repo.Refusal("quota_exceeded", "A quota of this tenant would be exceeded.", 1),
        tenant,
        new.tier,
    )


async def _replayed(jobs: JobStore, job_id: str, same_request: bool) -> tuple[JobRecord, bool]:
    """A replay of an Idempotency-Key: the job it made (not created now), or 409 for
    another request body."""
    if not same_request:
        _refuse_reused_key()
    replayed = await jobs.get(job_id)
    assert replayed is not None  # jobs are never deleted while their tenant lives
    return replayed, False


def _refuse_reused_key() -> NoReturn:
    raise _refuse(
        409,
        "This Idempotency-Key was already used with a different request body.",
        "idempotency_key_reused",
    )


def _refuse_if_queue_full(
    settings: Settings, tenant: TenantRecord, tier: Tier, queued: int | None
) -> None:
    """DEFAULT_MAX_QUEUED, against the waiting jobs a way in counted (None: the bound did
    not apply)."""
    if queued is not None and queued >= settings.default_max_queued > 0:
        _refuse_quota(quota_repo.too_many_queued(settings.default_max_queued), tenant, tier)


def _refuse_quota(refusal: quota_repo.Refusal, tenant: TenantRecord, tier: Tier) -> NoReturn:
    raise _refuse(
        429,
        refusal.message,
        refusal.code,
        tenant=tenant,
        tier=tier,
        retry_after_s=refusal.retry_after_s,
    )


# --- batch lines ---------------------------------------------------------------------------


def runnable_body(item: RawLine) -> dict[str, Any]:
    """A line's body as it runs: streaming fields dropped, and the tier is the batch's."""
    body = {k: v for k, v in item.body.items() if k not in ("stream", "stream_options")}
    body.pop("service_tier", None)
    return body


def prepare_line(settings: Settings, endpoint: str, item: RawLine) -> tuple[JobCreate, str]:
    """The job a line runs as, and its model: the line parsed as OpenAI's request for its
    endpoint (as an online request to that endpoint is) and checked as an online job is;
    ValidationError or Refused when it cannot run. The one parse of a line: what is
    reserved for it is what runs (no field can make a line reserve nothing and still run)."""
    job = openai_compat.parse(endpoint, runnable_body(item)).to_job()
    return job, check(job, settings)


def batch_line(settings: Settings, endpoint: str, item: RawLine) -> BatchLine:
    """A line's job, or the refusal that its error line will carry."""
    try:
        job, model = prepare_line(settings, endpoint, item)
        reserved = reservation(settings, job)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        message = f"Invalid value for '{where}': {first['msg']}." if where else first["msg"]
        return _refused_line(item, "invalid_request", message)
    except Refused as exc:
        return _refused_line(item, exc.code, exc.message)
    return BatchLine(
        line=item.number,
        custom_id=item.custom_id,
        model=model,
        messages=_messages(job),
        prompt=job.prompt,
        params=job.params(),
        reserved_tokens=reserved,
    )


def _refused_line(item: RawLine, code: str, message: str) -> BatchLine:
    model = runnable_body(item).get("model")
    return BatchLine(
        line=item.number,
        custom_id=item.custom_id,
        model=str(model)[:200] if model is not None else "",
        messages=None,
        prompt=None,
        params={},
        error_code=code,
        error_message=message,
    )


async def batch_prices(
    s: AsyncSession, settings: Settings, created_at: datetime
) -> tuple[Decimal, Decimal]:
    """The batch tier's price when the batch was created: its lines keep it."""
    price = await price_repo.current_price(
        s, settings.served_model_name, Tier.BATCH, settings.batch_discount, as_of=created_at
    )
    if price is None:
        return Decimal(0), Decimal(0)
    return price.input_per_million, price.output_per_million


def file_reservation(
    settings: Settings,
    store: FileStore,
    name: str,
    endpoint: str,
    price_in: Decimal,
    price_out: Decimal,
) -> tuple[int, Decimal]:
    """Tokens and the most money a batch's whole input file can take: what each line that
    will run reserves once it is a job (a line refused here fails on its own, costing
    nothing). Blocking reads and tokenizing: callers run it in a thread."""
    tokens, cost = 0, Decimal(0)
    for item, _ in requests_from(store, name, 0, 0, endpoint):
        try:
            job, _model = prepare_line(settings, endpoint, item)
            reserved = reservation(settings, job)
        except (ValidationError, Refused):
            continue
        tokens += reserved
        cost += quota_repo.reservation_cost(reserved, job.output_tokens, price_in, price_out)
    return tokens, cost


async def batch_refusal(
    s: AsyncSession, tenant_id: str, tokens: int, cost: Decimal
) -> quota_repo.Refusal | None:
    """Why a batch may not start: its tenant is not active, or the first of its budgets
    that reserving `tokens` and `cost` (its file's reservation) would pass. Checked under
    the tenant's lock in the transaction that starts the batch, with every other admission
    of the tenant (exclusive when a budget is checked): batches and online jobs started
    together are counted against the budget together, and a tenant suspended since the
    batch was created starts nothing."""
    quotas = [
        q
        for q in await quota_repo.quotas_of(s, tenant_id)
        if q.tier in (quota_repo.ALL_TIERS, Tier.BATCH.value)
        and (q.token_budget is not None or q.spend_budget is not None)
    ]
    status = await tenant_repo.lock_tenant(s, tenant_id, exclusive=bool(quotas))
    if status != TenantStatus.ACTIVE:
        return quota_repo.Refusal("tenant_suspended", "The tenant is suspended.", 0)
    for quota in quotas:
        refusal = await quota_repo.check(s, quota, Tier.BATCH.value, tokens, cost, online=False)
        if refusal is not None:
            return refusal
    return None
