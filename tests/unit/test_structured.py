"""Structured outputs at admission (tierq/services/structured.py): OpenAI's `response_format` in
each of its shapes becomes the engine's constraint, and a schema the engine could not run —
or whose shape would cost it without bound — is refused before anything is queued, on the
chat surface, the native job API and a batch line alike (one request model and one check)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tierq.core.settings import Settings
from tierq.services import openai_compat as oa
from tierq.services.requests import JobCreate, Refused, check
from tierq.services.structured import (
    MAX_ALTERNATIVES,
    MAX_ARRAY_BOUND,
    MAX_DEPTH,
    MAX_ERROR_CHARS,
    MAX_SCHEMA_CHARS,
    compile_error,
    refusal,
)

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


MODEL = Settings.model_fields["served_model_name"].default


def _chat(response_format: Any) -> oa.ChatCompletionRequest:
    return oa.ChatCompletionRequest.model_validate(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Who?"}],
            "response_format": response_format,
        }
    )


def _schema(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}


def _refused(schema: Any, tmp_path: Path) -> Refused:
    job = _chat(_schema(schema)).to_job()
    with pytest.raises(Refused) as refused:
        check(job, Settings(state_dir=tmp_path))
    assert refused.value.status == 400 and refused.value.code == "invalid_response_format"
    assert refused.value.param == "response_format"
    return refused.value


def test_each_shape_becomes_the_engines_constraint() -> None:
    assert _chat(_schema(PERSON)).to_job().params()["response_format"] == {"json": PERSON}
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
        {"prompt": "A person as JSON:", "response_format": _schema(PERSON)}
    )
    assert job.params()["response_format"] == {"json": PERSON}


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_schema"},  # no json_schema
        {"type": "text", "json_schema": {"name": "p"}},  # json_schema only with its type
        {"type": "json_object", "json_schema": {"name": "p"}},
        {"type": "json_schema", "json_schema": {"name": "has space"}},
        {"type": "json_schema", "json_schema": {"name": "p", "schema": 7}},
        {"type": "yaml"},
    ],
)
def test_a_shape_openai_does_not_define_is_refused(response_format: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="response_format"):
        _chat(response_format)


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "objekt"}, "the JSON schema cannot be used: Invalid type: objekt"),
        ({"type": "string", "pattern": "["}, "the JSON schema cannot be used: regex parse error"),
        ({"$ref": "#/$defs/missing"}, "the JSON schema cannot be used"),
        (
            {"type": "object", "description": "x" * MAX_SCHEMA_CHARS},
            f"longer than {MAX_SCHEMA_CHARS} characters",
        ),
        # An array bound the grammar would spell out (10**12 items: the compiler would
        # abort its process), however deep in the schema.
        (
            {"type": "object", "properties": {"tags": {"type": "array", "maxItems": 10**12}}},
            f"'maxItems' may be at most {MAX_ARRAY_BOUND}",
        ),
        (
            {"anyOf": [{"type": "array", "minItems": MAX_ARRAY_BOUND + 1}]},
            f"'minItems' may be at most {MAX_ARRAY_BOUND}",
        ),
        # Alternatives past llguidance's row limit fail at the first token, not at compile.
        (
            {"anyOf": [{"const": i} for i in range(2100)]},
            f"'anyOf' may list at most {MAX_ALTERNATIVES}",
        ),
        ({"enum": list(range(MAX_ALTERNATIVES + 1))}, "'enum' may list at most"),
        (
            {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(500)}},
            f"at most {MAX_ALTERNATIVES} properties",
        ),
        # Containers as enum values cost the compiler seconds for a few thousand.
        ({"enum": [[[[[]]]]] * 50}, "'enum' takes strings, numbers, booleans and null"),
        ({"const": {"a": 1}}, "'const' takes strings"),
        # Nested counted repetition: the lexer's first mask would take a second and fail.
        ({"type": "string", "pattern": "^(a{1000}){1000}$"}, "counted repetitions multiply"),
        (
            {"type": "object", "patternProperties": {"^(x{50}){50}$": {"type": "string"}}},
            "counted repetitions multiply",
        ),
        (_nested(MAX_DEPTH), f"more than {MAX_DEPTH} levels deep"),
    ],
)
def test_what_the_engine_could_not_run_is_refused_at_admission(
    schema: Any, message: str, tmp_path: Path
) -> None:
    refused = _refused(schema, tmp_path)
    assert message in refused.message


def test_what_is_within_the_bounds_is_taken(tmp_path: Path) -> None:
    settings = Settings(state_dir=tmp_path)
    within = {
        "type": "object",
        "properties": {
            "maxItems": {"type": "integer"},  # a property of that name, not a bound
            "list": {"type": "array", "minItems": 1, "maxItems": MAX_ARRAY_BOUND},
            "kind": {"enum": ["a", "b", None, 3]},
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "deep": _nested(20),
        },
        "default": {"maxItems": 10**9, "enum": [[1]]},  # data, not schema
    }
    assert check(_chat(_schema(within)).to_job(), settings) == settings.served_model_name


def test_a_batch_line_is_refused_by_the_same_rule(tmp_path: Path) -> None:
    """Batch lines are parsed and checked as online requests (tierq/services/admission.py
    `prepare_line`): the refusal becomes that line's error, the other lines run."""
    line = {"model": MODEL, "messages": [{"role": "user", "content": "Who?"}]}
    job = oa.parse(oa.CHAT_ENDPOINT, {**line, "response_format": _schema({"type": "objekt"})})
    with pytest.raises(Refused, match="Invalid type: objekt"):
        check(job.to_job(), Settings(state_dir=tmp_path))


def test_the_compilers_message_is_cut_short_and_its_verdict_kept() -> None:
    long_ref = {"$ref": "#/" + "x" * 5000}
    error = compile_error(f'{{"$ref": "{long_ref["$ref"]}"}}')
    assert error is not None and len(error) <= MAX_ERROR_CHARS
    assert compile_error('{"type":"object"}') is None
    started = time.perf_counter()
    assert refusal({"json": PERSON}) is None
    assert refusal({"json": PERSON}) is None  # the compile is cached
    assert time.perf_counter() - started < 0.5
    assert refusal({"json_object": True}) is None and refusal(None) is None
