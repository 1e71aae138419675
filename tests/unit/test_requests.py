"""The normalised request (tierq/services/requests.py): defaults, parameters and refusals."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tierq.services.requests import MAX_LOGIT_BIAS, JobCreate


def test_job_defaults_and_params() -> None:
    body = JobCreate.model_validate({"prompt": "hi"})
    assert body.tier is None and body.max_tokens == 256  # None: the tenant's default tier
    assert body.params() == {
        "max_tokens": 256,
        "temperature": 1.0,
        "top_p": 1.0,
        "stop": None,
        "seed": None,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "min_tokens": 0,
        "ignore_eos": False,
    }
    assert JobCreate.model_validate({"prompt": "x", "stop": "END"}).stop == ["END"]


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"prompt": ""},
        {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
        {"prompt": "a", "tier": "gold"},
        {"prompt": "a", "seed": "x"},
        {"prompt": "a", "stop": [""]},
        {"prompt": "a", "max_tokens": 4, "min_tokens": 5},
        {"prompt": "a", "metadata": {str(i): "v" for i in range(17)}},
    ],
)
def test_invalid_job_bodies(body: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        JobCreate.model_validate(body)


def test_blank_is_the_documents_whitespace_not_pythons() -> None:
    """NOT_BLANK is read by JSON Schema's (ECMA-262) regular expressions, whose `\\s` is not
    Python's: a prompt of U+001E conforms to the document, so it must be accepted; one of
    U+FEFF does not, so it must be refused."""
    from tierq.services.requests import blank

    for text in ("\x1c", "\x1d", "\x1e", "\x1f", "\x85", "a"):
        assert not blank(text)
        assert JobCreate(prompt=text).prompt == text
    for text in (" ", "\t\n\r\x0b\x0c", "\xa0", "\u2000\u200a", "\u3000", "\ufeff"):
        assert blank(text)
        with pytest.raises(ValidationError):
            JobCreate(prompt=text)
        with pytest.raises(ValidationError):
            JobCreate(messages=[{"role": "user", "content": text}])


def test_logit_bias_reaches_the_engine_bounded() -> None:
    body = JobCreate.model_validate({"prompt": "a", "logit_bias": {"42": -100, "7": 2.5}})
    assert body.params()["logit_bias"] == {"42": -100.0, "7": 2.5}
    assert "logit_bias" not in JobCreate.model_validate({"prompt": "a", "logit_bias": {}}).params()
    for bad, message in (
        ({"x": 1}, "token ids"),
        ({"-1": 1}, "token ids"),
        ({"1": 101}, "between -100 and 100"),
        ({str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}, f"at most {MAX_LOGIT_BIAS}"),
    ):
        with pytest.raises(ValidationError, match=message):
            JobCreate.model_validate({"prompt": "a", "logit_bias": bad})
