"""The operator's view of webhooks: a tenant's endpoints (registered by the operator or
the tenant), every delivery with its attempts and last answer, and sending a failed
delivery again."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from api.admin.tenants import tenant_or_404
from api.deps import DbDep, SettingsDep
from api.errors import APIError, documented, not_found
from api.webhooks.router import (
    create_endpoint,
    delete_endpoint,
    deliveries_page,
    endpoints_page,
)
from models import webhooks as repo
from services.webhooks import WebhookEndpointCreate

router = APIRouter()


@router.post("/tenants/{tenant_id}/webhook_endpoints", responses=documented(404, 409))
async def create(
    tenant_id: str, body: WebhookEndpointCreate, db: DbDep, settings: SettingsDep
) -> dict[str, Any]:
    """Register an endpoint for the tenant; the answer carries its signing secret, for the
    operator to hand to the tenant (no later answer shows it)."""
    made = await create_endpoint(db, settings, tenant_id, body, "operator")
    return made.to_api(with_secret=True)


@router.get("/tenants/{tenant_id}/webhook_endpoints", responses=documented(404))
async def list_endpoints(
    tenant_id: str,
    db: DbDep,
    settings: SettingsDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1)] = 20,
) -> dict[str, Any]:
    await tenant_or_404(db, tenant_id)
    return await endpoints_page(db, settings, tenant_id, after, limit, creator=True)


@router.delete("/tenants/{tenant_id}/webhook_endpoints/{endpoint_id}", responses=documented(404))
async def delete(tenant_id: str, endpoint_id: str, db: DbDep) -> dict[str, Any]:
    await tenant_or_404(db, tenant_id)
    return await delete_endpoint(db, tenant_id, endpoint_id)


@router.get("/webhook_deliveries")
async def list_deliveries(
    db: DbDep,
    settings: SettingsDep,
    tenant_id: str | None = None,
    endpoint_id: str | None = None,
    status: Annotated[str | None, Query(pattern="^(pending|delivered|failed)$")] = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1)] = 20,
) -> dict[str, Any]:
    """Every tenant's deliveries, newest first, filtered by tenant, endpoint or status."""
    return await deliveries_page(
        db,
        settings,
        tenant_id=tenant_id,
        endpoint_id=endpoint_id,
        status=status,
        after=after,
        limit=limit,
    )


@router.post("/webhook_deliveries/{delivery_id}/redeliver", responses=documented(404, 409))
async def redeliver(delivery_id: str, db: DbDep) -> dict[str, Any]:
    """Send a failed delivery again, its attempts counted anew (the same event id: a
    receiver that did take it deduplicates)."""
    async with db.transaction() as s:
        again = await repo.redeliver(s, delivery_id)
        found = again or await repo.get_delivery(s, delivery_id)
    if found is None:
        raise not_found("webhook_delivery", delivery_id)
    if again is None:
        raise APIError(
            409,
            f"The delivery is {found.status}: only a failed delivery to an endpoint that "
            "still exists is sent again.",
            "delivery_not_failed",
        )
    return again.to_api()
