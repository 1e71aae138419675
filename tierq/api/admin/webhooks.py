"""The operator's view of webhooks: a tenant's endpoints (registered by the operator or
the tenant), every delivery with its attempts and last answer, and sending a failed
delivery again."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from tierq.api.admin.tenants import tenant_or_404
from tierq.api.deps import PartsDep
from tierq.api.errors import APIError, not_found
from tierq.api.schemas import answered
from tierq.api.webhooks.router import (
    create_endpoint,
    delete_endpoint,
    deliveries_page,
    endpoints_page,
)
from tierq.api.webhooks.schemas import (
    WebhookDelivery,
    WebhookDeliveryList,
    WebhookEndpoint,
    WebhookEndpointDeleted,
    WebhookEndpointList,
)
from tierq.models import webhooks as repo
from tierq.services.webhooks import WebhookEndpointCreate

router = APIRouter()


@router.post(
    "/tenants/{tenant_id}/webhook_endpoints",
    response_model=None,
    responses=answered(WebhookEndpoint, 404, 409),
)
async def create(tenant_id: str, body: WebhookEndpointCreate, parts: PartsDep) -> dict[str, Any]:
    """Register an endpoint for the tenant; the answer carries its signing secret, for the
    operator to hand to the tenant (no later answer shows it)."""
    made = await create_endpoint(parts.db, parts.settings, tenant_id, body, "operator")
    return made.to_api(with_secret=True)


@router.get(
    "/tenants/{tenant_id}/webhook_endpoints",
    response_model=None,
    responses=answered(WebhookEndpointList, 404),
)
async def list_endpoints(
    tenant_id: str,
    parts: PartsDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1)] = 20,
) -> dict[str, Any]:
    await tenant_or_404(parts.db, tenant_id)
    return await endpoints_page(parts.db, parts.settings, tenant_id, after, limit, creator=True)


@router.delete(
    "/tenants/{tenant_id}/webhook_endpoints/{endpoint_id}",
    response_model=None,
    responses=answered(WebhookEndpointDeleted, 404),
)
async def delete(tenant_id: str, endpoint_id: str, parts: PartsDep) -> dict[str, Any]:
    await tenant_or_404(parts.db, tenant_id)
    return await delete_endpoint(parts.db, tenant_id, endpoint_id)


@router.get("/webhook_deliveries", response_model=None, responses=answered(WebhookDeliveryList))
async def list_deliveries(
    parts: PartsDep,
    tenant_id: str | None = None,
    endpoint_id: str | None = None,
    status: Annotated[str | None, Query(pattern="^(pending|delivered|failed)$")] = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1)] = 20,
) -> dict[str, Any]:
    """Every tenant's deliveries, newest first, filtered by tenant, endpoint or status."""
    return await deliveries_page(
        parts.db,
        parts.settings,
        tenant_id=tenant_id,
        endpoint_id=endpoint_id,
        status=status,
        after=after,
        limit=limit,
    )


@router.post(
    "/webhook_deliveries/{delivery_id}/redeliver",
    response_model=None,
    responses=answered(WebhookDelivery, 404, 409),
)
async def redeliver(delivery_id: str, parts: PartsDep) -> dict[str, Any]:
    """Send a failed delivery again, its attempts counted anew (the same event id: a
    receiver that did take it deduplicates)."""
    async with parts.db.transaction() as s:
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
