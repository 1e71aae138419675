"""The official `openai` SDK against tierq's OpenAI-compatible endpoints (simulated engine).

Requests go through the tiered queue like every job: admission, Redis, the dispatcher,
a worker. The SDK is used unchanged but for its base URL and key.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from openai import AsyncOpenAI
from sqlalchemy import text

from tests.conftest import Platform
from tests.helpers import assert_openai_error, until, until_async
from tierq.core.messages import Served
from tierq.models import jobs as job_repo
from tierq.models import tenants as tenant_repo
from tierq.workers.engine.simulated_engine import CostModel

pytestmark = pytest.mark.integration

HELLO = [{"role": "user", "content": "Say hello."}]


def sdk(platform: Platform, key: str, **kwargs: object) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{platform.url}/v1", api_key=key, **kwargs)  # type: ignore[arg-type]


async def _job(platform: Platform, job_id: str) -> job_repo.JobRecord:
    async with platform.db.session() as s:
        job = await job_repo.get_job(s, job_id)
    assert job is not None
    return job


async def test_models_lists_the_served_model(running: Platform, tenant_key: str) -> None:
    client = sdk(running, tenant_key)
    models = [m.id async for m in client.models.list()]
    assert models == [running.settings.served_model_name]
    assert (await client.models.retrieve(models[0])).id == models[0]
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("gpt-4o")


async def test_chat_completion_runs_as_a_job_of_the_default_tier(
    running: Platform, tenant_key: str
) -> None:
    client = sdk(running, tenant_key)
    raw = await client.chat.completions.with_raw_response.create(
        model=running.settings.served_model_name, messages=HELLO, max_tokens=12
    )
    completion = raw.parse()
    assert completion.object == "chat.completion"
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert completion.usage is not None and completion.usage.completion_tokens > 0
    assert completion.usage.total_tokens == (
        completion.usage.prompt_tokens + completion.usage.completion_tokens
    )
    assert completion.service_tier == "default"
    job = await _job(running, raw.headers["x-request-id"])
    assert job.tier.value == "standard" and job.status.value == "succeeded"
    assert job.result_text == choice.message.content
    assert job.completion_tokens == completion.usage.completion_tokens


async def test_service_tier_selects_the_tier_and_is_echoed(
    running: Platform, tenant_key: str
) -> None:
    client = sdk(running, tenant_key)
    expected = {"priority": ("interactive", "priority"), "flex": ("standard", "default")}
    for asked, (tier, echoed) in expected.items():
        raw = await client.chat.completions.with_raw_response.create(
            model=running.settings.served_model_name,
            messages=HELLO,
            max_tokens=4,
            service_tier=asked,  # type: ignore[arg-type]
        )
        assert raw.parse().service_tier == echoed
        assert (await _job(running, raw.headers["x-request-id"])).tier.value == tier


async def test_a_tier_the_tenant_may_not_use_is_refused_not_downgraded(
    running: Platform, tenant_key: str
) -> None:
    async with running.db.transaction() as s:
        tenant = await tenant_repo.tenant_for_key(s, tenant_key)
        assert tenant is not None
        await tenant_repo.set_tiers(s, tenant.id, ["standard", "batch"], "standard")
    client = sdk(running, tenant_key, max_retries=0)
    with pytest.raises(openai.PermissionDeniedError) as err:
        await client.chat.completions.create(
            model=running.settings.served_model_name,
            messages=HELLO,
            max_tokens=4,
            service_tier="priority",
        )
    assert err.value.code == "tier_not_allowed"
    async with running.db.session() as s:
        page, _ = await job_repo.list_jobs(s, tenant.id)
    assert page == []  # nothing was enqueued for it


async def test_the_first_chunk_of_a_stream_comes_with_the_first_token(
    platform: Platform, tenant_key: str
) -> None:
    """No chunk (not even the assistant's role) before a token exists: a client timing its
    first chunk measures the time to the first token, as with vLLM itself."""
    model = platform.settings.served_model_name
    body = {"model": model, "messages": HELLO, "max_tokens": 8, "stream": True}
    headers = {"Authorization": f"Bearer {tenant_key}"}
    async with (
        httpx.AsyncClient(base_url=platform.url, headers=headers, timeout=30) as c,
        c.stream("POST", "/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.aiter_lines()
        first = asyncio.ensure_future(lines.__anext__())
        # No dispatcher yet: the job waits in the queue. Nothing marks the moment a premature
        # chunk would have been sent: a second for one to show.
        await asyncio.sleep(1.0)
        assert not first.done()
        platform.start_dispatcher()
        await platform.start_worker("w1")
        role = json.loads((await first).removeprefix("data: "))
        assert role["choices"][0]["delta"]["role"] == "assistant"
        content = ""
        while not content:
            line = await lines.__anext__()
            if line.startswith("data: {"):
                content = json.loads(line.removeprefix("data: "))["choices"][0]["delta"].get(
                    "content", ""
                )
        assert content


async def test_streamed_chat_matches_the_stored_result_and_reports_usage(
    running: Platform, tenant_key: str
) -> None:
    client = sdk(running, tenant_key)
    stream = await client.chat.completions.create(
        model=running.settings.served_model_name,
        messages=HELLO,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
        service_tier="priority",
    )
    chunks = [c async for c in stream]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    job = await _job(running, "job_" + chunks[0].id.split("job_", 1)[1])
    assert job.result_text == text
    assert last.usage.completion_tokens == job.completion_tokens
    assert job.tier.value == "interactive"


async def test_text_completions_streamed_and_not(running: Platform, tenant_key: str) -> None:
    client = sdk(running, tenant_key)
    model = running.settings.served_model_name
    whole = await client.completions.create(model=model, prompt="Once upon a time", max_tokens=8)
    assert whole.object == "text_completion" and whole.choices[0].text
    assert whole.usage is not None and whole.usage.completion_tokens > 0
    stream = await client.completions.create(
        model=model, prompt=["Once upon a time"], max_tokens=8, stream=True
    )
    pieces = [c async for c in stream]
    assert "".join(c.choices[0].text for c in pieces if c.choices)
    assert pieces[-1].choices[0].finish_reason in ("stop", "length")


async def test_logprobs_plain_and_streamed_in_each_endpoints_shape(
    running: Platform, tenant_key: str
) -> None:
    """The simulated engine emits each token with certainty: log probability 0, every
    other candidate the floor. What is checked is where they go: each token's entry, in
    order, plain and streamed, chat and legacy, and the job keeps them."""
    client = sdk(running, tenant_key)
    model = running.settings.served_model_name
    chat = await client.chat.completions.create(
        model=model, messages=HELLO, max_tokens=6, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == chat.usage.completion_tokens == 6  # type: ignore[union-attr]
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    for t in content:
        assert t.logprob == 0.0 and t.bytes == list(t.token.encode())
        assert [c.logprob for c in t.top_logprobs] == [0.0, -9999.0, -9999.0]
        assert t.top_logprobs[0].token == t.token
    plain = await client.chat.completions.create(model=model, messages=HELLO, max_tokens=4)
    assert plain.choices[0].logprobs is None

    stream = await client.chat.completions.create(
        model=model, messages=HELLO, max_tokens=6, logprobs=True, stream=True
    )
    chunks = [c async for c in stream]
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content or []
    ]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "".join(t.token for t in streamed) == text and len(streamed) == 6
    assert all(t.top_logprobs == [] for t in streamed)  # top_logprobs 0: the chosen only
    job = await _job(running, "job_" + chunks[0].id.split("job_", 1)[1])
    assert job.result_logprobs == [t.model_dump() for t in streamed]

    legacy = await client.completions.create(model=model, prompt="Once", max_tokens=5, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 5
    assert "".join(lp.tokens) == legacy.choices[0].text
    assert lp.token_logprobs == [0.0] * 5 and lp.text_offset is not None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert lp.top_logprobs is not None and all(len(top) == 2 for top in lp.top_logprobs)
    pieces = [
        c
        async for c in await client.completions.create(
            model=model, prompt="Once", max_tokens=5, logprobs=1, stream=True
        )
    ]
    offsets = [
        o for c in pieces if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset or []
    ]
    tokens = [
        t for c in pieces if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens or []
    ]
    assert "".join(tokens) == "".join(c.choices[0].text for c in pieces)
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]

    # Refused: past the bounds, and top_logprobs without logprobs.
    async with httpx.AsyncClient(base_url=running.url) as raw:
        auth = {"Authorization": f"Bearer {tenant_key}"}
        # The native API takes them too, and its job's result carries them.
        made = await raw.post(
            "/v1/jobs", json={"prompt": "Once", "max_tokens": 3, "logprobs": 1}, headers=auth
        )
        assert made.status_code in (200, 201, 202), made.text
        native_url = f"/v1/jobs/{made.json()['id']}"

        async def succeeded() -> bool:
            return (await raw.get(native_url, headers=auth)).json()["status"] == "succeeded"

        await until_async(succeeded, "the native job succeeded", 5)
        result = (await raw.get(native_url, headers=auth)).json()["result"]
        assert [e["token"] for e in result["logprobs"]] == [" tok1", " tok2", " tok3"]
        assert all(len(e["top_logprobs"]) == 1 for e in result["logprobs"])
        for path, body in (
            ("/v1/chat/completions", {"messages": HELLO, "logprobs": True, "top_logprobs": 21}),
            ("/v1/chat/completions", {"messages": HELLO, "top_logprobs": 2}),
            ("/v1/completions", {"prompt": "x", "logprobs": 6}),
        ):
            resp = await raw.post(path, json={"model": model, **body}, headers=auth)
            assert_openai_error(resp, 400)


async def test_n_choices_plain_and_streamed_each_billed(running: Platform, tenant_key: str) -> None:
    """n = 3 on the simulated engine (choice i's tokens read " tok<k>.<i>"): every choice
    whole and in order, plain and streamed with its index, each one's tokens billed."""
    client = sdk(running, tenant_key)
    model = running.settings.served_model_name
    chat = await client.chat.completions.create(
        model=model, messages=HELLO, max_tokens=4, n=3, logprobs=True
    )
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert chat.choices[0].message.content == " tok1 tok2 tok3 tok4"
    assert chat.choices[2].message.content == " tok1.2 tok2.2 tok3.2 tok4.2"
    assert all(c.finish_reason == "length" for c in chat.choices)
    for c in chat.choices:
        assert "".join(t.token for t in c.logprobs.content or []) == c.message.content  # type: ignore[union-attr]
    assert chat.usage is not None and chat.usage.completion_tokens == 12
    job = await _job(running, "job_" + chat.id.split("job_", 1)[1])
    async with running.db.session() as s:
        billed = await s.execute(
            text("SELECT completion_tokens FROM usage_records WHERE job_id = :id"), {"id": job.id}
        )
    assert billed.scalar_one() == 12

    stream = await client.chat.completions.create(
        model=model,
        messages=HELLO,
        max_tokens=3,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    texts: dict[int, str] = {}
    roles: dict[int, int] = {}
    finishes: dict[int, list[str]] = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            roles[choice.index] = roles.get(choice.index, 0) + (choice.delta.role == "assistant")
            if choice.finish_reason:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert texts == {0: " tok1 tok2 tok3", 1: " tok1.1 tok2.1 tok3.1"}
    assert roles == {0: 1, 1: 1} and finishes == {0: ["length"], 1: ["length"]}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6

    legacy = await client.completions.create(model=model, prompt="Once", max_tokens=2, n=2)
    assert [c.text for c in legacy.choices] == [" tok1 tok2", " tok1.1 tok2.1"]
    async with httpx.AsyncClient(base_url=running.url) as raw:
        resp = await raw.post(
            "/v1/chat/completions",
            json={"model": model, "messages": HELLO, "n": 17},
            headers={"Authorization": f"Bearer {tenant_key}"},
        )
        assert_openai_error(resp, 400)


async def test_bad_requests_get_openai_errors_and_enqueue_nothing(
    running: Platform, tenant_key: str
) -> None:
    client = sdk(running, tenant_key, max_retries=0)
    model = running.settings.served_model_name
    with pytest.raises(openai.NotFoundError) as not_found:
        await client.chat.completions.create(model="gpt-4o", messages=HELLO)
    assert not_found.value.code == "model_not_found"
    bad: list[dict[str, object]] = [
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        {"n": 17},
        {"max_tokens": 0},
        {"temperature": 3},
        {"messages": []},
        {"messages": [{"role": "tool", "content": "x"}]},
        {"max_tokens": running.settings.max_model_len},
        {"stream_options": {"include_usage": True}},
    ]
    for extra in bad:
        body = {"model": model, "messages": HELLO, **extra}
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(**body)  # type: ignore[call-overload]
    async with httpx.AsyncClient(base_url=running.url) as raw:
        resp = await raw.post(
            "/v1/chat/completions",
            content=b"{not json",
            headers={"Authorization": f"Bearer {tenant_key}", "Content-Type": "application/json"},
        )
        assert_openai_error(resp, 400)
        resp = await raw.post("/v1/chat/completions", json={"model": model, "messages": HELLO})
        assert_openai_error(resp, 401)
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=model, prompt=["a", "b"])
    async with running.db.session() as s:
        tenant = await tenant_repo.tenant_for_key(s, tenant_key)
        assert tenant is not None
        page, _ = await job_repo.list_jobs(s, tenant.id)
    assert page == []


async def test_a_client_that_hangs_up_cancels_its_job(platform: Platform, tenant_key: str) -> None:
    platform.start_dispatcher()
    await platform.start_worker("w1", cost=CostModel(slots=8))  # real-time speed
    client = sdk(platform, tenant_key)
    stream = await client.chat.completions.create(
        model=platform.settings.served_model_name,
        messages=HELLO,
        max_tokens=1000,
        stream=True,
    )
    first = None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = chunk
            break
    assert first is not None
    await stream.close()
    job_id = "job_" + first.id.split("job_", 1)[1]

    async def cancelled() -> bool:
        return (await _job(platform, job_id)).status.value == "cancelled"

    await until_async(cancelled, f"{job_id} cancelled", 10)
    # The engine really let it go: its slot is free long before 1,000 tokens (30 s at this
    # speed), and the worker reported the run as cancelled after a fraction of them.
    _, _, engine = platform.workers["w1"]
    await until(lambda: engine.running == 0, "the engine let the run go", 5)

    # The worker reports the run once it has ended it (after the engine let it go).
    async def served() -> list[Served]:
        reports = await platform.r.xrange(platform.dispatcher.names.served)
        return [Served.decode(f) for _, f in reports if Served.decode(f).job_id == job_id]

    async def reported() -> bool:
        return bool(await served())

    await until_async(reported, "the worker reported the run", 5)
    mine = await served()
    assert [m.outcome for m in mine] == ["cancelled"]
    assert 0 < mine[0].actual < mine[0].estimated - 500  # most of the 1,000 never generated
    # The tokens it did generate are billed: on the job, and once in the ledger.

    async def billed() -> bool:
        return bool((await _job(platform, job_id)).completion_tokens)

    await until_async(billed, "the generated tokens billed on the job", 5)
    job = await _job(platform, job_id)
    assert job.prompt_tokens and 0 < (job.completion_tokens or 0) < 1000
    async with platform.db.session() as s:
        usage = await job_repo.usage_for_job(s, job_id)
    assert [(u.prompt_tokens, u.completion_tokens) for u in usage] == [
        (job.prompt_tokens, job.completion_tokens)
    ]
    assert mine[0].actual == job.prompt_tokens + job.completion_tokens


async def test_redis_refusing_the_job_gets_503_with_retry_after(
    platform: Platform, tenant_key: str
) -> None:
    """Redis answers but refuses writes (out of memory, as a full instance does): the online
    request is cancelled and refused with 503 and Retry-After, which the SDK honours."""
    r = platform.r
    old = await r.config_get("maxmemory")
    await r.config_set("maxmemory", "1")
    try:
        async with httpx.AsyncClient(base_url=platform.url, timeout=30) as raw:
            resp = await raw.post(
                "/v1/chat/completions",
                json={"model": platform.settings.served_model_name, "messages": HELLO},
                headers={"Authorization": f"Bearer {tenant_key}"},
            )
    finally:
        await r.config_set("maxmemory", old["maxmemory"])
    assert_openai_error(resp, 503, "service_unavailable")
    assert resp.headers["retry-after"] == "2"
    async with platform.db.session() as s:
        tenant = await tenant_repo.tenant_for_key(s, tenant_key)
        assert tenant is not None
        page, _ = await job_repo.list_jobs(s, tenant.id)
    assert [j.status.value for j in page] == ["cancelled"]  # accepted by nobody: never runs
