"""tierq's scheduler for vLLM: vLLM's own, with the tiers put first in every step. The worker
hands it to the engine (`scheduler_cls`) unless `ENGINE_PRIORITY_STEPS=false`.

Why. vLLM's priority policy orders only its waiting queue. Every step it first gives the
token budget to the requests already running, in the order they were admitted, and only
then admits waiting ones with what is left; and it preempts a running request only when
KV-cache blocks run out, so an interactive request that arrives when every `max_num_seqs`
slot is busy waits for a slot to free (vLLM issues #24365 and #40004 describe this priority
inversion). Four changes, applied before each step:

1. **Preemption for priority.** While a request waits that is strictly better than the
   worst running one and no running slot is free for it, the worst running request
   (priority value, then arrival — the victim vLLM picks under KV pressure) is preempted
   with vLLM's own `_preempt_request`: it goes back to the waiting queue, keeps the tokens
   it generated, and only its KV cache is recomputed when it resumes (its full blocks may
   still be in the prefix cache). Of equally bad ones, the one preempted least often goes
   first, so one request does not pay for every arrival. The better request enters in this
   very step. A request is preempted at most `max_preemptions` times (vLLM's
   `num_preemptions`, which counts KV-pressure preemptions too): after that it keeps its
   slot, so nothing livelocks. So lower tiers may fill every slot: the worker keeps none
   idle for the interactive tier.
2. **A step budget that follows the work.** On a compute-bound engine a step lasts as long
   as its token count, and a step's length bounds how long an arriving interactive request
   waits. While latency-sensitive work (priority at or better than `latency_priority`: the
   interactive tier) runs or waits, or arrived within `latency_hold_s`, a step takes at
   most `latency_step_tokens` (or what that work needs this step — its decodes, the
   prompts of latency-sensitive requests — if more); otherwise the full
   `max_num_batched_tokens`. 0 turns it off (the default on GPUs, where a step's time is
   nearly flat in its token count and a small budget would only slow prefill).
3. The running requests are sorted by (priority, arrival): an interactive request that is
   mid-prefill or decoding takes its tokens before batch work does.
4. While requests of a better priority wait for admission with slots free for them, the
   prefill chunks of worse-priority running requests that would leave them short of their
   prompts' tokens sit this step out (their decodes go on; prefills that fit beside it
   proceed, and one that does not fit may take a chunk of exactly what is left, through
   vLLM's per-request chunk limit `long_prefill_token_threshold` set for that step alone),
   so the budget they would have taken goes to the waiting requests.
5. **A first step of its own for a request that waited long.** While the small step
   budget is on, a latency-sensitive request that gets a slot with its prompt still to
   prefill, and that arrived in the first half of the step that just ended, is prefilled
   in a step of latency-sensitive work alone: every worse running request, decodes
   included, sits that one step out (`clear_step`). An arrival waits out the step under
   way (up to one step, S) and then its own, which carries every batch decode beside its
   prompt (about S again): up to 2S. Clearing the first step of the requests that waited
   most bounds the wait at about max(S + the prompt's own step, S/2 + S); each cleared step
   costs the other tiers one step's fixed cost (their decodes are delayed, not lost). Two
   bounds keep it from costing more: a request gets at most one cleared step (one that
   vLLM then cannot admit, for want of KV blocks, does not stop the engine again), and at
   most 5 steps in any 20 are cleared, however fast interactive work arrives
   (`FirstSteps`).

The deferral uses the scheduler's own per-request "not before step N" mark
(`next_decode_eligible_step`, which vLLM's async and diffusion schedulers set for their own
reasons). What tierq wants reaches vLLM's engine-core process in `additional_config`
(`Tiering`). vLLM calls its scheduler interface internal; `tests/unit/test_vllm_scheduler.py`
pins what this relies on and runs it on vLLM's real scheduler objects.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from tierq.workers.engine import quiet_waits
from tierq.workers.engine.parent_death import die_with_parent

if TYPE_CHECKING:
    from tierq.core.settings import Settings

# The scheduler runs in vLLM's engine-core process, where only vLLM's logger tree is set up
# (its lines reach the worker's log there).
log = logging.getLogger("vllm.tierq.scheduler")

# The key of tierq's part of vLLM's `additional_config`.
CONFIG_KEY = "tierq"
# On the CPU a step lasts about as long as its token count: a step of this many tokens
# keeps interactive decode steps short while prefills still move.
CPU_LATENCY_STEP_TOKENS = 128


@dataclass(frozen=True)
class Tiering:
    """What tierq's scheduler does beyond vLLM's own (see the module's docstring)."""

    preempt: bool = True
    max_preemptions: int = 4
    latency_priority: int = 0
    latency_step_tokens: int = 0  # 0: every step may take the full budget
    latency_hold_s: float = 5.0
    first_step_alone: bool = True  # clear_step (only while latency_step_tokens is on)

    @property
    def clears_first_steps(self) -> bool:
        """Whether a request that waited long gets a first step of its own (clear_step)."""
        return self.latency_step_tokens > 0 and self.first_step_alone

    @classmethod
    def from_settings(cls, settings: Settings) -> Tiering:
        from tierq.core.tiers import Tier, vllm_priority
        from tierq.workers.engine.vllm_build import vllm_cpu_build

        step_tokens = settings.interactive_step_tokens
        if step_tokens is None:
            step_tokens = CPU_LATENCY_STEP_TOKENS if vllm_cpu_build() else 0
        return cls(
            preempt=settings.engine_preemption,
            max_preemptions=settings.engine_max_preemptions,
            latency_priority=vllm_priority(Tier.INTERACTIVE),
            latency_step_tokens=step_tokens,
            latency_hold_s=settings.interactive_step_hold_s,
            first_step_alone=settings.interactive_first_step_alone,
        )

    def to_config(self) -> dict[str, Any]:
        return {CONFIG_KEY: asdict(self)}

    @classmethod
    def from_config(cls, additional_config: Any) -> Tiering:
        raw = additional_config.get(CONFIG_KEY) if isinstance(additional_config, dict) else None
        return cls(**raw) if raw else cls()


class _Request(Protocol):
    """What the decisions read of a request (vLLM's, or the simulated engine's)."""

    @property
    def priority(self) -> int: ...
    @property
    def arrival_time(self) -> float: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...

    next_decode_eligible_step: int


def _rank(r: Any) -> tuple[int, float]:
    return (r.priority, r.arrival_time)


def _left(r: Any) -> int:
    """Prompt tokens a request still has to prefill (0: it decodes, one token a step)."""
    return max(0, r.num_prompt_tokens - r.num_computed_tokens)


def kv_lost_on_preemption(block_size: int, prefix_caching: bool) -> Callable[[Any], int]:
    """What a preempted vLLM request computes again when it resumes, less its last token:
    with prefix caching the tokens it computed past its last full block that the cache
    holds, without it (or for a request that does not read the cache) every token it
    computed. Under async scheduling the step in flight (`num_output_placeholders`) is
    counted as computed but its block is not cached yet. An estimate for one full-attention
    KV group: hybrid and sliding-window models align cache hits otherwise."""

    def everything(r: Any) -> int:
        return int(r.num_computed_tokens)

    if not prefix_caching or block_size <= 0:
        return everything

    def past_cached_blocks(r: Any) -> int:
        if getattr(r, "skip_reading_prefix_cache", False):
            return everything(r)
        computed = int(r.num_computed_tokens)
        cached = max(0, computed - int(getattr(r, "num_output_placeholders", 0) or 0))
        return computed - cached // block_size * block_size

    return past_cached_blocks


def pick_victims(
    running: Iterable[Any],
    waiting: Iterable[Any],
    free_slots: int,
    max_preemptions: int,
    kv_lost: Callable[[Any], int] | None = None,
) -> list[Any]:
    """Running requests to preempt so that better waiting ones get a slot now.

    `waiting` in the order it is admitted (best first). Each waiting request beyond the free
    slots takes the slot of a running request of the worst priority value strictly worse
    than its own, preempted fewer than `max_preemptions` times: of those, the one preempted
    least often, then the one with the least KV to compute again when it resumes
    (`kv_lost`: with prefix caching, the tokens past its last full block; the cache keeps
    the full ones), then the latest to arrive (vLLM's own victim under KV pressure). A
    resumed request is the latest arrival again, and would otherwise be preempted over and
    over, its KV recomputed each time. Equal priorities never preempt each other."""
    lost = kv_lost or (lambda _r: 0)
    candidates = sorted(
        (r for r in running if r.num_preemptions < max_preemptions),
        key=lambda r: (r.priority, -r.num_preemptions, -lost(r), r.arrival_time),
    )
    victims: list[Any] = []
    for request in waiting:
        if free_slots > 0:
            free_slots -= 1
            continue
        if not candidates or candidates[-1].priority <= request.priority:
            break  # the rest wait no better than this one
        victims.append(candidates.pop())
    return victims


class StepBudget:
    """The token budget of each step: small while latency-sensitive work is around (see the
    module's docstring), the full one once only lower tiers have run for `latency_hold_s`."""

    def __init__(self, tiering: Tiering, clock: Callable[[], float] = time.monotonic) -> None:
        self.tiering = tiering
        self.clock = clock
        self.last_seen = float("-inf")  # when latency-sensitive work was last around

    def tokens(self, running: Iterable[Any], waiting: Iterable[Any], full: int) -> int:
        small = self.tiering.latency_step_tokens
        if small <= 0 or small >= full:
            return full
        best = self.tiering.latency_priority
        decodes = 0
        need = 0
        urgent = False
        for r in running:
            left = _left(r)
            decodes += not left
            if r.priority <= best:
                urgent = True
                need += left
        for r in waiting:  # best first: stop at the first that is not latency-sensitive
            if r.priority > best:
                break
            urgent = True
            need += _left(r)
        now = self.clock()
        if urgent:
            self.last_seen = now
        elif now - self.last_seen >= self.tiering.latency_hold_s:
            return full
        return min(full, max(small, decodes + need))


def prioritise(
    running: list[Any],
    waiting: Iterable[_Request],
    free_slots: int,
    current_step: int,
    budget: int,
) -> tuple[list[Any], int | None]:
    """Order `running` for the coming step and keep worse-priority prefill chunks from
    taking the budget that better waiting requests need. `waiting` in the order vLLM admits
    it (best first); of it, the requests that get one of the `free_slots` this step and
    share the best one's priority are the ones served first (all of them: two interactive
    requests that arrive in one step are both prefilled in the next). Returns the requests
    deferred for this step and, where one worse prefill can take exactly what is left
    beside them, that cap (a per-request chunk limit for this step; None: no cap).
    `current_step` is the scheduler's counter before `schedule()` increments it."""
    running.sort(key=_rank)
    admitted = list(itertools.islice(waiting, max(0, free_slots)))
    if not admitted:
        return [], None
    best = admitted[0].priority
    ahead = [w for w in admitted if w.priority <= best]

    left = _left

    # What vLLM will schedule before the worse prefills whatever happens: one token per
    # decoding request, the prefill of running requests at least as urgent, and the
    # prompts of the waiting requests served first.
    urgent = [left(w) for w in ahead]
    room = budget - sum(urgent)
    for r in running:
        if not left(r):
            room -= 1
        elif r.priority <= best:
            room -= left(r)
            urgent.append(left(r))
    deferred: list[Any] = []
    fitting: list[int] = []
    cap: int | None = None
    for r in running:  # vLLM walks them in this order; each takes all it can
        if r.priority <= best or not left(r):
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


# At most CLEAR_MAX_STEPS cleared steps in any CLEAR_WINDOW_STEPS: however fast
# latency-sensitive work arrives, the other tiers' decodes run in at least 3 steps of 4,
# while arrivals that come close together at a lower rate each get theirs.
CLEAR_WINDOW_STEPS = 20
CLEAR_MAX_STEPS = 5
# The mark clear_step leaves on a request it cleared a step for: a request gets at most one.
_CLEARED = "tierq_first_step_cleared"


def clear_step(
    running: list[Any],
    waiting: Iterable[_Request],
    free_slots: int,
    current_step: int,
    latency_priority: int,
    waited_long: Callable[[Any], bool],
) -> int | None:
    """Give a latency-sensitive request that has waited long its first step to
    latency-sensitive work alone.

    When waiting requests at or better than `latency_priority` get `free_slots` this step
    with their prompts still to prefill, and one of them has `waited_long` (FirstSteps'
    test: it arrived in the first half of the step that just ended) and had no step
    cleared for it yet, every worse-priority running request — decodes included — sits
    this one step out, and the step's budget is what the latency-sensitive work needs (its
    prompts, its own decodes and prefills). Those waiting requests are marked: none gets a
    second cleared step, so one that vLLM cannot admit after all (no KV blocks free) does
    not stop the others again and again. Why: the module's docstring, item 5. Returns that
    budget, or None (nothing cleared)."""
    admitted = list(itertools.islice(waiting, max(0, free_slots)))
    ahead = [w for w in admitted if w.priority <= latency_priority]
    if not any(_left(w) and waited_long(w) and not getattr(w, _CLEARED, False) for w in ahead):
        return None
    need = 0
    for w in ahead:
        setattr(w, _CLEARED, True)
        need += _left(w)
    for r in running:
        if r.priority <= latency_priority:
            need += _left(r) or 1
        else:
            r.next_decode_eligible_step = max(r.next_decode_eligible_step, current_step + 2)
    return need


class FirstSteps:
    """When `clear_step` may clear a step, for one engine: it keeps when the last step
    began (a request "waited long" if it arrived in the first half of the step that just
    ended) and which steps it cleared lately (at most CLEAR_MAX_STEPS in any
    CLEAR_WINDOW_STEPS)."""

    def __init__(
        self,
        tiering: Tiering,
        arrival: Callable[[Any], float],
        clock: Callable[[], float] = time.time,  # the clock of vLLM's arrival times
    ) -> None:
        self.tiering = tiering
        self.arrival = arrival
        self.clock = clock
        self.last_step_at = float("-inf")
        self.recent: collections.deque[int] = collections.deque(maxlen=CLEAR_MAX_STEPS)
        self.cleared = 0  # steps cleared (logs, tests)

    def budget(
        self, running: list[Any], waiting: Iterable[Any], free_slots: int, current_step: int
    ) -> int | None:
        """Called as each step is scheduled: the cleared step's budget, or None."""
        now = self.clock()
        half = (self.last_step_at + now) / 2
        self.last_step_at = now
        if not (self.tiering.clears_first_steps and running):
            return None
        full = len(self.recent) == CLEAR_MAX_STEPS
        if full and current_step - self.recent[0] < CLEAR_WINDOW_STEPS:
            return None
        alone = clear_step(
            running,
            waiting,
            free_slots,
            current_step,
            self.tiering.latency_priority,
            lambda r: self.arrival(r) <= half,
        )
        if alone is not None:
            self.recent.append(current_step)
            self.cleared += 1
        return alone


def _tiered(base: type) -> type:
    from vllm.v1.core.sched.request_queue import SchedulingPolicy

    class Tiered(base):
        _tiering = True  # off for good if this vLLM's internals are not what it expects

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            config = getattr(self, "vllm_config", None)
            policy = Tiering.from_config(getattr(config, "additional_config", None))
            if not getattr(self.scheduler_config, "enable_chunked_prefill", True):
                # Without chunked prefill a prompt longer than the step budget never runs.
                policy = replace(policy, latency_step_tokens=0)
            self.tier_policy = policy
            self.step_budget = StepBudget(policy)
            self.full_budget: int = getattr(
                self, "max_num_scheduled_tokens", self.scheduler_config.max_num_batched_tokens
            )
            self.priority_preemptions = 0  # how many this scheduler made (logs, tests)
            self.first_steps = FirstSteps(policy, lambda r: r.arrival_time)
            cache = getattr(self, "cache_config", None)
            self.kv_lost = kv_lost_on_preemption(
                int(getattr(self, "block_size", 0) or getattr(cache, "block_size", 0) or 0),
                bool(getattr(cache, "enable_prefix_caching", False)),
            )

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            if not (self._tiering and self.policy == SchedulingPolicy.PRIORITY):
                return super().schedule(*args, **kwargs)
            config = self.scheduler_config
            try:
                budget = self.step_budget.tokens(self.running, self.waiting, self.full_budget)
                if self.tier_policy.preempt and self.waiting and self.running:
                    self._preempt_for_priority()
                cap: int | None = None
                alone = self.first_steps.budget(
                    self.running, self._admissible(), self._free_slots(), self.current_step
                )
                if alone is not None:
                    budget = min(budget, alone)
                elif self.running:
                    _, cap = prioritise(
                        self.running,
                        self._admissible(),
                        self._free_slots(),
                        self.current_step,
                        budget,
                    )
                configured = config.long_prefill_token_threshold
            except Exception:  # an engine that dies takes every job in it along
                log.exception("tierq's scheduler does not fit this vLLM; using vLLM's own")
                self._tiering = False
                self.max_num_scheduled_tokens = self.full_budget
                return super().schedule(*args, **kwargs)
            self.max_num_scheduled_tokens = budget
            capped = cap is not None and not 0 < configured <= cap
            if capped:
                config.long_prefill_token_threshold = cap  # read once, at the start of a step
            try:
                return super().schedule(*args, **kwargs)
            finally:
                self.max_num_scheduled_tokens = self.full_budget
                if capped:
                    config.long_prefill_token_threshold = configured

        def _free_slots(self) -> int:
            limit: int = getattr(self, "max_num_active_reqs", None) or self.max_num_running_reqs
            # Paused streaming sessions hold a slot without being in `running` (vLLM counts
            # them the same way when it admits waiting requests).
            return limit - len(self.running) - getattr(self, "num_waiting_for_streaming_input", 0)

        def _admissible(self) -> Iterator[Any]:
            """The waiting requests vLLM may admit, best first (a request blocked on, say,
            a grammar's compilation is passed over)."""
            blocked = getattr(self, "_is_blocked_waiting_status", lambda _status: False)
            return (r for r in self.waiting if not blocked(r.status))

        def _preempt_for_priority(self) -> None:
            victims = pick_victims(
                self.running,
                self._admissible(),
                self._free_slots(),
                self.tier_policy.max_preemptions,
                self.kv_lost,
            )
            now = time.monotonic()
            for victim in victims:
                can_free = getattr(self, "_request_blocks_can_be_freed", lambda _r: True)
                if not can_free(victim):  # a deferred block free would not make room now
                    continue
                # What vLLM does to its victim under KV pressure: out of `running`, then back
                # to the waiting queue keeping its output; only its KV is recomputed.
                self.running.remove(victim)
                try:
                    self._preempt_request(
                        victim, now, drop_stale_output=getattr(self, "requires_kv_delivery", False)
                    )
                except BaseException:
                    self._restore(victim)  # never in neither queue, whatever failed
                    raise
                # Should it resume in this very step, the model runner needs all its tokens
                # again (as after vLLM's own reset_prefix_cache preemptions).
                self.prev_step_scheduled_req_ids.discard(victim.request_id)
                self.priority_preemptions += 1
                log.info(
                    "tierq: preempted request %s (priority %d, preempted %d times) for a "
                    "better waiting request",
                    victim.request_id,
                    victim.priority,
                    victim.num_preemptions,
                )

        def _restore(self, victim: Any) -> None:
            """Put a victim whose preemption failed back in a queue: a request in neither
            `running` nor `waiting` is never scheduled again, and its job never ends."""
            from vllm.v1.request import RequestStatus

            if victim in self.running or any(r is victim for r in self.waiting):
                return  # vLLM's own preemption got as far as the waiting queue
            if victim.status == RequestStatus.RUNNING:
                self.running.append(victim)  # untouched: its KV blocks are still its own
                log.error("tierq: preempting request %s failed; it runs on", victim.request_id)
                return
            # Part-way through: finish the preemption, so that it resumes from scratch (its
            # output kept) rather than from KV blocks it may no longer hold.
            with contextlib.suppress(Exception):
                self.kv_cache_manager.free(victim)
            victim.status = RequestStatus.PREEMPTED
            victim.num_computed_tokens = 0
            if hasattr(victim, "num_stale_output_tokens"):
                # Async scheduling: the step in flight delivers its tokens as stale ones
                # (counted, not applied to the reset counters), as vLLM's preemption has it.
                victim.num_stale_output_tokens = victim.num_in_flight_tokens
            victim.num_output_placeholders = 0
            self.waiting.prepend_request(victim)
            self.reset_preempted_req_ids.add(victim.request_id)
            log.error(
                "tierq: preempting request %s failed part-way; it waits to resume",
                victim.request_id,
            )

    Tiered.__name__ = Tiered.__qualname__ = f"Tiered{base.__name__}"
    return Tiered


def _settle(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """What tierq sets up in vLLM's engine-core process, where its scheduler is built: the
    process dies with the worker, and (if the worker asked) waits for its model worker
    without spinning (tierq/workers/engine/quiet_waits.py)."""
    die_with_parent()
    config = kwargs.get("vllm_config", args[0] if args else None)
    if quiet_waits.wanted(getattr(config, "additional_config", None)):
        quiet_waits.quiet_waits()


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
    scheduler vLLM would pick. Being built there, it also settles that process (`_settle`)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        _settle(args, kwargs)
        return _tiered(_vllm_scheduler(args, kwargs))(*args, **kwargs)


class StockScheduler:
    """vLLM's own scheduler, unchanged (ENGINE_PRIORITY_STEPS=false), built through the same
    hook so that the engine-core process is settled the same way in this mode too."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        _settle(args, kwargs)
        return _vllm_scheduler(args, kwargs)(*args, **kwargs)
