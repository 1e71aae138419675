"""Streams are a bounded, shared resource: one Redis pub/sub connection per API process
fans out to every follower; a tenant holds at most `max_streams_per_tenant` streams and
waiting online requests; a suspension or a revoked key closes the streams it covers.

Real PostgreSQL and Redis, the API under uvicorn; the simulated engine where a job must run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.conftest import Platform
from tests.helpers import (
    admin,
    admit_as,
    assert_openai_error,
    client,
    new_tenant,
    read_sse,
    until,
    until_async,
    wait_for,
    waiting_on_a_lock,
)
from tierq.core import scripts
from tierq.models import jobs as job_repo

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}


async def api_clients(platform: Platform) -> list[dict[str, str]]:
    """The API process's Redis connections (named `<prefix>:api`)."""
    name = f"{platform.settings.redis_prefix}:api"
    listed: Any = await platform.r.client_list()
    return [c for c in listed if c.get("name") == name]


async def subscribed(platform: Platform, channels: int) -> bool:
    """Whether an API connection is subscribed to `channels` channels (the access
    channel is always one)."""
    return any(int(c.get("sub", 0)) >= channels for c in await api_clients(platform))


class OpenStream:
    """An SSE stream held open in the background, its events collected as they come."""

    def __init__(self, c: httpx.AsyncClient, path: str) -> None:
        self.c = c
        self.path = path
        self.status: int | None = None
        self.events: list[dict[str, Any]] = []
        self.opened = asyncio.Event()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        current: dict[str, Any] = {}
        async with self.c.stream("GET", self.path) as resp:
            self.status = resp.status_code
            self.opened.set()
            if resp.status_code != 200:
                await resp.aread()
                return
            async for line in resp.aiter_lines():
                if not line:
                    if "event" in current:
                        current["data"] = json.loads(current.get("data", "null"))
                        self.events.append(current)
                    current = {}
                elif not line.startswith(":"):
                    field, _, value = line.partition(":")
                    current[field] = value[1:] if value.startswith(" ") else value

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            await self.task


@contextlib.asynccontextmanager
async def streams(c: httpx.AsyncClient, path: str, n: int) -> AsyncIterator[list[OpenStream]]:
    opened = [OpenStream(c, path) for _ in range(n)]
    try:
        await asyncio.wait_for(asyncio.gather(*(s.opened.wait() for s in opened)), 30)
        yield opened
    finally:
        for s in opened:
            await s.close()


async def queued_job(c: httpx.AsyncClient) -> str:
    """A job that stays queued (no dispatcher runs in these tests unless started)."""
    resp = await c.post("/v1/jobs", json=CHAT)
    assert resp.status_code == 202, resp.text
    return str(resp.json()["id"])


@pytest.mark.with_settings(redis_max_connections=8)
async def test_a_hundred_followers_share_one_pub_sub_connection(platform: Platform) -> None:
    _tenant, key = await new_tenant(platform)
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=200)
    async with httpx.AsyncClient(
        base_url=platform.url, headers=headers, limits=limits, timeout=30
    ) as c:
        job_id = await queued_job(c)
        async with streams(c, f"/v1/jobs/{job_id}/events", 100) as opened:
            assert {s.status for s in opened} == {200}
            await until_async(lambda: subscribed(platform, 2), "the job's channel subscribed")
            during = await api_clients(platform)
            pubsub = [x for x in during if int(x.get("sub", 0)) > 0]
            assert len(pubsub) == 1, pubsub  # one subscriber connection for all 100
            # the process's connections are bounded by its pool, not by the followers
            assert len(during) <= 8, len(during)
            # a cancel reaches every follower through that one connection
            await c.post(f"/v1/jobs/{job_id}/cancel")
            for s in opened:
                await asyncio.wait_for(s.task, 10)
            assert all(s.events[-1]["event"] == "done" for s in opened)
            assert all(s.events[-1]["data"]["status"] == "cancelled" for s in opened)


@pytest.mark.with_settings(max_streams_per_tenant=3)
async def test_a_tenant_past_its_stream_cap_gets_429_and_others_do_not(
    platform: Platform,
) -> None:
    _t1, key = await new_tenant(platform)
    _t2, other = await new_tenant(platform)
    async with client(platform.url, key) as c, client(platform.url, other) as o:
        job_id = await queued_job(c)
        path = f"/v1/jobs/{job_id}/events"
        async with streams(c, path, 3) as held:
            assert {s.status for s in held} == {200}
            refused = await c.get(path)
            assert_openai_error(refused, 429, "too_many_streams")
            assert int(refused.headers["retry-after"]) >= 1
            # an online request takes a slot too: refused before any job is created
            jobs_before = (await c.get("/v1/jobs")).json()["data"]
            chat = await c.post("/v1/chat/completions", json={**CHAT, "model": "x"})
            assert_openai_error(chat, 429, "too_many_streams")
            assert (await c.get("/v1/jobs")).json()["data"] == jobs_before
            # another tenant is not affected
            other_job = await queued_job(o)
            async with streams(o, f"/v1/jobs/{other_job}/events", 3) as theirs:
                assert {s.status for s in theirs} == {200}
            # a stream that ends gives its slot back at once
            await held[0].close()

            async def opens_again() -> bool:
                again = OpenStream(c, path)
                await again.opened.wait()
                await again.close()
                return again.status == 200

            await until_async(opens_again, "a stream opens in the slot given back", 2.5)

        async def none_held() -> bool:
            return await platform.r.zcard(platform.dispatcher.names.tenant_streams(_t1)) == 0

        await until_async(none_held, "no stream slot left held (leaked)", 2.5)


async def redis_calls(platform: Platform, command: str) -> int:
    """How many times the Redis server has run `command` (INFO commandstats)."""
    stats: Any = await platform.r.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


@pytest.mark.with_settings(max_streams_per_tenant=2)
async def test_a_tenant_holding_its_cap_here_is_refused_before_redis_and_the_database(
    platform: Platform,
) -> None:
    """This process holds every slot of the tenant: a stream past the cap is refused with
    neither the slot script nor the job's row read (a storm of them costs little)."""
    _tenant, key = await new_tenant(platform)
    async with client(platform.url, key) as c:
        job_id = await queued_job(c)
        async with streams(c, f"/v1/jobs/{job_id}/events", 2) as held:
            assert {s.status for s in held} == {200}
            # refused before the job is looked up: a job that does not exist gets 429
            assert_openai_error(await c.get("/v1/jobs/job_nope/events"), 429, "too_many_streams")
            scripts_before = await redis_calls(platform, "evalsha")
            for _ in range(20):
                refused = await c.get(f"/v1/jobs/{job_id}/events")
                assert_openai_error(refused, 429, "too_many_streams")
            # (a lease renewal or another script may run meanwhile: not one per refusal)
            assert await redis_calls(platform, "evalsha") - scripts_before <= 5
            # a reconnect is answered as before: a bad Last-Event-ID is a 400
            bad = await c.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "x"})
            assert_openai_error(bad, 400, "invalid_last_event_id")

        async def below_the_cap() -> bool:  # the slots come back as the server sees the ends
            resp = await c.get("/v1/jobs/job_nope/events")
            return resp.status_code == 404

        await until_async(below_the_cap, "a missing job is a 404 below the cap", 5)


async def test_slots_let_go_together_leave_redis_in_one_round_trip(platform: Platform) -> None:
    """Fifty streams ending in one turn of the API's loop remove their slots with one
    ZREM, not fifty; the slots' set is empty afterwards, and stopping removes the rest."""
    from tierq.api.streams.slots import StreamSlots

    settings = platform.settings.model_copy(update={"max_streams_per_tenant": 100})
    names = platform.dispatcher.names
    slots = StreamSlots(platform.r, names, settings)
    key = names.tenant_streams("ten_release")
    taken = [await slots.take("ten_release") for _ in range(50)]
    kept = [await slots.take("ten_release") for _ in range(3)]
    assert await platform.r.zcard(key) == 53
    removals_before = await redis_calls(platform, "zrem")
    for slot in taken:
        slot.release()
    slot.release()  # a second release of one slot sends nothing more

    async def only_kept() -> bool:
        return await platform.r.zcard(key) == 3

    await until_async(only_kept, "the fifty slots let go are removed", 5)
    # one ZREM for the fifty (at most one more from another client of this Redis server)
    assert await redis_calls(platform, "zrem") - removals_before <= 2
    assert kept[0].member in set(await platform.r.zrange(key, 0, -1))
    await slots.stop()  # what is still held goes too
    assert await platform.r.zcard(key) == 0


async def test_a_suspension_closes_the_tenants_open_streams(platform: Platform) -> None:
    tenant_id, key = await new_tenant(platform)
    _other, other_key = await new_tenant(platform)
    async with client(platform.url, key) as c, client(platform.url, other_key) as o:
        job_id = await queued_job(c)
        other_job = await queued_job(o)
        async with (
            streams(c, f"/v1/jobs/{job_id}/events", 2) as mine,
            streams(o, f"/v1/jobs/{other_job}/events", 1) as theirs,
        ):
            async with admin(platform) as a:
                assert (await a.post(f"/admin/tenants/{tenant_id}/suspend")).status_code == 200
            for s in mine:
                await asyncio.wait_for(s.task, 5)
                last = s.events[-1]
                # the cancel's done event, or the closing error: either way it ended
                assert last["event"] in ("done", "error"), s.events
            # Nothing marks a stream passed over: a moment for a wrong close to arrive.
            await asyncio.sleep(0.3)
            assert not theirs[0].task.done()  # another tenant's stream stays open


async def test_revoking_a_key_closes_the_streams_opened_with_it_only(platform: Platform) -> None:
    tenant_id, key = await new_tenant(platform)
    async with admin(platform) as a:
        second = (await a.post(f"/admin/tenants/{tenant_id}/keys")).json()
        first_id = next(
            k["id"]
            for k in (await a.get(f"/admin/tenants/{tenant_id}/keys")).json()["data"]
            if k["id"] != second["id"]
        )
    async with client(platform.url, key) as c, client(platform.url, second["key"]) as c2:
        job_id = await queued_job(c)
        path = f"/v1/jobs/{job_id}/events"
        async with streams(c, path, 2) as revoked, streams(c2, path, 1) as kept:
            async with admin(platform) as a:
                assert (await a.delete(f"/admin/keys/{first_id}")).status_code == 200
            for s in revoked:
                await asyncio.wait_for(s.task, 5)
                assert s.events[-1]["event"] == "error"
                assert s.events[-1]["data"]["error"]["code"] == "invalid_api_key"
            # Nothing marks a stream passed over: a moment for a wrong close to arrive.
            await asyncio.sleep(0.3)
            assert not kept[0].task.done()
            assert (await c.get(path)).status_code == 401
        # the job itself is the tenant's, not the key's: it is still queued
        assert (await c2.get(f"/v1/jobs/{job_id}")).json()["status"] == "queued"


async def test_a_revoked_stream_is_closed_even_if_the_message_was_lost(
    platform: Platform,
) -> None:
    """The access message is published once; the hub's periodic look finds a revocation
    whose message never arrived (here: revoked in the database behind the API's back)."""
    from tierq.models import tenants as tenant_repo

    _tenant_id, key = await new_tenant(platform)
    async with client(platform.url, key) as c:
        job_id = await queued_job(c)
        async with streams(c, f"/v1/jobs/{job_id}/events", 1) as (s,):
            async with platform.db.transaction() as session:
                owner = await tenant_repo.owner_of_key(session, key)
                assert owner is not None
                await tenant_repo.revoke_key(session, owner.key_id)
            await asyncio.wait_for(s.task, 6)
            assert s.events[-1]["data"]["error"]["code"] == "invalid_api_key"


async def test_a_revocation_committed_after_authentication_refuses_the_job(
    platform: Platform,
) -> None:
    """Admission reads the key's state under the tenant's lock, in the transaction that
    inserts the job — not the snapshot authentication took."""
    from tierq.models import tenants as tenant_repo
    from tierq.services.requests import JobCreate, Refused

    tenant_id, key = await new_tenant(platform)
    async with platform.db.session() as s:
        owner = await tenant_repo.owner_of_key(s, key)
    assert owner is not None  # authenticated
    async with admin(platform) as a:
        assert (await a.delete(f"/admin/keys/{owner.key_id}")).status_code == 200
    body = JobCreate(messages=[{"role": "user", "content": "hi"}], max_tokens=8)  # type: ignore[list-item]
    with pytest.raises(Refused) as refused:
        await admit_as(platform, owner.tenant, body, key_id=owner.key_id)
    assert refused.value.status == 401 and refused.value.code == "invalid_api_key"
    async with platform.db.session() as s:
        from tierq.models import jobs as job_repo

        page, _ = await job_repo.list_jobs(s, tenant_id)
    assert page == []


async def test_followers_miss_nothing_when_the_hub_connection_is_killed(
    platform: Platform,
) -> None:
    """CLIENT KILL of the API's pub/sub connection while 20 followers stream a job: each
    gets every event, ids 1..n without a gap or a repeat."""
    platform.start_dispatcher()
    await platform.start_worker("w1")
    _tenant, key = await new_tenant(platform)
    async with client(platform.url, key) as c:
        resp = await c.post("/v1/jobs", json={**CHAT, "max_tokens": 200})
        job_id = resp.json()["id"]
        readers = [asyncio.create_task(read_sse(c, f"/v1/jobs/{job_id}/events")) for _ in range(20)]
        await until_async(lambda: subscribed(platform, 2), "the job's channel subscribed")
        killed = 0
        for conn in await api_clients(platform):
            if int(conn.get("sub", 0)) > 0:
                await platform.r.execute_command("CLIENT", "KILL", "ID", conn["id"])
                killed += 1
        assert killed == 1
        results = await asyncio.wait_for(asyncio.gather(*readers), 60)
        final = await wait_for(c, job_id)
        assert final["status"] == "succeeded"
        for got in results:
            ids = [int(e["id"]) for e in got]
            assert ids == list(range(1, len(ids) + 1))
            text = "".join(e["data"].get("text", "") for e in got if e["event"] == "delta")
            assert text == final["result"]["text"]


@pytest.mark.parametrize("path", ["quotas", "fast"])
async def test_a_revocation_committed_while_admission_waits_for_the_lock_refuses_it(
    platform: Platform, path: str
) -> None:
    """An admission waiting on the tenant's row lock sees a revocation that committed
    while it waited (PostgreSQL re-reads only the locked row: the key is read after it),
    with a quota (the row's exclusive lock) and without (its shared lock) alike."""
    from tierq.models import tenants as tenant_repo
    from tierq.models.tables import ApiKey, utcnow
    from tierq.services.requests import JobCreate, Refused

    tenant_id, key = await new_tenant(platform)
    if path == "quotas":
        async with admin(platform) as a:  # a quota: admission takes the row's exclusive lock
            await a.put(f"/admin/tenants/{tenant_id}/quota", json={"requests_per_minute": 100})
    async with platform.db.session() as s:
        owner = await tenant_repo.owner_of_key(s, key)
    assert owner is not None
    body = JobCreate(messages=[{"role": "user", "content": "hi"}], max_tokens=8)  # type: ignore[list-item]
    async with platform.db.transaction() as s:
        await tenant_repo.lock_tenant(s, tenant_id)  # held while the admission starts
        admission = asyncio.create_task(admit_as(platform, owner.tenant, body, key_id=owner.key_id))

        await until_async(
            lambda: waiting_on_a_lock(platform), "the admission waits for the tenant's lock", 10
        )
        assert not admission.done()
        row = await s.get(ApiKey, owner.key_id)
        assert row is not None
        row.revoked_at = utcnow()
    with pytest.raises(Refused) as refused:
        await admission
    assert refused.value.status == 401 and refused.value.code == "invalid_api_key"
    async with platform.db.session() as s:
        assert await job_repo.tenant_job_counts(s, tenant_id) == {}  # nothing written


async def test_a_lease_renewal_never_brings_back_a_slot_let_go(platform: Platform) -> None:
    """Renewal touches only the slots still in the set (a slot released while a renewal
    was in flight stays released), and re-adds them all only if the set itself is gone."""
    renew = platform.r.register_script(scripts.source("stream_slots_renew"))
    key = platform.dispatcher.names.tenant_streams("ten_lease")
    await platform.r.zadd(key, {"kept": 1.0})
    await renew(keys=[key], args=[30, "kept", "released"])
    assert set(await platform.r.zrange(key, 0, -1)) == {"kept"}
    await platform.r.delete(key)  # a flush of Redis
    await renew(keys=[key], args=[30, "kept", "released"])
    assert set(await platform.r.zrange(key, 0, -1)) == {"kept", "released"}
    await platform.r.delete(key)


@pytest.mark.with_settings(replay_max_bytes=120)
async def test_an_openai_stream_that_resyncs_past_the_replay_bound_loses_no_text(
    running: Platform,
) -> None:
    """A follower that re-reads the buffer (its pub/sub connection killed mid-stream) finds
    placeholders past REPLAY_MAX_BYTES: the stream completes the text from the result."""
    _tenant, key = await new_tenant(running)
    body = {
        "model": running.settings.served_model_name,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 150,
        "stream": True,
    }
    text = ""
    async with (
        client(running.url, key) as c,
        c.stream("POST", "/v1/chat/completions", json=body) as resp,
    ):
        job_id = resp.headers["x-request-id"]
        chunks = 0
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line.removeprefix("data: "))["choices"][0]["delta"]
            text += delta.get("content") or ""
            chunks += 1
            if chunks == 10:
                for conn in await api_clients(running):
                    if int(conn.get("sub", 0)) > 0:
                        await running.r.execute_command("CLIENT", "KILL", "ID", conn["id"])
    async with client(running.url, key) as c:
        final = await wait_for(c, job_id)
    assert final["status"] == "succeeded"
    assert text == final["result"]["text"]


@pytest.mark.with_settings(auth_cache_ttl_s=600.0)
async def test_every_api_process_forgets_a_revoked_key_at_once(platform: Platform) -> None:
    """Each API process remembers key owners for AUTH_CACHE_TTL_S; a revocation made
    through one process refuses the other's next admission at once, and reaches its cache
    at once (the access channel), long before the entry would expire."""
    other = Platform(platform.settings, platform.db, platform.r)
    await other.start_api()
    try:
        tenant_id, key = await new_tenant(platform)
        async with client(other.url, key) as c:
            assert (await c.get("/v1/jobs")).status_code == 200  # remembered there now
            async with admin(platform) as a:
                keys = (await a.get(f"/admin/tenants/{tenant_id}/keys")).json()["data"]
                assert (await a.delete(f"/admin/keys/{keys[0]['id']}")).status_code == 200
            # The very next admission there is refused whatever its cache holds: admission
            # reads the key again under the tenant's lock (the fast path's one statement).
            assert_openai_error(await c.post("/v1/jobs", json=CHAT), 401, "invalid_api_key")

            async def forgotten() -> bool:  # pub/sub: a few milliseconds
                return (await c.get("/v1/jobs")).status_code == 401

            await until_async(forgotten, "the other replica forgets the revoked key", 1)
            assert_openai_error(await c.get("/v1/jobs"), 401, "invalid_api_key")
    finally:
        await other.stop()


@pytest.mark.with_settings(auth_cache_ttl_s=1.0)
async def test_a_revocation_whose_message_was_lost_holds_within_the_cache_ttl(
    platform: Platform,
) -> None:
    """Revoked behind the API's back (no message): admission refuses it at once (it reads
    the key again under the lock); reads are refused once the cache entry expires."""
    from tierq.models import tenants as tenant_repo

    _tenant_id, key = await new_tenant(platform)
    async with client(platform.url, key) as c:
        assert (await c.get("/v1/jobs")).status_code == 200
        async with platform.db.transaction() as s:
            owner = await tenant_repo.owner_of_key(s, key)
            assert owner is not None
            await tenant_repo.revoke_key(s, owner.key_id)
        assert_openai_error(await c.post("/v1/jobs", json=CHAT), 401, "invalid_api_key")
        await asyncio.sleep(1.1)  # past AUTH_CACHE_TTL_S
        assert_openai_error(await c.get("/v1/jobs"), 401, "invalid_api_key")


async def test_a_follower_of_a_job_cancelled_by_a_suspension_gets_its_final_event_at_once(
    platform: Platform,
) -> None:
    """The cancel path ends every cancelled job's event stream (tierq/services/cancellation.py):
    a follower hears `done` with the job cancelled within 1 s of the suspension's answer,
    before the suspension closes its stream, not at the hub's periodic recheck."""
    tenant_id, key = await new_tenant(platform)
    async with client(platform.url, key) as c:
        job_id = await queued_job(c)
        async with streams(c, f"/v1/jobs/{job_id}/events", 1) as (follower,):
            async with admin(platform) as a:
                assert (await a.post(f"/admin/tenants/{tenant_id}/suspend")).status_code == 200
            await asyncio.wait_for(follower.task, 1)
    assert follower.events[-1]["event"] == "done", follower.events
    assert follower.events[-1]["data"]["status"] == "cancelled"
    assert follower.events[-1]["data"]["error"]["code"] == "tenant_suspended"


@pytest.mark.parametrize("loop", ["recheck", "read"])
async def test_the_hub_stops_at_one_cancel_when_a_read_reports_it_as_an_error(
    settings: Any, redis_client: Any, db: Any, monkeypatch: pytest.MonkeyPatch, loop: str
) -> None:
    """redis-py may report a read cut short by a cancel as a ConnectionError. The hub's
    loops carry on past such errors (an outage), so each must see that the error is its
    own cancel: a swallowed cancel left the recheck loop running and an API's shutdown
    hanging (seen in CI). The fault: the hub's next database look or pub/sub read turns
    the cancel into a ConnectionError, on real Redis and PostgreSQL."""
    import redis

    from tierq.api.streams import Streams
    from tierq.api.streams import recheck as recheck_module
    from tierq.core.redis_names import RedisNames

    monkeypatch.setattr(recheck_module, "RECHECK_S", 0.1)
    streams = Streams(redis_client, RedisNames(settings.redis_prefix), db, settings, [])
    entered = asyncio.Event()

    async def read_cut_short(*_args: Any, **_kwargs: Any) -> Any:
        entered.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise redis.ConnectionError("Connection closed by server.") from None

    if loop == "recheck":
        monkeypatch.setattr(streams.recheck, "once", read_cut_short)
    await streams.start()
    if loop == "read":
        await until(lambda: streams.hub._pubsub is not None, "the hub connected", 5)
        assert streams.hub._pubsub is not None
        monkeypatch.setattr(streams.hub._pubsub, "get_message", read_cut_short)
    await asyncio.wait_for(entered.wait(), 5)
    task = streams.recheck._task if loop == "recheck" else streams.hub._reading
    assert task is not None
    task.cancel()  # once: no second cancel to rescue a swallowed one
    done, _ = await asyncio.wait([task], timeout=2)
    assert task in done and task.cancelled()
    started = asyncio.get_running_loop().time()
    await streams.stop()
    assert asyncio.get_running_loop().time() - started < 2
    assert streams.slots._renewing is not None and streams.slots._renewing.done()
