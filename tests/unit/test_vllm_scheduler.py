"""tierq's scheduler for vLLM: the per-step ordering and deferral (a pure function, tested on
plain request records), and the vLLM internals it relies on, pinned so that a vLLM upgrade
that moves them fails here rather than silently turning the tiered scheduler into vLLM's."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from workers.vllm_scheduler import TieredScheduler, _tiered, prioritise


@dataclass
class Req:
    name: str
    priority: int
    arrival_time: float
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    next_decode_eligible_step: int = 0


def decoding(name: str, priority: int, at: float) -> Req:
    return Req(name, priority, at, 50, 60)  # prompt done: one token a step


def test_running_requests_are_ordered_by_priority_then_arrival() -> None:
    running = [decoding("b1", 10, 1.0), decoding("i1", 0, 3.0), decoding("s1", 5, 0.5)]
    running.append(decoding("b0", 10, 0.2))
    deferred, cap = prioritise(running, None, free_slots=0, current_step=7, budget=128)
    assert [r.name for r in running] == ["i1", "s1", "b0", "b1"]
    assert deferred == [] and cap is None


def test_a_worse_prefill_that_would_starve_a_waiting_request_sits_out_one_step() -> None:
    # 60 decodes + a 600-token batch prompt mid-prefill: vLLM would hand the batch prompt
    # all of the 68 tokens left, and the interactive request waiting for a slot none.
    running = [decoding(f"d{i}", 10, i) for i in range(60)]
    big = Req("big", 10, 100.0, 600, 200)
    running.append(big)
    head = Req("chat", 0, 200.0, 60)
    deferred, cap = prioritise(running, head, free_slots=3, current_step=41, budget=128)
    # 8 tokens would be left beside the chat, but a chunk limit of 8 would cut the chat
    # too: the batch prompt's chunk is deferred instead. schedule() increments the step
    # to 42 and skips it while 42 < 43.
    assert deferred == [big] and cap is None and big.next_decode_eligible_step == 43
    # Without a free slot for the chat, deferring would only waste the budget.
    big.next_decode_eligible_step = 0
    assert prioritise(running, head, free_slots=0, current_step=41, budget=128) == ([], None)
    # Decodes are never deferred.
    assert all(r.next_decode_eligible_step == 0 for r in running if r is not big)


def test_worse_prefills_that_fit_beside_the_waiting_request_go_on() -> None:
    small = Req("small", 10, 1.0, 30, 10)  # 20 tokens left
    big = Req("big", 10, 2.0, 600, 0)
    head = Req("chat", 0, 3.0, 40)
    deferred, cap = prioritise([big, small], head, free_slots=1, current_step=0, budget=100)
    # Walked in arrival order: small (20) fits; big may take what is left beside the chat.
    assert deferred == [] and cap == 40  # 100 - 40 chat - 20 small
    # A cap may never cut a more urgent prefill: here the chat needs more than is left.
    head.num_prompt_tokens = 70
    deferred, cap = prioritise([big, small], head, free_slots=1, current_step=0, budget=100)
    assert deferred == [big] and cap is None


def test_nothing_is_deferred_without_a_better_waiting_request_and_a_free_slot() -> None:
    big = Req("big", 10, 1.0, 600, 0)
    same = Req("other-batch", 10, 2.0, 60)
    assert prioritise([big], same, free_slots=1, current_step=0, budget=64) == ([], None)
    chat = Req("chat", 0, 2.0, 60)
    assert prioritise([big], chat, free_slots=0, current_step=0, budget=64) == ([], None)
    assert big.next_decode_eligible_step == 0


def test_the_vllm_internals_the_tiered_scheduler_relies_on_are_there() -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    schedule = inspect.getsource(Scheduler.schedule)
    # The running requests are walked in list order, each skipped while its
    # "not before step N" mark is ahead of the step counter incremented first.
    assert "self.current_step += 1" in schedule
    assert "self.current_step < request.next_decode_eligible_step" in schedule
    assert "while req_index < len(self.running)" in schedule
    # The per-request chunk limit is read from the config once, at the start of a step.
    assert "self.scheduler_config.long_prefill_token_threshold" in schedule
    assert "self.next_decode_eligible_step = 0" in inspect.getsource(Request.__init__)
    init = inspect.getsource(Scheduler.__init__)
    for name in ("self.running", "self.waiting", "self.max_num_running_reqs", "self.policy"):
        assert name in init
    assert issubclass(AsyncScheduler, Scheduler)
    # What the worker names in its engine arguments resolves to this class.
    from workers.vllm_engine import TIERED_SCHEDULER

    module, _, name = TIERED_SCHEDULER.rpartition(".")
    assert getattr(__import__(module, fromlist=[name]), name) is TieredScheduler


class _Waiting(list[Req]):
    def peek_request(self) -> Req:
        return self[0]


class _StockStep:
    """Stands in for vLLM's scheduler under the tiered wrapper: records what one step saw."""

    def __init__(self, running: list[object], waiting: list[Req]) -> None:
        from types import SimpleNamespace

        from vllm.v1.core.sched.request_queue import SchedulingPolicy

        self.policy = SchedulingPolicy.PRIORITY
        self.running = running
        self.waiting = _Waiting(waiting)
        self.max_num_running_reqs = 4
        self.current_step = 10
        self.scheduler_config = SimpleNamespace(
            long_prefill_token_threshold=0, max_num_batched_tokens=100
        )
        self.seen: list[tuple[list[str], int]] = []

    def schedule(self) -> str:
        names = [getattr(r, "name", "?") for r in self.running]
        self.seen.append((names, self.scheduler_config.long_prefill_token_threshold))
        return "scheduled"


def test_the_wrapper_sets_the_chunk_cap_for_one_step_and_restores_it() -> None:
    tiered = _tiered(_StockStep)
    big, small = Req("big", 10, 1.0, 600), Req("small", 10, 0.5, 30, 10)
    step = tiered([big, small], [Req("chat", 0, 2.0, 40)])
    assert step.schedule() == "scheduled"
    # Sorted by priority then arrival; big capped to what is left beside the chat.
    assert step.seen == [(["small", "big"], 40)]
    assert step.scheduler_config.long_prefill_token_threshold == 0


def test_the_wrapper_falls_back_to_vllms_own_steps_if_the_internals_moved() -> None:
    tiered = _tiered(_StockStep)
    step = tiered([object(), object()], [])  # records without the fields it reads
    assert step.schedule() == "scheduled" and step.schedule() == "scheduled"
    assert step._tiering is False and len(step.seen) == 2
