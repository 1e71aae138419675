"""The platform at a glance: the one gathering behind the operator console (`/console`,
through `GET /admin/overview`) and `tierq top`.

Every figure is read, none is made up: the database for jobs, tenants, quotas, usage,
batches and failures (tierq/models/overview.py); Redis for the workers' heartbeats and inboxes,
the leading dispatcher's accounting of served tokens (its minimum-share window), and the
latency samples the workers record (tierq.core.queue.push_latency_samples). Redis' clock
judges heartbeats (as the dispatcher does); the database's timestamps are compared with
this host's clock.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

import redis.asyncio as aioredis

from tierq.core import clock
from tierq.core.messages import Heartbeat
from tierq.core.queue import LATENCY_KINDS, latency_samples
from tierq.core.redis_conn import redis_now
from tierq.core.redis_names import RedisNames
from tierq.core.settings import Settings
from tierq.core.states import BatchStatus
from tierq.core.tiers import TIER_ORDER, Tier
from tierq.dispatcher.loop import slo_from_settings
from tierq.models import overview as repo
from tierq.models import webhooks as webhook_repo
from tierq.models.db import Database
from tierq.models.quotas import QuotaRecord, QuotaUsage
from tierq.models.records import unix

TENANTS_SHOWN = 50
BATCHES_SHOWN = 20
BATCHES_FINISHED_WITHIN = timedelta(hours=1)
FAILURES_SHOWN = 20
FAILURES_ADMITTED_WITHIN = timedelta(days=1)
DELIVERIES_SHOWN = 20
DELIVERIES_COUNTED_WITHIN = timedelta(days=1)
PERCENTILES = (50, 95, 99)


def percentiles(values: Sequence[float]) -> dict[str, float | int | None]:
    """p50, p95 and p99 by nearest rank, and how many samples they are of (None: none)."""
    ordered = sorted(values)
    out: dict[str, float | int | None] = {"samples": len(ordered)}
    for p in PERCENTILES:
        if not ordered:
            out[f"p{p}"] = None
            continue
        rank = max(1, math.ceil(p / 100 * len(ordered)))
        out[f"p{p}"] = round(ordered[rank - 1], 4)
    return out


def served_shares(
    state: dict[str, Any] | None, now: float, window_s: float
) -> tuple[dict[str, float], dict[str, float | None]]:
    """Tokens served per tier over the window, and each tier's share of them (None when
    nothing was served), from the leading dispatcher's saved accounting: its window's
    events summed per second, [[second, tier, tokens], ...] (tierq/dispatcher/policy.py)."""
    tokens = dict.fromkeys((t.value for t in TIER_ORDER), 0.0)
    for second, tier, served in (state or {}).get("window", []):
        if float(second) >= now - window_s and tier in tokens:
            tokens[tier] += float(served)  # corrections are negative, as the policy sums them
    tokens = {t: max(0.0, v) for t, v in tokens.items()}
    total = sum(tokens.values())
    shares = {t: (round(v / total, 4) if total > 0 else None) for t, v in tokens.items()}
    return {t: round(v, 1) for t, v in tokens.items()}, shares


def _limits(quota: QuotaRecord, usage: QuotaUsage) -> list[dict[str, Any]]:
    """Each limit the quota sets, with what is used of it and the headroom left (0..1)."""
    pairs: list[tuple[str, int | Decimal | None, int | Decimal]] = [
        ("requests_per_minute", quota.requests_per_minute, usage.requests_last_minute),
        ("tokens_per_minute", quota.tokens_per_minute, usage.tokens_last_minute),
        ("max_running", quota.max_running, usage.running),
        ("max_queued", quota.max_queued, usage.queued),
        ("token_budget", quota.token_budget, usage.tokens_this_period),
        ("spend_budget", quota.spend_budget, usage.spend_this_period),
    ]
    out = []
    for name, limit, used in pairs:
        if limit is None:
            continue
        left = 0.0 if limit <= 0 else max(0.0, 1.0 - float(used) / float(limit))
        money = isinstance(limit, Decimal)
        out.append(
            {
                "limit_name": name,
                "tier": None if quota.tier == "*" else quota.tier,
                "limit": str(limit) if money else limit,
                "used": str(used) if money else used,
                "headroom": round(left, 4),
            }
        )
    return out


def _tenant(row: repo.TenantRow) -> dict[str, Any]:
    limits = [lim for q, u in row.quotas for lim in _limits(q, u)]
    tightest = min(limits, key=lambda lim: lim["headroom"]) if limits else None
    return {
        "id": row.tenant.id,
        "name": row.tenant.name,
        "status": row.tenant.status.value,
        "weight": row.tenant.weight,
        "month_tokens": row.month_tokens,
        "month_cost": str(row.month_cost),
        "queued": row.queued,
        "running": row.running,
        "quota": [{**q.to_api(), "usage": u.to_api()} for q, u in row.quotas],
        "limits": limits,
        "tightest": tightest,  # the limit with the least headroom; None: no limit set
    }


def _batch(row: repo.BatchRow, now: datetime) -> dict[str, Any]:
    b = row.batch
    done = row.completed + row.failed
    total = b.request_total
    rate = eta = None
    started = b.in_progress_at
    if b.status == BatchStatus.IN_PROGRESS and started is not None and done > 0:
        elapsed = (now - started).total_seconds()
        if elapsed > 0:
            rate = done / elapsed
            eta = max(0.0, (total - done) / rate)
    return {
        "id": b.id,
        "tenant_id": b.tenant_id,
        "status": b.status.value,
        "total": total,
        "completed": row.completed,
        "failed": row.failed,
        "progress": round(done / total, 4) if total else None,
        "lines_per_s": None if rate is None else round(rate, 3),
        "eta_s": None if eta is None else round(eta, 1),
        "created_at": unix(b.created_at),
        "in_progress_at": unix(b.in_progress_at),
        "expires_at": unix(b.expires_at),
    }


async def _workers(
    r: aioredis.Redis, names: RedisNames, now: float, dead_after_s: float
) -> list[dict[str, Any]]:
    raw = await r.hgetall(names.workers)
    beats = sorted((Heartbeat.decode(v) for v in raw.values()), key=lambda hb: hb.worker_id)
    async with r.pipeline(transaction=False) as pipe:
        for hb in beats:
            pipe.xlen(names.inbox(hb.worker_id))
        inboxes = await pipe.execute() if beats else []
    out = []
    for hb, inbox in zip(beats, inboxes, strict=True):
        age = max(0.0, now - hb.ts)
        out.append(
            {
                "id": hb.worker_id,
                "capacity": hb.capacity,
                "running": hb.running,
                "inbox": int(inbox),  # the dispatcher's view of its load (running or handed)
                "load": round(int(inbox) / hb.capacity, 4) if hb.capacity else None,
                "reserve": hb.reserve,
                "heartbeat_age_s": round(age, 3),
                "alive": age <= dead_after_s,
                "draining": hb.draining,
                "engine_ok": hb.engine_ok,
            }
        )
    return out


async def gather(
    db: Database, r: aioredis.Redis, names: RedisNames, settings: Settings
) -> dict[str, Any]:
    """The overview as JSON-ready data (the body of `GET /admin/overview`)."""
    now = clock.utcnow()
    redis_time = await redis_now(r)
    async with db.session() as s:
        tiers = await repo.tier_jobs(s)
        tenants, tenant_total = await repo.tenants(s, now, TENANTS_SHOWN)
        batches = await repo.batches(s, now, BATCHES_SHOWN, BATCHES_FINISHED_WITHIN)
        failures, by_code = await repo.failures(s, now, FAILURES_SHOWN, FAILURES_ADMITTED_WITHIN)
        deliveries = await webhook_repo.delivery_counts(s, now - DELIVERIES_COUNTED_WITHIN)
        undelivered = await webhook_repo.undelivered(s, DELIVERIES_SHOWN)
    saved = await r.get(names.dispatch_state)
    served, shares = served_shares(
        json.loads(saved) if saved else None, redis_time, settings.share_window_s
    )
    minimum = {Tier.STANDARD: settings.min_share_standard, Tier.BATCH: settings.min_share_batch}
    slo = slo_from_settings(settings)
    tier_rows = []
    for tier in TIER_ORDER:
        jobs = tiers.get(tier.value, repo.TierJobs(0, 0, None))
        oldest = jobs.oldest_queued_at
        oldest_wait = None if oldest is None else round((now - oldest).total_seconds(), 3)
        samples = {
            kind: percentiles(await latency_samples(r, names, kind, tier.value))
            for kind in LATENCY_KINDS
        }
        tier_rows.append(
            {
                "tier": tier.value,
                "queued": jobs.queued,
                "running": jobs.running,
                "oldest_wait_s": oldest_wait,
                "wait_s": samples["wait"],
                "ttft_s": samples["ttft"],
                "served_tokens": served[tier.value],
                "share": shares[tier.value],
                "min_share": minimum.get(tier),
                "slo_s": slo[tier],
            }
        )
    leader = str(await r.get(names.dispatch_leader) or "")  # "<epoch>:<holder>"
    return {
        "object": "overview",
        "at": round(redis_time, 3),
        "share_window_s": settings.share_window_s,
        "dispatcher_leader": leader.partition(":")[2] or None,
        "tiers": tier_rows,
        "workers": await _workers(r, names, redis_time, settings.worker_dead_after_s),
        "tenants": {"total": tenant_total, "data": [_tenant(t) for t in tenants]},
        "batches": [_batch(b, now) for b in batches],
        "failures": {
            "last_hour_by_code": by_code,
            "latest": [
                {
                    "job_id": f.job_id,
                    "tenant_id": f.tenant_id,
                    "tier": f.tier,
                    "code": f.code,
                    "message": f.message,
                    "finished_at": unix(f.finished_at),
                    "batch_id": f.batch_id,
                }
                for f in failures
            ],
        },
        # Webhook deliveries of the last day by status, and the latest not taken (failed, or
        # being retried).
        "webhooks": {
            "by_status": deliveries,
            "undelivered": [d.to_api() for d in undelivered],
        },
    }
