"""A generation request, normalised: the native job API's body, and what the OpenAI surface
and batch lines are translated into before admission. `check` applies the deployment's
limits; a refusal is `Refused`, which the API answers in OpenAI's error shape and a batch
writes to its error file.

The models' JSON Schema (the OpenAPI document) states what is accepted: a limit enforced
in a validator is declared beside it (`json_schema_extra`), with the validator keeping its
own message. Limits the deployment sets (MAX_MODEL_LEN, MAX_PROMPT_CHARS) are documented at
their defaults; a deployment that lowers them answers 400 past them. What no request may
carry anywhere (tierq/services/hostile.py: NUL, lone surrogates, integers past 64 bits, nesting
past 32) is one rule for every field and is not repeated in each schema.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from tierq.core import fleet, token_count
from tierq.core.settings import Settings
from tierq.core.tiers import Tier
from tierq.services import structured
from tierq.services.structured import ResponseFormat

# The deployment's limits at their defaults, as the document states them.
DOCUMENTED_MAX_TOKENS = Settings.model_fields["max_model_len"].default - 1
DOCUMENTED_MAX_PROMPT_CHARS = Settings.model_fields["max_prompt_chars"].default
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
MAX_STOPS = 4
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs, and vLLM's default max_logprobs
# Choices per request (`n`): each is a sequence of its own in the engine's batch.
MAX_CHOICES = 16
# logit_bias: token ids (decimal strings, as OpenAI's JSON has them) to a bias in
# [-100, 100], at most this many (each is an addition to every step's logits).
MAX_LOGIT_BIAS = 300
_TOKEN_ID = re.compile(r"[0-9]{1,9}")
_LOGIT_BIAS_SCHEMA: dict[str, Any] = {
    "maxProperties": MAX_LOGIT_BIAS,
    "propertyNames": {"pattern": "^[0-9]{1,9}$"},
    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
}


def _logit_bias(v: dict[str, float] | None) -> dict[str, float] | None:
    if not v:
        return None
    if len(v) > MAX_LOGIT_BIAS:
        raise ValueError(f"at most {MAX_LOGIT_BIAS} token ids")
    for token, bias in v.items():
        if not _TOKEN_ID.fullmatch(token):
            raise ValueError(f"keys are token ids (decimal integers), not {token[:20]!r}")
        if not -100 <= bias <= 100:
            raise ValueError(f"a bias is between -100 and 100, not {bias}")
    return v


# Added to the logits of these token ids at every step (-100 bans one, 100 forces it).
LogitBias = Annotated[
    dict[str, float] | None,
    AfterValidator(_logit_bias),
    Field(json_schema_extra=_LOGIT_BIAS_SCHEMA),
]

# JSON Schema of what the validators below require.
# A string with something besides whitespace, where whitespace is the set JSON Schema's
# regular expressions (ECMA-262) give `\s`, spelled out: Python's `\s` and str.strip() also
# take U+001C..U+001F and U+0085, so a prompt of U+001E alone conformed to the document
# and was refused as blank (found by the OpenAPI fuzz).
_ECMA_SPACE = (
    "\\t\\n\\u000b\\f\\r \\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000\\ufeff"
)
NOT_BLANK = f"[^{_ECMA_SPACE}]"
_NOT_BLANK = re.compile(NOT_BLANK)


def blank(text: str) -> bool:
    """Nothing but whitespace, as the document's NOT_BLANK pattern has it."""
    return _NOT_BLANK.search(text) is None


# The same whitespace as characters (str.strip's argument).
ECMA_SPACE_CHARS = (
    "\t\n\v\f\r \u00a0\u1680"
    + "".join(map(chr, range(0x2000, 0x200B)))
    + "\u2028\u2029\u202f\u205f\u3000\ufeff"
)


def strip_blank(text: str) -> str:
    """`text` without the whitespace NOT_BLANK stands for at either end (str.strip() would
    also take U+001C..U+001F and U+0085, and make a name the document takes empty)."""
    return text.strip(ECMA_SPACE_CHARS)


# The 64-bit range as the document states it: bounds a double holds exactly (2**63 - 1 does
# not: a client comparing in doubles would take 2**63 + 511 as within it).
INT64_DOCUMENTED = 2**63 - 1024
INT64: dict[str, Any] = {"minimum": -INT64_DOCUMENTED, "maximum": INT64_DOCUMENTED}
MAX_TOKENS_SCHEMA: dict[str, Any] = {
    "maximum": DOCUMENTED_MAX_TOKENS,
    "description": "Less than the model's context length: MAX_MODEL_LEN - 1 "
    f"({DOCUMENTED_MAX_TOKENS} by default); more is a 400 context_length_exceeded.",
}
_METADATA_SCHEMA = {
    "anyOf": [
        {
            "type": "object",
            "maxProperties": METADATA_PAIRS,
            "propertyNames": {"maxLength": METADATA_KEY_CHARS},
            "additionalProperties": {"type": "string", "maxLength": METADATA_VALUE_CHARS},
        },
        {"type": "null"},
    ],
    "default": None,
}
_STOP_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOPS},
        {"type": "null"},
    ],
    "default": None,
    "description": f"Up to {MAX_STOPS} non-empty stop sequences.",
}


def _check_metadata(v: dict[str, str] | None) -> dict[str, str] | None:
    if v is not None and (
        len(v) > METADATA_PAIRS
        or any(
            len(k) > METADATA_KEY_CHARS or len(val) > METADATA_VALUE_CHARS for k, val in v.items()
        )
    ):
        raise ValueError(
            f"at most {METADATA_PAIRS} pairs, keys up to {METADATA_KEY_CHARS} and values up to "
            f"{METADATA_VALUE_CHARS} characters"
        )
    return v


# OpenAI's metadata limits; jobs and batches take the same.
Metadata = Annotated[
    dict[str, str] | None, AfterValidator(_check_metadata), WithJsonSchema(_METADATA_SCHEMA)
]
# Stop sequences as the API takes them (JobCreate's validator checks them).
Stop = Annotated[str | list[str] | None, WithJsonSchema(_STOP_SCHEMA)]


def some_content(content: dict[str, Any]) -> dict[str, Any]:
    """A list of messages of which one at least has content besides whitespace, where
    `content` is the JSON Schema of a message's content that has some."""
    return {"contains": {"type": "object", "properties": {"content": content}}}


class Refused(Exception):
    """A request the platform will not take: an HTTP status and an OpenAI error code."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        param: str | None = None,
        *,
        retry_after_s: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s  # the Retry-After of a 429 or 503
        self.headers = headers  # what else its HTTP answer carries


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer"]
    content: str
    name: str | None = None


class JobCreate(BaseModel):
    """A generation job: exactly one of `messages` (of which one has some content) and
    `prompt` (not blank), up to MAX_PROMPT_CHARS characters of input in all (200,000 by
    default), and `min_tokens` no more than `max_tokens`."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "oneOf": [
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
            ]
        },
    )

    tier: Tier | None = None  # None: the tenant's default tier
    model: str | None = None
    messages: list[ChatMessage] | None = Field(
        default=None,
        min_length=1,
        json_schema_extra=some_content({"type": "string", "pattern": NOT_BLANK}),
    )
    prompt: str | None = Field(
        default=None,
        json_schema_extra={"pattern": NOT_BLANK, "maxLength": DOCUMENTED_MAX_PROMPT_CHARS},
    )
    max_tokens: int = Field(default=256, ge=1, json_schema_extra=MAX_TOKENS_SCHEMA)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: Stop = None
    seed: int | None = Field(default=None, json_schema_extra=INT64)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # vLLM's extensions of the OpenAI parameters, under the same names as `vllm serve`:
    # generate at least `min_tokens` before a stop or EOS may end the output; `ignore_eos`
    # runs to max_tokens (benchmarks and load tests use it for outputs of a known length).
    min_tokens: int = Field(
        default=0,
        ge=0,
        json_schema_extra={"maximum": DOCUMENTED_MAX_TOKENS, "description": "At most max_tokens."},
    )
    ignore_eos: bool = False
    # Structured outputs (tierq/services/structured.py): JSON, or JSON of a schema.
    response_format: ResponseFormat | None = None
    logit_bias: LogitBias = None
    # Log probabilities of the generated tokens: each token's, and the `logprobs` most
    # likely at its position (0: the chosen token's alone); None: none.
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # Choices generated for the prompt, each up to max_tokens, each billed.
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    metadata: Metadata = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ValueError("at most 4 non-empty stop sequences")
        return stops

    @model_validator(mode="after")
    def _one_input(self) -> JobCreate:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of 'messages' or 'prompt'")
        if self.prompt is not None and blank(self.prompt):
            raise ValueError("'prompt' must not be empty")
        if self.messages is not None and all(blank(m.content) for m in self.messages):
            raise ValueError("'messages' must carry some content")
        if self.min_tokens > self.max_tokens:
            raise ValueError("'min_tokens' must not exceed 'max_tokens'")
        return self

    def params(self) -> dict[str, Any]:
        """The sampling parameters, as the worker passes them to the engine."""
        params: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stop": self.stop,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
        }
        structured = self.response_format.engine_param() if self.response_format else None
        if structured is not None:  # left out otherwise: what older workers read stays so
            params["response_format"] = structured
        if self.logit_bias:
            params["logit_bias"] = self.logit_bias
        if self.logprobs is not None:
            params["logprobs"] = self.logprobs
        if self.n > 1:
            params["n"] = self.n
        return params

    @property
    def output_tokens(self) -> int:
        """The most tokens the job can generate: max_tokens for each of its n choices."""
        return self.max_tokens * self.n

    def input_chars(self) -> int:
        if self.prompt is not None:
            return len(self.prompt)
        return sum(len(m.content) for m in self.messages or [])


def check(body: JobCreate, settings: Settings) -> str:
    """The checks that need the deployment's settings; returns the model name to run."""
    model = body.model or settings.served_model_name
    if model != settings.served_model_name:
        raise Refused(404, f"The model '{model}' does not exist.", "model_not_found", "model")
    context = fleet.max_model_len(settings)  # what the fleet's workers serve
    if body.max_tokens >= context:
        raise Refused(
            400,
            f"max_tokens={body.max_tokens} leaves no room for a prompt in this model's "
            f"maximum context length of {context} tokens.",
            "context_length_exceeded",
            "max_tokens",
        )
    if body.input_chars() > settings.max_prompt_chars:
        raise Refused(
            400,
            f"The input is longer than {settings.max_prompt_chars} characters.",
            "context_length_exceeded",
            "messages" if body.messages is not None else "prompt",
        )
    why = structured.refusal(body.response_format.engine_param() if body.response_format else None)
    if why is not None:
        raise Refused(400, f"{why}.", "invalid_response_format", "response_format")
    counter = token_count.for_settings(settings)
    vocabulary = counter.vocabulary_size()
    past = [t for t in body.logit_bias or {} if vocabulary and int(t) >= vocabulary]
    if past:
        raise Refused(
            400,
            f"logit_bias names token ids past this model's vocabulary of {vocabulary}: "
            f"{', '.join(past[:5])}.",
            "token_id_out_of_vocabulary",
            "logit_bias",
        )
    # What provably cannot fit goes no further (no tokenizer run: bytes over the longest
    # token of the vocabulary).
    contents = [{"content": m.content} for m in body.messages or []]
    floor = counter.floor_quick(contents or None, body.prompt)
    refuse_unless_fits(floor, body, settings)
    return model


def refuse_unless_fits(prompt_tokens_at_least: int, body: JobCreate, settings: Settings) -> None:
    """Refuse a request whose prompt takes at least `prompt_tokens_at_least` tokens when
    that and its max_tokens pass the model's context, as the engine would after queueing."""
    context = fleet.max_model_len(settings)
    if prompt_tokens_at_least + body.max_tokens <= context:
        return
    raise Refused(
        400,
        f"This model's maximum context length is {context} tokens. However, "
        f"the input takes at least {prompt_tokens_at_least} tokens and max_tokens is "
        f"{body.max_tokens}: reduce the length of the input or max_tokens.",
        "context_length_exceeded",
        "messages" if body.messages is not None else "prompt",
    )
