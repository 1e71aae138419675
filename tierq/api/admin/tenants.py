"""`/admin/tenants`: create, list, read, update, suspend, resume and delete a tenant.

A change to a tenant is in effect before the answer: the dispatcher's entry is rewritten
and every API process's key cache told (`policy_changed`); a tenant stopped (suspended or
deleted) also has its queued and running work cancelled and its open streams closed.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from sqlalchemy.exc import IntegrityError

from tierq.api.admin.schemas import Tenant, TenantCreate, TenantList, TenantUpdate
from tierq.api.auth import forget_in_process
from tierq.api.deps import AppParts, PartsDep
from tierq.api.errors import APIError, not_found
from tierq.api.pages import list_page
from tierq.api.schemas import Deleted, answered
from tierq.core.redis_names import RedisNames
from tierq.core.states import TenantStatus
from tierq.models import batches as batch_repo
from tierq.models import tenants as tenant_repo
from tierq.models.db import Database
from tierq.models.records import TenantRecord
from tierq.services import batch_signal, cancellation, tenant_policy

router = APIRouter()


async def tenant_or_404(db: Database, tenant_id: str) -> TenantRecord:
    async with db.session() as s:
        tenant = await tenant_repo.get_tenant(s, tenant_id)
    if tenant is None:
        raise not_found("tenant", tenant_id)
    return tenant


async def policy_changed(db: Database, r: Any, names: RedisNames, tenant_id: str) -> None:
    """A tenant changed: the dispatcher's entry rewritten, every key cache told."""
    forget_in_process(f"changed:{tenant_id}")
    await tenant_policy.publish(db, r, names, tenant_id)


async def announce(r: Any, names: RedisNames, what: str) -> None:
    """A key revoked ("key:<id>") or a tenant stopped ("tenant:<id>"): in effect in this
    process before the answer, and in every other API process when it hears of it."""
    forget_in_process(what)
    await r.publish(names.access_channel, what)


async def _stop_work(parts: AppParts, tenant_id: str, why: str) -> None:
    """A tenant stopped (suspended or deleted, as committed): cancel its queued and running
    jobs (running ones are aborted in their engines, every follower gets the final event)
    and its active batches, then tell the dispatcher and every API process."""
    db, r, names, settings = parts.db, parts.redis, parts.names, parts.settings
    # Batches first: a batch that expanded lines into jobs before it was stopped has them
    # cancelled next, and one stopped expands no more.
    async with db.transaction() as s:
        batches = await batch_repo.cancel_tenant_batches(s, tenant_id)
    stopped = await parts.jobs.cancel_all(tenant_id, "tenant_suspended", why)
    await cancellation.announce(r, names, parts.events, stopped)
    for batch_id in batches:
        await batch_signal.poke(settings, r, names, batch_id)
    await policy_changed(db, r, names, tenant_id)
    await announce(r, names, f"tenant:{tenant_id}")  # its open streams close


@router.post("/tenants", response_model=None, responses=answered(Tenant, 409))
async def create_tenant(body: TenantCreate, parts: PartsDep) -> dict[str, Any]:
    try:
        async with parts.db.transaction() as s:
            tenant = await tenant_repo.create_tenant(
                s,
                body.name,
                list(dict.fromkeys(body.allowed_tiers)),
                body.default_tier,
                body.weight,
            )
    except IntegrityError:
        raise APIError(409, f"A tenant named '{body.name}' exists.", "tenant_exists") from None
    await policy_changed(parts.db, parts.redis, parts.names, tenant.id)
    return tenant.to_api()


@router.get("/tenants", response_model=None, responses=answered(TenantList))
async def list_tenants(
    parts: PartsDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1)] = 100,
) -> dict[str, Any]:
    async with parts.db.session() as s:
        page, more = await tenant_repo.list_tenants(s, after, min(limit, 1000))
    return list_page([t.to_api() for t in page], more)


@router.get(
    "/tenants/{tenant_id}",
    response_model=None,
    responses=answered(Tenant, 404),
)
async def get_tenant(tenant_id: str, parts: PartsDep) -> dict[str, Any]:
    return (await tenant_or_404(parts.db, tenant_id)).to_api()


@router.patch(
    "/tenants/{tenant_id}",
    response_model=None,
    responses=answered(Tenant, 404, 409),
)
async def update_tenant(
    tenant_id: str,
    body: TenantUpdate,
    parts: PartsDep,
) -> dict[str, Any]:
    current = await tenant_or_404(parts.db, tenant_id)
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
        async with parts.db.transaction() as s:
            updated = await tenant_repo.update_tenant(s, tenant_id, **values)
    except IntegrityError:
        raise APIError(409, f"A tenant named '{body.name}' exists.", "tenant_exists") from None
    if updated is None:
        raise not_found("tenant", tenant_id)
    if status == TenantStatus.SUSPENDED and updated.status != TenantStatus.SUSPENDED:
        return await suspend_tenant(tenant_id, parts)
    if status == TenantStatus.ACTIVE and updated.status != TenantStatus.ACTIVE:
        return await resume_tenant(tenant_id, parts)
    await policy_changed(parts.db, parts.redis, parts.names, tenant_id)
    return updated.to_api()


@router.post(
    "/tenants/{tenant_id}/suspend",
    response_model=None,
    responses=answered(Tenant, 404),
)
async def suspend_tenant(
    tenant_id: str,
    parts: PartsDep,
) -> dict[str, Any]:
    """Its keys stop working at once; its queued and running jobs and batches are cancelled."""
    await tenant_or_404(parts.db, tenant_id)
    async with parts.db.transaction() as s:
        tenant = await tenant_repo.update_tenant(s, tenant_id, status=TenantStatus.SUSPENDED)
    assert tenant is not None
    await _stop_work(parts, tenant_id, "the tenant was suspended")
    return tenant.to_api()


@router.post(
    "/tenants/{tenant_id}/resume",
    response_model=None,
    responses=answered(Tenant, 404),
)
async def resume_tenant(tenant_id: str, parts: PartsDep) -> dict[str, Any]:
    await tenant_or_404(parts.db, tenant_id)
    async with parts.db.transaction() as s:
        tenant = await tenant_repo.update_tenant(s, tenant_id, status=TenantStatus.ACTIVE)
    assert tenant is not None
    await policy_changed(parts.db, parts.redis, parts.names, tenant_id)
    return tenant.to_api()


@router.delete(
    "/tenants/{tenant_id}",
    response_model=None,
    responses=answered(Deleted, 404),
)
async def delete_tenant(
    tenant_id: str,
    parts: PartsDep,
) -> dict[str, Any]:
    """Keys revoked, work cancelled, the tenant gone from every listing; its ledger and
    invoices stay (billing history is not deleted)."""
    await tenant_or_404(parts.db, tenant_id)
    async with parts.db.transaction() as s:
        await tenant_repo.update_tenant(s, tenant_id, status=TenantStatus.DELETED)
        await tenant_repo.revoke_all_keys(s, tenant_id)
    await _stop_work(parts, tenant_id, "the tenant was deleted")
    return {"id": tenant_id, "object": "tenant", "deleted": True}
