"""What a worker needs from an engine, whichever engine it is (vLLM, or the simulated one)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol


class EngineRequestError(Exception):
    """The engine refused the request itself (too long for the context, bad parameters)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Chunk:
    text: str  # new text since the previous chunk
    new_tokens: int  # generated tokens in this chunk
    prompt_tokens: int
    finish_reason: str | None  # set on the last chunk


class Engine(Protocol):
    name: str

    async def start(self) -> None: ...

    def generate(
        self,
        request_id: str,
        messages: list[dict[str, Any]] | None,
        prompt: str | None,
        params: dict[str, Any],
        priority: int,
    ) -> AsyncIterator[Chunk]: ...

    async def abort(self, request_id: str) -> None: ...

    async def shutdown(self) -> None: ...
