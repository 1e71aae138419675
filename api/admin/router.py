"""The admin API (`/admin/...`): tenants, keys, quotas, prices, usage and invoices.

Every route needs the ADMIN_API_KEY (a tenant's key gets 403, none 401).
"""

from __future__ import annotations

import csv
import io
import re
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response
from sqlalchemy.exc import IntegrityError

from api.admin import metrics as admin_metrics
from api.admin.schemas import PriceSet, QuotaSet, TenantCreate, TenantUpdate
from api.auth import forget_in_process
from api.deps import DbDep, EventsDep, NamesDep, RedisDep, SettingsDep, require_admin
from api.errors import APIError, documented, not_found
from api.pages import list_page
from api.usage import GroupBy, Since, Until, usage_report
from models import batches as batch_repo
from models import billing
from models import jobs as job_repo
from models import prices as price_repo
from models import quotas as quota_repo
from models import tenants as tenant_repo
from models.db import Database
from models.records import TenantRecord
from services import batch_signal, cancellation, tenant_policy
from tierq.queue import EventLog
from tierq.redis_names import RedisNames
from tierq.settings import Settings
from tierq.states import TenantStatus

# Every route: the door's guard (400), the admin key (401, 403), the database (503).
router = APIRouter(
    prefix="/admin",
    tags=["admin"],
    dependencies=[Depends(require_admin)],
    responses=documented(400, 401, 403, 503),
)
router.include_router(admin_metrics.router)


async def _tenant(db: Database, tenant_id: str) -> TenantRecord:
    async with db.session() as s:
        tenant = await tenant_repo.get_tenant(s, tenant_id)
    if tenant is None:
        raise not_found("tenant", tenant_id)
    return tenant


# --- tenants -------------------------------------------------------------------------------


@router.post("/tenants", responses=documented(409))
async def create_tenant(
    body: TenantCreate, db: DbDep, r: RedisDep, names: NamesDep
) -> dict[str, Any]:
    try:
        async with db.transaction() as s:
            tenant = await tenant_repo.create_tenant(
                s,
                body.name,
                list(dict.fromkeys(body.allowed_tiers)),
                body.default_tier,
                body.weight,
            )
    except IntegrityError:
        raise APIError(409, f"A tenant named '{body.name}' exists.", "tenant_exists") from None
    await _policy_changed(db, r, names, tenant.id)
    return tenant.to_api()


@router.get("/tenants")
async def list_tenants(
    db: DbDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1)] = 100,
) -> dict[str, Any]:
    async with db.session() as s:
        page, more = await tenant_repo.list_tenants(s, after, min(limit, 1000))
    return list_page([t.to_api() for t in page], more)


@router.get("/tenants/{tenant_id}", responses=documented(404))
async def get_tenant(tenant_id: str, db: DbDep) -> dict[str, Any]:
    return (await _tenant(db, tenant_id)).to_api()


@router.patch("/tenants/{tenant_id}", responses=documented(404, 409))
async def update_tenant(
    tenant_id: str,
    body: TenantUpdate,
    db: DbDep,
    r: RedisDep,
    names: NamesDep,
    events: EventsDep,
    settings: SettingsDep,
) -> dict[str, Any]:
    current = await _tenant(db, tenant_id)
    values = body.model_dump(exclude_unset=True, exclude_none=True)
    allowed = body.allowed_tiers or list(current.allowed_tiers)
    default = body.default_tier or current.default_tier
    if default not in allowed:
        raise APIError(
            400,
            "'default_tier' must be one of 'allowed_tiers'.",
            "invalid_request",
            param="default_tier",
        )
    if "allowed_tiers" in values:
        values["allowed_tiers"] = [t.value for t in dict.fromkeys(allowed)]
    if "default_tier" in values:
        values["default_tier"] = default.value
    status = values.pop("status", None)
    try:
        async with db.transaction() as s:
            updated = await tenant_repo.update_tenant(s, tenant_id, **values)
    except IntegrityError:
        raise APIError(409, f"A tenant named '{body.name}' exists.", "tenant_exists") from None
    if updated is None:
        raise not_found("tenant", tenant_id)
    if status == TenantStatus.SUSPENDED and updated.status != TenantStatus.SUSPENDED:
        return await suspend_tenant(tenant_id, db, r, names, events, settings)
    if status == TenantStatus.ACTIVE and updated.status != TenantStatus.ACTIVE:
        return await resume_tenant(tenant_id, db, r, names)
    await _policy_changed(db, r, names, tenant_id)
    return updated.to_api()


async def _policy_changed(db: Database, r: Any, names: RedisNames, tenant_id: str) -> None:
    """A tenant changed: the dispatcher's entry rewritten, every key cache told."""
    forget_in_process(f"changed:{tenant_id}")
    await tenant_policy.publish(db, r, names, tenant_id)


async def _announce(r: Any, names: RedisNames, what: str) -> None:
    """A key revoked ("key:<id>") or a tenant stopped ("tenant:<id>"): in effect in this
    process before the answer, and in every other API process when it hears of it."""
    forget_in_process(what)
    await r.publish(names.access_channel, what)


async def _stop_work(
    db: Database,
    r: Any,
    names: RedisNames,
    events: EventLog,
    settings: Settings,
    tenant_id: str,
    why: str,
) -> None:
    """Cancel the tenant's queued and running jobs (running ones are aborted in their
    engines, every follower gets the final event) and its active batches."""
    async with db.transaction() as s:
        stopped = await job_repo.cancel_tenant_jobs(s, tenant_id, "tenant_suspended", why)
        batches = await batch_repo.cancel_tenant_batches(s, tenant_id)
    await cancellation.announce(r, names, events, stopped)
    for batch_id in batches:
        await batch_signal.poke(settings, r, names, batch_id)


@router.post("/tenants/{tenant_id}/suspend", responses=documented(404))
async def suspend_tenant(
    tenant_id: str,
    db: DbDep,
    r: RedisDep,
    names: NamesDep,
    events: EventsDep,
    settings: SettingsDep,
) -> dict[str, Any]:
    """Its keys stop working at once; its queued and running jobs and batches are cancelled."""
    await _tenant(db, tenant_id)
    async with db.transaction() as s:
        tenant = await tenant_repo.update_tenant(s, tenant_id, status=TenantStatus.SUSPENDED)
    assert tenant is not None
    await _stop_work(db, r, names, events, settings, tenant_id, "the tenant was suspended")
    await _policy_changed(db, r, names, tenant_id)
    await _announce(r, names, f"tenant:{tenant_id}")  # its open streams close
    return tenant.to_api()


@router.post("/tenants/{tenant_id}/resume", responses=documented(404))
async def resume_tenant(tenant_id: str, db: DbDep, r: RedisDep, names: NamesDep) -> dict[str, Any]:
    await _tenant(db, tenant_id)
    async with db.transaction() as s:
        tenant = await tenant_repo.update_tenant(s, tenant_id, status=TenantStatus.ACTIVE)
    assert tenant is not None
    await _policy_changed(db, r, names, tenant_id)
    return tenant.to_api()


@router.delete("/tenants/{tenant_id}", responses=documented(404))
async def delete_tenant(
    tenant_id: str,
    db: DbDep,
    r: RedisDep,
    names: NamesDep,
    events: EventsDep,
    settings: SettingsDep,
) -> dict[str, Any]:
    """Keys revoked, work cancelled, the tenant gone from every listing; its ledger and
    invoices stay (billing history is not deleted)."""
    await _tenant(db, tenant_id)
    async with db.transaction() as s:
        await tenant_repo.update_tenant(s, tenant_id, status=TenantStatus.DELETED)
        await tenant_repo.revoke_all_keys(s, tenant_id)
    await _stop_work(db, r, names, events, settings, tenant_id, "the tenant was deleted")
    await _policy_changed(db, r, names, tenant_id)
    await _announce(r, names, f"tenant:{tenant_id}")  # its open streams close
    return {"id": tenant_id, "object": "tenant", "deleted": True}


# --- keys ------------------------------------------------------------------------------------


@router.post("/tenants/{tenant_id}/keys", responses=documented(404))
async def create_key(tenant_id: str, db: DbDep) -> dict[str, Any]:
    """The secret is in this answer only; the database keeps its hash."""
    await _tenant(db, tenant_id)
    async with db.transaction() as s:
        issued = await tenant_repo.issue_key(s, tenant_id)
    return issued.to_api()


@router.get("/tenants/{tenant_id}/keys", responses=documented(404))
async def list_keys(tenant_id: str, db: DbDep) -> dict[str, Any]:
    await _tenant(db, tenant_id)
    async with db.session() as s:
        keys = await tenant_repo.list_keys(s, tenant_id)
    return list_page([k.to_api() for k in keys], False)


@router.delete("/keys/{key_id}", responses=documented(404))
async def revoke_key(key_id: str, db: DbDep, r: RedisDep, names: NamesDep) -> dict[str, Any]:
    """Effective at once: every request looks its key up in the database (no cache),
    admission looks again under the tenant's lock, and the key's open streams close."""
    async with db.transaction() as s:
        key = await tenant_repo.revoke_key(s, key_id)
    if key is None:
        raise not_found("key", key_id)
    await _announce(r, names, f"key:{key_id}")
    return {**key.to_api(), "revoked": True}


# --- quotas ----------------------------------------------------------------------------------


@router.put("/tenants/{tenant_id}/quota", responses=documented(404))
async def set_quota(
    tenant_id: str, body: QuotaSet, db: DbDep, r: RedisDep, names: NamesDep
) -> dict[str, Any]:
    """Replace the tenant's quota (all tiers, or `tier`'s): an omitted limit is no limit."""
    await _tenant(db, tenant_id)
    limits = body.model_dump(exclude={"tier"})
    scope = body.tier.value if body.tier else quota_repo.ALL_TIERS
    async with db.transaction() as s:
        quota = await quota_repo.set_quota(s, tenant_id, scope, **limits)
    await _policy_changed(db, r, names, tenant_id)
    return {"object": "quota", "tenant_id": tenant_id, **quota.to_api()}


@router.get("/tenants/{tenant_id}/quota", responses=documented(404))
async def get_quota(tenant_id: str, db: DbDep) -> dict[str, Any]:
    """Every quota of the tenant with its current usage against each limit."""
    await _tenant(db, tenant_id)
    now = datetime.now(UTC)
    async with db.session() as s:
        quotas = await quota_repo.quotas_of(s, tenant_id)
        in_flight = await job_repo.tenant_job_counts(s, tenant_id)
        data = []
        for q in quotas:
            data.append({**q.to_api(), "usage": await _quota_usage(s, q, in_flight, now)})
    return {"object": "list", "tenant_id": tenant_id, "data": data}


async def _quota_usage(
    s: Any, q: quota_repo.QuotaRecord, in_flight: dict[tuple[str, str], int], now: datetime
) -> dict[str, Any]:
    def count(status: str) -> int:
        return sum(
            n for (tier, st), n in in_flight.items() if st == status and q.tier in ("*", tier)
        )

    minute = await quota_repo.last_minute(s, q.tenant_id, q.tier, now)
    start, _end = quota_repo.period_bounds(q.budget_period, now)
    tokens, cost = await quota_repo.spent(s, q.tenant_id, q.tier, q.budget_period, now)
    return {
        "requests_last_minute": minute[0],
        "tokens_last_minute": minute[1],
        "running": count("running"),
        "queued": count("queued"),
        "period_start": int(start.timestamp()) if start else None,
        "tokens_this_period": tokens,
        "spend_this_period": str(cost),
    }


# --- prices ----------------------------------------------------------------------------------


@router.put("/prices")
async def set_price(body: PriceSet, db: DbDep) -> dict[str, Any]:
    """Applies to jobs admitted from now on; admitted jobs keep their price."""
    async with db.transaction() as s:
        price = await price_repo.set_price(
            s, body.model, body.tier.value, body.input_per_million, body.output_per_million
        )
    return price.to_api()


@router.get("/prices")
async def list_prices(db: DbDep) -> dict[str, Any]:
    async with db.session() as s:
        prices = await price_repo.current_prices(s)
    return {"object": "list", "data": [p.to_api() for p in prices]}


# --- usage and invoices -----------------------------------------------------------------------


@router.get("/tenants/{tenant_id}/usage", responses=documented(404))
async def tenant_usage(
    tenant_id: str,
    db: DbDep,
    start: Since = None,
    end: Until = None,
    group_by: GroupBy = None,
) -> dict[str, Any]:
    async with db.session() as s:
        exists = await tenant_repo.get_tenant(s, tenant_id)
    if exists is None:
        raise not_found("tenant", tenant_id)
    return await usage_report(db, tenant_id, start, end, group_by)


# A month as invoices name it: YYYY-MM in ASCII digits, whose end is a date too (so not
# 9999-12), and no other spelling of the same month ("2024-1", Arabic-Indic digits).
PERIOD_PATTERN = r"^(?!0000)(?!9999-12)[0-9]{4}-(0[1-9]|1[0-2])$"
Period = Annotated[str | None, Query(json_schema_extra={"pattern": PERIOD_PATTERN})]


def _period(value: str | None) -> str | None:
    if value is None:
        return None
    if re.fullmatch(PERIOD_PATTERN, value) is None:
        raise APIError(400, "'period' is a month: YYYY-MM.", "invalid_request", param="period")
    return value


@router.get(
    "/invoices",
    response_model=None,
    responses={200: {"content": {"text/csv": {"schema": {"type": "string"}}}}},
)
async def list_invoices(
    db: DbDep,
    tenant: str | None = None,
    period: Period = None,
    format: Annotated[str, Query(json_schema_extra={"enum": ["json", "csv"]})] = "json",
) -> dict[str, Any] | Response:
    async with db.session() as s:
        rows = await billing.invoices(s, tenant, _period(period))
    if format == "csv":
        return _csv(rows)
    if format != "json":
        raise APIError(400, "'format' is json or csv.", "invalid_request", param="format")
    return {"object": "list", "data": rows}


@router.get(
    "/invoices.csv",
    response_model=None,
    responses={200: {"content": {"text/csv": {"schema": {"type": "string"}}}}},
)
async def invoices_csv(db: DbDep, tenant: str | None = None, period: Period = None) -> Response:
    async with db.session() as s:
        rows = await billing.invoices(s, tenant, _period(period))
    return _csv(rows)


def _csv(rows: list[dict[str, Any]]) -> Response:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(
        [
            "invoice_id",
            "tenant_id",
            "period",
            "tier",
            "model",
            "requests",
            "prompt_tokens",
            "completion_tokens",
            "cost",
        ]
    )
    for inv in rows:
        for line in inv["lines"]:
            writer.writerow(
                [
                    inv["id"],
                    inv["tenant_id"],
                    inv["period"],
                    line["tier"],
                    line["model"],
                    line["requests"],
                    line["prompt_tokens"],
                    line["completion_tokens"],
                    line["cost"],
                ]
            )
        writer.writerow(
            [
                inv["id"],
                inv["tenant_id"],
                inv["period"],
                "total",
                "",
                inv["requests"],
                inv["prompt_tokens"],
                inv["completion_tokens"],
                inv["cost"],
            ]
        )
    return Response(
        out.getvalue(),
        media_type="text/csv",
        headers={"Content-Disposition": 'attachment; filename="invoices.csv"'},
    )


@router.post("/invoices/rollup")
async def roll_up_invoices(db: DbDep, period: Period = None) -> dict[str, Any]:
    """Roll the month's ledger up into invoices now (beat does it periodically)."""
    month = _period(period) or datetime.now(UTC).strftime("%Y-%m")
    async with db.transaction() as s:
        tenants = await billing.roll_up(s, month)
    async with db.session() as s:
        rows = await billing.invoices(s, None, month)
    return {"object": "list", "period": month, "tenants": tenants, "data": rows}
