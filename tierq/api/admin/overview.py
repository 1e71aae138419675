"""`/admin/overview`: the platform at a glance (tierq/services/overview.py), what the operator
console polls and `tierq top` shows; and `/admin/batches/{id}/cancel`, the console's way
to stop any tenant's batch (the tenant's own route cancels the same way)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from tierq.api.admin.schemas import Overview
from tierq.api.deps import PartsDep
from tierq.api.openai.protocol import Batch
from tierq.api.schemas import answered
from tierq.services import cancellation, overview

router = APIRouter()


@router.get("/overview", response_model=None, responses=answered(Overview))
async def get_overview(parts: PartsDep) -> dict[str, Any]:
    """Tiers (depth, wait and TTFT percentiles, served share against the minimum), workers
    (slots, load, heartbeat age), tenants (usage this month, quota headroom, status),
    batches (progress, estimated completion) and recent failures with their codes."""
    return await overview.gather(parts.db, parts.redis, parts.names, parts.settings)


@router.post(
    "/batches/{batch_id}/cancel",
    response_model=None,
    responses=answered(Batch, 404, 409),
)
async def cancel_batch(batch_id: str, parts: PartsDep) -> dict[str, Any]:
    """Cancel any tenant's batch, as its tenant could (`POST /v1/batches/{id}/cancel`)."""
    return await cancellation.cancel_batch(
        parts.db, parts.redis, parts.names, parts.settings, batch_id, None
    )
