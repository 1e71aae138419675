"""The leading dispatcher's SLO gauges: what waits in each tier and for how long, the share
of served tokens each tier got against its minimum, and each live worker's slots.

Refreshed once a second by the loop (`Observer.publish`), from Redis (each shard's length
and its oldest entry, each inbox's length) and the policy's own accounting; nothing here
decides anything. A dispatcher that stands by clears them (`Observer.clear`): only the
leader's count, as with `tierq_desired_workers`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis

from tierq.core import metrics
from tierq.core.messages import Heartbeat, JobMessage
from tierq.core.redis_names import RedisNames
from tierq.core.settings import Settings
from tierq.core.tiers import TIER_ORDER, Tier
from tierq.dispatcher.policy import Policy, TierqPolicy

PUBLISH_EVERY_S = 1.0


def tier_gauges(
    lengths: Mapping[Tier, int], oldest: Mapping[Tier, float | None], now: float
) -> dict[Tier, tuple[int, float]]:
    """Each tier's (depth, age of its oldest waiting job in seconds; 0 when none waits)."""
    out: dict[Tier, tuple[int, float]] = {}
    for tier in TIER_ORDER:
        depth = lengths.get(tier, 0)
        first = oldest.get(tier)
        age = max(0.0, now - first) if depth > 0 and first is not None else 0.0
        out[tier] = (depth, age)
    return out


def policy_shares(policy: Policy, now: float) -> dict[Tier, float] | None:
    """The served-token share per tier the policy defends (None: a baseline keeps none)."""
    if not isinstance(policy, TierqPolicy):
        return None
    policy.window.expire(now)
    return policy.window.shares()


class Observer:
    def __init__(self, settings: Settings, r: aioredis.Redis, names: RedisNames) -> None:
        self.settings = settings
        self.r = r
        self.names = names
        self._at = 0.0
        self._workers: set[str] = set()  # worker label values set last time

    def due(self, now: float) -> bool:
        """True once every PUBLISH_EVERY_S (and it counts as done from now)."""
        if now - self._at < PUBLISH_EVERY_S:
            return False
        self._at = now
        return True

    async def publish(
        self,
        now: float,
        streams: Sequence[str],
        stream_tier: Mapping[str, Tier],
        alive: Sequence[Heartbeat],
        shares: Mapping[Tier, float] | None,
    ) -> None:
        """`streams`: every source stream (shards and head-of-tier streams); `shares`: the
        policy's served-token share per tier over the window (None: it keeps none)."""
        async with self.r.pipeline(transaction=False) as pipe:
            for stream in streams:
                pipe.xlen(stream)
                pipe.xrange(stream, count=1)
            for hb in alive:
                pipe.xlen(self.names.inbox(hb.worker_id))
            got: list[Any] = await pipe.execute()
        lengths: dict[Tier, int] = dict.fromkeys(TIER_ORDER, 0)
        oldest: dict[Tier, float | None] = dict.fromkeys(TIER_ORDER)
        for i, stream in enumerate(streams):
            tier = stream_tier[stream]
            length, head = int(got[2 * i]), got[2 * i + 1]
            lengths[tier] += length
            if length and head and head[0][1]:
                at = JobMessage.decode(head[0][1]).enqueued_at
                first = oldest[tier]
                oldest[tier] = at if first is None else min(first, at)
        for tier, (depth, age) in tier_gauges(lengths, oldest, now).items():
            metrics.QUEUE_DEPTH.labels(tier.value).set(depth)
            metrics.QUEUE_OLDEST_AGE.labels(tier.value).set(age)
        slo = self.settings.tier_slo_s
        minimum = self.settings.tier_min_share
        for tier in TIER_ORDER:
            metrics.TIER_SLO.labels(tier.value).set(slo[tier.value])
            metrics.TIER_MIN_SHARE.labels(tier.value).set(minimum[tier.value])
            if shares is not None:
                metrics.TIER_SERVED_SHARE.labels(tier.value).set(shares.get(tier, 0.0))
        loads = got[2 * len(streams) :]
        workers = set()
        for hb, load in zip(alive, loads, strict=True):
            used = int(load)
            metrics.WORKER_SLOTS.labels(hb.worker_id, "used").set(used)
            metrics.WORKER_SLOTS.labels(hb.worker_id, "free").set(max(0, hb.capacity - used))
            workers.add(hb.worker_id)
        for gone in self._workers - workers:  # dead or gone: its series go with it
            for state in ("used", "free"):
                with contextlib.suppress(KeyError):
                    metrics.WORKER_SLOTS.remove(gone, state)
        self._workers = workers

    def clear(self) -> None:
        """Standing by: the leader's figures are the ones to read."""
        if self._at == 0.0 and not self._workers:
            return
        for gauge in (
            metrics.QUEUE_DEPTH,
            metrics.QUEUE_OLDEST_AGE,
            metrics.TIER_SERVED_SHARE,
            metrics.WORKER_SLOTS,
        ):
            gauge.clear()
        self._workers = set()
        self._at = 0.0
