"""A tenant's API keys: issue, list, revoke (`/admin/tenants/{id}/keys`, `/admin/keys/{id}`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from tierq.api.admin.schemas import ApiKey, ApiKeyList
from tierq.api.admin.tenants import announce, tenant_or_404
from tierq.api.deps import PartsDep
from tierq.api.errors import not_found
from tierq.api.pages import list_page
from tierq.api.schemas import answered
from tierq.models import tenants as tenant_repo

router = APIRouter()


@router.post(
    "/tenants/{tenant_id}/keys",
    response_model=None,
    responses=answered(ApiKey, 404),
)
async def create_key(tenant_id: str, parts: PartsDep) -> dict[str, Any]:
    """The secret is in this answer only; the database keeps its hash."""
    await tenant_or_404(parts.db, tenant_id)
    async with parts.db.transaction() as s:
        issued = await tenant_repo.issue_key(s, tenant_id)
    return issued.to_api()


@router.get(
    "/tenants/{tenant_id}/keys",
    response_model=None,
    responses=answered(ApiKeyList, 404),
)
async def list_keys(tenant_id: str, parts: PartsDep) -> dict[str, Any]:
    await tenant_or_404(parts.db, tenant_id)
    async with parts.db.session() as s:
        keys = await tenant_repo.list_keys(s, tenant_id)
    return list_page([k.to_api() for k in keys], False)


@router.delete("/keys/{key_id}", response_model=None, responses=answered(ApiKey, 404))
async def revoke_key(key_id: str, parts: PartsDep) -> dict[str, Any]:
    """Effective at once: every request looks its key up in the database (no cache),
    admission looks again under the tenant's lock, and the key's open streams close."""
    async with parts.db.transaction() as s:
        key = await tenant_repo.revoke_key(s, key_id)
    if key is None:
        raise not_found("key", key_id)
    await announce(parts.redis, parts.names, f"key:{key_id}")
    return {**key.to_api(), "revoked": True}
