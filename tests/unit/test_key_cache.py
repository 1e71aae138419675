"""The API's key cache (tierq/api/auth.py): requests that miss it for one key at once share one
lookup; a revocation during a lookup is not undone by it; a failed lookup is not kept; a key that
owns nothing is remembered as such; lookups run a few at once; and a burst records the
key's use once."""

from __future__ import annotations

import asyncio
import secrets
from datetime import UTC, datetime, timedelta

import pytest

from tierq.api.auth import KeyCache, LookupsOverloaded, well_formed
from tierq.core.states import TenantStatus
from tierq.models.records import TenantRecord
from tierq.models.tenants import KEY_PREFIX, KeyOwner

NOW = datetime(2026, 12, 1, tzinfo=UTC)
OWNER = KeyOwner(TenantRecord("ten_1", "t", TenantStatus.ACTIVE, NOW), "key_1", None)


class Loads:
    """A lookup that counts its calls and waits until released."""

    def __init__(self, result: KeyOwner | None = OWNER, error: Exception | None = None) -> None:
        self.calls = 0
        self.called = asyncio.Event()
        self.release = asyncio.Event()
        self.result = result
        self.error = error

    async def __call__(self) -> KeyOwner | None:
        self.calls += 1
        self.called.set()
        await self.release.wait()
        if self.error is not None:
            raise self.error
        return self.result


async def under_way(*loads: Loads) -> None:
    """Until each of `loads` has been called: its lookup is under way (and every waiter
    started before it has had its turn)."""
    await asyncio.wait_for(asyncio.gather(*(load.called.wait() for load in loads)), 1)


async def test_a_cold_burst_shares_one_lookup_and_then_hits_the_cache() -> None:
    cache, load = KeyCache(ttl_s=60), Loads()
    waiters = [asyncio.create_task(cache.lookup("h", load)) for _ in range(20)]
    await under_way(load)
    load.release.set()
    assert await asyncio.gather(*waiters) == [OWNER] * 20
    assert load.calls == 1
    assert await cache.lookup("h", load) == OWNER and load.calls == 1  # cached


async def test_a_waiter_that_goes_away_does_not_end_the_lookup_for_the_others() -> None:
    cache, load = KeyCache(ttl_s=60), Loads()
    first = asyncio.create_task(cache.lookup("h", load))
    second = asyncio.create_task(cache.lookup("h", load))
    await under_way(load)
    first.cancel()
    load.release.set()
    assert await second == OWNER
    assert load.calls == 1


async def test_a_revocation_during_the_lookup_is_not_undone_by_it() -> None:
    cache, load = KeyCache(ttl_s=60), Loads()
    waiter = asyncio.create_task(cache.lookup("h", load))
    await under_way(load)
    cache.forget("key:key_1")  # revoked while the lookup ran
    load.release.set()
    assert await waiter == OWNER  # it read before the revocation
    assert cache.get("h") is None  # but what it read is not kept: the next request looks again


async def test_a_failed_lookup_fails_its_waiters_and_is_not_kept() -> None:
    cache, load = KeyCache(ttl_s=60), Loads(error=ConnectionError("database down"))
    waiters = [asyncio.create_task(cache.lookup("h", load)) for _ in range(3)]
    await under_way(load)
    load.release.set()
    for outcome in await asyncio.gather(*waiters, return_exceptions=True):
        assert isinstance(outcome, ConnectionError)
    again = Loads()
    again.release.set()
    assert await cache.lookup("h", again) == OWNER and again.calls == 1


async def test_an_unknown_key_is_remembered_as_such_until_access_changes() -> None:
    """A wrong key retried costs one lookup for the TTL; any access change (a tenant let
    back in, say) forgets it, as the key may own something now."""
    cache, load = KeyCache(ttl_s=60), Loads(result=None)
    load.release.set()
    assert await cache.lookup("h", load) is None
    assert await cache.lookup("h", load) is None and load.calls == 1
    cache.forget("changed:ten_1")
    load.result = OWNER
    assert await cache.lookup("h", load) == OWNER and load.calls == 2


async def test_an_unknown_key_is_not_remembered_without_a_ttl() -> None:
    cache, load = KeyCache(ttl_s=0), Loads(result=None)
    load.release.set()
    assert await cache.lookup("h", load) is None
    assert await cache.lookup("h", load) is None and load.calls == 2


async def test_lookups_run_a_few_at_once_and_a_full_queue_refuses_at_once() -> None:
    cache = KeyCache(ttl_s=60, lookup_concurrency=2, lookup_queue=3)
    loads = [Loads(result=None) for _ in range(5)]
    waiters = [asyncio.create_task(cache.lookup(f"h{i}", load)) for i, load in enumerate(loads)]
    await under_way(*loads[:2])
    assert [load.calls for load in loads] == [1, 1, 0, 0, 0]  # two run, three wait
    with pytest.raises(LookupsOverloaded):
        await cache.lookup("h-more", Loads())
    loads[0].release.set()  # one ends: a waiting one runs, and the queue has room again
    await under_way(loads[2])
    assert [load.calls for load in loads] == [1, 1, 1, 0, 0]
    more = Loads(result=None)
    more.release.set()
    extra = asyncio.create_task(cache.lookup("h-extra", more))
    for load in loads:
        load.release.set()
    assert await asyncio.gather(*waiters[:4], extra) == [None] * 5


def test_only_what_could_be_a_key_is_well_formed() -> None:
    assert well_formed(KEY_PREFIX + secrets.token_urlsafe(32))
    for junk in (
        "",
        "tq-",
        "tq-abc",
        KEY_PREFIX + "a" * 42,
        KEY_PREFIX + "a" * 44,
        "sk-" + "a" * 43,
    ):
        assert not well_formed(junk), junk
    assert not well_formed(KEY_PREFIX + "a" * 42 + "/")


def test_a_burst_records_the_keys_use_once() -> None:
    cache = KeyCache(ttl_s=60)
    cache.put("h", OWNER)
    resolution = timedelta(minutes=1)
    claims = [cache.claim_touch("h", OWNER, NOW, resolution) for _ in range(10)]
    assert claims == [True] + [False] * 9
    # Past the resolution it is recorded again.
    assert cache.claim_touch("h", OWNER, NOW + 2 * resolution, resolution)
