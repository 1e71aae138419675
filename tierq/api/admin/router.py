"""The admin API (`/admin/...`): one router of each resource's, under one guard.

Every route needs the ADMIN_API_KEY (a tenant's key gets 403, none 401). The order of
inclusion is the order of the routes in the OpenAPI document.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends

from tierq.api.admin import billing, keys, metrics, overview, prices, quotas, tenants, webhooks
from tierq.api.deps import require_admin
from tierq.api.errors import documented

# Every route: the door's guard (400), the admin key (401, 403), the database (503).
router = APIRouter(
    prefix="/admin",
    tags=["admin"],
    dependencies=[Depends(require_admin)],
    responses=documented(400, 401, 403, 503),
)
for part in (metrics, overview, tenants, keys, quotas, prices, billing, webhooks):
    router.include_router(part.router)
