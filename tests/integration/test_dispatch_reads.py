"""What a dispatcher's read round reads, on real Redis: after a recovery every shard, then
only the shards given entries since (the ready set every enqueue and every requeue
joins) and those whose last read filled their read-ahead — never every tenant that ever
queued work. Nothing enqueued is missed, and a deposed leader takes nothing from the set."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from tierq.core.messages import JobMessage
from tierq.core.queue import Enqueuer, enqueue
from tierq.core.redis_names import DISPATCH_GROUP, RedisNames
from tierq.core.settings import Settings
from tierq.core.tiers import Tier
from tierq.dispatcher.leadership import LeaseLost
from tierq.dispatcher.loop import Dispatcher

pytestmark = pytest.mark.integration

TENANTS = 300


class Spied:
    """The streams each of a dispatcher's XREADGROUP calls asked for."""

    def __init__(self, d: Dispatcher) -> None:
        self.calls: list[set[str]] = []
        real = d.leadership.read_group

        async def read_group(group: str, consumer: str, streams: dict[str, str], count: int) -> Any:
            self.calls.append(set(streams))
            return await real(group, consumer, streams, count)

        d.leadership.read_group = read_group  # type: ignore[method-assign]

    def last(self) -> set[str]:
        return self.calls[-1] if self.calls else set()


@pytest.fixture
async def leading(settings: Settings, redis_client: aioredis.Redis) -> AsyncIterator[Dispatcher]:
    d = Dispatcher(settings, redis_client)
    assert await d.leadership.acquire()
    yield d
    await d.leadership.release()


def buffered(d: Dispatcher) -> set[str]:
    return {
        b.msg.job_id for shards in d.buffers.values() for e in shards.values() for b in e.values()
    }


async def test_a_round_reads_the_shards_given_entries_not_every_tenant(
    leading: Dispatcher, redis_client: aioredis.Redis
) -> None:
    d, r, names = leading, redis_client, leading.names
    queue = Enqueuer(r, names)
    for n in range(TENANTS):
        await queue.enqueue(JobMessage(f"j{n}", f"t{n}", Tier.BATCH, cost=10))
    await queue.aclose()
    await d._recover()  # a new leader: every shard, from its pending entries
    spy = Spied(d)
    await d._read()  # their pending entries (none: nobody read them before)
    await d._read()  # then their new ones
    # every shard and the head-of-tier streams, both times
    assert [len(streams) for streams in spy.calls] == [TENANTS + 3] * 2
    assert buffered(d) == {f"j{n}" for n in range(TENANTS)}

    # Every shard was read to its end: a round with nothing new reads nothing.
    calls = len(spy.calls)
    await d._read()
    assert len(spy.calls) == calls
    assert await r.scard(names.dispatch_ready) == 0

    # One tenant's new job, and a tenant never seen before: those two shards alone.
    await enqueue(r, names, JobMessage("late", "t7", Tier.BATCH))
    await enqueue(r, names, JobMessage("new", "newcomer", Tier.STANDARD))
    await d._read()
    assert spy.last() == {
        names.tier_stream(Tier.BATCH, "t7"),
        names.tier_stream(Tier.STANDARD, "newcomer"),
    }
    assert {"late", "new"} <= buffered(d)
    # the newcomer's shard has its consumer group now, and its entry is pending there
    pending = await r.xpending(names.tier_stream(Tier.STANDARD, "newcomer"), DISPATCH_GROUP)
    assert pending["pending"] == 1


async def test_a_shard_whose_read_filled_its_read_ahead_is_read_again_once_it_drains(
    leading: Dispatcher, redis_client: aioredis.Redis
) -> None:
    """More entries than a read-ahead: the rest are read once half of it went out, with no
    new enqueue to mark the shard."""
    d, r, names = leading, redis_client, leading.names
    ahead = d.settings.dispatch_read_ahead
    queue = Enqueuer(r, names)
    for n in range(3 * ahead):
        await queue.enqueue(JobMessage(f"j{n}", "big", Tier.BATCH))
    await queue.aclose()
    await d._recover()
    spy = Spied(d)
    await d._read()
    await d._read()
    stream = names.tier_stream(Tier.BATCH, "big")
    assert len(buffered(d)) == ahead
    calls = len(spy.calls)
    await d._read()  # its read-ahead is full: not read (nor is anything else)
    assert len(spy.calls) == calls
    # half of it handed out (acknowledged and deleted, as a hand-off does)
    shard = d.buffers[Tier.BATCH]["big"]
    for _stream, entry_id in list(shard)[: ahead // 2 + 1]:
        d._drop(shard[(stream, entry_id)].job)
        await r.xack(stream, DISPATCH_GROUP, entry_id)
        await r.xdel(stream, entry_id)
    await d._read()
    assert spy.last() == {stream}
    assert len(buffered(d)) == ahead - (ahead // 2 + 1) + ahead


async def test_a_dead_workers_jobs_put_back_are_read_again(
    leading: Dispatcher, redis_client: aioredis.Redis
) -> None:
    """A requeued inbox entry joins the ready set with its shard, so the next round reads it."""
    d, r, names = leading, redis_client, leading.names
    await d._recover()
    await d._read()
    inbox = names.inbox("gone")
    await r.xgroup_create(inbox, "worker", id="0", mkstream=True)
    msg = JobMessage("back", "t1", Tier.STANDARD)
    entry_id = await r.xadd(inbox, msg.encode())  # type: ignore[arg-type]
    await d._requeue(inbox, entry_id, msg.encode())
    stream = names.tier_stream(Tier.STANDARD, "t1")
    assert await r.smembers(names.dispatch_ready) == {stream}
    await d._read()
    assert "back" in buffered(d)


async def test_a_deposed_leader_takes_nothing_from_the_ready_set(
    settings: Settings, leading: Dispatcher, redis_client: aioredis.Redis
) -> None:
    r, names = redis_client, RedisNames(settings.redis_prefix)
    await enqueue(r, names, JobMessage("j1", "t1", Tier.INTERACTIVE))
    await r.set(names.dispatch_leader, "999:someone-else")  # the lease was taken over
    with pytest.raises(LeaseLost):
        await leading.leadership.take_ready(100)
    # what arrived stays for the leader
    assert await r.smembers(names.dispatch_ready) == {names.tier_stream(Tier.INTERACTIVE, "t1")}


async def test_an_entry_added_without_the_ready_set_is_found_by_the_sweep(
    leading: Dispatcher, redis_client: aioredis.Redis
) -> None:
    """An API or worker of an older version adds entries without marking their shard: the
    leader's slow sweep over every shard finds the entry past its group's last delivered
    one, and the next round reads it."""
    d, r, names = leading, redis_client, leading.names
    queue = Enqueuer(r, names)
    for n in range(TENANTS):
        await queue.enqueue(JobMessage(f"j{n}", f"t{n}", Tier.STANDARD))
    await queue.aclose()
    await d._recover()
    await d._read()
    await d._read()
    stream = names.tier_stream(Tier.STANDARD, "t42")
    await r.xadd(stream, JobMessage("unmarked", "t42", Tier.STANDARD).encode())  # type: ignore[arg-type]
    await d._read()
    assert "unmarked" not in buffered(d)  # no ready mark: the round does not know of it
    for _ in range(20):  # every tier's shards, SWEEP_BATCH at a time
        d._swept_at = 0.0
        await d._sweep()
        if stream in d._unread:
            break
    # that shard alone: the others, read to their end, are not made to be read again
    assert d._unread == {stream}
    await d._read()
    assert "unmarked" in buffered(d)
