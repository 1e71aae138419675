"""A simulated engine with a calibrated cost model — for scheduler tests and benchmarks at scale.

It is never the default of a serving command (Settings.engine defaults to "vllm"), and
anything measured with it says so. It mimics what matters to the platform around it: a
fixed number of slots, priority admission (lower first, ties by arrival), continuous
batching (one decode step serves every running sequence, and costs more the more there
are), prefill cost per prompt token, a per-step token budget (chunked prefill), streaming
deltas, and abort.

Each step hands out the token budget the way vLLM's scheduler does: first to the running
requests, one after another, each taking what it needs (a decode token, or a chunk of its
prompt) while the budget lasts; then to waiting requests, admitted by priority while
slots and budget remain. `priority_steps=False` walks the running requests in the order
they were admitted, with the full budget every step, and never preempts (vLLM's stock
scheduler with the KV cache never short); True runs the very decisions of tierq's scheduler
for vLLM (`tierq.workers.engine.vllm_scheduler`), as `tiering` sets them: preemption for priority
(the
victim goes back to waiting, keeps its output and recomputes its KV — prompt and generated
tokens — when it resumes; at most `max_preemptions` times), the step budget that follows
the work, priority order, and worse prefill chunks deferred or capped while a better
request waits for a slot.

A simulated prefix cache (`CostModel.prefix_cache_entries`, 0 = none, the default): each
engine keeps an LRU of the prefix keys (`tierq.core.messages.prefix_key`, the digest placement
keys on, within the request's cache_salt as vLLM salts its cache) of the requests it was
given, at most that many; a request whose key is there skips the prefill of its first
min(prompt tokens - 1, PREFIX_CHARS / 4) tokens (their KV is cached; the last prompt token
is always computed, as in vLLM). It stands for vLLM's automatic prefix caching with room
for that many prefixes, no more: it is a model, and figures measured with it say so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierq.core import metrics
from tierq.core.messages import PREFIX_CHARS, prefix_key
from tierq.core.token_count import PromptCounter
from tierq.workers.engine.base import (
    LOGPROB_FLOOR,
    Chunk,
    EngineDead,
    EngineRequestError,
    logprob_entry,
    resumed_params,
)
from tierq.workers.engine.vllm_scheduler import (
    FirstSteps,
    StepBudget,
    Tiering,
    pick_victims,
    prioritise,
)

# What `tierq bench calibrate` (benchmarks/calibrate.py) measured on the real engine here.
CALIBRATION_FILE = Path(__file__).with_name("calibration.json")


@dataclass(frozen=True)
class CostModel:
    """Step time = base + per_seq * decoding sequences + prefill_per_token * prefill tokens."""

    prefill_s_per_token: float = 0.0004
    decode_step_base_s: float = 0.030
    decode_step_per_seq_s: float = 0.0025
    slots: int = 64
    max_model_len: int = 2048
    max_batched_tokens: int = 2048  # vLLM's per-step token budget (chunked prefill)
    speedup: float = 1.0  # simulated seconds per wall-clock second
    # vLLM's KV block (128 on the CPU build). A preempted request's full blocks stay in the
    # prefix cache (this model assumes they are not reused meanwhile): on resuming, only
    # the tokens past its last full block are computed again.
    block_size: int = 128
    # The simulated prefix cache: prefixes (prefix keys) an engine keeps, LRU; 0 = none.
    prefix_cache_entries: int = 0

    @classmethod
    def load(cls, path: Path | None = None) -> CostModel:
        """The cost model `tierq bench calibrate` fitted to the real engine on this machine."""
        raw = json.loads((path or CALIBRATION_FILE).read_text())
        return cls(
            prefill_s_per_token=raw["prefill_s_per_token"],
            decode_step_base_s=raw["decode_step_base_s"],
            decode_step_per_seq_s=raw["decode_step_per_seq_s"],
            slots=raw["slots"],
            max_model_len=raw["max_model_len"],
            max_batched_tokens=raw.get("max_batched_tokens", 2048),
        )

    def step_s(self, batch: int) -> float:
        return self.decode_step_base_s + self.decode_step_per_seq_s * batch

    def scaled(self, speedup: float) -> CostModel:
        """The engine `speedup` times as fast: a faster (or, under 1, slower) machine, or
        the calibrated engine on a clock compressed by `speedup`."""
        return dataclasses.replace(
            self,
            prefill_s_per_token=self.prefill_s_per_token / speedup,
            decode_step_base_s=self.decode_step_base_s / speedup,
            decode_step_per_seq_s=self.decode_step_per_seq_s / speedup,
            speedup=self.speedup * speedup,
        )


@dataclass(order=True)
class _Request:
    priority: int
    arrival: int
    request_id: str = field(compare=False)
    prompt_tokens: int = field(compare=False)
    max_tokens: int = field(compare=False)
    out: asyncio.Queue[Chunk | None] = field(compare=False)
    generated: int = field(default=0, compare=False)
    prefill_left: int = field(default=0, compare=False)
    next_decode_eligible_step: int = field(default=0, compare=False)
    num_preemptions: int = field(default=0, compare=False)
    cached: int = field(default=0, compare=False)  # prompt tokens the prefix cache held
    arrived_at: float = field(default=0.0, compare=False)  # time.monotonic()
    tierq_first_step_cleared: bool = field(default=False, compare=False)  # clear_step's mark
    logprobs: int | None = field(default=None, compare=False)  # top log probabilities asked
    index: int = field(default=0, compare=False)  # the choice it generates (of the n asked)

    # The names tierq's scheduler reads on vLLM's requests (tierq/workers/engine/vllm_scheduler.py).
    @property
    def arrival_time(self) -> float:
        return self.arrival

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_tokens

    @property
    def num_computed_tokens(self) -> int:
        # After a preemption prefill_left may count generated tokens too (their KV is
        # recomputed), and this may go below zero; what is left to prefill stays right.
        return self.prompt_tokens - self.prefill_left


class SimulatedEngine:
    name = "simulated"

    def __init__(
        self,
        cost: CostModel | None = None,
        priority_steps: bool = True,
        counter: PromptCounter | None = None,
        tiering: Tiering | None = None,
    ) -> None:
        self.cost = cost or CostModel()
        self.priority_steps = priority_steps
        self.tiering = tiering or Tiering()
        self.preempts_for_priority = priority_steps and self.tiering.preempt
        # The budget's clock runs in simulated seconds, as the cost model does.
        self._budget = StepBudget(self.tiering, lambda: time.monotonic() * self.cost.speedup)
        self._first_steps = FirstSteps(self.tiering, lambda r: r.arrived_at, time.monotonic)
        self.preemptions = 0  # preemptions for priority (tests and benchmarks read it)
        self.budgets: list[int] = []  # each step's token budget, the last 1000 steps
        # Prompts are counted as the served model's tokenizer would (given one), else by
        # a stand-in of about four characters a token.
        self.counter = counter or PromptCounter()
        # The simulated prefix cache (cost.prefix_cache_entries): keys, least recent first.
        self._prefixes: OrderedDict[str, None] = OrderedDict()
        self.prefix_lookups = 0  # requests looked up in it (benchmarks read these)
        self.prefix_hits = 0
        self._step_no = 0
        self._waiting: list[_Request] = []
        self._running: dict[str, _Request] = {}
        self._children: dict[str, list[str]] = {}  # a request of n > 1 -> its other choices' ids
        self._arrivals = itertools.count()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._loop_task = asyncio.create_task(self._step_loop(), name="simulated-engine")

    async def check_health(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            raise EngineDead("the simulated engine's step loop is not running")

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None

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
        prompt_tokens = self.counter.count(messages, prompt)
        max_tokens = int(params.get("max_tokens", 256))
        if prompt_tokens + max_tokens > self.cost.max_model_len:
            raise EngineRequestError(
                "context_length_exceeded",
                f"{prompt_tokens} prompt tokens plus max_tokens={max_tokens} exceed the "
                f"maximum context length of {self.cost.max_model_len}",
            )
        # A resumed run prefills its prompt and the tokens it resumes after, and goes on
        # counting from there: its text continues the earlier run's exactly.
        left = int(resumed_params(params, len(resume))["max_tokens"])
        # n choices are n requests of their own, as in vLLM (the first under the request's
        # id), writing to one queue.
        n = int(params.get("n", 1))
        out: asyncio.Queue[Chunk | None] = asyncio.Queue()
        if n > 1:
            self._children[request_id] = [f"{i}_{request_id}" for i in range(1, n)]
        for i in range(n):
            req = _Request(
                priority,
                next(self._arrivals),
                request_id if i == 0 else f"{i}_{request_id}",
                prompt_tokens,
                max_tokens,
                out,
                generated=max_tokens - left,
                arrived_at=time.monotonic(),
                logprobs=params.get("logprobs"),
                index=i,
            )
            req.cached = self._cached_prefix(
                messages, prompt, prompt_tokens + req.generated, cache_salt
            )
            req.prefill_left = prompt_tokens + req.generated - req.cached
            self._waiting.append(req)
        self._waiting.sort()
        self._wake.set()
        finished = 0
        try:
            while True:
                chunk = await out.get()
                if chunk is None:
                    return  # aborted
                yield chunk
                if chunk.finish_reason is not None:
                    finished += 1
                    if finished == n:
                        return
        finally:
            await self.abort(request_id)

    def _cached_prefix(
        self,
        messages: list[dict[str, Any]] | None,
        prompt: str | None,
        prompt_tokens: int,
        cache_salt: str | None,
    ) -> int:
        """Prompt tokens the simulated prefix cache holds for this request (0 on a miss);
        the request's prefix key becomes the most recent entry, evicting the least."""
        entries = self.cost.prefix_cache_entries
        if entries <= 0:
            return 0
        key = prefix_key(messages, prompt, scope=cache_salt)
        self.prefix_lookups += 1
        if key in self._prefixes:
            self._prefixes.move_to_end(key)
            self.prefix_hits += 1
            return max(0, min(prompt_tokens - 1, PREFIX_CHARS // 4))
        self._prefixes[key] = None
        while len(self._prefixes) > entries:
            self._prefixes.popitem(last=False)
        return 0

    async def abort(self, request_id: str) -> None:
        for child in self._children.pop(request_id, []):
            await self.abort(child)
        req = self._running.pop(request_id, None)
        if req is None:
            for i, waiting in enumerate(self._waiting):
                if waiting.request_id == request_id:
                    req = self._waiting.pop(i)
                    break
        if req is not None:
            req.out.put_nowait(None)

    @property
    def running(self) -> int:
        return len(self._running)

    def _computed(self, req: _Request) -> int:
        """Tokens whose KV the request holds: all but those left to prefill, or all but
        the last sampled token while it decodes."""
        return req.prompt_tokens + req.generated - max(req.prefill_left, 1)

    def _kv_lost(self, req: _Request) -> int:
        """What preempting the request throws away: its computed tokens past the last full
        block (vLLM's prefix cache gives the full ones back)."""
        return self._computed(req) % self.cost.block_size

    def _recomputed(self, req: _Request) -> int:
        """The tokens a preempted request has to compute when it resumes: everything past
        its last cached full block, a prompt it had not finished prefilling included."""
        cached = self._computed(req) // self.cost.block_size * self.cost.block_size
        return req.prompt_tokens + req.generated - cached

    def _preempt_for_priority(self) -> None:
        victims = pick_victims(
            self._running.values(),
            self._waiting,
            self.cost.slots - len(self._running),
            self.tiering.max_preemptions,
            self._kv_lost,
        )
        for victim in victims:
            del self._running[victim.request_id]
            victim.prefill_left = self._recomputed(victim)
            victim.num_preemptions += 1
            victim.next_decode_eligible_step = 0
            self._waiting.append(victim)
            self.preemptions += 1
            metrics.ENGINE_PREEMPTIONS.inc()
        if victims:
            self._waiting.sort()

    async def _step_loop(self) -> None:
        while True:
            if not self._running and not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            budget = self.cost.max_batched_tokens
            cap: int | None = None
            if self.priority_steps:
                budget = self._budget.tokens(self._running.values(), self._waiting, budget)
                if self.tiering.preempt:
                    self._preempt_for_priority()
            order = list(self._running.values())  # admission order
            if self.priority_steps:
                free = self.cost.slots - len(order)
                alone = self._first_steps.budget(order, self._waiting, free, self._step_no)
                if alone is not None:
                    budget = min(budget, alone)
                else:
                    _, cap = prioritise(order, self._waiting, free, self._step_no, budget)
            self.budgets = [*self.budgets[-999:], budget]
            self._step_no += 1
            chunk_limit = cap or budget
            decoding: list[_Request] = []
            chunks: list[tuple[_Request, int]] = []
            for req in order:
                if budget <= 0:
                    break
                if self._step_no < req.next_decode_eligible_step:
                    continue  # deferred for this step
                if req.prefill_left == 0:
                    decoding.append(req)
                    budget -= 1
                else:
                    take = min(req.prefill_left, budget, chunk_limit)
                    chunks.append((req, take))
                    budget -= take
            while self._waiting and len(self._running) < self.cost.slots and budget > 0:
                req = self._waiting.pop(0)  # by priority, then arrival
                self._running[req.request_id] = req
                take = min(req.prefill_left, budget, chunk_limit)
                chunks.append((req, take))
                budget -= take
            step = (
                self.cost.decode_step_base_s
                + self.cost.decode_step_per_seq_s * len(decoding)
                + self.cost.prefill_s_per_token * sum(n for _, n in chunks)
            )
            await asyncio.sleep(step)
            emitting = list(decoding)
            for req, take in chunks:
                req.prefill_left -= take
                if req.prefill_left == 0:
                    emitting.append(req)
            for req in emitting:
                if self._running.get(req.request_id) is not req:
                    continue  # aborted during the step
                req.generated += 1
                done = req.generated >= req.max_tokens
                req.out.put_nowait(
                    Chunk(
                        text=_token(req),
                        new_tokens=1,
                        prompt_tokens=req.prompt_tokens,
                        finish_reason="length" if done else None,
                        token_ids=(req.generated,),
                        cached_tokens=req.cached,
                        logprobs=_logprobs(req),
                        index=req.index,
                    )
                )
                if done:
                    del self._running[req.request_id]


def _token(req: _Request, ahead: int = 0) -> str:
    """The simulated engine's text of a token: " tok<k>" for the k-th, " tok<k>.<i>" in
    choice i > 0."""
    k = req.generated + ahead
    return f" tok{k}" if req.index == 0 else f" tok{k}.{req.index}"


def _logprobs(req: _Request) -> tuple[dict[str, Any], ...]:
    """The simulated engine's own distribution: it emits its next token with certainty
    (log probability 0), every other one never (the floor)."""
    if req.logprobs is None:
        return ()
    top = [(_token(req, j), 0.0 if j == 0 else LOGPROB_FLOOR) for j in range(req.logprobs)]
    return (logprob_entry(_token(req), 0.0, top),)
