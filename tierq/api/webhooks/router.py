"""OpenAI's webhook endpoints (`/v1/webhook_endpoints`, what `client.webhooks` calls): a
tenant registers URLs for its batch events, gets each one's signing secret once (at
creation and at a rotation), and reads what was sent to it (`.../deliveries`, tierq's).

The operator registers endpoints for a tenant too (`/admin/tenants/{id}/webhook_endpoints`,
tierq/api/admin/webhooks.py), and may keep that to itself (WEBHOOK_TENANT_ENDPOINTS=false): then a
tenant reads its endpoints and deliveries but changes nothing.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request

from tierq.api.deps import PartsDep, TenantDep, api_key_id
from tierq.api.errors import APIError, documented, not_found
from tierq.api.pages import list_page
from tierq.api.schemas import answered
from tierq.api.webhooks.schemas import (
    WebhookDeliveryList,
    WebhookEndpoint,
    WebhookEndpointDeleted,
    WebhookEndpointList,
    WebhookEventTypes,
    WebhookTestResult,
)
from tierq.core import clock
from tierq.core.ids import new_id
from tierq.core.settings import Settings
from tierq.models import tenants as tenant_repo
from tierq.models import webhooks as repo
from tierq.models.db import Database
from tierq.models.records import unix
from tierq.models.webhooks import EndpointRecord
from tierq.services import webhooks
from tierq.services.admission import refuse_unless_active
from tierq.services.requests import strip_blank
from tierq.services.webhooks import (
    EVENT_TYPES,
    RotateSecret,
    WebhookEndpointCreate,
    WebhookEndpointUpdate,
    WebhookTest,
)

router = APIRouter(prefix="/v1", tags=["webhooks"], responses=documented(400, 401, 503))
KEEP_OLD_SECRET = timedelta(hours=24)


# --- what the operator's routes share ----------------------------------------------------


async def checked_url(url: str, settings: Settings) -> str:
    """The URL, if webhooks may be sent to it; else a 400 saying why."""
    try:
        await webhooks.check_reachable(url, settings)
    except webhooks.UnsafeURL as exc:
        raise APIError(400, str(exc), "invalid_webhook_url", param="url") from None
    return url


async def create_endpoint(
    db: Database,
    settings: Settings,
    tenant_id: str,
    body: WebhookEndpointCreate,
    created_by: str,
    key_id: str | None = None,
) -> EndpointRecord:
    url = await checked_url(body.url, settings)
    async with db.transaction() as s:
        # Under the tenant's lock: the cap is exact, and a suspended tenant adds none.
        status = await tenant_repo.lock_tenant(s, tenant_id, key_id=key_id)
        if status is None:
            raise not_found("tenant", tenant_id)
        refuse_unless_active(status)
        if await repo.count_endpoints(s, tenant_id) >= settings.webhook_max_endpoints:
            raise APIError(
                409,
                f"A tenant may have at most {settings.webhook_max_endpoints} webhook "
                "endpoints; delete one first.",
                "too_many_webhook_endpoints",
            )
        return await repo.create_endpoint(
            s,
            tenant_id,
            strip_blank(body.name),
            url,
            list(body.event_types),
            webhooks.new_secret(),
            created_by,
        )


async def delete_endpoint(db: Database, tenant_id: str, endpoint_id: str) -> dict[str, Any]:
    async with db.transaction() as s:
        if not await repo.delete_endpoint(s, endpoint_id, tenant_id):
            raise not_found("webhook_endpoint", endpoint_id)
    return {"id": endpoint_id, "object": "webhook_endpoint.deleted", "deleted": True}


async def endpoints_page(
    db: Database,
    settings: Settings,
    tenant_id: str,
    after: str | None,
    limit: int,
    *,
    creator: bool = False,
) -> dict[str, Any]:
    """One page of the tenant's endpoints (`creator`: with who registered each, for the
    operator)."""
    async with db.session() as s:
        page, more = await repo.list_endpoints(
            s, tenant_id, after=after, limit=min(limit, settings.list_page_max)
        )
    extra = (lambda e: {"created_by": e.created_by}) if creator else (lambda e: {})
    return list_page([{**e.to_api(), **extra(e)} for e in page], more)


async def deliveries_page(
    db: Database,
    settings: Settings,
    *,
    tenant_id: str | None,
    endpoint_id: str | None,
    status: str | None,
    after: str | None,
    limit: int,
) -> dict[str, Any]:
    async with db.session() as s:
        page, more = await repo.list_deliveries(
            s,
            tenant_id=tenant_id,
            endpoint_id=endpoint_id,
            status=status,
            after=after,
            limit=min(limit, settings.list_page_max),
        )
    return list_page([d.to_api() for d in page], more)


# --- the tenant's routes -----------------------------------------------------------------


def _tenant_may_change(settings: Settings) -> None:
    if not settings.webhook_tenant_endpoints:
        raise APIError(
            403,
            "Webhook endpoints are registered by the operator on this deployment.",
            "webhooks_managed_by_operator",
        )


async def _endpoint(db: Database, tenant_id: str, endpoint_id: str) -> EndpointRecord:
    async with db.session() as s:
        found = await repo.get_endpoint(s, endpoint_id, tenant_id)
    if found is None:
        raise not_found("webhook_endpoint", endpoint_id)
    return found


@router.get("/webhook_event_types", response_model=None, responses=answered(WebhookEventTypes))
async def list_event_types(_: TenantDep) -> dict[str, Any]:
    """The events this deployment sends: OpenAI's batch events."""
    return {"object": "list", "data": list(EVENT_TYPES)}


@router.post(
    "/webhook_endpoints",
    response_model=None,
    responses=answered(WebhookEndpoint, 403, 409),
)
async def create(
    body: WebhookEndpointCreate,
    request: Request,
    tenant: TenantDep,
    parts: PartsDep,
) -> dict[str, Any]:
    """Register a URL for the given batch events; the answer carries its signing secret,
    which no later answer shows again (rotate it to get a new one)."""
    _tenant_may_change(parts.settings)
    made = await create_endpoint(
        parts.db, parts.settings, tenant.id, body, "tenant", api_key_id(request)
    )
    return made.to_api(with_secret=True)


@router.get("/webhook_endpoints", response_model=None, responses=answered(WebhookEndpointList))
async def list_endpoints(
    tenant: TenantDep,
    parts: PartsDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1)] = 20,
) -> dict[str, Any]:
    return await endpoints_page(parts.db, parts.settings, tenant.id, after, limit)


@router.get(
    "/webhook_endpoints/{endpoint_id}",
    response_model=None,
    responses=answered(WebhookEndpoint, 404),
)
async def retrieve(endpoint_id: str, tenant: TenantDep, parts: PartsDep) -> dict[str, Any]:
    return (await _endpoint(parts.db, tenant.id, endpoint_id)).to_api()


@router.post(
    "/webhook_endpoints/{endpoint_id}",
    response_model=None,
    responses=answered(WebhookEndpoint, 403, 404),
)
async def update(
    endpoint_id: str,
    body: WebhookEndpointUpdate,
    tenant: TenantDep,
    parts: PartsDep,
) -> dict[str, Any]:
    """Change the name, URL or event types; what is left out stays."""
    _tenant_may_change(parts.settings)
    url = None if body.url is None else await checked_url(body.url, parts.settings)
    name = None if body.name is None else strip_blank(body.name)
    types = None if body.event_types is None else tuple(body.event_types)
    async with parts.db.transaction() as s:
        changed = await repo.update_endpoint(
            s, endpoint_id, tenant.id, name=name, url=url, event_types=types
        )
    if changed is None:
        raise not_found("webhook_endpoint", endpoint_id)
    return changed.to_api()


@router.delete(
    "/webhook_endpoints/{endpoint_id}",
    response_model=None,
    responses=answered(WebhookEndpointDeleted, 403, 404),
)
async def delete(endpoint_id: str, tenant: TenantDep, parts: PartsDep) -> dict[str, Any]:
    """Stop sending to the endpoint: what it still had to receive fails as such."""
    _tenant_may_change(parts.settings)
    return await delete_endpoint(parts.db, tenant.id, endpoint_id)


@router.post(
    "/webhook_endpoints/{endpoint_id}/rotate_secret",
    response_model=None,
    responses=answered(WebhookEndpoint, 403, 404),
)
async def rotate_secret(
    endpoint_id: str,
    tenant: TenantDep,
    parts: PartsDep,
    body: RotateSecret | None = None,
) -> dict[str, Any]:
    """A new signing secret; the old one signs beside it for 24 hours if asked."""
    _tenant_may_change(parts.settings)
    keep = body is not None and body.keep_old_secret_active_for_24_hours
    async with parts.db.transaction() as s:
        rotated = await repo.rotate_secret(
            s, endpoint_id, tenant.id, webhooks.new_secret(), KEEP_OLD_SECRET if keep else None
        )
    if rotated is None:
        raise not_found("webhook_endpoint", endpoint_id)
    return rotated.to_api(with_secret=True)


@router.post(
    "/webhook_endpoints/{endpoint_id}/test",
    response_model=None,
    responses=answered(WebhookTestResult, 403, 404),
)
async def test(
    endpoint_id: str,
    body: WebhookTest,
    tenant: TenantDep,
    parts: PartsDep,
) -> dict[str, Any]:
    """Send a sample event (about a batch that does not exist) now, once, signed like any;
    the answer is the endpoint's status code. A URL that cannot be reached is a 400 saying
    why. Not recorded as a delivery."""
    _tenant_may_change(parts.settings)
    endpoint = await _endpoint(parts.db, tenant.id, endpoint_id)
    event_id = new_id("evt")
    payload = repo.event_body(
        event_id, body.event_type, new_id("batch"), unix(clock.utcnow()) or 0
    ).encode()
    headers = webhooks.signed_headers(
        event_id, payload, endpoint.signing_secrets(clock.utcnow()), int(clock.now())
    )
    outcome = await webhooks.send(endpoint.url, payload, headers, parts.settings)
    if outcome.status_code is None:
        raise APIError(
            400, f"The endpoint could not be reached: {outcome.error}", "webhook_unreachable"
        )
    return {
        "object": "webhook_endpoint.test",
        "webhook_endpoint_id": endpoint.id,
        "event_type": body.event_type,
        "status_code": outcome.status_code,
        "success": True,
    }


@router.get(
    "/webhook_endpoints/{endpoint_id}/deliveries",
    response_model=None,
    responses=answered(WebhookDeliveryList, 404),
)
async def list_deliveries(
    endpoint_id: str,
    tenant: TenantDep,
    parts: PartsDep,
    status: Annotated[str | None, Query(pattern="^(pending|delivered|failed)$")] = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1)] = 20,
) -> dict[str, Any]:
    """What was sent to the endpoint, newest first: each event's status, attempts and the
    last answer (tierq's; OpenAI has no such route)."""
    await _endpoint(parts.db, tenant.id, endpoint_id)
    return await deliveries_page(
        parts.db,
        parts.settings,
        tenant_id=tenant.id,
        endpoint_id=endpoint_id,
        status=status,
        after=after,
        limit=limit,
    )
