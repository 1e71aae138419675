"""Structured outputs: OpenAI's `response_format`, checked at admission as the engine will
run it.

A job may ask for any JSON object (`{"type": "json_object"}`) or JSON that validates against
a JSON Schema (`{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`);
`{"type": "text"}` is the default. vLLM constrains the generation with a grammar compiled
from the schema; the worker's engine uses the `guidance` backend (llguidance), and
admission compiles the schema with the same library, so a schema the engine could not
compile is a 400 here (or a batch line's error), never a job that fails after queueing.

The schema is enforced whatever `strict` says (tierq has no looser mode to fall back to);
a schema without `additionalProperties: false` lets the model add properties, as JSON
Schema does.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import llguidance
from pydantic import BaseModel, ConfigDict, Field, model_validator

# A schema's size, as JSON: a grammar is compiled from it on every engine it runs on.
MAX_SCHEMA_CHARS = 65_536
# The largest array bound (minItems, maxItems, ...) a schema may set. The grammar spells
# each bounded repetition out: maxItems 100,000 takes the compiler 130 MB and half a
# second, 10,000,000 aborts the process on a 4 GB allocation (in the engine too, whose
# other jobs it would take with it) before any of llguidance's limits applies.
MAX_ARRAY_BOUND = 1024
_ARRAY_BOUNDS = ("minItems", "maxItems", "minContains", "maxContains")
_ANY_OBJECT = '{"type": "object"}'


def _bound_past_limit(node: Any) -> str | None:
    """The first array bound in a schema above MAX_ARRAY_BOUND, named, or None."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                big = isinstance(value, int | float) and not isinstance(value, bool)
                if key in _ARRAY_BOUNDS and big and value > MAX_ARRAY_BOUND:
                    return f"{key} {value}"
                stack.append(value)
        elif isinstance(item, list):
            stack.extend(item)
    return None


def compile_error(schema_json: str) -> str | None:
    """Why the engine could not run a schema (llguidance's own message), or None. Pure
    and quick (no tokenizer): the grammar is checked, not built for a vocabulary."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema_json, defaults={"whitespace_flexible": True}
        )
    except Exception as exc:  # whatever the library raises, the schema is the cause
        return str(exc) or type(exc).__name__
    error = llguidance.LLMatcher.validate_grammar(grammar, None)
    return error or None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    # `schema` in the body; the attribute has another name (pydantic's models have one).
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`. A `json_schema` without a schema is any JSON object."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _compiles(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("'json_schema' is given with, and only with, type 'json_schema'")
        schema = self.output_schema()
        if schema is None or schema == _ANY_OBJECT:
            return self
        if len(schema) > MAX_SCHEMA_CHARS:
            raise ValueError(f"the JSON schema is longer than {MAX_SCHEMA_CHARS} characters")
        past = _bound_past_limit(self.json_schema.json_schema if self.json_schema else None)
        if past is not None:
            raise ValueError(
                f"the JSON schema's {past} is more than this server takes ({MAX_ARRAY_BOUND})"
            )
        error = compile_error(schema)
        if error is not None:
            raise ValueError(f"the JSON schema cannot be used: {error.strip()}")
        return self

    def output_schema(self) -> str | None:
        """The schema the output must validate against, as JSON; None for plain text."""
        if self.type == "text":
            return None
        if self.json_schema is None or self.json_schema.json_schema is None:
            return _ANY_OBJECT
        return json.dumps(self.json_schema.json_schema, separators=(",", ":"))

    def engine_param(self) -> dict[str, Any] | None:
        """What the worker hands the engine (a job's `response_format` parameter): the schema
        (`json`) or any object (`json_object`); None for plain text."""
        schema = self.output_schema()
        if schema is None:
            return None
        if schema == _ANY_OBJECT:
            return {"json_object": True}
        return {"json": json.loads(schema)}
