"""A generation request, normalised: the native job API's body, and what the OpenAI surface
and batch lines are translated into before admission. `check` applies the deployment's
limits; a refusal is `Refused`, which the API answers in OpenAI's error shape and a batch
writes to its error file."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from tierq.settings import Settings
from tierq.tiers import Tier


def _check_metadata(v: dict[str, str] | None) -> dict[str, str] | None:
    if v is not None and (
        len(v) > 16 or any(len(k) > 64 or len(val) > 512 for k, val in v.items())
    ):
        raise ValueError("at most 16 pairs, keys up to 64 and values up to 512 characters")
    return v


# OpenAI's metadata limits; jobs and batches take the same.
Metadata = Annotated[dict[str, str] | None, AfterValidator(_check_metadata)]


class Refused(Exception):
    """A request the platform will not take: an HTTP status and an OpenAI error code."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer"]
    content: str
    name: str | None = None


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tier: Tier | None = None  # None: the tenant's default tier
    model: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    prompt: str | None = None
    max_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # vLLM's extensions of the OpenAI parameters, under the same names as `vllm serve`:
    # generate at least `min_tokens` before a stop or EOS may end the output; `ignore_eos`
    # runs to max_tokens (benchmarks and load tests use it for outputs of a known length).
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    metadata: Metadata = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("at most 4 non-empty stop sequences")
        return stops

    @model_validator(mode="after")
    def _one_input(self) -> JobCreate:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of 'messages' or 'prompt'")
        if self.prompt is not None and not self.prompt.strip():
            raise ValueError("'prompt' must not be empty")
        if self.messages is not None and not any(m.content.strip() for m in self.messages):
            raise ValueError("'messages' must carry some content")
        if self.min_tokens > self.max_tokens:
            raise ValueError("'min_tokens' must not exceed 'max_tokens'")
        return self

    def params(self) -> dict[str, Any]:
        """The sampling parameters, as the worker passes them to the engine."""
        return {
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

    def input_chars(self) -> int:
        if self.prompt is not None:
            return len(self.prompt)
        return sum(len(m.content) for m in self.messages or [])


def check(body: JobCreate, settings: Settings) -> str:
    """The checks that need the deployment's settings; returns the model name to run."""
    model = body.model or settings.served_model_name
    if model != settings.served_model_name:
        raise Refused(404, f"The model '{model}' does not exist.", "model_not_found", "model")
    if body.max_tokens >= settings.max_model_len:
        raise Refused(
            400,
            f"max_tokens={body.max_tokens} leaves no room for a prompt in this model's "
            f"maximum context length of {settings.max_model_len} tokens.",
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
    return model
