"""OpenAI's surface, its protocol: the response bodies of the models, completions, files
and batches routes as pydantic models (the requests' are tierq/services/openai_compat.py's,
which batch input lines share). The OpenAPI document describes every answer with them,
and the schema fuzz (tests/integration/test_openapi_fuzz.py) checks each answer against
its model (tierq/api/schemas.py says how they are used).
"""

from __future__ import annotations

from typing import Any, Literal

from tierq.api.schemas import Body, Page, TokenLogprob, Usage


# --- models -----------------------------------------------------------------------------------
class Model(Body):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(Body):
    object: Literal["list"]
    data: list[Model]


# --- chat completions and completions -------------------------------------------------------
class ChatMessage(Body):
    role: Literal["assistant"]
    content: str | None
    refusal: str | None


class ChatLogprobs(Body):
    content: list[TokenLogprob] | None
    refusal: None


class ChatChoice(Body):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: str


class _Completion(Body):
    id: str
    created: int
    model: str
    usage: Usage
    service_tier: str | None
    system_fingerprint: str | None


class ChatCompletion(_Completion):
    """A chat completion, whole (`stream` unset); with `stream: true` the answer is
    Server-Sent Events of `chat.completion.chunk` objects, then `data: [DONE]`."""

    object: Literal["chat.completion"]
    choices: list[ChatChoice]


class CompletionLogprobs(Body):
    """OpenAI's legacy shape: parallel lists, one entry a token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(Body):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str


class TextCompletion(_Completion):
    """A text completion, whole (`stream` unset); streamed, Server-Sent Events of
    `text_completion` pieces, then `data: [DONE]`."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]


# --- files and batches ------------------------------------------------------------------------
class FileObject(Body):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str
    status_details: str | None
    expires_at: int | None


class FileList(Page):
    data: list[FileObject]


class RequestCounts(Body):
    total: int
    completed: int
    failed: int


class BatchErrors(Body):
    object: Literal["list"]
    data: list[dict[str, Any]]


class Batch(Body):
    id: str
    object: Literal["batch"]
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None


class BatchList(Page):
    data: list[Batch]
