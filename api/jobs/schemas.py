"""Request bodies of the native job API (responses are JobRecord.to_api())."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tierq.tiers import DEFAULT_TIER, Tier


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer"]
    content: str
    name: str | None = None


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tier: Tier = DEFAULT_TIER
    model: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    prompt: str | None = None
    max_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    metadata: dict[str, str] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("at most 4 non-empty stop sequences")
        return stops

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None and (
            len(v) > 16 or any(len(k) > 64 or len(val) > 512 for k, val in v.items())
        ):
            raise ValueError("at most 16 pairs, keys up to 64 and values up to 512 characters")
        return v

    @model_validator(mode="after")
    def _one_input(self) -> JobCreate:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of 'messages' or 'prompt'")
        if self.prompt is not None and not self.prompt.strip():
            raise ValueError("'prompt' must not be empty")
        if self.messages is not None and not any(m.content.strip() for m in self.messages):
            raise ValueError("'messages' must carry some content")
        return self

    def params(self) -> dict[str, Any]:
        """The sampling parameters, as the worker passes them to the engine."""
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stop": self.stop,
            "seed": self.seed,
        }

    def input_chars(self) -> int:
        if self.prompt is not None:
            return len(self.prompt)
        return sum(len(m.content) for m in self.messages or [])
