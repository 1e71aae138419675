"""Enqueueing on real Redis: the entry and every mark that goes with it, in one script."""

from __future__ import annotations

import redis.asyncio as aioredis

from tierq.messages import JobMessage
from tierq.queue import enqueue
from tierq.redis_names import RedisNames
from tierq.settings import Settings
from tierq.tiers import Tier

SAMPLED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
UNSAMPLED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"


async def test_enqueue_writes_the_entry_and_every_mark_with_it(
    settings: Settings, redis_client: aioredis.Redis
) -> None:
    r, names = redis_client, RedisNames(settings.redis_prefix)
    first = JobMessage("j1", "t1", Tier.STANDARD, enqueued_at=1.5, cost=40, trace=SAMPLED)
    entry = await enqueue(r, names, first)
    stream = names.tier_stream(Tier.STANDARD, "t1")
    ((entry_id, fields),) = await r.xrange(stream)
    assert entry_id == entry and JobMessage.decode(fields) == first
    assert await r.smembers(names.tier_tenants(Tier.STANDARD)) == {"t1"}
    assert await r.smembers(names.inflight) == {"j1"}
    assert await r.get(names.arrivals) == "1"
    assert await r.get(names.trace_context("j1")) == SAMPLED
    assert 0 < await r.ttl(names.trace_context("j1")) <= 86_400

    # A preempted job goes back to the head of its tier: no tenant joins the tier's set,
    # it is not an arrival, and the wake-up list keeps one entry however many were pushed.
    back = JobMessage("j2", "t2", Tier.STANDARD, preemptions=1, trace=UNSAMPLED)
    await enqueue(r, names, back, head_of_tier=True, arrival=False)
    ((_, fields),) = await r.xrange(names.preempted_stream(Tier.STANDARD))
    assert JobMessage.decode(fields) == back
    assert await r.smembers(names.tier_tenants(Tier.STANDARD)) == {"t1"}
    assert await r.smembers(names.inflight) == {"j1", "j2"}
    assert await r.get(names.arrivals) == "1"
    assert await r.exists(names.trace_context("j2")) == 0  # not sampled: nothing kept
    assert await r.llen(names.dispatch_wake) == 1

    # A batch line's trace context is not kept (its followers are the batch's, not a job's).
    await enqueue(r, names, JobMessage("j3", "t1", Tier.BATCH, batch_id="b1", trace=SAMPLED))
    assert await r.exists(names.trace_context("j3")) == 0
    assert await r.smembers(names.tier_tenants(Tier.BATCH)) == {"t1"}
    assert await r.get(names.arrivals) == "2"


async def test_enqueue_after_redis_forgot_its_scripts(
    settings: Settings, redis_client: aioredis.Redis
) -> None:
    """A restarted Redis (or SCRIPT FLUSH) has no scripts: enqueue loads its own again."""
    r, names = redis_client, RedisNames(settings.redis_prefix)
    await enqueue(r, names, JobMessage("j1", "t1", Tier.INTERACTIVE))
    await r.script_flush()
    await enqueue(r, names, JobMessage("j2", "t1", Tier.INTERACTIVE))
    entries = await r.xrange(names.tier_stream(Tier.INTERACTIVE, "t1"))
    assert [JobMessage.decode(f).job_id for _, f in entries] == ["j1", "j2"]
    assert await r.smembers(names.inflight) == {"j1", "j2"}
