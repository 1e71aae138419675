"""OpenAI's request and response shapes, translated to and from tierq's jobs.

The online endpoints (`/v1/chat/completions`, `/v1/completions`) and the lines of a batch
file share these, so a request means the same thing either way and a batch's output body
is exactly what the online endpoint would have answered.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tierq.core.tiers import Tier
from tierq.models.records import JobRecord, unix
from tierq.services.requests import (
    DOCUMENTED_MAX_PROMPT_CHARS,
    DOCUMENTED_MAX_TOKENS,
    INT64,
    MAX_CHOICES,
    MAX_TOKENS_SCHEMA,
    MAX_TOP_LOGPROBS,
    NOT_BLANK,
    ChatMessage,
    JobCreate,
    LogitBias,
    Metadata,
    Stop,
    some_content,
)
from tierq.services.structured import ResponseFormat

MAX_COMPLETION_LOGPROBS = 5  # what OpenAI's legacy completions take
CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
ENDPOINTS = (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT)

# service_tier -> tier; None means the tenant's default tier.
_TIER_BY_SERVICE_TIER: dict[str, Tier | None] = {
    "auto": None,
    "default": None,
    "flex": Tier.STANDARD,
    "priority": Tier.INTERACTIVE,
}
# The service_tier a response echoes: the OpenAI name of the tier the job ran in.
SERVICE_TIER_BY_TIER = {Tier.INTERACTIVE: "priority", Tier.STANDARD: "default", Tier.BATCH: "batch"}

# Tool calling needs a model whose chat template takes tool definitions and a parser for
# the calls it writes (vLLM's --tool-call-parser); the bundled model's template takes none
# (SmolLM2-135M-Instruct renders only role and content), and tierq runs no parser.
_TOOLS = ("tools", "tool_choice", "functions", "function_call")
# Parameters OpenAI defines that this server does not implement: refused with a clear 400
# rather than silently ignored.
_UNSUPPORTED = (
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
    "reasoning_effort",
    "suffix",
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class OpenAIMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ContentPart]
    name: str | None = None

    def plain(self) -> ChatMessage:
        text = (
            self.content
            if isinstance(self.content, str)
            else "".join(part.text for part in self.content)
        )
        return ChatMessage(role=self.role, content=text, name=self.name)


# A prompt the engine can take: not blank, and no longer than MAX_PROMPT_CHARS (default).
_PROMPT_TEXT: dict[str, Any] = {
    "type": "string",
    "pattern": NOT_BLANK,
    "maxLength": DOCUMENTED_MAX_PROMPT_CHARS,
}
# An OpenAI message's content with some text: a string, or parts of which one has some.
_SOME_TEXT: dict[str, Any] = {
    "anyOf": [
        {"type": "string", "pattern": NOT_BLANK},
        {
            "type": "array",
            "contains": {"type": "object", "properties": {"text": {"pattern": NOT_BLANK}}},
        },
    ]
}
# `stream_options` is only taken with `stream: true`.
_STREAM_OPTIONS_NEED_STREAM: dict[str, Any] = {
    "anyOf": [
        {"not": {"required": ["stream_options"]}},
        {"properties": {"stream_options": {"type": "null"}}},
        {"required": ["stream"], "properties": {"stream": {"const": True}}},
    ]
}


class _Common(BaseModel):
    """What chat and text completions share. `min_tokens` is at most the request's
    `max_tokens`; the input is at most MAX_PROMPT_CHARS characters (200,000 by default)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_STREAM_OPTIONS_NEED_STREAM)

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    # Choices for the prompt, each up to max_tokens, each billed (prompt tokens once).
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    stop: Stop = None
    seed: int | None = Field(default=None, json_schema_extra=INT64)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    # vLLM's extensions (extra_body)
    min_tokens: int | None = Field(
        default=None, ge=0, json_schema_extra={"maximum": DOCUMENTED_MAX_TOKENS}
    )
    ignore_eos: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    user: str | None = None
    metadata: Metadata = None
    store: bool | None = None
    response_format: ResponseFormat | None = None
    logit_bias: LogitBias = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in _TOOLS:
                if data.get(name) not in (None, False):
                    raise ValueError(
                        f"'{name}' is not supported: this server runs no tool calling for "
                        f"the model '{data.get('model')}' (its chat template takes no tools "
                        "and no tool-call parser is configured)"
                    )
            for name in _UNSUPPORTED:
                if data.get(name) not in (None, False):
                    raise ValueError(f"'{name}' is not supported by this server")
        return data

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Common:
        if self.stream_options is not None and not self.stream:
            raise ValueError("'stream_options' is only allowed when 'stream' is true")
        return self

    @property
    def tier(self) -> Tier | None:
        return _TIER_BY_SERVICE_TIER[self.service_tier or "auto"]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _job(self, max_tokens: int, **inputs: Any) -> JobCreate:
        optional: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stop": self.stop,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "response_format": self.response_format,
            "logit_bias": self.logit_bias,
            "n": self.n,
            "metadata": self.metadata,
        }
        fields = {k: v for k, v in optional.items() if v is not None}
        inputs = {k: v for k, v in inputs.items() if v is not None}
        return JobCreate.model_validate(
            {"tier": self.tier, "model": self.model, "max_tokens": max_tokens, **inputs, **fields}
        )


# `top_logprobs` is only taken with `logprobs: true`.
_TOP_LOGPROBS_NEED_LOGPROBS: dict[str, Any] = {
    "anyOf": [
        {"not": {"required": ["top_logprobs"]}},
        {"properties": {"top_logprobs": {"type": "null"}}},
        {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
    ]
}


class ChatCompletionRequest(_Common):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"allOf": [_STREAM_OPTIONS_NEED_STREAM, _TOP_LOGPROBS_NEED_LOGPROBS]},
    )

    messages: list[OpenAIMessage] = Field(min_length=1, json_schema_extra=some_content(_SOME_TEXT))
    max_tokens: int | None = Field(default=None, ge=1, json_schema_extra=MAX_TOKENS_SCHEMA)
    max_completion_tokens: int | None = Field(
        default=None, ge=1, json_schema_extra=MAX_TOKENS_SCHEMA
    )
    # Each generated token's log probability, and `top_logprobs` most likely at its place.
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("'top_logprobs' is only allowed when 'logprobs' is true")
        return self

    def to_job(self) -> JobCreate:
        max_tokens = self.max_completion_tokens or self.max_tokens or 256
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._job(max_tokens, messages=[m.plain() for m in self.messages], logprobs=logprobs)


class CompletionRequest(_Common):
    prompt: str | list[str] = Field(
        json_schema_extra={
            "anyOf": [
                _PROMPT_TEXT,
                {"type": "array", "items": _PROMPT_TEXT, "minItems": 1, "maxItems": 1},
            ]
        }
    )
    # OpenAI's default for completions
    max_tokens: int | None = Field(default=16, ge=1, json_schema_extra=MAX_TOKENS_SCHEMA)
    echo: bool = Field(default=False, json_schema_extra={"const": False})  # refused when true
    best_of: int | None = Field(default=None, ge=1, le=1)
    # Each generated token's log probability and the `logprobs` most likely at its place
    # (OpenAI's legacy bound: at most 5).
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise ValueError("'prompt' must be one string (one completion per request)")
        if self.echo:
            raise ValueError("'echo' is not supported by this server")
        return self

    def to_job(self) -> JobCreate:
        prompt = self.prompt if isinstance(self.prompt, str) else self.prompt[0]
        return self._job(self.max_tokens or 16, prompt=prompt, logprobs=self.logprobs)


def parse(endpoint: str, body: dict[str, Any]) -> ChatCompletionRequest | CompletionRequest:
    """A request body for `endpoint` (one of ENDPOINTS); pydantic's ValidationError if bad."""
    if endpoint == CHAT_ENDPOINT:
        return ChatCompletionRequest.model_validate(body)
    return CompletionRequest.model_validate(body)


class BatchCreate(BaseModel):
    """The body of `POST /v1/batches`: an uploaded JSONL file of requests to one endpoint."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str = Field(json_schema_extra={"enum": list(ENDPOINTS)})
    completion_window: Literal["24h"]
    metadata: Metadata = None

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        if v not in ENDPOINTS:
            raise ValueError(f"must be one of {', '.join(ENDPOINTS)}")
        return v


# --- responses ----------------------------------------------------------------------------


def usage(job: JobRecord) -> dict[str, int]:
    prompt = job.prompt_tokens or 0
    completion = job.completion_tokens or 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def response_id(job: JobRecord, chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + job.id


def chat_logprobs(entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """A chat choice's `logprobs`: the tokens' entries as stored (OpenAI's chat shape)."""
    return None if entries is None else {"content": entries, "refusal": None}


def completion_logprobs(entries: list[dict[str, Any]] | None, offset: int = 0) -> Any:
    """A text completion choice's `logprobs`, OpenAI's legacy shape: parallel lists of the
    tokens, their log probabilities, the most likely tokens at each place with the chosen
    one (up to `logprobs` + 1), and each token's character offset in the completion from
    `offset` (where the previous chunk's text ended)."""
    if entries is None:
        return None
    offsets, at = [], offset
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [
            {
                **{t["token"]: t["logprob"] for t in e["top_logprobs"]},
                e["token"]: e["logprob"],
            }
            for e in entries
        ],
        "text_offset": offsets,
    }


def chat_completion(job: JobRecord) -> dict[str, Any]:
    return {
        "id": response_id(job, True),
        "object": "chat.completion",
        "created": unix(job.created_at),
        "model": job.model,
        "choices": [
            {
                "index": c["index"],
                "message": {"role": "assistant", "content": c["text"], "refusal": None},
                "logprobs": chat_logprobs(c["logprobs"]),
                "finish_reason": c["finish_reason"] or "stop",
            }
            for c in job.choices()
        ],
        "usage": usage(job),
        "service_tier": SERVICE_TIER_BY_TIER[job.tier],
        "system_fingerprint": None,
    }


def text_completion(job: JobRecord) -> dict[str, Any]:
    return {
        "id": response_id(job, False),
        "object": "text_completion",
        "created": unix(job.created_at),
        "model": job.model,
        "choices": [
            {
                "index": c["index"],
                "text": c["text"],
                "logprobs": completion_logprobs(c["logprobs"]),
                "finish_reason": c["finish_reason"] or "stop",
            }
            for c in job.choices()
        ],
        "usage": usage(job),
        "service_tier": SERVICE_TIER_BY_TIER[job.tier],
        "system_fingerprint": None,
    }


def completion_body(job: JobRecord, chat: bool) -> dict[str, Any]:
    return chat_completion(job) if chat else text_completion(job)


def chunk(
    job: JobRecord,
    chat: bool,
    *,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    include_usage: bool = False,
    logprobs: list[dict[str, Any]] | None = None,
    offset: int = 0,
    index: int = 0,
) -> dict[str, Any]:
    """One streamed chunk of choice `index` (chat.completion.chunk, or a text_completion
    piece); `logprobs`: the entries of its text's tokens (`offset`: the characters of the
    choice's text sent before it)."""
    if chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None or role:
            delta["content"] = text or ""
        choice: dict[str, Any] = {"index": index, "delta": delta}
        choice["logprobs"] = chat_logprobs(logprobs)
    else:
        choice = {"index": index, "text": text or ""}
        choice["logprobs"] = completion_logprobs(logprobs, offset)
    choice["finish_reason"] = finish_reason
    body: dict[str, Any] = {
        "id": response_id(job, chat),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": unix(job.created_at),
        "model": job.model,
        "choices": [choice],
        "service_tier": SERVICE_TIER_BY_TIER[job.tier],
        "system_fingerprint": None,
    }
    if include_usage:
        body["usage"] = None
    return body


def usage_chunk(job: JobRecord, chat: bool) -> dict[str, Any]:
    """The last chunk when stream_options.include_usage is set: no choices, the usage."""
    return {
        "id": response_id(job, chat),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": unix(job.created_at),
        "model": job.model,
        "choices": [],
        "service_tier": SERVICE_TIER_BY_TIER[job.tier],
        "system_fingerprint": None,
        "usage": usage(job),
    }


# Failure codes of a job that are the request's fault (400); the rest are the server's (500).
CLIENT_ERROR_CODES = frozenset({"context_length_exceeded", "invalid_request", "model_not_found"})


def failure_status(job: JobRecord) -> int:
    if job.error_code == "cancelled":
        return 409
    return 400 if job.error_code in CLIENT_ERROR_CODES else 500
