"""What a worker needs from an engine, whichever engine it is (vLLM, or the simulated one).

Failures come in three kinds, and the worker settles each differently:
- `EngineRequestError`: the engine refused this request (too long for the context, bad
  parameters). Running it again would fail again: the job fails with the error's code.
- `EngineDead`: the engine itself is gone. Nothing more runs here: the worker hands its
  jobs back and exits non-zero so that its supervisor restarts it.
- anything else: unknown, perhaps transient. The job is handed back for another delivery,
  and fails with `engine_error` once it has used up MAX_DELIVERIES.

A run can continue an earlier one (`resume`: the token ids the earlier runs generated):
the engine takes the prompt followed by those tokens as its prompt, generates at most
`max_tokens` minus their number, with the same sampling, and reports the original prompt's
token count. Nothing is decoded twice, and with the prefix cache the re-prefill is cheap.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class EngineRequestError(Exception):
    """The engine refused the request itself (too long for the context, bad parameters)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class EngineDead(Exception):
    """The engine can serve nothing more (its core process died, or it shut down)."""


@dataclass(frozen=True)
class Chunk:
    text: str  # new text since the previous chunk
    new_tokens: int  # generated tokens in this chunk
    prompt_tokens: int  # the request's own prompt (without tokens it resumes after)
    finish_reason: str | None  # set on the last chunk
    token_ids: tuple[int, ...] = ()  # the ids of this chunk's new tokens
    cached_tokens: int = 0  # prompt tokens the prefix cache held (0 until it is known)
    # With `logprobs` asked for: one entry per new token (`logprob_entry`).
    logprobs: tuple[dict[str, Any], ...] = ()
    index: int = 0  # the choice (of the request's n) this chunk continues


# What JSON carries for a log probability of -inf (a token the model rules out): the floor
# OpenAI's API and vLLM's server use.
LOGPROB_FLOOR = -9999.0


def logprob_entry(token: str, logprob: float, top: Sequence[tuple[str, float]]) -> dict[str, Any]:
    """One generated token's log probability and the most likely tokens at its place, in
    OpenAI's chat shape (`bytes`: the UTF-8 of the token's text)."""

    def one(text: str, value: float) -> dict[str, Any]:
        return {
            "token": text,
            "logprob": max(float(value), LOGPROB_FLOOR),
            "bytes": list(text.encode("utf-8")),
        }

    return {**one(token, logprob), "top_logprobs": [one(t, v) for t, v in top]}


class Engine(Protocol):
    name: str

    @property
    def preempts_for_priority(self) -> bool:
        """True: a better-priority request that finds every slot busy preempts a worse
        running one inside the engine (which resumes it later with its output kept), so the
        worker may take interactive work beyond its slots and the dispatcher never aborts
        its jobs for priority."""
        ...

    async def start(self) -> None: ...

    def generate(
        self,
        request_id: str,
        messages: list[dict[str, Any]] | None,
        prompt: str | None,
        params: dict[str, Any],
        priority: int,
        resume: Sequence[int] = (),
        cache_salt: str | None = None,
    ) -> AsyncIterator[Chunk]:
        """The request's chunks as the engine makes them. Its prompt's prefix-cache entries
        are shared only with requests of the same `cache_salt` (the worker passes its
        tenant's id: one tenant's cached prefixes never speed up, nor reveal to, another)."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def check_health(self) -> None:
        """Raise EngineDead when the engine can no longer serve."""
        ...

    async def shutdown(self) -> None: ...


class EngineWrapper:
    """An engine around another one (fault injection, instrumentation): everything goes to
    the inner engine unchanged, and each run's chunks pass through `observe`, which a
    wrapper overrides to watch, change or cut them."""

    def __init__(self, inner: Engine, name: str) -> None:
        self.inner = inner
        self.name = name

    def generate(
        self,
        request_id: str,
        messages: list[dict[str, Any]] | None,
        prompt: str | None,
        params: dict[str, Any],
        priority: int,
        resume: Sequence[int] = (),
        cache_salt: str | None = None,
    ) -> AsyncIterator[Chunk]:
        run = self.inner.generate(
            request_id, messages, prompt, params, priority, resume, cache_salt=cache_salt
        )
        return self.observe(request_id, resume, run)

    def observe(
        self, request_id: str, resume: Sequence[int], run: AsyncIterator[Chunk]
    ) -> AsyncIterator[Chunk]:
        """The chunks of one run of the request (continuing after `resume`), as the worker
        gets them; the inner engine's own by default. The run starts when first iterated."""
        return run

    @property
    def preempts_for_priority(self) -> bool:
        return self.inner.preempts_for_priority

    async def start(self) -> None:
        await self.inner.start()

    async def shutdown(self) -> None:
        await self.inner.shutdown()

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    async def check_health(self) -> None:
        await self.inner.check_health()


def resumed_params(params: dict[str, Any], resumed: int) -> dict[str, Any]:
    """A request's parameters for the run that continues after `resumed` generated tokens:
    what is left of max_tokens and min_tokens; sampling unchanged."""
    if not resumed:
        return params
    left = dict(params)
    left["max_tokens"] = int(params.get("max_tokens", 256)) - resumed
    left["min_tokens"] = max(0, int(params.get("min_tokens") or 0) - resumed)
    return left
