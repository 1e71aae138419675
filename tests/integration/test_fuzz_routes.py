"""Property-based fuzzing (hypothesis) of every route with hostile values, on the real
PostgreSQL and Redis: NUL and lone surrogates, integers past 64 bits, non-ASCII digits,
dates out of range, 10,000 nested lists, wrong types and empty strings — in every body
field, query parameter, path segment and header, in the multipart fields and file names of
an upload, and in the lines of a batch file.

Every answer is below 500, every 4xx is in OpenAI's error shape, and a refused request
leaves nothing behind: no job row, no stream entry, no file (row or bytes), no batch, no
change to a tenant, a key, a quota or a price. A hostile batch line ends as an error of
its own (the batch failing validation with the line named, or an error line in the
batch's error file), never as a batch stuck retrying.

tests/integration/test_hostile_input.py pins the door's answers to named cases and fuzzes
strings in the fields of /v1/jobs; this module covers the rest of the surface.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from sqlalchemy import text

from tests.conftest import ADMIN_KEY, REDIS_TEST_URL, Platform
from tests.helpers import assert_openai_error, client, error_code, new_tenant, wait_for
from tests.integration.batch_helpers import finished, jsonl, line, lines_of, sdk, submit
from tests.integration.celery_proc import CeleryWorker
from tierq.core.redis_names import RedisNames
from tierq.core.tiers import Tier

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
DEEP = "__deep__"  # stands for 10,000 nested lists, spliced into the raw JSON
DEEP_JSON = "[" * 10_000 + "]" * 10_000

# Text no field may hold (NUL, lone surrogates), digits that are not ASCII, numbers as
# text past every range, dates no calendar has, and the empty and blank strings.
HOSTILE_TEXT = [
    "a\x00b",
    "\x00",
    "\ud800",
    "x\udfff",
    "²",
    "٣",
    "\uff11\uff12",  # fullwidth digits
    "",
    " ",
    "9" * 41,  # one digit past what a money column holds
    "-" + "9" * 40,
    "1e309",
    "NaN",
    "0001-01-01T00:00:00+14:00",
    "9999-12-31T23:59:59-14:00",
    "2024-02-30",
    "9999-12",  # a month whose end no calendar has
    "0000-01",
    "2024-1",
    "-99999999999999",
]
HOSTILE_NUMBERS = [
    10**30,
    -(10**30),
    2**63,
    -(2**63) - 1,
    2**64,
    1e308,
    -1e308,
    float("nan"),  # written as NaN and Infinity, which Python's JSON parser takes
    float("inf"),
    -1,
    0,
    0.5,
]
WRONG_TYPES: list[Any] = [None, True, [], {}, ["x", 1], {"k": {"k": "v"}}]
hostile_text = st.sampled_from(HOSTILE_TEXT) | st.builds(
    lambda a, b: a + b, st.text(max_size=4), st.sampled_from(["\x00", "\ud800", "²"])
)
hostile_value = st.one_of(
    hostile_text, st.sampled_from(HOSTILE_NUMBERS), st.sampled_from(WRONG_TYPES), st.just(DEEP)
)

# A body each route takes, and the fields (paths into it) a hostile value replaces.
JOB = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "metadata": {"k": "v"}}
OPENAI_COMMON = [
    ("model",),
    ("temperature",),
    ("top_p",),
    ("n",),
    ("stop",),
    ("stop", 0),
    ("seed",),
    ("presence_penalty",),
    ("frequency_penalty",),
    ("min_tokens",),
    ("ignore_eos",),
    ("stream",),
    ("stream_options",),
    ("service_tier",),
    ("user",),
    ("metadata", "k"),
    ("metadata",),
    ("store",),
    ("max_tokens",),
    ("logprobs",),
    ("surprise",),
]
BODIES: dict[str, tuple[dict[str, Any], list[tuple[Any, ...]]]] = {
    "/v1/jobs": (
        JOB,
        [
            ("tier",),
            ("model",),
            ("messages",),
            ("messages", 0),
            ("messages", 0, "role"),
            ("messages", 0, "content"),
            ("messages", 0, "name"),
            ("prompt",),
            ("max_tokens",),
            ("temperature",),
            ("top_p",),
            ("stop",),
            ("seed",),
            ("presence_penalty",),
            ("frequency_penalty",),
            ("min_tokens",),
            ("ignore_eos",),
            ("metadata",),
            ("metadata", "k"),
            ("surprise",),
        ],
    ),
    CHAT: (
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 4,
            "metadata": {"k": "v"},
            "stop": ["x"],
        },
        [
            *OPENAI_COMMON,
            ("messages", 0, "content"),
            ("messages", 0, "content", 0, "text"),
            ("messages", 0, "content", 0, "type"),
            ("messages", 0, "role"),
            ("messages", 0, "name"),
            ("max_completion_tokens",),
            ("parallel_tool_calls",),
        ],
    ),
    COMPLETIONS: (
        {"model": MODEL, "prompt": ["hi"], "max_tokens": 4, "metadata": {"k": "v"}, "stop": ["x"]},
        [*OPENAI_COMMON, ("prompt",), ("prompt", 0), ("echo",), ("best_of",)],
    ),
    "/v1/batches": (
        {"input_file_id": "FILE", "endpoint": CHAT, "completion_window": "24h"},
        [("input_file_id",), ("endpoint",), ("completion_window",), ("metadata",), ("x",)],
    ),
    "/admin/tenants": (
        {"name": "NAME", "allowed_tiers": ["standard"], "default_tier": "standard"},
        [("name",), ("allowed_tiers",), ("allowed_tiers", 0), ("default_tier",), ("weight",)],
    ),
    "/admin/tenants/VICTIM": (
        {"weight": 2},
        [("name",), ("allowed_tiers",), ("default_tier",), ("weight",), ("status",)],
    ),
    "/admin/tenants/VICTIM/quota": (
        {"max_queued": 100, "tier": "batch"},
        [
            ("tier",),
            ("requests_per_minute",),
            ("tokens_per_minute",),
            ("max_running",),
            ("max_queued",),
            ("token_budget",),
            ("spend_budget",),
            ("budget_period",),
        ],
    ),
    "/admin/prices": (
        {
            "model": "fuzz-model",
            "tier": "batch",
            "input_per_million": "1",
            "output_per_million": "2",
        },
        [("model",), ("tier",), ("input_per_million",), ("output_per_million",)],
    ),
}
METHODS = {
    "/admin/tenants/VICTIM": "PATCH",
    "/admin/tenants/VICTIM/quota": "PUT",
    "/admin/prices": "PUT",
}
FIELDS = [(route, path) for route, (_, paths) in BODIES.items() for path in paths]

# Every route with query parameters, and its parameters.
QUERIES = [
    ("GET", "/v1/jobs", ["status", "tier", "after", "limit"]),
    ("GET", "/v1/files", ["purpose", "after", "limit", "order"]),
    ("GET", "/v1/batches", ["after", "limit"]),
    ("GET", "/v1/models", ["x"]),
    ("GET", "/v1/usage", ["from", "to", "group_by"]),
    ("GET", "/admin/tenants", ["after", "limit"]),
    ("GET", "/admin/tenants/VICTIM/usage", ["from", "to", "group_by"]),
    ("GET", "/admin/invoices", ["tenant", "period", "format"]),
    ("GET", "/admin/invoices.csv", ["tenant", "period"]),
    ("POST", "/admin/invoices/rollup", ["period"]),
    ("GET", "/admin/metrics", ["x"]),
]
# Every route with an id in its path.
PATHS = [
    ("GET", "/v1/jobs/{}"),
    ("POST", "/v1/jobs/{}/cancel"),
    ("GET", "/v1/jobs/{}/events"),
    ("GET", "/v1/models/{}"),
    ("GET", "/v1/files/{}"),
    ("DELETE", "/v1/files/{}"),
    ("GET", "/v1/files/{}/content"),
    ("GET", "/v1/batches/{}"),
    ("POST", "/v1/batches/{}/cancel"),
    ("GET", "/admin/tenants/{}"),
    ("DELETE", "/admin/tenants/{}"),
    ("POST", "/admin/tenants/{}/suspend"),
    ("POST", "/admin/tenants/{}/resume"),
    ("POST", "/admin/tenants/{}/keys"),
    ("GET", "/admin/tenants/{}/keys"),
    ("DELETE", "/admin/keys/{}"),
    ("GET", "/admin/tenants/{}/quota"),
    ("PUT", "/admin/tenants/{}/quota"),
    ("GET", "/admin/tenants/{}/usage"),
    ("POST", "/admin/batches/{}/cancel"),
    ("GET", "/static/docs/{}"),
    ("GET", "/console/static/{}"),
]

FUZZ = settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def raw_json(body: Any) -> bytes:
    """JSON as a hostile client writes it: lone surrogates escaped (`\\ud800`), integers
    of any size, and DEEP as 10,000 nested lists."""
    return json.dumps(body).replace(json.dumps(DEEP), DEEP_JSON).encode()


def with_value(body: Any, path: tuple[Any, ...], value: Any) -> Any:
    """A copy of `body` with `value` at `path` (made where it is missing)."""
    body = json.loads(json.dumps(body))
    if not path:
        return value
    node = body
    for key in path[:-1]:
        if isinstance(node, list) and isinstance(key, int) and key < len(node):
            node = node[key]
        elif isinstance(node, dict):
            node = node.setdefault(key, {})
        else:
            return body
    if isinstance(node, list) and isinstance(path[-1], int):
        node[path[-1] % max(len(node), 1) :] = [value]
    elif isinstance(node, dict):
        node[path[-1]] = value
    return body


def escaped(value: str) -> str:
    """A path segment or query value as raw bytes on the wire (a lone surrogate as the
    invalid UTF-8 it encodes to)."""
    return quote(value, safe="", errors="surrogatepass")


class Fuzzed:
    """The platform, a tenant's and the admin's clients, and a victim tenant for the admin
    routes; `written()` is what a refused request must leave unchanged."""

    def __init__(self, platform: Platform, tenants: dict[str, str], key: str) -> None:
        self.platform = platform
        self.tenants = tenants  # name -> id: the fuzzing tenant and the victim
        self.tenant = client(platform.url, key)
        self.admin = client(platform.url, ADMIN_KEY)
        # Its own connection, retried: other suites on this Redis may CLIENT KILL it.
        self.r = aioredis.Redis.from_url(
            REDIS_TEST_URL,
            decode_responses=True,
            retry=Retry(ExponentialBackoff(), 5),
            retry_on_error=[redis.ConnectionError],
        )
        names = RedisNames(platform.settings.redis_prefix)
        self.streams = [names.tier_stream(t, i) for t in Tier for i in tenants.values()]
        self.file_id = ""
        self.job_id = ""

    @property
    def victim(self) -> str:
        return self.tenants["victim"]

    async def written(self) -> tuple[Any, ...]:
        async with self.platform.db.session() as s:
            rows = [tuple(map(tuple, (await s.execute(text(sql))).all())) for sql in WRITTEN]
        async with self.r.pipeline(transaction=False) as pipe:
            for key in self.streams:
                pipe.xinfo_stream(key)
            infos = await pipe.execute(raise_on_error=False)
        # Entries ever added to the tenants' tier streams: admission's only writes there.
        added = [i["entries-added"] if isinstance(i, dict) else 0 for i in infos]
        files_dir = self.platform.settings.resolved_files_dir
        on_disk = sorted(p.name for p in files_dir.iterdir()) if files_dir.exists() else []
        return (*rows, tuple(added), tuple(on_disk))

    async def check(
        self, c: httpx.AsyncClient, method: str, url: str, **kwargs: Any
    ) -> httpx.Response:
        """Send a request: never a 5xx, a 4xx in OpenAI's shape, and nothing written when
        refused. A 503 service_unavailable is an outage (other suites on this Redis kill its
        connections), not an answer to the input: retried, as the SDKs do."""
        for _ in range(5):
            before = await self.written()
            resp = await c.request(method, url, **kwargs)
            if resp.status_code != 503 or error_code(resp) != "service_unavailable":
                break
            await asyncio.sleep(0.5)
        assert resp.status_code < 500, resp.text
        if resp.status_code >= 400:
            sent = (resp.request.method, str(resp.request.url), resp.request.headers)
            assert resp.headers.get("content-type") == "application/json", (sent, resp.text)
            assert_openai_error(resp, resp.status_code)
            assert await self.written() == before, resp.text
        return resp

    async def close(self) -> None:
        await self.tenant.aclose()
        await self.admin.aclose()
        await self.r.aclose()


# What a refused request must leave as it was (a worker changes none of it, but the count
# of job rows: jobs it runs are counted, not their states).
WRITTEN = (
    "SELECT count(*) FROM jobs",
    "SELECT count(*) FROM batches",
    "SELECT count(*) FROM invoices",
    "SELECT id, filename, bytes, purpose FROM files ORDER BY id",
    "SELECT id, name, status, CAST(allowed_tiers AS TEXT), default_tier, weight FROM tenants"
    " ORDER BY id",
    "SELECT id, tenant_id, revoked_at FROM api_keys ORDER BY id",
    "SELECT tenant_id, tier, requests_per_minute, tokens_per_minute, max_running, max_queued,"
    " token_budget, spend_budget, budget_period FROM quotas ORDER BY tenant_id, tier",
    "SELECT id, model, tier, input_per_million, output_per_million FROM prices ORDER BY id",
)


@pytest.fixture
async def fuzzed(running: Platform) -> AsyncIterator[Fuzzed]:
    tenant_id, key = await new_tenant(running)
    victim, _ = await new_tenant(running)
    fuzz = Fuzzed(running, {"tenant": tenant_id, "victim": victim}, key)
    upload = await fuzz.tenant.post(
        "/v1/files", files={"file": ("in.jsonl", b"{}\n")}, data={"purpose": "batch"}
    )
    assert upload.status_code == 200, upload.text
    fuzz.file_id = upload.json()["id"]
    job = (await fuzz.tenant.post("/v1/jobs", json=JOB)).json()
    fuzz.job_id = (await wait_for(fuzz.tenant, job["id"]))["id"]
    yield fuzz
    await fuzz.close()


def _route(fuzz: Fuzzed, route: str) -> tuple[str, httpx.AsyncClient]:
    path = route.replace("VICTIM", fuzz.victim)
    return path, fuzz.admin if route.startswith("/admin") else fuzz.tenant


@FUZZ
@given(field=st.sampled_from(FIELDS), value=hostile_value)
async def test_fuzz_every_body_field(
    fuzzed: Fuzzed, field: tuple[str, tuple[Any, ...]], value: Any
) -> None:
    route, path = field
    base, _ = BODIES[route]
    base = json.loads(
        json.dumps(base)
        .replace('"FILE"', json.dumps(fuzzed.file_id))
        .replace('"NAME"', json.dumps(f"t-{uuid.uuid4().hex[:8]}"))
    )
    url, c = _route(fuzzed, route)
    body = raw_json(with_value(base, path, value))
    headers = {"Content-Type": "application/json"}
    await fuzzed.check(c, METHODS.get(route, "POST"), url, content=body, headers=headers)


@FUZZ
@given(route=st.sampled_from(sorted(BODIES)), value=hostile_value)
async def test_fuzz_whole_bodies(fuzzed: Fuzzed, route: str, value: Any) -> None:
    url, c = _route(fuzzed, route)
    for content in (raw_json(value), raw_json([value]), b"\xff\xfe{", b'{"a": 1,}'):
        headers = {"Content-Type": "application/json"}
        await fuzzed.check(c, METHODS.get(route, "POST"), url, content=content, headers=headers)


@FUZZ
@given(
    query=st.sampled_from(QUERIES),
    data=st.data(),
    value=hostile_text | st.sampled_from([str(n) for n in HOSTILE_NUMBERS]),
)
async def test_fuzz_every_query_parameter(
    fuzzed: Fuzzed, query: tuple[str, str, list[str]], data: st.DataObject, value: str
) -> None:
    method, route, names = query
    name = data.draw(st.sampled_from(names))
    url, c = _route(fuzzed, route)
    await fuzzed.check(c, method, f"{url}?{escaped(name)}={escaped(value)}")
    # The name itself hostile, too.
    await fuzzed.check(c, method, f"{url}?{escaped(value)}=1")


@FUZZ
@given(route=st.sampled_from(PATHS), value=hostile_text)
async def test_fuzz_every_path_segment(fuzzed: Fuzzed, route: tuple[str, str], value: str) -> None:
    method, template = route
    c = fuzzed.admin if template.startswith("/admin") else fuzzed.tenant
    url = template.format(escaped(value) or "%20")
    kwargs: dict[str, Any] = {}
    if method == "PUT":
        kwargs = {"json": {}}
    await fuzzed.check(c, method, url, **kwargs)


def header(value: str | bytes) -> bytes:
    """A header value as raw bytes: non-ASCII as UTF-8, a lone surrogate as invalid UTF-8.
    NUL, CR, LF and whitespace at either end cannot be sent in a header at all (the HTTP
    client refuses them)."""
    raw = value if isinstance(value, bytes) else value.encode("utf-8", errors="surrogatepass")
    return raw.replace(b"\x00", b"").replace(b"\r", b"").replace(b"\n", b"").strip(b" \t")


# Other control characters in a header are refused by uvicorn's HTTP parser before the app
# sees the request: a plain-text 400 that is the server's, not the API's.
CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


@FUZZ
@given(value=hostile_text | st.sampled_from(["1", "0", "-1", "1e3", " 2", "2 ", "x" * 300]))
async def test_fuzz_headers(fuzzed: Fuzzed, value: str) -> None:
    raw = header(value)
    events = f"/v1/jobs/{fuzzed.job_id}/events"
    if CONTROL.search(raw):
        before = await fuzzed.written()
        try:
            resp = await fuzzed.tenant.post("/v1/jobs", json=JOB, headers={"Idempotency-Key": raw})
        except httpx.LocalProtocolError:
            return  # nor does the HTTP client send all of them
        assert resp.status_code == 400 and await fuzzed.written() == before
        return
    resp = await fuzzed.check(fuzzed.tenant, "GET", events, headers={"Last-Event-ID": raw})
    if raw and not (raw.isascii() and raw.isdigit() and len(raw) < 19):
        assert_openai_error(resp, 400, "invalid_last_event_id")
    elif not raw:
        assert resp.status_code == 200, resp.text  # no id: the events from the start
    await fuzzed.check(
        fuzzed.tenant, "POST", "/v1/jobs", json=JOB, headers={"Idempotency-Key": raw}
    )
    for c in (fuzzed.tenant, fuzzed.admin):  # a hostile key: 401, not a 500
        bearer = header(b"Bearer " + raw)
        await fuzzed.check(c, "GET", "/v1/models", headers={"Authorization": bearer})
        await fuzzed.check(c, "GET", "/admin/tenants", headers={"Authorization": bearer})
        await fuzzed.check(c, "GET", "/v1/models", headers={"Authorization": raw})


def multipart(parts: list[tuple[bytes, bytes | None, bytes]]) -> tuple[bytes, str]:
    """A multipart/form-data body written by hand: (name, filename or None, content) parts,
    as raw bytes (so a name may hold what no HTTP client library would write)."""
    boundary = uuid.uuid4().hex
    out = bytearray()
    for name, filename, content in parts:
        out += b"--" + boundary.encode() + b"\r\n"
        out += b'Content-Disposition: form-data; name="' + name + b'"'
        if filename is not None:
            out += b'; filename="' + filename + b'"'
        out += b"\r\n\r\n" + content + b"\r\n"
    out += b"--" + boundary.encode() + b"--\r\n"
    return bytes(out), f"multipart/form-data; boundary={boundary}"


def utf8(value: str) -> bytes:
    return value.encode("utf-8", errors="surrogatepass")


@FUZZ
@given(
    field=st.sampled_from(
        ["purpose", "expires_after[anchor]", "expires_after[seconds]", "expires_after[x]", "x"]
    ),
    value=hostile_text | st.sampled_from(["3600", "2592001", str(10**30), "-3600"]),
    filename=hostile_text | st.sampled_from(["../../etc/passwd", "/", "a" * 10_000, "..", "."]),
    file_field=st.booleans(),
)
async def test_fuzz_uploads(
    fuzzed: Fuzzed, field: str, value: str, filename: str, file_field: bool
) -> None:
    fields = {"purpose": "batch", "expires_after[anchor]": "created_at"}
    fields["expires_after[seconds]"] = "3600"
    fields[field] = value
    parts: list[tuple[bytes, bytes | None, bytes]] = [
        (utf8(k), None, utf8(v)) for k, v in fields.items()
    ]
    parts.append((b"file" if file_field else utf8(value), utf8(filename), b"{}\n"))
    body, content_type = multipart(parts)
    headers = {"Content-Type": content_type}
    resp = await fuzzed.check(fuzzed.tenant, "POST", "/v1/files", content=body, headers=headers)
    if resp.status_code == 200:  # taken: its name is one PostgreSQL could store
        assert "\x00" not in resp.json()["filename"]


# --- batch lines ---------------------------------------------------------------------------

# Lines no batch may take: the whole batch fails validation, each line named.
UNSTORABLE_LINES: list[Any] = [
    line("nul\x00id"),
    line("\ud800"),
    line("c3", model="a\x00b"),
    line("c4", "x\udfff"),
    line("c5", max_tokens=10**30),
    line("c6", seed=-(10**30)),
    line("c7", metadata={"k\x00": "v"}),
    line("c8", stop=["\x00"]),
    {**line("c9"), "method": "POST\x00"},
    {**line("c10"), "url": "/v1/chat/completions\x00"},
    line(10**30),  # type: ignore[arg-type]
    line("c12", deep=DEEP),
    # JSON that Python's parser refuses (an integer of over 4,300 digits): written out by
    # hand, since json.dumps refuses it too.
    b'{"custom_id": "c13", "method": "POST", "url": "/v1/chat/completions", "body": '
    b'{"model": "SmolLM2-135M-Instruct", "max_tokens": ' + b"9" * 5000 + b"}}",
]
# Lines that parse and can be stored but cannot run: each an error line of its own.
WRONG_LINES: list[Any] = [
    line("w-digits", max_tokens="²"),
    line("w-arabic", max_tokens="٣"),
    line("w-no-model", model=None),
    line("w-empty-content", ""),
    line("w-no-messages", messages=[]),
    line("w-wrong-type", messages="hi"),
    line("w-temperature", temperature="NaN"),
    line("w-huge", max_tokens=2**62),
    line("w-negative", max_tokens=-(2**62)),
    line("w-float", temperature=1e308),
    line("w-bool", n=True, best_of=2),
    line("w-stop", stop=["", ""]),
    line("w-meta", metadata={"k": 1}),
    line("w-unknown", tools=[{"type": "function"}]),
    line("w-date", seed="9999-12-31T23:59:59-14:00"),
]


async def test_hostile_batch_lines_end_as_errors_of_their_own(
    running: Platform, tenant_key: str
) -> None:
    # Any storable custom_id is an id; an empty model is the served one.
    good = [line("ok-1"), line("²٣"), line(" "), line("empty-model", model="")]
    c = sdk(running, tenant_key)
    celery = CeleryWorker(running.settings)
    celery.start()
    try:
        batches = [
            await submit(
                c, jsonl([item if isinstance(item, bytes) else raw_json(item) for item in items])
            )
            for items in (good[:1] + UNSTORABLE_LINES, good + WRONG_LINES)
        ]
        refused, wrong = [await finished(c, b.id, celery) for b in batches]
    finally:
        celery.stop()

    # Unstorable lines: validation fails, naming each of them (line 1 is the good one).
    assert refused.status == "failed", refused
    assert refused.errors is not None and refused.errors.data is not None
    assert {e.line for e in refused.errors.data} == set(range(2, len(UNSTORABLE_LINES) + 2))
    assert {e.code for e in refused.errors.data} <= {"invalid_request", "invalid_json_line"}
    async with running.db.session() as s:
        sql = text("SELECT count(*) FROM jobs WHERE batch_id = :b")
        assert (await s.execute(sql, {"b": refused.id})).scalar() == 0

    # Lines that cannot run: each one an error line; the good ones answered.
    assert wrong.status == "completed", wrong
    output = await lines_of(c, wrong.output_file_id)
    errors = await lines_of(c, wrong.error_file_id)
    assert sorted(x["custom_id"] for x in output) == sorted(x["custom_id"] for x in good)
    assert sorted(x["custom_id"] for x in errors) == sorted(x["custom_id"] for x in WRONG_LINES)
    for err in errors:
        assert err["error"]["code"] and err["error"]["message"], err
        assert err["response"] is None or err["response"]["status_code"] < 500, err
    counts = wrong.request_counts
    assert counts is not None
    assert (counts.total, counts.completed, counts.failed) == (
        len(good) + len(WRONG_LINES),
        len(good),
        len(WRONG_LINES),
    )
