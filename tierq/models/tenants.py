"""Tenants and API keys: every SQL statement about them."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from tierq.core.ids import new_id
from tierq.core.states import TenantStatus
from tierq.core.tiers import TIER_ORDER, Tier
from tierq.models.records import TenantRecord, as_utc, unix
from tierq.models.tables import ApiKey, Tenant, utcnow

KEY_PREFIX = "tq-"
LAST_USED_RESOLUTION = timedelta(seconds=60)  # last_used_at is written at most this often


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class IssuedKey:
    id: str
    tenant_id: str
    key: str  # the secret, shown once
    prefix: str
    created_at: datetime

    def to_api(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "api_key",
            "key": self.key,
            "prefix": self.prefix,
            "created_at": unix(self.created_at),
        }


@dataclass(frozen=True)
class KeyRecord:
    id: str
    tenant_id: str
    prefix: str
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None

    def to_api(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "api_key",
            "prefix": self.prefix,
            "created_at": unix(self.created_at),
            "last_used_at": unix(self.last_used_at),
            "revoked_at": unix(self.revoked_at),
        }


async def create_tenant(
    s: AsyncSession,
    name: str,
    allowed_tiers: list[Tier] | None = None,
    default_tier: Tier = Tier.STANDARD,
    weight: float = 1.0,
) -> TenantRecord:
    row = Tenant(
        id=new_id("ten"),
        name=name,
        status=TenantStatus.ACTIVE,
        allowed_tiers=[t.value for t in (allowed_tiers or list(TIER_ORDER))],
        default_tier=default_tier.value,
        weight=weight,
        created_at=utcnow(),
    )
    s.add(row)
    await s.flush()
    return TenantRecord.from_row(row)


async def get_tenant(s: AsyncSession, tenant_id: str) -> TenantRecord | None:
    """A tenant that exists (deleted ones are gone for every caller)."""
    row = await s.get(Tenant, tenant_id)
    return None if row is None or row.status == TenantStatus.DELETED else TenantRecord.from_row(row)


async def get_tenant_by_name(s: AsyncSession, name: str) -> TenantRecord | None:
    row = (await s.execute(select(Tenant).where(Tenant.name == name))).scalar_one_or_none()
    return None if row is None or row.status == TenantStatus.DELETED else TenantRecord.from_row(row)


async def list_tenants(
    s: AsyncSession, after: str | None = None, limit: int = 100
) -> tuple[list[TenantRecord], bool]:
    stmt = select(Tenant).where(Tenant.status != TenantStatus.DELETED)
    if after is not None:
        stmt = stmt.where(Tenant.id > after)
    rows = list((await s.execute(stmt.order_by(Tenant.id).limit(limit + 1))).scalars())
    return [TenantRecord.from_row(r) for r in rows[:limit]], len(rows) > limit


async def update_tenant(s: AsyncSession, tenant_id: str, **values: Any) -> TenantRecord | None:
    """Set name, allowed_tiers, default_tier, weight or status (already validated)."""
    row = await s.get(Tenant, tenant_id, with_for_update=True)
    if row is None or row.status == TenantStatus.DELETED:
        return None
    for name, value in values.items():
        setattr(row, name, value)
    await s.flush()
    return TenantRecord.from_row(row)


REVOKED = "revoked"  # what lock_tenant answers for a request whose key was revoked


async def lock_tenant(
    s: AsyncSession, tenant_id: str, *, exclusive: bool = True, key_id: str | None = None
) -> str | None:
    """Lock the tenant's row for the rest of the transaction and return its status (None:
    no such tenant), or REVOKED when `key_id` (the request's key) has been revoked.
    Exclusive: admissions of one tenant run one at a time (quota checks); shared: they run
    side by side, but a suspension or a key's revocation (each takes the row's exclusive
    lock) waits for them, and they see it once it committed — so no job is admitted past
    either. The key is read by a statement of its own, after the lock: PostgreSQL gives a
    statement that waited for a lock the new version of the locked row only, not of the
    rows it joins."""
    stmt = select(Tenant.status).where(Tenant.id == tenant_id)
    lock = stmt.with_for_update(read=not exclusive)
    status = (await s.execute(lock)).scalar_one_or_none()
    if status is None or key_id is None:
        return status
    key = select(ApiKey.revoked_at).where(ApiKey.id == key_id, ApiKey.tenant_id == tenant_id)
    found = (await s.execute(key)).one_or_none()
    return REVOKED if found is None or found[0] is not None else str(status)


async def issue_key(s: AsyncSession, tenant_id: str) -> IssuedKey:
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(
        id=new_id("key"),
        tenant_id=tenant_id,
        prefix=secret[:10],
        key_hash=hash_key(secret),
        created_at=utcnow(),
    )
    s.add(row)
    await s.flush()
    return IssuedKey(row.id, tenant_id, secret, row.prefix, row.created_at)


def _key(row: ApiKey) -> KeyRecord:

    return KeyRecord(
        row.id,
        row.tenant_id,
        row.prefix,
        as_utc(row.created_at) or row.created_at,
        as_utc(row.last_used_at),
        as_utc(row.revoked_at),
    )


async def list_keys(s: AsyncSession, tenant_id: str) -> list[KeyRecord]:
    stmt = select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.created_at)
    return [_key(r) for r in (await s.execute(stmt)).scalars()]


async def revoke_key(s: AsyncSession, key_id: str) -> KeyRecord | None:
    row = await s.get(ApiKey, key_id)
    if row is None:
        return None
    if row.revoked_at is None:
        # Waits for the admissions in flight (see lock_tenant); later ones see it.
        await lock_tenant(s, row.tenant_id)
        row.revoked_at = utcnow()
        await s.flush()
    return _key(row)


async def revoke_all_keys(s: AsyncSession, tenant_id: str) -> None:
    await s.execute(
        update(ApiKey)
        .where(ApiKey.tenant_id == tenant_id, ApiKey.revoked_at.is_(None))
        .values(revoked_at=utcnow())
    )


@dataclass(frozen=True)
class KeyOwner:
    tenant: TenantRecord
    key_id: str
    last_used_at: datetime | None


async def owner_of_key(s: AsyncSession, secret: str) -> KeyOwner | None:
    """The active tenant that owns an unrevoked key, with the key's id, or None."""
    stmt = (
        select(Tenant, ApiKey.id, ApiKey.last_used_at)
        .join(ApiKey, ApiKey.tenant_id == Tenant.id)
        .where(
            ApiKey.key_hash == hash_key(secret),
            ApiKey.revoked_at.is_(None),
            Tenant.status == TenantStatus.ACTIVE,
        )
    )
    found = (await s.execute(stmt)).one_or_none()
    if found is None:
        return None

    return KeyOwner(TenantRecord.from_row(found[0]), found[1], as_utc(found[2]))


async def unusable_keys(s: AsyncSession, key_ids: list[str]) -> set[str]:
    """Those of these keys that are revoked, gone, or whose tenant is no longer active."""
    stmt = (
        select(ApiKey.id)
        .join(Tenant, ApiKey.tenant_id == Tenant.id)
        .where(
            ApiKey.id.in_(key_ids),
            ApiKey.revoked_at.is_(None),
            Tenant.status == TenantStatus.ACTIVE,
        )
    )
    usable = set((await s.execute(stmt)).scalars())
    return set(key_ids) - usable


async def tenant_for_key(s: AsyncSession, secret: str) -> TenantRecord | None:
    owner = await owner_of_key(s, secret)
    return None if owner is None else owner.tenant


async def touch_key(s: AsyncSession, key_id: str) -> None:
    """Record a use of the key, at most once per LAST_USED_RESOLUTION."""
    now = utcnow()
    await s.execute(
        update(ApiKey)
        .where(
            ApiKey.id == key_id,
            or_(ApiKey.last_used_at.is_(None), ApiKey.last_used_at < now - LAST_USED_RESOLUTION),
        )
        .values(last_used_at=now)
    )


async def set_tiers(
    s: AsyncSession, tenant_id: str, allowed: list[str], default_tier: str
) -> TenantRecord | None:
    """The tiers a tenant may use and the one its requests get when they name none."""
    return await update_tenant(s, tenant_id, allowed_tiers=list(allowed), default_tier=default_tier)


async def all_weights(s: AsyncSession) -> dict[str, float]:
    stmt = select(Tenant.id, Tenant.weight).where(Tenant.status == TenantStatus.ACTIVE)
    return {tid: float(w) for tid, w in (await s.execute(stmt)).all()}
