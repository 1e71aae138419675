"""Tenants and API keys: every SQL statement about them."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from models.records import TenantRecord
from models.tables import ApiKey, Tenant, utcnow

KEY_PREFIX = "tq-"


def new_id(kind: str) -> str:
    return f"{kind}_{secrets.token_hex(12)}"


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class IssuedKey:
    id: str
    tenant_id: str
    key: str  # the secret, shown once
    prefix: str
    created_at: datetime


async def create_tenant(s: AsyncSession, name: str) -> TenantRecord:
    row = Tenant(id=new_id("ten"), name=name, status="active", created_at=utcnow())
    s.add(row)
    await s.flush()
    return TenantRecord.from_row(row)


async def get_tenant_by_name(s: AsyncSession, name: str) -> TenantRecord | None:
    row = (await s.execute(select(Tenant).where(Tenant.name == name))).scalar_one_or_none()
    return None if row is None else TenantRecord.from_row(row)


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


async def tenant_for_key(s: AsyncSession, secret: str) -> TenantRecord | None:
    """The active tenant that owns an unrevoked key, or None."""
    stmt = (
        select(Tenant)
        .join(ApiKey, ApiKey.tenant_id == Tenant.id)
        .where(
            ApiKey.key_hash == hash_key(secret),
            ApiKey.revoked_at.is_(None),
            Tenant.status == "active",
        )
    )
    row = (await s.execute(stmt)).scalar_one_or_none()
    return None if row is None else TenantRecord.from_row(row)


async def set_tiers(
    s: AsyncSession, tenant_id: str, allowed: list[str], default_tier: str
) -> TenantRecord | None:
    """The tiers a tenant may use and the one its requests get when they name none."""
    row = await s.get(Tenant, tenant_id)
    if row is None:
        return None
    row.allowed_tiers = list(allowed)
    row.default_tier = default_tier
    await s.flush()
    return TenantRecord.from_row(row)


async def get_tenant(s: AsyncSession, tenant_id: str) -> TenantRecord | None:
    row = await s.get(Tenant, tenant_id)
    return None if row is None else TenantRecord.from_row(row)
