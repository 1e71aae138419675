"""Bad input gets a clear 4xx in OpenAI's error shape, and nothing is enqueued or written."""

from __future__ import annotations

import pytest

from tests.conftest import Platform
from tests.helpers import assert_openai_error, client

pytestmark = pytest.mark.integration

OK = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


async def _nothing_written(platform: Platform, key: str | None = None) -> None:
    if key is not None:
        async with client(platform.url, key) as c:
            assert (await c.get("/v1/jobs")).json()["data"] == []
    names = platform.dispatcher.names
    assert [k async for k in platform.r.scan_iter(match=f"{names.prefix}:stream:*")] == []


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({**OK, "tier": "platinum"}, "invalid_request", "tier"),
        ({"max_tokens": 8}, "invalid_request", None),
        ({**OK, "prompt": "both"}, "invalid_request", None),
        ({"prompt": "   ", "max_tokens": 8}, "invalid_request", None),
        ({"messages": [], "max_tokens": 8}, "invalid_request", "messages"),
        ({"messages": [{"role": "user", "content": ""}]}, "invalid_request", None),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "invalid_request", None),
        ({**OK, "max_tokens": 0}, "invalid_request", "max_tokens"),
        ({**OK, "max_tokens": "many"}, "invalid_request", "max_tokens"),
        ({**OK, "max_tokens": 4096}, "context_length_exceeded", "max_tokens"),
        ({**OK, "temperature": 3}, "invalid_request", "temperature"),
        ({**OK, "top_p": 0}, "invalid_request", "top_p"),
        ({**OK, "stop": ["a", "b", "c", "d", "e"]}, "invalid_request", "stop"),
        ({**OK, "metadata": {"k": "v" * 600}}, "invalid_request", "metadata"),
        ({**OK, "surprise": True}, "invalid_request", "surprise"),
        ({**OK, "model": "gpt-9"}, "model_not_found", "model"),
        ([1, 2, 3], "invalid_request", None),
    ],
)
async def test_invalid_bodies_are_refused(
    platform: Platform, tenant_key: str, body: object, code: str, param: str | None
) -> None:
    async with client(platform.url, tenant_key) as c:
        resp = await c.post("/v1/jobs", json=body)
    status = 404 if code == "model_not_found" else 400
    assert_openai_error(resp, status, code)
    if param is not None:
        assert resp.json()["error"]["param"] == param
    await _nothing_written(platform, tenant_key)


async def test_malformed_json_is_refused(platform: Platform, tenant_key: str) -> None:
    async with client(platform.url, tenant_key) as c:
        resp = await c.post(
            "/v1/jobs", content=b'{"messages": [', headers={"Content-Type": "application/json"}
        )
    assert_openai_error(resp, 400, "invalid_request")
    assert "JSON" in resp.json()["error"]["message"]
    await _nothing_written(platform, tenant_key)


async def test_a_prompt_too_long_for_the_limit_is_refused(
    platform: Platform, tenant_key: str
) -> None:
    platform.settings.max_prompt_chars = 100
    async with client(platform.url, tenant_key) as c:
        resp = await c.post("/v1/jobs", json={"prompt": "x" * 101, "max_tokens": 4})
    assert_openai_error(resp, 400, "context_length_exceeded")
    await _nothing_written(platform, tenant_key)


async def test_a_body_over_the_size_limit_is_refused(platform: Platform, tenant_key: str) -> None:
    huge = {"prompt": "x" * 2_000_000, "max_tokens": 4}
    async with client(platform.url, tenant_key) as c:
        resp = await c.post("/v1/jobs", json=huge)
        assert_openai_error(resp, 413, "request_too_large")

        async def chunks():  # no Content-Length: the limit holds for a streamed body too
            for _ in range(30):
                yield b"x" * 100_000

        streamed = await c.post(
            "/v1/jobs", content=chunks(), headers={"Content-Type": "application/json"}
        )
        assert_openai_error(streamed, 413, "request_too_large")
    await _nothing_written(platform, tenant_key)


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({}, "missing_api_key"),
        ({"Authorization": "Bearer tq-not-a-real-key"}, "invalid_api_key"),
        ({"Authorization": "Basic dXNlcjpwYXNz"}, "missing_api_key"),
        ({"Authorization": "Bearer"}, "missing_api_key"),
    ],
)
async def test_missing_or_wrong_keys_are_refused(
    platform: Platform, headers: dict[str, str], code: str
) -> None:
    async with client(platform.url, None) as c:
        for resp in (
            await c.post("/v1/jobs", json=OK, headers=headers),
            await c.get("/v1/jobs", headers=headers),
            await c.get("/v1/jobs/job_x", headers=headers),
        ):
            assert_openai_error(resp, 401, code)
    await _nothing_written(platform)


async def test_unknown_routes_and_ids_answer_in_the_error_shape(
    platform: Platform, tenant_key: str
) -> None:
    async with client(platform.url, tenant_key) as c:
        assert_openai_error(await c.get("/v1/nope"), 404)
        assert_openai_error(await c.get("/v1/jobs/job_missing"), 404, "job_not_found")
        assert_openai_error(await c.delete("/v1/jobs"), 405)
        assert_openai_error(await c.get("/v1/jobs", params={"status": "sleeping"}), 400)
        assert_openai_error(await c.get("/v1/jobs", params={"limit": 0}), 400)
        bad_last = await c.get("/v1/jobs/job_x/events", headers={"Last-Event-ID": "x"})
        assert_openai_error(bad_last, 404, "job_not_found")
        # For a job that exists, the header itself is judged: a 400, never a 500.
        job = (await c.post("/v1/jobs", json=OK)).json()
        # Non-ASCII digits travel as raw bytes, as a hostile client sends them.
        superscript_two, fullwidth_one = b"\xb2", "\uff11".encode()
        for bad in (b"x", b"-1", b"1.5", superscript_two, fullwidth_one, b"9" * 40):
            resp = await c.get(f"/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": bad})
            assert_openai_error(resp, 400, "invalid_last_event_id")
