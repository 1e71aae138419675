"""Batch webhooks end to end: endpoints registered through the official `openai` SDK
(`client.webhooks`), batches run by a real Celery worker and beat on the real PostgreSQL and
Redis (the simulated engine), and receivers — real HTTP servers in the test — that verify
every delivery with `client.webhooks.unwrap`, fail on purpose, redirect, or hang while the
Celery worker sending to them is SIGKILLed."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from sqlalchemy import update
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from benchmarks.ports import free_port
from tests.conftest import ADMIN_KEY, Platform
from tests.helpers import assert_openai_error
from tests.integration.batch_helpers import finished, jsonl, line, sdk, submit
from tests.integration.celery_proc import CeleryWorker
from tierq.models.tables import Batch
from tierq.workers.engine.simulated_engine import CostModel

pytestmark = pytest.mark.integration

ALL = ["batch.completed", "batch.failed", "batch.expired", "batch.cancelled"]
OPEN = {"webhook_allow_private": True, "webhook_allow_http": True, "webhook_timeout_s": 2.0}
# The Celery worker's: private addresses (the receivers are on 127.0.0.1), quick retries.
CELERY_ENV = {
    "WEBHOOK_ALLOW_PRIVATE": "true",
    "WEBHOOK_ALLOW_HTTP": "true",
    "WEBHOOK_TIMEOUT_S": "2",
    "WEBHOOK_RETRY_BASE_S": "0.2",
    "WEBHOOK_RETRY_MAX_S": "1",
    "WEBHOOK_MAX_ATTEMPTS": "3",
    "WEBHOOK_TICK_S": "0.3",
}


@dataclass
class Arrival:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float = field(default_factory=time.monotonic)


class Receivers:
    """One HTTP server with a path per behaviour; every request is recorded."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.arrivals: list[Arrival] = []
        self.down_status = 500
        self.seen: Counter[tuple[str, str]] = Counter()
        self.server: uvicorn.Server | None = None
        self.task: asyncio.Task[None] | None = None

    async def _handle(self, request: Request) -> Response:
        path = request.url.path
        arrival = Arrival(path, dict(request.headers), await request.body())
        self.arrivals.append(arrival)
        key = (path, arrival.headers.get("webhook-id", ""))
        self.seen[key] += 1
        if path == "/flaky" and self.seen[key] <= 2:
            return Response("not yet", 500)
        if path == "/down":
            return Response("down", self.down_status)
        if path == "/redirect":  # 307: a client that followed it would POST again
            return Response(status_code=307, headers={"location": f"{self.url}/target"})
        if path == "/slow" and self.seen[key] == 1:
            await asyncio.sleep(15)  # its sender is killed meanwhile
        return Response("ok", 200)

    async def start(self) -> None:
        methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD"]
        app = Starlette(routes=[Route("/{name}", self._handle, methods=methods)])
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        assert self.server is not None and self.task is not None
        self.server.should_exit = True
        self.server.force_exit = True
        await asyncio.wait_for(self.task, 20)

    def at(self, path: str) -> list[Arrival]:
        return [a for a in self.arrivals if a.path == path]


@pytest.fixture
async def receivers() -> AsyncIterator[Receivers]:
    r = Receivers()
    await r.start()
    yield r
    await r.stop()


def celery_worker(platform: Platform, name: str = "celery") -> CeleryWorker:
    worker = CeleryWorker(platform.settings, name=name, BATCH_MAX_REQUESTS="400", **CELERY_ENV)
    worker.start()
    return worker


@pytest.fixture
async def celery(platform: Platform) -> AsyncIterator[CeleryWorker]:
    worker = celery_worker(platform)
    yield worker
    worker.stop()


def admin(platform: Platform) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=platform.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30
    )


async def deliveries(platform: Platform, **query: str) -> list[dict[str, Any]]:
    async with admin(platform) as a:
        resp = await a.get("/admin/webhook_deliveries", params={"limit": "100", **query})
    assert resp.status_code == 200, resp.text
    return list(resp.json()["data"])


async def settled(
    platform: Platform, celery: CeleryWorker, count: int, timeout: float = 60
) -> None:
    """Wait until `count` deliveries exist and none is pending."""
    deadline = time.monotonic() + timeout
    while True:
        found = await deliveries(platform)
        if len(found) >= count and all(d["status"] != "pending" for d in found):
            return
        assert celery.proc is not None and celery.proc.poll() is None, celery.output()
        assert time.monotonic() < deadline, (found, celery.output())
        await asyncio.sleep(0.2)


def verified(arrival: Arrival, secret: str) -> Any:
    """The event, verified as a receiver verifies it with the official SDK."""
    return openai.OpenAI(api_key="unused").webhooks.unwrap(
        arrival.body, arrival.headers, secret=secret
    )


@pytest.mark.with_settings(**OPEN)
async def test_each_batch_event_reaches_each_endpoint_signed_and_retried_until_taken(
    platform: Platform,
    celery: CeleryWorker,
    receivers: Receivers,
    tenant_key: str,
    other_tenant_key: str,
) -> None:
    platform.start_dispatcher()
    await platform.start_worker("w1", cost=CostModel(slots=8))  # real-time speed
    client, other = sdk(platform, tenant_key), sdk(platform, other_tenant_key)
    hooks = {
        name: await client.webhooks.create(
            name=name,
            url=f"{receivers.url}/{name}",
            event_types=types,  # type: ignore[arg-type]
        )
        for name, types in (
            ("ok", ALL),
            ("flaky", ALL),
            ("down", ["batch.completed"]),
            ("redirect", ["batch.completed"]),
        )
    }
    theirs = await other.webhooks.create(
        name="theirs",
        url=f"{receivers.url}/theirs",
        event_types=ALL,  # type: ignore[arg-type]
    )
    assert all(h.signing_secret.startswith("whsec_") for h in hooks.values())
    assert hooks["ok"].event_types == ALL and hooks["ok"].object == "webhook_endpoint"

    # One batch for each of the four events.
    completed = await submit(client, jsonl([line(f"a{i}", max_tokens=4) for i in range(3)]))
    failed = await submit(client, b"{not json\n")
    cancelled = await submit(client, jsonl([line(f"c{i}", max_tokens=40) for i in range(200)]))
    await client.batches.cancel(cancelled.id)
    expired = await submit(client, jsonl([line(f"e{i}", max_tokens=40) for i in range(200)]))
    async with platform.db.transaction() as s:  # its 24 h window passes
        await s.execute(
            update(Batch).where(Batch.id == expired.id).values(expires_at=Batch.created_at)
        )
    ends = {}
    for batch in (completed, failed, cancelled, expired):
        done = await finished(client, batch.id, celery)
        ends[done.id] = f"batch.{done.status}"
    assert sorted(ends.values()) == sorted(ALL)
    # ok and flaky take all four; down and redirect the completed one; theirs none.
    await settled(platform, celery, 4 + 4 + 1 + 1)

    # Every arrival verifies with its endpoint's secret, and with no other.
    for name, hook in hooks.items():
        for arrival in receivers.at(f"/{name}"):
            event = verified(arrival, hook.signing_secret)
            assert arrival.headers["webhook-id"] == event.id
            assert ends[event.data.id] == event.type
            with pytest.raises(openai.InvalidWebhookSignatureError):
                verified(arrival, theirs.signing_secret)
    # ok: each event once, each batch once.
    ok = [verified(a, hooks["ok"].signing_secret) for a in receivers.at("/ok")]
    assert sorted((e.data.id, e.type) for e in ok) == sorted(ends.items())
    assert len({e.id for e in ok}) == 4
    # flaky: each event three times (500, 500, 200), same id and body each time.
    flaky = receivers.at("/flaky")
    by_id: dict[str, list[Arrival]] = {}
    for arrival in flaky:
        by_id.setdefault(arrival.headers["webhook-id"], []).append(arrival)
    assert len(by_id) == 4 and all(len(a) == 3 for a in by_id.values()), by_id
    for tries in by_id.values():
        assert len({a.body for a in tries}) == 1
        stamps = [int(a.headers["webhook-timestamp"]) for a in tries]
        assert stamps == sorted(stamps)
    assert not receivers.at("/theirs") and not receivers.at("/target")

    records = {d["id"]: d for d in await deliveries(platform)}
    for d in records.values():
        assert d["data"]["id"] in ends and d["event_type"] == ends[d["data"]["id"]]
    by_endpoint = {
        name: [d for d in records.values() if d["webhook_endpoint_id"] == hook.id]
        for name, hook in hooks.items()
    }
    assert all(d["status"] == "delivered" and d["attempts"] == 1 for d in by_endpoint["ok"])
    assert all(
        d["status"] == "delivered" and d["attempts"] == 3 and d["last_status_code"] == 200
        for d in by_endpoint["flaky"]
    )
    [down] = by_endpoint["down"]
    assert down["status"] == "failed" and down["attempts"] == 3
    assert down["last_status_code"] == 500 and "down" in down["last_error"]
    [redirected] = by_endpoint["redirect"]
    assert redirected["status"] == "failed" and redirected["last_status_code"] == 307
    assert "redirects are not followed" in redirected["last_error"]
    # The tenant reads its endpoint's deliveries; the other tenant neither.
    mine = await client.get(
        f"/webhook_endpoints/{hooks['down'].id}/deliveries", cast_to=httpx.Response
    )
    assert [d["id"] for d in mine.json()["data"]] == [down["id"]]
    with pytest.raises(openai.NotFoundError):
        await other.webhooks.retrieve(hooks["down"].id)
    with pytest.raises(openai.NotFoundError):
        await other.get(f"/webhook_endpoints/{hooks['down'].id}/deliveries", cast_to=httpx.Response)

    # The operator sends the failed one again once the receiver is back: the same event.
    receivers.down_status = 200
    async with admin(platform) as a:
        again = await a.post(f"/admin/webhook_deliveries/{down['id']}/redeliver")
        assert again.status_code == 200 and again.json()["status"] == "pending", again.text
        twice = await a.post(f"/admin/webhook_deliveries/{down['id']}/redeliver")
        assert_openai_error(twice, 409, "delivery_not_failed")
    await settled(platform, celery, 10)
    resent = receivers.at("/down")
    assert len(resent) == 4 and {a.headers["webhook-id"] for a in resent} == {down["id"]}
    # Attempt numbers go on (3 failed, then the 4th): an outcome is kept by its number.
    [taken] = await deliveries(platform, status="delivered", endpoint_id=hooks["down"].id)
    assert taken["attempts"] == 4 and taken["last_status_code"] == 200


@pytest.mark.with_settings(**OPEN)
async def test_endpoints_through_the_sdk_list_update_rotate_test_and_delete(
    platform: Platform, receivers: Receivers, tenant_key: str, other_tenant_key: str
) -> None:
    client, other = sdk(platform, tenant_key), sdk(platform, other_tenant_key)
    made = await client.webhooks.create(
        name="first", url=f"{receivers.url}/ok", event_types=["batch.completed"]
    )
    await other.webhooks.create(name="other", url=f"{receivers.url}/ok", event_types=ALL)  # type: ignore[arg-type]
    listed = await client.webhooks.list()
    assert [e.id for e in listed.data] == [made.id]
    got = await client.webhooks.retrieve(made.id)
    assert got.url == made.url and got.signing_secret_hint == f"whsec_...{made.signing_secret[-4:]}"
    assert "signing_secret" not in got.model_dump(exclude_unset=True)
    types = (await client.webhooks.event_types.list()).data
    assert sorted(types) == sorted(ALL)

    changed = await client.webhooks.update(made.id, name="renamed", event_types=ALL)  # type: ignore[arg-type]
    assert changed.name == "renamed" and changed.event_types == ALL and changed.url == made.url

    # A test event: sent now, signed with the current secret.
    result = await client.webhooks.test(made.id, event_type="batch.failed")
    assert result.status_code == 200 and result.webhook_endpoint_id == made.id
    event = verified(receivers.at("/ok")[-1], made.signing_secret)
    assert event.type == "batch.failed"

    # Rotated keeping the old one: both verify for a while. Rotated again without: one.
    rotated = await client.webhooks.rotate_secret(made.id, keep_old_secret_active_for_24_hours=True)
    assert rotated.signing_secret != made.signing_secret
    await client.webhooks.test(made.id, event_type="batch.completed")
    for secret in (made.signing_secret, rotated.signing_secret):
        verified(receivers.at("/ok")[-1], secret)
    final = await client.webhooks.rotate_secret(made.id)
    await client.webhooks.test(made.id, event_type="batch.completed")
    verified(receivers.at("/ok")[-1], final.signing_secret)
    with pytest.raises(openai.InvalidWebhookSignatureError):
        verified(receivers.at("/ok")[-1], rotated.signing_secret)

    # A host name: resolved, checked, and sent to at a checked address that answers (the
    # receiver listens on 127.0.0.1 only; localhost may resolve to ::1 first), the name
    # kept in Host.
    named = await client.webhooks.create(
        name="by name",
        url=f"http://localhost:{receivers.port}/ok",
        event_types=ALL,  # type: ignore[arg-type]
    )
    assert (await client.webhooks.test(named.id, event_type="batch.expired")).status_code == 200
    assert receivers.at("/ok")[-1].headers["host"] == f"localhost:{receivers.port}"
    verified(receivers.at("/ok")[-1], named.signing_secret)

    # Another tenant can neither see nor change it.
    for call in (
        other.webhooks.retrieve(made.id),
        other.webhooks.delete(made.id),
        other.webhooks.update(made.id, name="x"),
        other.webhooks.test(made.id, event_type="batch.completed"),
    ):
        with pytest.raises(openai.NotFoundError):
            await call
    deleted = await client.webhooks.delete(made.id)
    assert deleted.deleted and deleted.id == made.id
    with pytest.raises(openai.NotFoundError):
        await client.webhooks.retrieve(made.id)
    assert [e.id for e in (await client.webhooks.list()).data] == [named.id]

    # A receiver that cannot be reached is a 400 saying so.
    gone = await client.webhooks.create(
        name="gone",
        url=f"http://127.0.0.1:{free_port()}/x",
        event_types=ALL,  # type: ignore[arg-type]
    )
    with pytest.raises(openai.BadRequestError) as refused:
        await client.webhooks.test(gone.id, event_type="batch.completed")
    assert refused.value.code == "webhook_unreachable"


async def test_private_addresses_plain_http_and_unknown_events_are_refused(
    platform: Platform, tenant_key: str
) -> None:
    """At the defaults: only https, only public addresses — literal or resolved."""
    client = sdk(platform, tenant_key)
    for url in (
        "https://127.0.0.1/hook",
        "https://10.0.0.7/hook",
        "https://169.254.169.254/latest/meta-data",
        "https://[::1]/hook",
        "https://[::ffff:127.0.0.1]/hook",
        "https://localhost/hook",
        "https://0.0.0.0/hook",
        "http://8.8.8.8/hook",
        "https://user:pw@8.8.8.8/hook",
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.webhooks.create(name="x", url=url, event_types=["batch.completed"])
        assert refused.value.code == "invalid_webhook_url", url
    async with httpx.AsyncClient(base_url=platform.url) as raw:
        resp = await raw.post(
            "/v1/webhook_endpoints",
            json={"name": "x", "url": "https://8.8.8.8/", "event_types": ["response.completed"]},
            headers={"Authorization": f"Bearer {tenant_key}"},
        )
    assert_openai_error(resp, 400)
    ok = await client.webhooks.create(
        name="public", url="https://8.8.8.8/hook", event_types=["batch.completed"]
    )
    with pytest.raises(openai.BadRequestError) as moved:  # an update is checked alike
        await client.webhooks.update(ok.id, url="https://192.168.0.1/hook")
    assert moved.value.code == "invalid_webhook_url"


@pytest.mark.with_settings(webhook_tenant_endpoints=False, webhook_max_endpoints=2)
async def test_the_operator_can_keep_registration_to_itself(
    platform: Platform, tenant_key: str
) -> None:
    client = sdk(platform, tenant_key)
    with pytest.raises(openai.PermissionDeniedError) as refused:
        await client.webhooks.create(
            name="x", url="https://8.8.8.8/hook", event_types=["batch.completed"]
        )
    assert refused.value.code == "webhooks_managed_by_operator"
    async with admin(platform) as a:
        [tenant_id] = [t["id"] for t in (await a.get("/admin/tenants")).json()["data"]]
        body = {"name": "ops", "url": "https://8.8.8.8/hook", "event_types": ["batch.failed"]}
        for _ in range(2):
            made = await a.post(f"/admin/tenants/{tenant_id}/webhook_endpoints", json=body)
            assert made.status_code == 200 and made.json()["signing_secret"], made.text
        third = await a.post(f"/admin/tenants/{tenant_id}/webhook_endpoints", json=body)
        assert_openai_error(third, 409, "too_many_webhook_endpoints")
        listed = (await a.get(f"/admin/tenants/{tenant_id}/webhook_endpoints")).json()["data"]
        assert [e["created_by"] for e in listed] == ["operator", "operator"]
    # The tenant reads what the operator registered, without its secret.
    seen = (await client.webhooks.list()).data
    assert len(seen) == 2 and all(not getattr(e, "signing_secret", None) for e in seen)
    with pytest.raises(openai.PermissionDeniedError):
        await client.webhooks.delete(seen[0].id)


@pytest.mark.with_settings(**OPEN)
async def test_a_delivery_outlives_its_celery_worker_killed_mid_attempt(
    platform: Platform, receivers: Receivers, tenant_key: str
) -> None:
    """SIGKILL of the Celery worker while the receiver holds its request: another worker
    sends it again once the claim lapses, with the same webhook-id, and it is delivered."""
    client = sdk(platform, tenant_key)
    hook = await client.webhooks.create(
        name="slow", url=f"{receivers.url}/slow", event_types=["batch.failed"]
    )
    first = celery_worker(platform, "first")
    try:
        batch = await submit(client, b"{not json\n")
        await finished(client, batch.id, first)
        deadline = time.monotonic() + 30
        while not receivers.at("/slow"):
            assert time.monotonic() < deadline, first.output()
            await asyncio.sleep(0.05)
    finally:
        first.kill()
    [record] = await deliveries(platform)
    assert record["status"] == "pending" and record["attempts"] == 1
    second = celery_worker(platform, "second")
    try:
        await settled(platform, second, 1, timeout=60)
    finally:
        second.stop()
    arrivals = receivers.at("/slow")
    assert len(arrivals) == 2
    assert {a.headers["webhook-id"] for a in arrivals} == {record["id"]}
    for arrival in arrivals:
        assert verified(arrival, hook.signing_secret).data.id == batch.id
    [done] = await deliveries(platform)
    assert done["status"] == "delivered" and done["attempts"] == 2
    assert json.loads(arrivals[0].body) == json.loads(arrivals[1].body)
