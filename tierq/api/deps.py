"""Typed dependencies: route functions take these and nothing else — the app's parts
(`PartsDep`), the tenant a key names (`TenantDep`), a database session (`SessionDep`).

Every dependency is a coroutine function, even where it only reads app.state: FastAPI
runs a plain function in a worker thread, a hop that costs the hot path more than the
lookup itself."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated

import redis.asyncio as aioredis
from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncSession

from tierq.api.auth import KeyCache, LookupsOverloaded, well_formed
from tierq.api.errors import APIError
from tierq.api.gate import TenantGate
from tierq.api.streams import Streams
from tierq.api.streams.slots import Slot, StreamSlots, TooManyStreams
from tierq.core.queue import Enqueuer, EventLog
from tierq.core.redis_names import RedisNames
from tierq.core.settings import Settings
from tierq.models import tenants
from tierq.models.db import Database
from tierq.models.records import TenantRecord
from tierq.models.store import SqlJobStore
from tierq.models.tables import utcnow
from tierq.models.tenants import KeyOwner


@dataclass(frozen=True, slots=True)
class AppParts:
    """The app's parts, made once at startup (tierq/api/app.py). Routes reach them through one
    dependency, `PartsDep`: FastAPI's resolution of a dependency costs more than reading
    app.state does, so a route pays for one."""

    settings: Settings
    db: Database
    jobs: SqlJobStore
    redis: aioredis.Redis
    names: RedisNames
    events: EventLog
    streams: Streams
    gate: TenantGate
    enqueuer: Enqueuer


async def get_parts(request: Request) -> AppParts:
    parts: AppParts = request.app.state.parts
    return parts


PartsDep = Annotated[AppParts, Depends(get_parts)]


async def get_session(parts: PartsDep) -> AsyncIterator[AsyncSession]:
    async with parts.db.session() as s:
        yield s


SessionDep = Annotated[AsyncSession, Depends(get_session)]


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError(
            401,
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
            "missing_api_key",
        )
    return token.strip()


async def get_tenant(request: Request) -> TenantRecord:
    """The tenant whose active key the request carries; 401 for a missing or wrong key.

    Remembered for AUTH_CACHE_TTL_S by this process (tierq/api/auth.py); a revoked key or a
    suspended tenant is forgotten at once by every API process (the access channel).
    """
    secret = _bearer(request)
    if not well_formed(secret):  # no key looks like this: no lookup
        raise APIError(401, "Incorrect API key provided.", "invalid_api_key")
    cache: KeyCache = request.app.state.key_cache
    db: Database = request.app.state.db  # not a dependency: every request authenticates
    key_hash = tenants.hash_key(secret)

    async def load() -> KeyOwner | None:
        async with db.session() as s:
            return await tenants.owner_of_key(s, secret)

    try:
        owner = await cache.lookup(key_hash, load)
    except LookupsOverloaded:
        raise APIError(
            503,
            "Too many requests with unknown API keys are being checked; retry shortly.",
            "auth_overloaded",
            retry_after_s=1,
        ) from None
    if owner is None:
        raise APIError(401, "Incorrect API key provided.", "invalid_api_key")
    if cache.claim_touch(key_hash, owner, utcnow(), tenants.LAST_USED_RESOLUTION):
        async with db.transaction() as s:
            await tenants.touch_key(s, owner.key_id)
    request.state.api_key_id = owner.key_id  # open streams close when it is revoked
    return owner.tenant


TenantDep = Annotated[TenantRecord, Depends(get_tenant)]


def api_key_id(request: Request) -> str | None:
    """The id of the key the request was authenticated with (set by get_tenant)."""
    key_id: str | None = getattr(request.state, "api_key_id", None)
    return key_id


async def stream_slot(slots: StreamSlots, tenant: TenantRecord) -> Slot:
    """One of the tenant's stream slots (an SSE stream or a waiting online request);
    429 too_many_streams at `max_streams_per_tenant`."""
    try:
        return await slots.take(tenant.id)
    except TooManyStreams as exc:
        raise _too_many_streams(slots, exc) from None


def refuse_at_stream_cap(slots: StreamSlots, tenant: TenantRecord) -> None:
    """429 too_many_streams, before any other work, when this process alone holds all of
    the tenant's stream slots (`stream_slot` asks Redis for the rest)."""
    try:
        slots.refuse_if_full_here(tenant.id)
    except TooManyStreams as exc:
        raise _too_many_streams(slots, exc) from None


def _too_many_streams(slots: StreamSlots, exc: TooManyStreams) -> APIError:
    return APIError(
        429,
        f"Too many open streams: this tenant may hold {exc.limit} streams and waiting "
        "requests at once. Close one, or retry later.",
        "too_many_streams",
        retry_after_s=slots.retry_after_s(),
    )


async def require_admin(request: Request, parts: PartsDep) -> None:
    """ADMIN_API_KEY, compared in constant time: a tenant's key gets 403, none 401."""
    secret = _bearer(request)
    configured = parts.settings.admin_api_key
    if configured and hmac.compare_digest(secret.encode(), configured.encode()):
        return
    owner = None
    if well_formed(secret):  # a tenant's key, perhaps: say so (403), not merely 401
        async with parts.db.session() as s:
            owner = await tenants.owner_of_key(s, secret)
    if owner is not None:
        raise APIError(
            403,
            "This is a tenant's API key; the admin API takes the ADMIN_API_KEY.",
            "permission_denied",
        )
    if not configured:
        raise APIError(
            401, "The admin API is closed: ADMIN_API_KEY is not set.", "admin_api_disabled"
        )
    raise APIError(401, "Incorrect admin API key provided.", "invalid_api_key")
