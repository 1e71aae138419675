"""OpenAI request translation (tierq/services/openai_compat.py): pure functions, no services."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tierq.core.tiers import Tier
from tierq.services import openai_compat as oa

CHAT = "/v1/chat/completions"


def test_chat_request_becomes_a_job_with_the_tier_of_its_service_tier() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    tiers = {
        None: None,
        "auto": None,
        "default": None,
        "flex": Tier.STANDARD,
        "priority": Tier.INTERACTIVE,
    }
    for asked, tier in tiers.items():
        body = {**base, **({"service_tier": asked} if asked else {})}
        assert oa.ChatCompletionRequest.model_validate(body).to_job().tier == tier
    job = oa.ChatCompletionRequest.model_validate(
        {
            **base,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
            "max_completion_tokens": 7,
            "max_tokens": 99,
            "temperature": 0,
            "stop": "END",
        }
    ).to_job()
    assert job.messages is not None and job.messages[0].content == "ab"
    assert job.max_tokens == 7 and job.temperature == 0 and job.stop == ["END"]


def test_completion_request_defaults_and_single_prompt() -> None:
    job = oa.CompletionRequest.model_validate({"model": "m", "prompt": ["once"]}).to_job()
    assert job.prompt == "once" and job.max_tokens == 16  # OpenAI's default for completions
    for bad in (
        {"prompt": ["a", "b"]},
        {"prompt": "a", "echo": True},
        {"prompt": "a", "best_of": 2},
    ):
        with pytest.raises(ValidationError):
            oa.CompletionRequest.model_validate({"model": "m", **bad})


def test_vllm_extensions_min_tokens_and_ignore_eos_reach_the_engine_parameters() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    job = oa.ChatCompletionRequest.model_validate(
        {**base, "min_tokens": 4, "ignore_eos": True}
    ).to_job()
    assert job.params()["min_tokens"] == 4 and job.params()["ignore_eos"] is True
    plain = oa.ChatCompletionRequest.model_validate(base).to_job().params()
    assert plain["min_tokens"] == 0 and plain["ignore_eos"] is False
    with pytest.raises(ValidationError, match="min_tokens"):
        oa.ChatCompletionRequest.model_validate({**base, "min_tokens": 9}).to_job()


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [{"type": "function"}]},
        {"response_format": {"type": "yaml"}},
        {"logit_bias": {"42": 500}},
        {"tool_choice": "auto"},
        {"top_logprobs": 2},  # without logprobs
        {"logprobs": True, "top_logprobs": 21},
        {"n": 17},
        {"n": 0},
        {"stream_options": {"include_usage": True}},  # without stream
        {"unknown_field": 1},
    ],
)
def test_unsupported_parameters_are_refused_not_ignored(extra: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        oa.ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
        )


def test_logprobs_become_the_jobs_top_count() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    chat = oa.ChatCompletionRequest.model_validate
    assert "logprobs" not in chat(base).to_job().params()
    assert "logprobs" not in chat({**base, "logprobs": False}).to_job().params()
    assert chat({**base, "logprobs": True}).to_job().params()["logprobs"] == 0
    assert chat({**base, "logprobs": True, "top_logprobs": 20}).to_job().params()["logprobs"] == 20
    text = oa.CompletionRequest.model_validate
    assert text({"model": "m", "prompt": "p", "logprobs": 5}).to_job().params()["logprobs"] == 5
    assert text({"model": "m", "prompt": "p", "logprobs": 0}).to_job().params()["logprobs"] == 0
    with pytest.raises(ValidationError):  # OpenAI's legacy bound
        text({"model": "m", "prompt": "p", "logprobs": 6})


def _entry(token: str, logprob: float, top: list[tuple[str, float]]) -> dict[str, object]:
    from tierq.workers.engine.base import logprob_entry

    return logprob_entry(token, logprob, top)


def test_logprobs_render_in_each_endpoints_shape() -> None:
    entries = [
        _entry("Hi", -0.5, [("Hi", -0.5), ("Hello", -1.25)]),
        _entry("!", -0.1, [("!", -0.1), (".", float("-inf"))]),
    ]
    assert entries[1]["top_logprobs"][1]["logprob"] == -9999.0  # -inf as JSON carries it
    assert entries[0]["bytes"] == [72, 105]
    assert oa.chat_logprobs(entries) == {"content": entries, "refusal": None}
    assert oa.chat_logprobs(None) is None
    legacy = oa.completion_logprobs(entries, offset=10)
    assert legacy == {
        "tokens": ["Hi", "!"],
        "token_logprobs": [-0.5, -0.1],
        "top_logprobs": [{"Hi": -0.5, "Hello": -1.25}, {"!": -0.1, ".": -9999.0}],
        "text_offset": [10, 12],
    }
    # The chosen token is always among the legacy top_logprobs (up to logprobs + 1).
    unlikely = oa.completion_logprobs([_entry("x", -7.0, [("a", -0.1)])])
    assert unlikely["top_logprobs"] == [{"a": -0.1, "x": -7.0}]


def test_tools_are_refused_naming_the_model() -> None:
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}]}
    for extra in (
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        {"tool_choice": "auto"},
    ):
        with pytest.raises(
            ValidationError, match="tool calling for the model 'SmolLM2-135M-Instruct'"
        ):
            oa.ChatCompletionRequest.model_validate({**body, **extra})


def test_n_choices_reserve_max_tokens_each() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}
    job = oa.ChatCompletionRequest.model_validate({**body, "n": 3}).to_job()
    assert job.params()["n"] == 3 and job.output_tokens == 21
    one = oa.ChatCompletionRequest.model_validate(body).to_job()
    assert "n" not in one.params() and one.output_tokens == 7
