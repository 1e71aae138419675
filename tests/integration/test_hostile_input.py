"""Hostile input is refused at the door with a 4xx in OpenAI's error shape, on the real
PostgreSQL (SQLite stores a NUL that PostgreSQL refuses: only PostgreSQL shows the 500s),
and nothing is written for a refused request. After a job's final SSE event, reconnecting
with its id answers 204, which ends a browser's EventSource."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import ADMIN_KEY, Platform
from tests.helpers import assert_openai_error, client, read_sse, wait_for

pytestmark = pytest.mark.integration

OK = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
NUL, SURROGATE = "a\u0000b", "a\ud800b"
HUGE = 10**30


def raw_json(body: Any) -> bytes:
    """JSON as a client may send it: lone surrogates escaped (json.dumps' default)."""
    return json.dumps(body).encode()


async def post(c: httpx.AsyncClient, path: str, body: Any) -> httpx.Response:
    return await c.post(path, content=raw_json(body), headers={"Content-Type": "application/json"})


async def no_jobs(platform: Platform, key: str) -> None:
    async with client(platform.url, key) as c:
        assert (await c.get("/v1/jobs")).json()["data"] == []
    names = platform.dispatcher.names
    assert [k async for k in platform.r.scan_iter(match=f"{names.prefix}:stream:*")] == []


JOB_BODIES = [
    {**OK, "messages": [{"role": "user", "content": NUL}]},
    {**OK, "messages": [{"role": "user", "content": SURROGATE}]},
    {"prompt": NUL, "max_tokens": 8},
    {**OK, "metadata": {"k": NUL}},
    {**OK, "metadata": {NUL: "v"}},
    {**OK, "stop": [NUL]},
    {**OK, "seed": HUGE},
    {**OK, "max_tokens": HUGE},
    {
        **OK,
        "metadata": {"k": "v"},
        "deep": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]],
    },
]


@pytest.mark.parametrize("body", JOB_BODIES)
async def test_a_job_body_holding_what_postgres_cannot_store_is_a_400(
    platform: Platform, tenant_key: str, body: dict[str, Any]
) -> None:
    async with client(platform.url, tenant_key) as c:
        resp = await post(c, "/v1/jobs", body)
        assert_openai_error(resp, 400)
        chat = await post(c, "/v1/chat/completions", {**body, "model": "SmolLM2-135M-Instruct"})
        assert_openai_error(chat, 400)
    await no_jobs(platform, tenant_key)


async def test_the_content_types_case_or_its_absence_does_not_let_it_past(
    platform: Platform, tenant_key: str
) -> None:
    # FastAPI parses a body as JSON whatever the case of its type: the guard scans every
    # body that is not a form (a route may read any other itself).
    body = raw_json({"prompt": NUL, "max_tokens": 8})
    chat = raw_json({**JOB_BODIES[0], "model": "SmolLM2-135M-Instruct"})
    async with client(platform.url, tenant_key) as c:
        for headers in ({"Content-Type": "Application/JSON"}, {"Content-Type": "TEXT/JSON"}, {}):
            assert_openai_error(await c.post("/v1/jobs", content=body, headers=headers), 400)
            resp = await c.post("/v1/chat/completions", content=chat, headers=headers)
            assert_openai_error(resp, 400)
        # JSON in UTF-16 (json.loads reads it): the NUL escape's bytes are not UTF-8's.
        utf16 = json.dumps({"prompt": NUL, "max_tokens": 8}).encode("utf-16-le")
        resp = await c.post("/v1/jobs", content=utf16, headers={"Content-Type": "application/json"})
        assert_openai_error(resp, 400)
        # Valid JSON that Python's parser refuses (an integer of over 4,300 digits).
        huge = b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"
        resp = await c.post("/v1/jobs", content=huge, headers={"Content-Type": "application/json"})
        assert_openai_error(resp, 400)
    async with client(platform.url, ADMIN_KEY) as a:
        name = raw_json({"name": NUL})
        resp = await a.post(
            "/admin/tenants", content=name, headers={"Content-Type": "Application/Json"}
        )
        assert_openai_error(resp, 400)
        names = [t["name"] for t in (await a.get("/admin/tenants")).json()["data"]]
        assert not any("\x00" in n for n in names)
    await no_jobs(platform, tenant_key)


async def test_queries_paths_and_the_admin_api_refuse_it_too(
    platform: Platform, tenant_key: str
) -> None:
    async with client(platform.url, tenant_key) as c:
        assert_openai_error(await c.get("/v1/jobs", params={"status": NUL}), 400)
        assert_openai_error(await c.get("/v1/jobs", params={"after": NUL}), 400)
        assert_openai_error(await c.get("/v1/jobs/job_%00x"), 400)
        assert_openai_error(await c.get("/v1/usage", params={"from": "1000000000000000000"}), 400)
        for edge in ("9999-12-31T23:59:59-14:00", "0001-01-01T00:00:00+14:00", "-99999999999"):
            assert (await c.get("/v1/usage", params={"from": edge})).status_code < 500, edge
    async with client(platform.url, ADMIN_KEY) as a:
        assert_openai_error(await post(a, "/admin/tenants", {"name": NUL}), 400)
        tenant = (await post(a, "/admin/tenants", {"name": "fine"})).json()
        for quota in ({"max_running": HUGE}, {"requests_per_minute": 2**40}):
            resp = await a.put(f"/admin/tenants/{tenant['id']}/quota", json=quota)
            assert_openai_error(resp, 400)


async def test_after_the_final_event_a_reconnect_is_answered_204(
    platform: Platform, tenant_key: str
) -> None:
    platform.start_dispatcher()
    await platform.start_worker("w1")
    async with client(platform.url, tenant_key) as c:
        job = (await c.post("/v1/jobs", json=OK)).json()
        await wait_for(c, job["id"])
        events = await read_sse(c, f"/v1/jobs/{job['id']}/events")
        assert events[-1]["event"] == "done"
        again = await c.get(
            f"/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": events[-1]["id"]}
        )
        assert again.status_code == 204
        # One event short of the end still gets the final event.
        rest = await read_sse(
            c, f"/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": events[-2]["id"]}
        )
        assert [e["event"] for e in rest] == ["done"]

        # Once the replay buffer has expired (here: removed), a reconnect short of the end
        # still gets the final event, from the database, with the whole job; the final
        # event's id then ends the reconnecting.
        await platform.r.delete(platform.dispatcher.names.job_events(job["id"]))
        late = await read_sse(
            c, f"/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": events[-2]["id"]}
        )
        assert [e["event"] for e in late] == ["done"]
        assert late[0]["data"]["result"] == events[-1]["data"]["result"]
        fresh = await read_sse(c, f"/v1/jobs/{job['id']}/events")
        assert [e["event"] for e in fresh] == ["delta", "done"]
        assert fresh[0]["data"]["text"] == events[-1]["data"]["result"]["text"]
        for final in (late[-1]["id"], fresh[-1]["id"]):
            again = await c.get(f"/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": final})
            assert again.status_code == 204, final


HOSTILE = st.sampled_from(["\u0000", "\ud800", "\udfff", "x\u0000", "\u0000" * 3])


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    field=st.sampled_from(["content", "prompt", "stop", "meta_key", "meta_value", "model"]),
    bad=HOSTILE,
    prefix=st.text(max_size=8),
)
async def test_fuzz_no_hostile_string_in_any_field_gets_past_the_door(
    platform: Platform, tenant_key: str, field: str, bad: str, prefix: str
) -> None:
    text = prefix + bad
    body: dict[str, Any] = dict(OK)
    if field == "content":
        body["messages"] = [{"role": "user", "content": text}]
    elif field == "prompt":
        body = {"prompt": text, "max_tokens": 8}
    elif field == "stop":
        body["stop"] = text
    elif field == "meta_key":
        body["metadata"] = {text: "v"}
    elif field == "meta_value":
        body["metadata"] = {"k": text}
    else:
        body["model"] = text
    async with client(platform.url, tenant_key) as c:
        resp = await post(c, "/v1/jobs", body)
    assert resp.status_code == 400, resp.text
    await no_jobs(platform, tenant_key)
