"""Enqueueing on real Redis: the entry and every mark that goes with it, in one script, and
the API's Enqueuer, which carries the jobs admitted together in one call."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from benchmarks.ports import free_port
from tierq.core import scripts
from tierq.core.messages import JobMessage
from tierq.core.queue import Enqueuer, _enqueue_part, _enqueue_parts, enqueue
from tierq.core.redis_names import RedisNames
from tierq.core.settings import Settings
from tierq.core.tiers import Tier

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
    assert await r.smembers(names.dispatch_ready) == {stream}  # the dispatcher reads it next

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
    ready = {stream, names.preempted_stream(Tier.STANDARD)}
    assert await r.smembers(names.dispatch_ready) == ready

    # A batch line's trace context is not kept (its followers are the batch's, not a job's).
    await enqueue(r, names, JobMessage("j3", "t1", Tier.BATCH, batch_id="b1", trace=SAMPLED))
    assert await r.exists(names.trace_context("j3")) == 0
    assert await r.smembers(names.tier_tenants(Tier.BATCH)) == {"t1"}
    assert await r.get(names.arrivals) == "2"


async def test_every_script_compiles_on_redis(redis_client: aioredis.Redis) -> None:
    for name in scripts.names():
        sha = await redis_client.script_load(scripts.source(name))
        assert (await redis_client.script_exists(sha)) == [True], name


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


async def test_an_enqueuer_carries_a_burst_in_few_calls_each_job_on_its_own_stream(
    settings: Settings, redis_client: aioredis.Redis
) -> None:
    """Admissions that arrive together share script calls; each gets its own entry, on
    its tenant's stream, with every mark enqueue makes."""
    r, names = redis_client, RedisNames(settings.redis_prefix)
    queue = Enqueuer(r, names)
    tiers = (Tier.INTERACTIVE, Tier.STANDARD, Tier.BATCH)
    jobs = [JobMessage(f"j{i}", f"t{i % 3}", tiers[i % 3], enqueued_at=i) for i in range(60)]
    ids = await asyncio.gather(*(queue.enqueue(m) for m in jobs))
    assert queue.calls <= 2  # sixty jobs, one or two commands
    for tier in tiers:
        tenant = f"t{tiers.index(tier)}"
        entries = await r.xrange(names.tier_stream(tier, tenant))
        mine = [(i, m) for i, m in zip(ids, jobs, strict=True) if m.tier == tier]
        # In the order they were admitted, each waiter told its own entry's id.
        assert [(e, JobMessage.decode(f)) for e, f in entries] == mine
        assert await r.smembers(names.tier_tenants(tier)) == {tenant}
    assert await r.smembers(names.inflight) == {m.job_id for m in jobs}
    assert await r.get(names.arrivals) == "60"
    assert await r.llen(names.dispatch_wake) == 1
    # A lone job later goes at once, in a call of its own.
    await queue.enqueue(JobMessage("late", "t0", Tier.INTERACTIVE))
    assert queue.calls <= 3
    await queue.aclose()


async def test_an_enqueuer_survives_its_connection_killed(
    settings: Settings, redis_client: aioredis.Redis
) -> None:
    r, names = redis_client, RedisNames(settings.redis_prefix)
    # No retries of redis-py's own (the API's pool has none): the Enqueuer's must recover.
    own = aioredis.Redis.from_url(
        settings.resolved_redis_url, decode_responses=True, retry=Retry(NoBackoff(), 0)
    )
    try:
        queue = Enqueuer(own, names)
        await queue.enqueue(JobMessage("j0", "t1", Tier.STANDARD))
        # Its one pooled connection, killed by id (only this test's).
        assert await r.client_kill_filter(_id=await own.client_id()) == 1
        burst = [JobMessage(f"j{i}", "t1", Tier.STANDARD) for i in range(1, 11)]
        await asyncio.gather(*(queue.enqueue(m) for m in burst))
        entries = await r.xrange(names.tier_stream(Tier.STANDARD, "t1"))
        assert [JobMessage.decode(f).job_id for _, f in entries] == [f"j{i}" for i in range(11)]
        assert await r.get(names.arrivals) == "11"
        await queue.aclose()
    finally:
        await own.aclose()


async def test_an_enqueuer_without_redis_fails_each_waiter_and_then_works_again(
    settings: Settings, redis_client: aioredis.Redis
) -> None:
    """Redis unreachable: every waiting admission is told (it then leaves its job to the
    reconciler, or refuses an online request); the Enqueuer itself carries on."""
    names = RedisNames(settings.redis_prefix)
    gone = aioredis.Redis(
        host="127.0.0.1", port=free_port(), socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0)
    )
    try:
        queue = Enqueuer(gone, names)
        results = await asyncio.gather(
            *(queue.enqueue(JobMessage(f"j{i}", "t1", Tier.STANDARD)) for i in range(5)),
            return_exceptions=True,
        )
        assert all(isinstance(x, redis.ConnectionError) for x in results), results
        assert queue._flusher is not None and queue._flusher.done()
        # The same Enqueuer, once Redis answers, enqueues again.
        queue.r = redis_client
        await queue.enqueue(JobMessage("after", "t1", Tier.STANDARD))
        entries = await redis_client.xrange(names.tier_stream(Tier.STANDARD, "t1"))
        assert [JobMessage.decode(f).job_id for _, f in entries] == ["after"]
        await queue.aclose()
    finally:
        await gone.aclose()


async def test_a_waiter_that_goes_away_still_has_its_job_enqueued(
    settings: Settings, redis_client: aioredis.Redis
) -> None:
    """A request cancelled while its job's enqueue is under way (its client hung up after
    the job was committed): the job is enqueued all the same."""
    r, names = redis_client, RedisNames(settings.redis_prefix)
    queue = Enqueuer(r, names)
    waiter = asyncio.create_task(queue.enqueue(JobMessage("j1", "t1", Tier.STANDARD)))
    await asyncio.sleep(0)  # its job is handed to the Enqueuer
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await queue.aclose()  # lets the call under way finish
    entries = await r.xrange(names.tier_stream(Tier.STANDARD, "t1"))
    assert [JobMessage.decode(f).job_id for _, f in entries] == ["j1"]


async def test_a_traced_burst_keeps_each_jobs_trace_context(
    settings: Settings, redis_client: aioredis.Redis
) -> None:
    r, names = redis_client, RedisNames(settings.redis_prefix)
    queue = Enqueuer(r, names)
    traced = [f"00-{i:032x}-00f067aa0ba902b7-01" for i in range(1, 6)]
    jobs = [JobMessage(f"j{i}", "t1", Tier.STANDARD, trace=t) for i, t in enumerate(traced)]
    jobs.insert(2, JobMessage("plain", "t1", Tier.STANDARD, trace=UNSAMPLED))
    await asyncio.gather(*(queue.enqueue(m) for m in jobs))
    assert queue.calls == 1
    for m in jobs:
        kept = await r.get(names.trace_context(m.job_id))
        assert kept == (m.trace if m.job_id != "plain" else None), m.job_id
    await queue.aclose()


async def test_one_jobs_error_fails_that_job_alone(
    settings: Settings, redis_client: aioredis.Redis
) -> None:
    """A job whose stream cannot be written (here a key of the wrong type) is refused on
    its own; the jobs of the same call from other tenants are enqueued and counted."""
    r, names = redis_client, RedisNames(settings.redis_prefix)
    await r.set(names.tier_stream(Tier.STANDARD, "broken"), "not a stream")
    queue = Enqueuer(r, names)
    jobs = [JobMessage(f"j{i}", ("ok", "broken")[i % 2], Tier.STANDARD) for i in range(6)]
    results = await asyncio.gather(*(queue.enqueue(m) for m in jobs), return_exceptions=True)
    assert queue.calls == 1
    for m, result in zip(jobs, results, strict=True):
        if m.tenant_id == "broken":
            assert isinstance(result, redis.ResponseError) and "WRONGTYPE" in str(result)
        else:
            assert isinstance(result, str)
    entries = await r.xrange(names.tier_stream(Tier.STANDARD, "ok"))
    assert [JobMessage.decode(f).job_id for _, f in entries] == ["j0", "j2", "j4"]
    assert await r.get(names.arrivals) == "3"
    # A call none of whose jobs could go fails as a whole (as one job's enqueue does).
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        await queue.enqueue(JobMessage("alone", "broken", Tier.STANDARD))
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        await enqueue(r, names, JobMessage("alone", "broken", Tier.STANDARD))
    await queue.aclose()


async def test_a_repeated_call_counts_its_arrivals_once(
    settings: Settings, redis_client: aioredis.Redis
) -> None:
    """A call sent again after its reply was lost (with_retries) finds its jobs held
    already: their entries may be there twice (the worker keeps one run), but the
    arrivals, the autoscaling signal, are counted once."""
    r, names = redis_client, RedisNames(settings.redis_prefix)
    parts = [
        _enqueue_part(names, JobMessage(f"j{i}", "t1", Tier.STANDARD), False, True)
        for i in range(3)
    ]
    await _enqueue_parts(r, names, parts)
    await _enqueue_parts(r, names, parts)
    assert await r.get(names.arrivals) == "3"
    assert await r.smembers(names.inflight) == {"j0", "j1", "j2"}


async def test_a_stuck_call_fails_its_waiters_at_the_deadline_and_the_stop_is_bounded(
    settings: Settings, redis_client: aioredis.Redis
) -> None:
    """Redis that takes the command and never answers it (writes paused here, as a
    connection gone half-open would hold it): the waiters are told in `deadline_s`, not
    held for ever, and the Enqueuer works again once Redis does. A stop while a call is
    stuck tells its waiters the API is stopping, and refuses enqueues from then on."""
    r, names = redis_client, RedisNames(settings.redis_prefix)
    own = aioredis.Redis.from_url(settings.resolved_redis_url, decode_responses=True)
    try:
        queue = Enqueuer(own, names, deadline_s=0.5)
        await own.ping()
        await r.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")
        try:
            began = time.monotonic()
            results = await asyncio.gather(
                *(queue.enqueue(JobMessage(f"j{i}", "t1", Tier.STANDARD)) for i in range(4)),
                return_exceptions=True,
            )
            assert all(isinstance(x, redis.TimeoutError) for x in results), results
            assert time.monotonic() - began < 3.0
            stopping = Enqueuer(own, names, deadline_s=30)
            waiter = asyncio.create_task(stopping.enqueue(JobMessage("s", "t1", Tier.STANDARD)))
            await asyncio.sleep(0.1)  # its call sent, and stuck (nothing public shows it)
            began = time.monotonic()
            await stopping.aclose(timeout_s=0.2)
            assert time.monotonic() - began < 2.0
            with pytest.raises(redis.ConnectionError, match="stopping"):
                await waiter
            with pytest.raises(redis.ConnectionError, match="stopping"):
                await stopping.enqueue(JobMessage("late", "t1", Tier.STANDARD))
        finally:
            await r.execute_command("CLIENT", "UNPAUSE")
        await queue.enqueue(JobMessage("after", "t1", Tier.STANDARD))
        entries = await r.xrange(names.tier_stream(Tier.STANDARD, "t1"))
        assert "after" in [JobMessage.decode(f).job_id for _, f in entries]
        await queue.aclose()
    finally:
        await own.aclose()
