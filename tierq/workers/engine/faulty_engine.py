"""A fault-injecting engine wrapper: for failure-path tests and `tierq bench chaos` only.

It wraps a real engine (vLLM or the simulated one) and makes a seeded fraction of requests
fail with each failure class an engine can raise, so that the worker's settle path is
exercised by the very exceptions it must survive: the engine refusing the request
(`request`), vLLM's input validation (`validation`, raised by the wrapper as vLLM's own
`VLLMValidationError` when vLLM is installed, through the real engine's translation), an
unknown error (`random`, a RuntimeError), and the engine dying (`dead`: every later call
raises EngineDead and `check_health` reports it). A fault strikes before the first chunk or
after some, as the seed decides. Never the default: ENGINE_FAULT_RATE is 0 unless set.

One more kind, asked for by name only: `stall`, a run that goes silent (the wrapper stops
passing its chunks on and waits until the worker gives up on it, as when the engine loses
track of a request), for the worker's watchdog (JOB_STALL_S). A request stalls at most
once, so its next delivery finishes.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Sequence

from tierq.workers.engine.base import Chunk, Engine, EngineDead, EngineRequestError, EngineWrapper

FAULT_KINDS = ("request", "validation", "random", "dead")  # the default mix
KNOWN_KINDS = (*FAULT_KINDS, "stall")


def _validation_error(message: str) -> BaseException:
    """vLLM's own validation error when vLLM is installed, as the real engine meets it."""
    try:
        from vllm.exceptions import VLLMValidationError

        from tierq.workers.engine.vllm_engine import translate_error
    except ImportError:
        return EngineRequestError("context_length_exceeded", message)
    return translate_error(VLLMValidationError(message))


class FaultyEngine(EngineWrapper):
    def __init__(
        self,
        inner: Engine,
        rate: float,
        seed: int = 0,
        kinds: tuple[str, ...] = FAULT_KINDS,
    ) -> None:
        unknown = set(kinds) - set(KNOWN_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds: {sorted(unknown)}")
        super().__init__(inner, f"faulty-{inner.name}")
        self.rate = rate
        self.kinds = kinds
        self.rng = random.Random(seed)
        self.dead = False
        self.injected: dict[str, int] = dict.fromkeys(KNOWN_KINDS, 0)
        self.stalled: set[str] = set()  # the requests that have had their stall

    async def check_health(self) -> None:
        if self.dead:
            raise EngineDead("the engine was killed by fault injection")
        await self.inner.check_health()

    def _raise(self, kind: str) -> None:
        self.injected[kind] += 1
        if kind == "request":
            raise EngineRequestError("invalid_request", "injected: the engine refused the request")
        if kind == "validation":
            raise _validation_error(
                "This model's maximum context length is 2048 tokens. However, your prompt "
                "contains 3000 input tokens (injected)"
            )
        if kind == "dead":
            self.dead = True
            raise EngineDead("injected: the engine died")
        raise RuntimeError("injected: an unknown engine error")

    async def observe(
        self, request_id: str, resume: Sequence[int], run: AsyncIterator[Chunk]
    ) -> AsyncIterator[Chunk]:
        if self.dead:
            raise EngineDead("the engine was killed by fault injection")
        fault = self.rng.choice(self.kinds) if self.rng.random() < self.rate else None
        if fault == "stall" and request_id in self.stalled:
            fault = None
        after = self.rng.randint(0, 8) if fault is not None else -1
        n = 0
        while True:
            if fault is not None and n == after:
                if fault == "stall":
                    await self._stall(request_id)
                else:
                    await self.inner.abort(request_id)
                    self._raise(fault)
            try:
                chunk = await anext(run)
            except StopAsyncIteration:
                return
            if self.dead:
                raise EngineDead("the engine was killed by fault injection")
            yield chunk
            n += 1

    async def _stall(self, request_id: str) -> None:
        """Silence for ever: the run's chunks are no longer passed on (the inner engine goes
        on with the request until the worker aborts it)."""
        self.injected["stall"] += 1
        self.stalled.add(request_id)
        await asyncio.Event().wait()
