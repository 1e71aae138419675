"""`/admin/tenants/{id}/quota`: set a tenant's quota, and read each with its usage."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from tierq.api.admin.schemas import QuotaList, QuotaSet, QuotaSetResult
from tierq.api.admin.tenants import policy_changed, tenant_or_404
from tierq.api.deps import PartsDep
from tierq.api.schemas import answered
from tierq.core import clock
from tierq.models import quotas as quota_repo

router = APIRouter()


@router.put(
    "/tenants/{tenant_id}/quota",
    response_model=None,
    responses=answered(QuotaSetResult, 404),
)
async def set_quota(tenant_id: str, body: QuotaSet, parts: PartsDep) -> dict[str, Any]:
    """Replace the tenant's quota (all tiers, or `tier`'s): an omitted limit is no limit."""
    await tenant_or_404(parts.db, tenant_id)
    limits = body.model_dump(exclude={"tier"})
    scope = body.tier.value if body.tier else quota_repo.ALL_TIERS
    async with parts.db.transaction() as s:
        quota = await quota_repo.set_quota(s, tenant_id, scope, **limits)
    await policy_changed(parts.db, parts.redis, parts.names, tenant_id)
    return {"object": "quota", "tenant_id": tenant_id, **quota.to_api()}


@router.get(
    "/tenants/{tenant_id}/quota",
    response_model=None,
    responses=answered(QuotaList, 404),
)
async def get_quota(tenant_id: str, parts: PartsDep) -> dict[str, Any]:
    """Every quota of the tenant with its current usage against each limit."""
    await tenant_or_404(parts.db, tenant_id)
    async with parts.db.session() as s:
        report = await quota_repo.usage_report(s, tenant_id, clock.utcnow())
    data = [{**q.to_api(), "usage": usage.to_api()} for q, usage in report]
    return {"object": "list", "tenant_id": tenant_id, "data": data}
