"""What provably cannot fit the model's context is refused at admission, never queued.

With the served model's tokenizer on the API's host (the bundled model, prepared), a prompt
the engine would refuse after queueing — 200,000 characters against a 2,048-token context,
or one whose tokens and max_tokens pass it — gets 400 `context_length_exceeded` and no job;
one that fits is admitted. On the real API and PostgreSQL.
"""

from __future__ import annotations

import pytest

from tests.conftest import Platform
from tests.helpers import assert_openai_error, client, jobs_of
from tierq.core import token_count
from tierq.models import jobs as job_repo
from tierq.workers.engine.bundled_model import prepare_bundled_model

pytestmark = pytest.mark.integration


@pytest.fixture
def with_tokenizer(platform: Platform) -> token_count.PromptCounter:
    prepare_bundled_model(platform.settings)
    counter = token_count.for_settings(platform.settings)
    assert counter.exact, "the bundled model's tokenizer is needed (tierq prepare-model)"
    return counter


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x" * 200_000, "max_tokens": 16},
        {"messages": [{"role": "user", "content": "Paris is lovely. " * 2_000}], "max_tokens": 8},
        # fits alone, not with its max_tokens
        {"messages": [{"role": "user", "content": "word " * 1_500}], "max_tokens": 1_000},
    ],
)
async def test_a_prompt_that_cannot_fit_is_refused_and_not_queued(
    platform: Platform, tenant_key: str, with_tokenizer: token_count.PromptCounter, body: dict
) -> None:
    async with client(platform.url, tenant_key) as c:
        resp = await c.post("/v1/jobs", json=body)
        assert_openai_error(resp, 400, "context_length_exceeded")
        assert "maximum context length is 2048 tokens" in resp.json()["error"]["message"]
        chat = await c.post(
            "/v1/chat/completions",
            json={"model": platform.settings.served_model_name, "stream": False, **body}
            if "messages" in body
            else {
                "model": platform.settings.served_model_name,
                "messages": [{"role": "user", "content": body["prompt"]}],
                "max_tokens": body["max_tokens"],
            },
        )
        assert_openai_error(chat, 400, "context_length_exceeded")
    assert await jobs_of(platform, await _tenant_of(platform, tenant_key)) == []


async def test_a_prompt_far_past_the_context_is_refused_by_its_first_part(
    platform: Platform, tenant_key: str, with_tokenizer: token_count.PromptCounter
) -> None:
    """63,000 characters of prose against a 2,048-token context: admission tokenizes no
    more than the prefix that shows it cannot fit (eight characters a token of room)."""
    words = " ".join(["lantern", "meadow", "copper", "harbour", "signal"] * 1_700)
    seen: list[int] = []
    tokens_many = with_tokenizer._tokens_many

    def spy(texts: list[str]) -> list[int]:
        seen.extend(len(t) for t in texts)
        return tokens_many(texts)

    with_tokenizer._tokens_many = spy  # type: ignore[method-assign]
    try:
        async with client(platform.url, tenant_key) as c:
            resp = await c.post("/v1/jobs", json={"prompt": words, "max_tokens": 16})
    finally:
        del with_tokenizer._tokens_many
    assert_openai_error(resp, 400, "context_length_exceeded")
    assert seen and max(seen) <= 8 * (2048 - 16) < len(words)


async def test_a_long_prompt_that_fits_is_admitted(
    platform: Platform, tenant_key: str, with_tokenizer: token_count.PromptCounter
) -> None:
    content = "word " * 1_500  # about 1,500 tokens: more bytes than the context, it fits
    async with client(platform.url, tenant_key) as c:
        resp = await c.post(
            "/v1/jobs", json={"messages": [{"role": "user", "content": content}], "max_tokens": 64}
        )
    assert resp.status_code == 202, resp.text
    job = resp.json()
    async with platform.db.session() as s:
        record = await job_repo.get_job(s, job["id"])
    assert record is not None
    # Reserved by the tokenizer's count, not the byte bound (7,500 bytes).
    assert record.reserved_tokens < 1_700


async def _tenant_of(platform: Platform, key: str) -> str:
    from tierq.models import tenants

    async with platform.db.session() as s:
        owner = await tenants.owner_of_key(s, key)
    assert owner is not None
    return owner.tenant.id
