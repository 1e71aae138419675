"""What the dispatcher must know about tenants — weight within a tier, max_running — kept
in one Redis hash. The admin API writes a tenant's entry whenever it changes; Celery's
reconciler rewrites every entry from the database (so a flushed Redis heals itself)."""

from __future__ import annotations

import json

import redis.asyncio as aioredis

from tierq.core.redis_names import RedisNames
from tierq.core.states import TenantStatus
from tierq.models import quotas as quota_repo
from tierq.models import tenants as tenant_repo
from tierq.models.db import Database


def _entry(weight: float, max_running: dict[str, int]) -> str:
    return json.dumps({"weight": weight, "max_running": max_running}, separators=(",", ":"))


async def publish(db: Database, r: aioredis.Redis, names: RedisNames, tenant_id: str) -> None:
    """Write the tenant's entry, and tell every API process it changed (their key caches
    forget it)."""
    async with db.session() as s:
        tenant = await tenant_repo.get_tenant(s, tenant_id)
        quotas = await quota_repo.quotas_of(s, tenant_id)
    if tenant is None or tenant.status != TenantStatus.ACTIVE:
        await r.hdel(names.tenant_policy, tenant_id)
    else:
        caps = {q.tier: q.max_running for q in quotas if q.max_running is not None}
        await r.hset(names.tenant_policy, tenant_id, _entry(tenant.weight, caps))
    await r.publish(names.access_channel, f"changed:{tenant_id}")


async def sync_all(db: Database, r: aioredis.Redis, names: RedisNames) -> int:
    """Rewrite every active tenant's entry; drop the rest. Returns the entries written."""
    async with db.session() as s:
        weights = await tenant_repo.all_weights(s)
        caps = await quota_repo.all_max_running(s)
    entries = {tid: _entry(w, caps.get(tid, {})) for tid, w in weights.items()}
    async with r.pipeline(transaction=True) as pipe:
        pipe.delete(names.tenant_policy)
        if entries:
            pipe.hset(names.tenant_policy, mapping=entries)  # type: ignore[arg-type]
        await pipe.execute()
    return len(entries)
