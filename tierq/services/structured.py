"""Structured outputs: OpenAI's `response_format`, checked at admission as the engine will
run it.

A job may ask for any JSON object (`{"type": "json_object"}`) or JSON that validates against
a JSON Schema (`{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`);
`{"type": "text"}` is the default. vLLM constrains the generation with a grammar compiled
from the schema; the worker's engine uses the `guidance` backend (llguidance), and
admission compiles each schema with the same library and the same options, so a schema the
engine could not run is refused before anything is queued (`400 invalid_response_format`,
or a batch line's error), never a job that fails after queueing.

Before the compiler sees a schema, its shape is bounded (`schema_refusal`): a compile, and
each step of the generation after it, costs in proportion to what the schema spells out,
and some shapes cost without bound (llguidance spells a `maxItems` out one item at a time:
ten million abort its process on a 4 GB allocation, in the engine too, with every job beside
it; an `anyOf` past 2,000 branches passes the compile and fails at the first token). The
bounds: at most MAX_SCHEMA_CHARS of JSON, nesting at most MAX_DEPTH (vLLM's own limit),
array bounds at most MAX_ARRAY_BOUND, at most MAX_ALTERNATIVES enum values, anyOf/oneOf/
allOf branches, prefixItems or properties of one object, `enum` and `const` values of
strings, numbers, booleans and null, and patterns whose counted repetitions multiply to at
most MAX_REPETITION.

The schema is enforced whatever `strict` says (tierq has no looser mode to fall back to);
a schema without `additionalProperties: false` lets the model add properties, as JSON
Schema does. Whitespace between JSON tokens is not generated (compact JSON): a small model
left free to emit whitespace may emit only that until max_tokens.
"""

from __future__ import annotations

import functools
import json
import re

# typeshed declares these private modules in some releases and not in others.
from re import _constants as sre_constants  # type: ignore[attr-defined, unused-ignore]
from re import _parser as sre_parse  # type: ignore[attr-defined, unused-ignore]
from typing import Annotated, Any, Literal

import llguidance
from pydantic import BaseModel, ConfigDict, Field

MAX_SCHEMA_CHARS = 65_536
MAX_DEPTH = 64  # vLLM's MAX_STRUCTURED_OUTPUT_JSON_NESTING
MAX_ARRAY_BOUND = 1024
MAX_ALTERNATIVES = 256
MAX_REPETITION = 1024
MAX_ERROR_CHARS = 300  # of the compiler's message, which may quote the schema

_ARRAY_BOUNDS = ("minItems", "maxItems", "minContains", "maxContains")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "enum")
_DATA = ("const", "default", "examples", "enum", "description", "title", "$comment")


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def _repetition(pattern: str) -> int:
    """The product of a regular expression's nested counted repetitions (`(a{30}){40}`:
    1200), read with Python's parser (JSON Schema's ECMA patterns are close enough for
    counting); 0 when Python cannot read it (the compiler then judges it)."""
    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError):
        return 0
    worst = 1

    def walk(items: Any, factor: int) -> None:
        nonlocal worst
        for op, av in items:
            if op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT):
                low, high, sub = av
                count = low if high == sre_constants.MAXREPEAT else max(low, high)
                inner = factor * max(count, 1)
                worst = max(worst, inner)
                walk(sub, inner)
            elif op == sre_constants.SUBPATTERN:
                walk(av[-1], factor)
            elif op == sre_constants.BRANCH:
                for branch in av[1]:
                    walk(branch, factor)

    walk(parsed, 1)
    return worst


def _too_deep(schema: Any) -> bool:
    """vLLM's own count (`check_json_nesting`): objects and arrays nested past MAX_DEPTH."""
    level = [schema]
    for _ in range(MAX_DEPTH):
        level = [
            child
            for node in level
            for child in (node.values() if isinstance(node, dict) else node)
            if isinstance(child, dict | list)
        ]
        if not level:
            return False
    return True


def schema_refusal(schema: Any) -> str | None:
    """Why a schema's shape is past what this server compiles, or None."""
    if not isinstance(schema, dict):
        return "the JSON schema must be an object"
    if _too_deep(schema):
        return f"the JSON schema nests objects and arrays more than {MAX_DEPTH} levels deep"
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if key in _ARRAY_BOUNDS and number and value > MAX_ARRAY_BOUND:
                return f"'{key}' may be at most {MAX_ARRAY_BOUND}, not {value}"
            if key in _LISTS and isinstance(value, list) and len(value) > MAX_ALTERNATIVES:
                return f"'{key}' may list at most {MAX_ALTERNATIVES}, not {len(value)}"
            if key == "properties" and isinstance(value, dict):
                if len(value) > MAX_ALTERNATIVES:
                    return f"an object may have at most {MAX_ALTERNATIVES} properties"
                stack.extend(value.values())  # each a schema; their names are data
                continue
            if key in ("enum", "const"):
                values = value if key == "enum" and isinstance(value, list) else [value]
                if not all(_scalar(v) for v in values):
                    return f"'{key}' takes strings, numbers, booleans and null"
            if key == "pattern" and isinstance(value, str) and _repetition(value) > MAX_REPETITION:
                return f"a pattern's counted repetitions multiply past {MAX_REPETITION}"
            if key == "patternProperties" and isinstance(value, dict):
                if any(_repetition(p) > MAX_REPETITION for p in value):
                    return f"a pattern's counted repetitions multiply past {MAX_REPETITION}"
                stack.extend(value.values())
                continue
            if key not in _DATA:
                stack.append(value)
    return None


@functools.lru_cache(maxsize=128)
def compile_error(schema_json: str) -> str | None:
    """Why the engine could not run a schema (llguidance's message, cut short), or None.
    No tokenizer is needed: the grammar is checked, not built for a vocabulary. Cached: an
    online request checks before it is queued (in a thread) and again in `check`; a batch
    line when its file is reserved and when it is expanded."""
    try:
        # The options the engine compiles with: vLLM's guidance backend with whitespace
        # off (`disable_any_whitespace`, tierq/workers/engine/vllm_engine.py).
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema_json, defaults={"whitespace_flexible": False}
        )
        error = llguidance.LLMatcher.validate_grammar(grammar, None)
    except Exception as exc:  # whatever the library raises, the schema is the cause
        error = str(exc) or type(exc).__name__
    if not error:
        return None
    error = " ".join(error.split())
    return error if len(error) <= MAX_ERROR_CHARS else error[: MAX_ERROR_CHARS - 1] + "…"


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]

    def engine_param(self) -> dict[str, Any] | None:
        return None


class JsonObjectFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["json_object"]

    def engine_param(self) -> dict[str, Any] | None:
        return {"json_object": True}


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    # `schema` in the body; the attribute has another name (pydantic's models have one).
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["json_schema"]
    json_schema: JsonSchema

    def engine_param(self) -> dict[str, Any] | None:
        """The schema; without one, any JSON object (as OpenAI takes it)."""
        schema = self.json_schema.json_schema
        return {"json_object": True} if schema is None else {"json": schema}


# OpenAI's `response_format`: one of three shapes, told apart by `type`.
ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]


def refusal(param: dict[str, Any] | None) -> str | None:
    """Why a job's `response_format` parameter (its `engine_param`) cannot run, or None:
    its shape first (quick, pure), then the compiler's verdict."""
    if not param or "json" not in param:
        return None
    schema = param["json"]
    text = json.dumps(schema, separators=(",", ":"))
    if len(text) > MAX_SCHEMA_CHARS:
        return f"the JSON schema is longer than {MAX_SCHEMA_CHARS} characters"
    why = schema_refusal(schema)
    if why is not None:
        return why
    error = compile_error(text)
    return None if error is None else f"the JSON schema cannot be used: {error}"
