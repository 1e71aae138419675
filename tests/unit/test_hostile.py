"""The one check of what no request may carry (tierq/services/hostile.py), and batch lines with it."""

from __future__ import annotations

import json

from tierq.services.batch_input import check_line
from tierq.services.hostile import MAX_DEPTH, suspect, unstorable


def test_storable_values_pass() -> None:
    assert unstorable({"a": ["text", 1, 2.5, None, True, {"b": "ünï 😀"}]}) is None
    assert unstorable(2**63 - 1) is None and unstorable(-(2**63)) is None


def test_nul_surrogates_huge_integers_and_deep_nesting_are_named() -> None:
    assert "NUL" in (unstorable({"m": [{"content": "a\x00"}]}) or "")
    assert "m[0].content" in (unstorable({"m": [{"content": "a\x00"}]}) or "")
    assert "surrogate" in (unstorable({"k": "\ud800"}) or "")
    assert "key" in (unstorable({"\x00": 1}) or "")
    assert "64-bit" in (unstorable({"seed": 2**63}) or "")
    deep: object = 1
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    assert "nested" in (unstorable(deep) or "")


def test_the_cheap_prescan_flags_every_body_the_check_would_refuse() -> None:
    deep: object = 1
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    for bad in ({"c": "a\x00"}, {"c": "\udc00"}, {"n": 10**20}, deep):
        assert suspect(json.dumps(bad).encode()), bad
    assert not suspect(json.dumps({"messages": [{"role": "user", "content": "hi 😀"}]}).encode())


def test_a_batch_line_carrying_a_nul_is_refused_like_an_online_request() -> None:
    line = {
        "custom_id": "a\x00b",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    }
    item, error = check_line(json.dumps(line).encode(), "/v1/chat/completions")
    assert item is None and error is not None and error[0] == "invalid_request"
    line["custom_id"] = "fine"
    line["body"]["messages"][0]["content"] = "\ud800"  # type: ignore[index]
    item, error = check_line(json.dumps(line).encode(), "/v1/chat/completions")
    assert item is None and error is not None and "surrogate" in error[1]
