"""A schema-driven fuzz of the OpenAPI document (schemathesis 4), against the whole platform
on the real PostgreSQL and Redis: the API under uvicorn, a dispatcher and a worker on the
simulated engine, so completions finish and answer.

Every operation gets a bounded number of generated requests — bodies that conform to the
documented schema, and some that do not — sent with a tenant's key (the admin key for
`/admin`). Each answer must be no 5xx, a documented status code, of the documented content
type and schema; a request that conforms to the documented schema must not be refused as
invalid (the document states what is accepted, not less). The platform runs on an event
loop in a thread of its own: schemathesis' calls are synchronous.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections import Counter
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import redis.asyncio as aioredis
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import positive_data_acceptance
from sqlalchemy import text

from tests.conftest import ADMIN_KEY, REDIS_TEST_URL, Platform, base_settings
from tests.helpers import error_code
from tierq.api.app import build_app
from tierq.core.settings import Settings
from tierq.models.db import Database
from tierq.models.tables import Base
from tierq.workers.engine.simulated_engine import CostModel

pytestmark = pytest.mark.integration

T = TypeVar("T")

CONFIG = """
[generation]
max-examples = 40
allow-x00 = false
codec = "utf-8"

[checks]
not_a_server_error.enabled = true
status_code_conformance.enabled = true
content_type_conformance.enabled = true
response_schema_conformance.enabled = true
positive_data_acceptance.enabled = true
# Off: pydantic's lax mode takes "8" for 8 and 0 for false, which the document does not
# promise; what it promises to refuse is refused (every refusal is a 4xx, checked above).
negative_data_rejection.enabled = false

[phases.coverage]
enabled = true
[phases.stateful]
enabled = false

# schemathesis 4.32's coverage phase cannot build a multipart body with a binary part
[[operations]]
include-name = "POST /v1/files"
phases.coverage.enabled = false
"""


class BackgroundPlatform:
    """tests.conftest.Platform (API, dispatcher, one simulated worker) on its own loop."""

    def __init__(self, pg_database: str, state_dir: Path) -> None:
        self.settings = base_settings(pg_database, state_dir)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.platform: Platform | None = None

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> Platform:
        self.thread.start()
        self.platform = self.run(self._start())
        return self.platform

    async def _start(self) -> Platform:
        db = Database(self.settings.resolved_database_url)
        tables = ", ".join(t.name for t in Base.metadata.sorted_tables)
        async with db.transaction() as s:
            await s.execute(text(f"TRUNCATE {tables} CASCADE"))
        r = aioredis.Redis.from_url(REDIS_TEST_URL, decode_responses=True)
        platform = Platform(self.settings, db, r)
        await platform.start_api()
        platform.start_dispatcher()
        # Fast enough that a completion of the most tokens the document allows is quick.
        await platform.start_worker("w1", cost=CostModel(slots=64).scaled(2000))
        return platform

    def stop(self) -> None:
        if self.platform is not None:
            self.run(self._stop(self.platform))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _stop(self, platform: Platform) -> None:
        await platform.stop()
        keys = [k async for k in platform.r.scan_iter(match=f"{self.settings.redis_prefix}:*")]
        if keys:
            await platform.r.delete(*keys)
        await platform.r.aclose()
        await platform.db.close()


@pytest.fixture(scope="module")
def background(
    pg_database: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Platform, dict[str, str]]]:
    runner = BackgroundPlatform(pg_database, tmp_path_factory.mktemp("openapi-fuzz"))
    platform = runner.start()
    try:
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        with httpx.Client(base_url=platform.url, headers=admin) as a:
            tenant = a.post("/admin/tenants", json={"name": f"fuzz-{uuid.uuid4().hex[:8]}"})
            key = a.post(f"/admin/tenants/{tenant.json()['id']}/keys").json()["key"]
        yield platform, {"tenant": f"Bearer {key}", "admin": f"Bearer {ADMIN_KEY}"}
    finally:
        runner.stop()


SERVED_MODEL = Settings.model_fields["served_model_name"].default

# The document the app serves (it depends on no setting the test changes).
schema = schemathesis.openapi.from_dict(
    build_app(Settings(_env_file=None, admin_api_key=None)).openapi(),  # type: ignore[call-arg]
    config=schemathesis.Config.from_str(CONFIG),
)


# The default max_tokens of each operation that takes a model and min_tokens.
DEFAULT_MAX_TOKENS = {"/v1/jobs": 256, "/v1/chat/completions": 256, "/v1/completions": 16}


def fit(body: dict[str, Any], path: str) -> None:
    """A conforming generation request made to reach the queue: most name the served model
    (any other is a 404), and `min_tokens` is at most `max_tokens` — the one rule JSON
    Schema cannot state (the document says it in words)."""
    if isinstance(body.get("model"), str) and len(body["model"]) % 4:
        body["model"] = SERVED_MODEL
    # Most schemas a response_format carries are made ones that compile (a random object
    # mostly does not: refused, as the document says in words).
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and isinstance(fmt.get("json_schema"), dict):
        schema = fmt["json_schema"].get("schema")
        if isinstance(schema, dict) and len(schema) % 4:
            fmt["json_schema"]["schema"] = {"type": "object", "required": sorted(schema)[:3]}
    most = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS[path]
    # (JSON Schema's integers include 374.0, which pydantic takes as 374)
    if isinstance(body.get("min_tokens"), int | float) and body["min_tokens"] > most:
        body["min_tokens"] = most


# (operation, status, error code) of every request whose body conformed to the document.
CONFORMING: list[tuple[str, int, str | None]] = []
# What no JSON Schema states: a model's context is counted in tokens, after its chat
# template; a response_format's schema must compile (tierq/services/structured.py); logit_bias
# ids must be in the served model's vocabulary; a webhook URL's host must resolve, to public
# addresses (tierq/services/webhooks.py).
BEYOND_THE_DOCUMENT = (
    "context_length_exceeded",
    "invalid_response_format",
    "token_id_out_of_vocabulary",
    "invalid_webhook_url",
)


@schema.parametrize()
def test_the_openapi_document_holds(case: Any, background: tuple[Platform, dict[str, str]]) -> None:
    platform, keys = background
    _assert_running(platform)
    headers = {"Authorization": keys["admin"] if case.path.startswith("/admin") else keys["tenant"]}
    positive = case.meta is not None and case.meta.generation.mode.is_positive
    if positive and case.path in DEFAULT_MAX_TOKENS and isinstance(case.body, dict):
        fit(case.body, case.path)
    if positive and isinstance(case.body, dict) and "url" in case.body and len(case.body) % 4:
        # Most webhook URLs made ones that resolve to a public address: no generated
        # host does (refused, as the document says in words).
        case.body["url"] = "https://8.8.8.8/hook"
    response = case.call(base_url=platform.url, headers=headers, timeout=30)
    code = error_code(response)
    if positive and case.media_type is not None:
        CONFORMING.append((case.operation.label, response.status_code, code))
    excluded: list[Any] = []
    if code in BEYOND_THE_DOCUMENT:  # a 400 for what the document cannot state
        excluded.append(positive_data_acceptance)
    if case.path == "/readyz" and response.status_code == 503:
        # The documented answer to `?min_workers=N` past the live workers (one here) while
        # the replica itself is fine: not a server error.
        body = response.json()
        assert body["checks"]["database"] == body["checks"]["redis"] == "ok", body
        assert body["checks"]["workers"].startswith("error: 1 of "), body
        excluded.append(not_a_server_error)
    case.validate_response(
        response,
        headers=headers,
        transport_kwargs={"base_url": platform.url},
        excluded_checks=excluded or None,
    )


def _assert_running(platform: Platform) -> None:
    """The dispatcher and the worker still run (else every completion would wait out its
    timeout): fail at once, with what ended them."""
    tasks = [*platform.tasks, *(task for _, task, _ in platform.workers.values())]
    ended = [task for task in tasks if task.done()]
    assert not ended, [task.exception() if not task.cancelled() else "cancelled" for task in ended]


def test_conforming_bodies_are_mostly_accepted() -> None:
    """Of the requests whose body conforms to the document, none is refused as invalid —
    the document states what is accepted — but for what it states only in words (a prompt
    past the model's context, a schema that does not compile, a token id past the
    vocabulary), and
    most are accepted (2xx); the others name what does not exist (404: another model, a file
    or tenant of no one) or meet a documented conflict or cap (409, 429)."""
    # Collected by the fuzz above (run this module whole, not this test alone).
    assert CONFORMING, "no conforming request was recorded: the fuzz above did not run"
    refused = [(label, code) for label, status, code in CONFORMING if status in (400, 413, 415)]
    beyond = [label for label, code in refused if code in BEYOND_THE_DOCUMENT]
    accepted = [label for label, status, _ in CONFORMING if 200 <= status < 300]
    summary = Counter((label, status) for label, status, _ in CONFORMING)
    assert [r for r in refused if r[1] not in BEYOND_THE_DOCUMENT] == [], summary
    assert len(beyond) <= len(CONFORMING) // 20, summary
    assert len(accepted) >= len(CONFORMING) // 2, summary
