"""`/admin/overview`: the platform at a glance (services/overview.py), what the operator
console polls and `tierq top` shows; and `/admin/batches/{id}/cancel`, the console's way
to stop any tenant's batch (the tenant's own route cancels the same way)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from api.deps import DbDep, NamesDep, RedisDep, SettingsDep
from api.errors import documented
from services import cancellation, overview

router = APIRouter()


@router.get("/overview")
async def get_overview(
    db: DbDep, r: RedisDep, names: NamesDep, settings: SettingsDep
) -> dict[str, Any]:
    """Tiers (depth, wait and TTFT percentiles, served share against the minimum), workers
    (slots, load, heartbeat age), tenants (usage this month, quota headroom, status),
    batches (progress, estimated completion) and recent failures with their codes."""
    return await overview.gather(db, r, names, settings)


@router.post("/batches/{batch_id}/cancel", responses=documented(404, 409))
async def cancel_batch(
    batch_id: str, db: DbDep, r: RedisDep, names: NamesDep, settings: SettingsDep
) -> dict[str, Any]:
    """Cancel any tenant's batch, as its tenant could (`POST /v1/batches/{id}/cancel`)."""
    return await cancellation.cancel_batch(db, r, names, settings, batch_id, None)
