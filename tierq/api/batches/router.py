"""OpenAI's Batches API. The work itself is Celery's (tierq/workers/batches.py); these routes
create, show, list and cancel batches, and ask Celery to advance one when it changed."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request

from tierq.api.deps import PartsDep, TenantDep, api_key_id
from tierq.api.errors import APIError, documented, not_found
from tierq.api.openai.protocol import Batch, BatchList
from tierq.api.pages import list_page
from tierq.api.schemas import answered
from tierq.core import clock, metrics, tracing
from tierq.core.states import BatchStatus
from tierq.core.tiers import Tier
from tierq.models import batches as batch_repo
from tierq.models import files as file_repo
from tierq.models import tenants as tenant_repo
from tierq.services import batch_signal, cancellation
from tierq.services.admission import refuse_unless_active
from tierq.services.openai_compat import BatchCreate

router = APIRouter(prefix="/v1/batches", tags=["batches"], responses=documented(400, 401, 503))


@router.post("", response_model=None, responses=answered(Batch, 403, 404, 413, 429))
async def create_batch(
    body: BatchCreate,
    request: Request,
    tenant: TenantDep,
    parts: PartsDep,
) -> dict[str, Any]:
    if Tier.BATCH not in tenant.allowed_tiers:
        raise APIError(403, "This tenant may not use the batch tier.", "tier_not_allowed")
    async with parts.db.transaction() as s:
        # Serialised with the tenant's other admissions: the cap below is exact, and a
        # suspension or revocation that committed meanwhile refuses the batch.
        status = await tenant_repo.lock_tenant(s, tenant.id, key_id=api_key_id(request))
        refuse_unless_active(status)
        unfinished = await batch_repo.count_unfinished(s, tenant.id)
        if unfinished >= parts.settings.max_batches_per_tenant:
            raise APIError(
                429,
                f"Too many batches in progress: at most "
                f"{parts.settings.max_batches_per_tenant} may be unfinished at once. Retry when "
                "one has finished.",
                "too_many_batches",
                retry_after_s=30,
            )
        source = await file_repo.get_file(s, body.input_file_id, tenant.id)
        if source is None:
            raise APIError(
                404,
                f"No file found with id '{body.input_file_id}'.",
                "file_not_found",
                param="input_file_id",
            )
        if source.purpose != "batch":
            raise APIError(
                400,
                f"The input file's purpose is '{source.purpose}'; a batch reads 'batch' files.",
                "invalid_input_file",
                param="input_file_id",
            )
        batch = await batch_repo.create_batch(
            s,
            tenant.id,
            body.endpoint,
            body.input_file_id,
            body.completion_window,
            body.metadata,
            clock.utcnow() + timedelta(seconds=parts.settings.batch_window_s),
        )
    metrics.BATCHES.labels(status=BatchStatus.VALIDATING).inc()
    # The batch's trace (this request's), which its lines' traces link to.
    await tracing.remember(
        parts.redis, parts.names.trace_context(batch.id), 2 * parts.settings.batch_window_s
    )
    await batch_signal.poke(parts.settings, parts.redis, parts.names, batch.id)
    return batch.to_api()


@router.get("", response_model=None, responses=answered(BatchList))
async def list_batches(
    tenant: TenantDep,
    parts: PartsDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1)] = 20,
) -> dict[str, Any]:
    limit = min(limit, parts.settings.list_page_max)
    async with parts.db.session() as s:
        page, has_more = await batch_repo.list_batches(s, tenant.id, after=after, limit=limit)
        data = [b.to_api(await batch_repo.live_counts(s, b)) for b in page]
    return list_page(data, has_more)


@router.get("/{batch_id}", response_model=None, responses=answered(Batch, 404))
async def get_batch(batch_id: str, tenant: TenantDep, parts: PartsDep) -> dict[str, Any]:
    async with parts.db.session() as s:
        batch = await batch_repo.get_batch(s, batch_id, tenant.id)
        if batch is None:
            raise not_found("batch", batch_id)
        return batch.to_api(await batch_repo.live_counts(s, batch))


@router.post(
    "/{batch_id}/cancel",
    response_model=None,
    responses=answered(Batch, 404, 409),
)
async def cancel_batch(
    batch_id: str,
    tenant: TenantDep,
    parts: PartsDep,
) -> dict[str, Any]:
    return await cancellation.cancel_batch(
        parts.db, parts.redis, parts.names, parts.settings, batch_id, tenant.id
    )
