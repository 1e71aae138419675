"""tierq's scheduler for vLLM: vLLM's own, with each step's token budget offered in priority
order. The worker hands it to the engine (`scheduler_cls`) unless
`ENGINE_PRIORITY_STEPS=false`.

Why. vLLM's priority policy orders only its waiting queue. Every step it first gives the
token budget to the requests already running, in the order they were admitted, and only
then admits waiting ones with what is left. On a busy engine the running requests include
lower-tier prompts still being prefilled in chunks, so a newly arrived interactive request
gets the crumbs of the budget, or none, step after step (vLLM issues #24365 and #40004
describe this priority inversion). Two changes, applied before each step:

1. The running requests are sorted by (priority, arrival): an interactive request that is
   mid-prefill or decoding takes its tokens before batch work does.
2. While a request of a better priority waits for admission with a slot free for it, the
   prefill chunks of worse-priority running requests that would leave it short of its
   prompt's tokens sit this step out (their decodes go on; prefills that fit beside it
   proceed, and one that does not fit may take a chunk of exactly what is left, through
   vLLM's per-request chunk limit `long_prefill_token_threshold` set for that step alone),
   so the budget they would have taken goes to the waiting request.

Nothing is lost or recomputed: a deferred chunk is computed a step later. The deferral
uses the scheduler's own per-request "not before step N" mark (`next_decode_eligible_step`,
which vLLM's async and diffusion schedulers set for their own reasons). vLLM calls its
scheduler interface internal; `tests/unit/test_vllm_scheduler.py` pins what this relies on.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from workers.parent_death import die_with_parent

log = logging.getLogger(__name__)


class _Request(Protocol):
    """What the decision reads of a request (vLLM's, or the simulated engine's)."""

    @property
    def priority(self) -> int: ...
    @property
    def arrival_time(self) -> float: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...

    next_decode_eligible_step: int


def prioritise(
    running: list[Any],
    waiting_head: _Request | None,
    free_slots: int,
    current_step: int,
    budget: int,
) -> tuple[list[Any], int | None]:
    """Order `running` for the coming step and keep worse-priority prefill chunks from
    taking the budget a better waiting request needs. Returns the requests deferred for this
    step and, where one worse prefill can take exactly what is left beside the waiting
    request, that cap (a per-request chunk limit for this step; None: no cap).
    `current_step` is the scheduler's counter before `schedule()` increments it."""
    running.sort(key=lambda r: (r.priority, r.arrival_time))
    if waiting_head is None or free_slots <= 0:
        return [], None

    def left(r: Any) -> int:
        return max(0, r.num_prompt_tokens - r.num_computed_tokens)

    # What vLLM will schedule before the waiting request whatever happens: one token per
    # decoding request, and the prefill of running requests at least as urgent.
    room = budget - left(waiting_head)
    urgent = [left(waiting_head)]
    for r in running:
        if not left(r):
            room -= 1
        elif r.priority <= waiting_head.priority:
            room -= left(r)
            urgent.append(left(r))
    deferred: list[Any] = []
    fitting: list[int] = []
    cap: int | None = None
    for r in running:  # vLLM walks them in this order; each takes all it can
        if r.priority <= waiting_head.priority or not left(r):
            continue
        if cap is None and left(r) <= room:
            room -= left(r)
            fitting.append(left(r))
            continue
        if cap is None and room > 0 and room >= max(urgent + fitting):
            cap, room = room, 0  # a chunk of exactly what is left; nobody else is cut
            continue
        # schedule() increments current_step, then skips a request while
        # current_step < next_decode_eligible_step: this skips exactly one step.
        r.next_decode_eligible_step = max(r.next_decode_eligible_step, current_step + 2)
        deferred.append(r)
    return deferred, cap


def _tiered(base: type) -> type:
    from vllm.v1.core.sched.request_queue import SchedulingPolicy

    class Tiered(base):
        _tiering = True  # off for good if this vLLM's internals are not what it expects

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            if not (self._tiering and self.policy == SchedulingPolicy.PRIORITY and self.running):
                return super().schedule(*args, **kwargs)
            config = self.scheduler_config
            try:
                limit: int = getattr(self, "max_num_active_reqs", None) or self.max_num_running_reqs
                _, cap = prioritise(
                    self.running,
                    self.waiting.peek_request() if self.waiting else None,
                    limit - len(self.running),
                    self.current_step,
                    getattr(self, "max_num_scheduled_tokens", config.max_num_batched_tokens),
                )
                configured = config.long_prefill_token_threshold
            except Exception:  # an engine that dies takes every job in it along
                log.exception("tierq's scheduler does not fit this vLLM; using vLLM's own")
                self._tiering = False
                return super().schedule(*args, **kwargs)
            if cap is None or 0 < configured <= cap:
                return super().schedule(*args, **kwargs)
            config.long_prefill_token_threshold = cap  # read once, at the start of a step
            try:
                return super().schedule(*args, **kwargs)
            finally:
                config.long_prefill_token_threshold = configured

    Tiered.__name__ = Tiered.__qualname__ = f"Tiered{base.__name__}"
    return Tiered


def _vllm_scheduler(args: tuple[Any, ...], kwargs: dict[str, Any]) -> type:
    """The scheduler class vLLM itself would pick for this configuration (the async one
    where async scheduling is on, as on GPUs)."""
    config = kwargs.get("vllm_config", args[0] if args else None)
    if config is not None and config.scheduler_config.async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        return AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


class TieredScheduler:
    """What vLLM instantiates (in its engine-core process): the tiered version of the
    scheduler vLLM would pick. Being built there, it also ties that process's life to
    the worker's (workers/parent_death.py)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        die_with_parent()
        return _tiered(_vllm_scheduler(args, kwargs))(*args, **kwargs)


class StockScheduler:
    """vLLM's own scheduler, unchanged (ENGINE_PRIORITY_STEPS=false), built through the same
    hook so that the engine-core process dies with the worker in this mode too."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        die_with_parent()
        return _vllm_scheduler(args, kwargs)(*args, **kwargs)
