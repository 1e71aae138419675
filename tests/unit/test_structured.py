"""Structured outputs at admission (services/structured.py): OpenAI's `response_format` in
each of its shapes becomes the engine's constraint, and a schema the engine could not
compile is refused before anything is queued — on the chat surface, the native job API and
a batch line alike (one request model, `JobCreate`)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from services import openai_compat as oa
from services.requests import JobCreate
from services.structured import MAX_ARRAY_BOUND, MAX_SCHEMA_CHARS, ResponseFormat, compile_error

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _chat(response_format: Any) -> oa.ChatCompletionRequest:
    return oa.ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "Who?"}],
            "response_format": response_format,
        }
    )


def test_each_shape_becomes_the_engines_constraint() -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    assert _chat(schema).to_job().params()["response_format"] == {"json": PERSON}
    assert _chat({"type": "json_object"}).to_job().params()["response_format"] == {
        "json_object": True
    }
    # A json_schema without a schema is any JSON object; text is no constraint at all.
    bare = {"type": "json_schema", "json_schema": {"name": "any", "strict": True}}
    assert _chat(bare).to_job().params()["response_format"] == {"json_object": True}
    assert "response_format" not in _chat({"type": "text"}).to_job().params()
    assert "response_format" not in _chat(None).to_job().params()


def test_the_native_job_api_takes_the_same_field() -> None:
    job = JobCreate.model_validate(
        {
            "prompt": "A person as JSON:",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": PERSON},
            },
        }
    )
    assert job.params()["response_format"] == {"json": PERSON}


@pytest.mark.parametrize(
    ("response_format", "message"),
    [
        (
            {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "objekt"}}},
            "the JSON schema cannot be used: Invalid type: objekt",
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": {"type": "string", "pattern": "["}},
            },
            "the JSON schema cannot be used: regex parse error",
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": {"$ref": "#/$defs/missing"}},
            },
            "the JSON schema cannot be used",
        ),
        ({"type": "json_schema"}, "'json_schema' is given with, and only with"),
        ({"type": "json_object", "json_schema": {"name": "p"}}, "only with, type"),
        ({"type": "json_schema", "json_schema": {"name": "has space"}}, "name"),
        ({"type": "yaml"}, "type"),
        (
            {
                "type": "json_schema",
                "json_schema": {
                    "name": "big",
                    "schema": {"type": "object", "description": "x" * MAX_SCHEMA_CHARS},
                },
            },
            f"longer than {MAX_SCHEMA_CHARS} characters",
        ),
        # An array bound the grammar would spell out (10**12 items: the compiler would
        # abort its process), however deep in the schema.
        (
            {
                "type": "json_schema",
                "json_schema": {
                    "name": "p",
                    "schema": {
                        "type": "object",
                        "properties": {"tags": {"type": "array", "maxItems": 10**12}},
                    },
                },
            },
            f"maxItems 1000000000000 is more than this server takes ({MAX_ARRAY_BOUND})",
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {
                    "name": "p",
                    "schema": {"anyOf": [{"type": "array", "minItems": MAX_ARRAY_BOUND + 1}]},
                },
            },
            f"minItems {MAX_ARRAY_BOUND + 1} is more",
        ),
    ],
)
def test_what_the_engine_could_not_run_is_refused_at_admission(
    response_format: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError, match="response_format") as refused:
        _chat(response_format)
    assert message in str(refused.value)


def test_a_batch_line_is_refused_by_the_same_rule() -> None:
    """Batch lines are parsed by the endpoint's request model (services/batch_input.py):
    the refusal becomes that line's error, the other lines run."""
    line = {
        "model": "m",
        "messages": [{"role": "user", "content": "Who?"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": 7}},
    }
    with pytest.raises(ValidationError, match="response_format"):
        oa.parse(oa.CHAT_ENDPOINT, line)


def test_bounds_up_to_the_limit_and_properties_named_like_bounds_are_taken() -> None:
    schema = {
        "type": "object",
        "properties": {
            "maxItems": {"type": "integer"},  # a property of that name, not a bound
            "list": {"type": "array", "minItems": 1, "maxItems": MAX_ARRAY_BOUND},
        },
    }
    taken = _chat({"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    assert taken.to_job().params()["response_format"] == {"json": schema}


def test_the_check_is_llguidances_own_compile() -> None:
    assert compile_error('{"type": "object"}') is None
    assert compile_error("not json") is not None
    fmt = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    )
    assert fmt.output_schema() is not None and compile_error(fmt.output_schema() or "") is None
