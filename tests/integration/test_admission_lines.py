"""Admission of batch lines (tierq/services/admission.py): the one parse of a line, what it
reserves, and what a whole file reserves — with the bundled model's tokenizer, as the
batch runner counts. The online half is test_admission.py (PostgreSQL)."""

from __future__ import annotations

import json
from decimal import Decimal
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from tierq.core import token_count
from tierq.core.file_store import LocalStore
from tierq.core.settings import Settings
from tierq.models.quotas import reservation_cost
from tierq.services import admission
from tierq.services.batch_input import RawLine
from tierq.workers.engine.bundled_model import prepare_bundled_model

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"
PRICE_IN, PRICE_OUT = Decimal("0.50"), Decimal("2.00")


@cache
def _settings() -> Settings:
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    prepare_bundled_model(settings)  # the tokenizer the runner counts with
    return settings


def _item(number: int, **body: Any) -> RawLine:
    base = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi."}]}
    return RawLine(number, f"r{number}", {**base, "max_tokens": 8, **body})


def test_a_line_reserves_its_prompt_and_max_tokens_as_an_online_job_does() -> None:
    line = admission.batch_line(_settings(), CHAT, _item(1))
    assert line.error_code is None and line.model == "SmolLM2-135M-Instruct"
    assert line.params["max_tokens"] == 8
    # What the online path reserves for the same request: the served model's tokenizer's
    # bound on the prompt, plus max_tokens (tierq/services/admission.py `_counted`).
    counter = token_count.for_settings(_settings())
    online = counter.reserve([{"role": "user", "content": "Hi."}], None, 8)
    assert line.reserved_tokens == online > 8
    assert line.messages == [{"role": "user", "content": "Hi."}]


def test_no_field_makes_a_line_reserve_nothing_and_still_run() -> None:
    """Issue 10's bypass: `service_tier: "x"` failed the reservation's validation (0
    reserved), then was stripped and the line ran. The line's tier is the batch's: the
    field is dropped before the one parse, as are the streaming fields."""
    plain = admission.batch_line(_settings(), CHAT, _item(1))
    for extra in (
        {"service_tier": "x"},
        {"service_tier": "priority"},
        {"stream": True, "stream_options": {"include_usage": True}},
    ):
        line = admission.batch_line(_settings(), CHAT, _item(1, **extra))
        assert line.error_code is None, extra
        assert line.reserved_tokens == plain.reserved_tokens > 0, extra


def test_a_refused_line_reserves_nothing_and_says_why() -> None:
    unknown = admission.batch_line(_settings(), CHAT, _item(2, model="gpt-9"))
    assert (unknown.error_code, unknown.reserved_tokens) == ("model_not_found", 0)
    assert unknown.model == "gpt-9" and unknown.messages is None and unknown.params == {}
    hot = admission.batch_line(_settings(), CHAT, _item(3, temperature=5))
    assert hot.error_code == "invalid_request"
    assert hot.error_message is not None and "'temperature'" in hot.error_message
    long = admission.batch_line(_settings(), CHAT, _item(4, max_tokens=10**6))
    assert long.error_code == "context_length_exceeded"


def test_a_files_reservation_is_the_sum_of_its_runnable_lines(tmp_path: Path) -> None:
    items = [_item(1), _item(2, model="gpt-9"), _item(3, max_tokens=100), _item(4, temperature=5)]
    path = tmp_path / "input.jsonl"
    path.write_text(
        "".join(
            json.dumps({"custom_id": i.custom_id, "method": "POST", "url": CHAT, "body": i.body})
            + "\n"
            for i in items
        )
    )
    lines = [admission.batch_line(_settings(), CHAT, i) for i in items]
    runnable = [x for x in lines if x.error_code is None]
    assert len(runnable) == 2
    tokens, cost = admission.file_reservation(
        _settings(), LocalStore(tmp_path), path.name, CHAT, PRICE_IN, PRICE_OUT
    )
    assert tokens == sum(x.reserved_tokens for x in runnable)
    assert cost == sum(
        reservation_cost(x.reserved_tokens, x.params["max_tokens"], PRICE_IN, PRICE_OUT)
        for x in runnable
    )
    assert cost > 0
