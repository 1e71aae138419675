"""OpenAI's Batches API. The work itself is Celery's (workers/batches.py); these routes
create, show, list and cancel batches, and ask Celery to advance one when it changed."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request

from api.deps import (
    DbDep,
    NamesDep,
    RedisDep,
    SettingsDep,
    TenantDep,
    api_key_id,
)
from api.errors import APIError, documented, not_found
from api.pages import list_page
from models import batches as batch_repo
from models import files as file_repo
from models import tenants as tenant_repo
from services import batch_signal, cancellation
from services.admission import refuse_unless_active
from services.openai_compat import BatchCreate
from tierq import clock, metrics, tracing
from tierq.states import BatchStatus
from tierq.tiers import Tier

router = APIRouter(prefix="/v1/batches", tags=["batches"], responses=documented(400, 401, 503))


@router.post("", responses=documented(403, 404, 413, 429))
async def create_batch(
    body: BatchCreate,
    request: Request,
    tenant: TenantDep,
    db: DbDep,
    r: RedisDep,
    names: NamesDep,
    settings: SettingsDep,
) -> dict[str, Any]:
    if Tier.BATCH not in tenant.allowed_tiers:
        raise APIError(403, "This tenant may not use the batch tier.", "tier_not_allowed")
    async with db.transaction() as s:
        # Serialised with the tenant's other admissions: the cap below is exact, and a
        # suspension or revocation that committed meanwhile refuses the batch.
        status = await tenant_repo.lock_tenant(s, tenant.id, key_id=api_key_id(request))
        refuse_unless_active(status)
        unfinished = await batch_repo.count_unfinished(s, tenant.id)
        if unfinished >= settings.max_batches_per_tenant:
            raise APIError(
                429,
                f"Too many batches in progress: at most {settings.max_batches_per_tenant} may "
                "be unfinished at once. Retry when one has finished.",
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
            clock.utcnow() + timedelta(seconds=settings.batch_window_s),
        )
    metrics.BATCHES.labels(status=BatchStatus.VALIDATING).inc()
    # The batch's trace (this request's), which its lines' traces link to.
    await tracing.remember(r, names.trace_context(batch.id), 2 * settings.batch_window_s)
    await batch_signal.poke(settings, r, names, batch.id)
    return batch.to_api()


@router.get("")
async def list_batches(
    tenant: TenantDep,
    db: DbDep,
    settings: SettingsDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1)] = 20,
) -> dict[str, Any]:
    limit = min(limit, settings.list_page_max)
    async with db.session() as s:
        page, has_more = await batch_repo.list_batches(s, tenant.id, after=after, limit=limit)
        data = [b.to_api(await batch_repo.live_counts(s, b)) for b in page]
    return list_page(data, has_more)


@router.get("/{batch_id}", responses=documented(404))
async def get_batch(batch_id: str, tenant: TenantDep, db: DbDep) -> dict[str, Any]:
    async with db.session() as s:
        batch = await batch_repo.get_batch(s, batch_id, tenant.id)
        if batch is None:
            raise not_found("batch", batch_id)
        return batch.to_api(await batch_repo.live_counts(s, batch))


@router.post("/{batch_id}/cancel", responses=documented(404, 409))
async def cancel_batch(
    batch_id: str,
    tenant: TenantDep,
    db: DbDep,
    r: RedisDep,
    names: NamesDep,
    settings: SettingsDep,
) -> dict[str, Any]:
    return await cancellation.cancel_batch(db, r, names, settings, batch_id, tenant.id)
