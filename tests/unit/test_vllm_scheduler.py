"""tierq's scheduler for vLLM: the per-step decisions (pure functions, tested on plain request
records), the scheduler itself on vLLM's real scheduler objects (preemption for priority, the
step budget, the preemption bound), and the vLLM internals it relies on, pinned so that a
vLLM upgrade that moves them fails here rather than silently turning the tiered scheduler
into vLLM's."""

from __future__ import annotations

import collections
import inspect
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tierq.workers.engine.vllm_scheduler import (
    FirstSteps,
    StepBudget,
    TieredScheduler,
    Tiering,
    _tiered,
    clear_step,
    kv_lost_on_preemption,
    pick_victims,
    prioritise,
)


@dataclass
class Req:
    name: str
    priority: int
    arrival_time: float
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    next_decode_eligible_step: int = 0
    num_preemptions: int = 0
    status: str = "WAITING"


def decoding(name: str, priority: int, at: float) -> Req:
    return Req(name, priority, at, 50, 60)  # prompt done: one token a step


def test_running_requests_are_ordered_by_priority_then_arrival() -> None:
    running = [decoding("b1", 10, 1.0), decoding("i1", 0, 3.0), decoding("s1", 5, 0.5)]
    running.append(decoding("b0", 10, 0.2))
    deferred, cap = prioritise(running, [], free_slots=0, current_step=7, budget=128)
    assert [r.name for r in running] == ["i1", "s1", "b0", "b1"]
    assert deferred == [] and cap is None


def test_a_worse_prefill_that_would_starve_a_waiting_request_sits_out_one_step() -> None:
    # 60 decodes + a 600-token batch prompt mid-prefill: vLLM would hand the batch prompt
    # all of the 68 tokens left, and the interactive request waiting for a slot none.
    running = [decoding(f"d{i}", 10, i) for i in range(60)]
    big = Req("big", 10, 100.0, 600, 200)
    running.append(big)
    head = Req("chat", 0, 200.0, 60)
    deferred, cap = prioritise(running, [head], free_slots=3, current_step=41, budget=128)
    # 8 tokens would be left beside the chat, but a chunk limit of 8 would cut the chat
    # too: the batch prompt's chunk is deferred instead. schedule() increments the step
    # to 42 and skips it while 42 < 43.
    assert deferred == [big] and cap is None and big.next_decode_eligible_step == 43
    # Without a free slot for the chat, deferring would only waste the budget.
    big.next_decode_eligible_step = 0
    assert prioritise(running, [head], free_slots=0, current_step=41, budget=128) == ([], None)
    # Decodes are never deferred.
    assert all(r.next_decode_eligible_step == 0 for r in running if r is not big)


def test_worse_prefills_that_fit_beside_the_waiting_request_go_on() -> None:
    small = Req("small", 10, 1.0, 30, 10)  # 20 tokens left
    big = Req("big", 10, 2.0, 600, 0)
    head = Req("chat", 0, 3.0, 40)
    deferred, cap = prioritise([big, small], [head], free_slots=1, current_step=0, budget=100)
    # Walked in arrival order: small (20) fits; big may take what is left beside the chat.
    assert deferred == [] and cap == 40  # 100 - 40 chat - 20 small
    # A cap may never cut a more urgent prefill: here the chat needs more than is left.
    head.num_prompt_tokens = 70
    deferred, cap = prioritise([big, small], [head], free_slots=1, current_step=0, budget=100)
    assert deferred == [big] and cap is None


def test_every_waiting_request_of_the_best_priority_that_gets_a_slot_is_served_first() -> None:
    # Two chats arrived in one step beside 60 decodes and a batch prompt mid-prefill. Were
    # only the first counted, the batch prompt would be capped to the 8 tokens left beside
    # it and the second chat cut to 8 tokens of its 60: its first token a step later.
    running = [decoding(f"d{i}", 10, i) for i in range(60)]
    big = Req("big", 10, 100.0, 600, 200)
    running.append(big)
    chats = [Req("chat1", 0, 200.0, 30), Req("chat2", 0, 201.0, 30)]
    later = Req("batch", 10, 202.0, 100)
    deferred, cap = prioritise(running, [*chats, later], free_slots=3, current_step=0, budget=128)
    assert deferred == [big] and cap is None
    # With one free slot only the first chat is admitted: the batch prompt may take what
    # is left beside it (128 - 60 decodes - 30), and the second chat waits anyway.
    big.next_decode_eligible_step = 0
    deferred, cap = prioritise(running, [*chats, later], free_slots=1, current_step=0, budget=128)
    assert deferred == [] and cap == 38


def test_nothing_is_deferred_without_a_better_waiting_request_and_a_free_slot() -> None:
    big = Req("big", 10, 1.0, 600, 0)
    same = Req("other-batch", 10, 2.0, 60)
    assert prioritise([big], [same], free_slots=1, current_step=0, budget=64) == ([], None)
    chat = Req("chat", 0, 2.0, 60)
    assert prioritise([big], [chat], free_slots=0, current_step=0, budget=64) == ([], None)
    assert big.next_decode_eligible_step == 0


def test_an_interactive_request_that_waited_long_gets_a_step_of_its_own() -> None:
    # 63 batch decodes and an interactive request waiting for the free slot, arrived early
    # in the step that just ended: every worse request (decodes too) sits this step out,
    # and the step's budget is what interactive work needs.
    running = [decoding(f"d{i}", 100, i) for i in range(62)]
    running.append(decoding("older-chat", 0, 50.0))  # an interactive request decoding
    chat = Req("chat", 0, 200.0, 60)
    alone = clear_step(running, [chat], 1, 41, 0, lambda r: r.arrival_time <= 200.0)
    assert alone == 60 + 1  # its prompt and the other chat's decode
    assert all(r.next_decode_eligible_step == 43 for r in running if r.priority == 100)
    assert running[-1].next_decode_eligible_step == 0


def test_a_request_gets_one_cleared_step_and_the_others_keep_three_steps_in_four() -> None:
    running = [decoding(f"d{i}", 100, i) for i in range(8)]
    chat = Req("chat", 0, 200.0, 60)
    assert clear_step(running, [chat], 1, 41, 0, lambda r: True) == 60
    # Not admitted after all (vLLM found no KV blocks for it): it still waits, long, but
    # gets no second cleared step — the decodes go on and free what it needs.
    assert clear_step(running, [chat], 1, 42, 0, lambda r: True) is None

    # However fast interactive requests arrive, at most 5 steps in any 20 are cleared; a
    # few arriving close together each get theirs.
    now = [0.0]
    steps = FirstSteps(Tiering(latency_step_tokens=128), lambda r: r.arrival_time, lambda: now[0])
    cleared = []
    for step in range(100):
        now[0] = step + 1.0
        arrived = Req(f"chat{step}", 0, now[0] - 0.9, 60)  # early in the step that ended
        cleared.append(steps.budget(running, [arrived], 1, step) is not None)
    assert cleared[0] is False  # no step before it: nothing waited
    assert cleared[1:6] == [True] * 5  # close together: each its own
    assert all(sum(cleared[i : i + 20]) <= 5 for i in range(81))
    assert sum(cleared) == 25  # 5 in every 20, not fewer
    # Off with INTERACTIVE_FIRST_STEP_ALONE=false, or without the small step budget.
    for tiering in (Tiering(latency_step_tokens=128, first_step_alone=False), Tiering()):
        off = FirstSteps(tiering, lambda r: r.arrival_time, lambda: now[0])
        assert off.budget(running, [Req("c", 0, 0.0, 60)], 1, 100) is None


def test_a_request_that_arrived_late_in_the_step_shares_its_first_step() -> None:
    # Arrived in the second half of the step that just ended: it waited little, and its
    # first step carries the others' decodes as usual (nothing cleared).
    running = [decoding(f"d{i}", 100, i) for i in range(63)]
    chat = Req("chat", 0, 200.0, 60)
    assert clear_step(running, [chat], 1, 41, 0, lambda r: r.arrival_time <= 150.0) is None
    assert all(r.next_decode_eligible_step == 0 for r in running)
    # Nor is anything cleared for a request that gets no slot, or for worse ones.
    assert clear_step(running, [chat], 0, 41, 0, lambda r: True) is None
    worse = Req("std", 10, 200.0, 60)
    assert clear_step(running, [worse], 1, 41, 0, lambda r: True) is None
    # Nor for an interactive request whose prompt is done (a resumed one has its prompt
    # and output to recompute: that counts as prompt).
    done = Req("chat", 0, 200.0, 60, 60)
    assert clear_step(running, [done], 1, 41, 0, lambda r: True) is None


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
    for name in (
        "self.running",
        "self.waiting",
        "self.max_num_running_reqs",
        "self.policy",
        "self.max_num_scheduled_tokens",
        "self.prev_step_scheduled_req_ids",
    ):
        assert name in init
    # The step's token budget is read from the attribute the wrapper sets for the step.
    assert "token_budget = self.max_num_scheduled_tokens" in schedule
    # Preemption for priority goes through vLLM's own: back to waiting, output kept, KV
    # freed; waiting requests are admitted in a step only if that step preempted nothing.
    preempt = inspect.getsource(Scheduler._preempt_request)
    for line in (
        "request.status = RequestStatus.PREEMPTED",
        "request.num_computed_tokens = 0",
        "request.num_preemptions += 1",
        "self.waiting.prepend_request(request)",
        "self.reset_preempted_req_ids.add(request.request_id)",
    ):
        assert line in preempt
    assert "if not preempted_reqs" in schedule
    # Async scheduling (the GPU default): the same scheduler, each step's next tokens
    # counted as placeholders, and a victim's step in flight delivered as stale output.
    assert issubclass(AsyncScheduler, Scheduler)
    assert "num_output_placeholders +=" in inspect.getsource(AsyncScheduler._update_after_schedule)
    assert "request.num_stale_output_tokens = request.num_in_flight_tokens" in preempt
    # What the worker names in its engine arguments resolves to this class.
    from tierq.workers.engine.vllm_args import TIERED_SCHEDULER

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
        self.max_num_scheduled_tokens = 100
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


# --- preemption for priority and the step budget: the pure decisions ---------------------


def test_a_better_waiting_request_takes_the_worst_running_requests_slot() -> None:
    running = [decoding("b-old", 100, 1.0), decoding("s", 10, 2.0), decoding("b-new", 100, 3.0)]
    waiting = [Req("chat1", 0, 4.0, 40), Req("chat2", 0, 5.0, 40), Req("b", 100, 6.0, 40)]
    # Two better requests, no free slot: the newest batch request, then the older one.
    victims = pick_victims(running, waiting, free_slots=0, max_preemptions=4)
    assert [v.name for v in victims] == ["b-new", "b-old"]
    # A free slot serves the first; only the second needs a victim.
    assert [v.name for v in pick_victims(running, waiting, 1, 4)] == ["b-new"]
    # Equal priorities never preempt each other (batch behind batch just waits).
    assert pick_victims(running, [Req("b", 100, 6.0, 40)], 0, 4) == []
    # A standard request preempts batch work, never interactive or standard work.
    victims = pick_victims(
        [decoding("i", 0, 1.0), decoding("s", 10, 2.0)], [Req("s2", 10, 3.0, 40)], 0, 4
    )
    assert victims == []


def test_of_equally_bad_requests_the_one_preempted_least_often_goes_first() -> None:
    resumed = decoding("resumed", 100, 9.0)  # the latest arrival, but preempted before
    resumed.num_preemptions = 1
    other = decoding("other", 100, 1.0)
    waiting = [Req("chat", 0, 10.0, 40)]
    assert pick_victims([other, resumed], waiting, 0, max_preemptions=4) == [other]
    other.num_preemptions = 1
    assert pick_victims([other, resumed], waiting, 0, max_preemptions=4) == [resumed]


def test_of_equally_bad_requests_the_one_with_least_kv_to_recompute_goes_first() -> None:
    # Prefix caching keeps full blocks of 16: the tail past the last one is what is lost.
    lost = kv_lost_on_preemption(16, prefix_caching=True)
    short_tail = Req("short-tail", 100, 1.0, 50, 65)  # 65 computed: 1 past four blocks
    long_tail = Req("long-tail", 100, 9.0, 50, 63)  # 15 past three blocks, the latest
    waiting = [Req("chat", 0, 10.0, 40)]
    assert pick_victims([short_tail, long_tail], waiting, 0, 4, lost) == [short_tail]
    # Preempted before, the short tail is spared: fewest preemptions rank first.
    short_tail.num_preemptions = 1
    assert pick_victims([short_tail, long_tail], waiting, 0, 4, lost) == [long_tail]
    # Without prefix caching every computed token is lost: the fewest go, though it is
    # not the latest arrival.
    short_tail.num_preemptions = 0
    fewest = Req("fewest", 100, 0.5, 50, 63)
    everything = kv_lost_on_preemption(16, prefix_caching=False)
    assert pick_victims([short_tail, fewest], waiting, 0, 4, everything) == [fewest]
    # Equal losses: the latest arrival, as before.
    tied = Req("tied", 100, 5.0, 50, 65)
    assert pick_victims([short_tail, tied], waiting, 0, 4, lost) == [tied]


def test_kv_lost_counts_a_step_in_flight_and_a_request_that_skips_the_cache() -> None:
    lost = kv_lost_on_preemption(16, prefix_caching=True)
    # 64 computed, four full blocks: nothing past them...
    assert lost(Req("r", 100, 1.0, 50, 64)) == 0
    # ...unless the last was computed by the async step still in flight: its block is not
    # cached yet, so all 16 of it are lost.
    in_flight = Req("r", 100, 1.0, 50, 64)
    in_flight.num_output_placeholders = 1  # type: ignore[attr-defined]
    assert lost(in_flight) == 16
    skipping = Req("r", 100, 1.0, 50, 64)
    skipping.skip_reading_prefix_cache = True  # type: ignore[attr-defined]
    assert lost(skipping) == 64


def test_a_request_preempted_max_preemptions_times_keeps_its_slot() -> None:
    tired = decoding("tired", 100, 3.0)
    tired.num_preemptions = 2
    fresh = decoding("fresh", 100, 1.0)
    waiting = [Req("chat1", 0, 4.0, 40), Req("chat2", 0, 5.0, 40)]
    assert pick_victims([fresh, tired], waiting, 0, max_preemptions=2) == [fresh]
    fresh.num_preemptions = 2
    assert pick_victims([fresh, tired], waiting, 0, max_preemptions=2) == []


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_step_budget_is_small_while_interactive_work_is_around() -> None:
    clock = Clock()
    budget = StepBudget(Tiering(latency_step_tokens=128, latency_hold_s=5.0), clock)
    batch = [decoding(f"b{i}", 100, i) for i in range(20)]
    # Only lower tiers, ever: the full budget.
    assert budget.tokens(batch, [Req("b-next", 100, 50.0, 600)], 2048) == 2048
    # An interactive request waiting: small, but never less than its prompt and the decodes.
    assert budget.tokens(batch, [Req("chat", 0, 60.0, 40)], 2048) == 128
    assert budget.tokens(batch, [Req("chat", 0, 60.0, 500)], 2048) == 520
    # Running (mid-prefill or decoding) counts too.
    assert budget.tokens([*batch, decoding("chat", 0, 60.0)], [], 2048) == 128
    # It has gone: small for the hold, then the full budget again.
    clock.now += 4.9
    assert budget.tokens(batch, [], 2048) == 128
    clock.now += 0.2
    assert budget.tokens(batch, [], 2048) == 2048
    # Off (0, the GPU default) or not below the full budget: always the full budget.
    off = StepBudget(Tiering(latency_step_tokens=0), clock)
    assert off.tokens(batch, [Req("chat", 0, 60.0, 40)], 2048) == 2048
    assert budget.tokens(batch, [Req("chat", 0, 60.0, 40)], 100) == 100


def test_tiering_reaches_the_engine_core_process_through_vllms_additional_config() -> None:
    tiering = Tiering(preempt=False, max_preemptions=3, latency_step_tokens=64)
    config = json.loads(json.dumps(tiering.to_config()))  # what crosses the process line
    assert Tiering.from_config(config) == tiering
    assert Tiering.from_config(None) == Tiering() == Tiering.from_config({"other": 1})


# --- the scheduler on vLLM's real scheduler objects ----------------------------------------

BLOCK = 16
FIRST_TOKEN = 100  # the fake model samples FIRST_TOKEN + position: a lost or repeated token shows


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model config only (no weights, no tokenizer): all vLLM's scheduler reads."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 1,
        "vocab_size": 1000,
        "max_position_embeddings": 2048,
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _device_config() -> dict[str, Any]:
    """vLLM's CUDA build on a host with no GPU (`make test-vllm-cuda`) finds no platform
    and cannot infer a device: the config then names the CPU, which the scheduler never
    reads (it schedules tokens and KV blocks, whatever the device)."""
    from vllm.config import DeviceConfig
    from vllm.platforms import current_platform

    return {} if current_platform.device_type else {"device_config": DeviceConfig(device="cpu")}


class Engine:
    """vLLM's real scheduler (tierq's, as the worker configures it) and a fake model runner
    that samples one token for every request whose prompt and output are all computed.

    With `async_scheduling` (vLLM's default on GPUs) the scheduler is tierq's subclass of
    vLLM's AsyncScheduler and the steps run as vLLM's engine core runs them then
    (`EngineCore.step_with_batch_queue`, a queue two batches deep): each step is scheduled
    while the one before is still in flight, its requests' next tokens counted as
    placeholders, and the results of a step reach the scheduler only after the next one is
    scheduled."""

    def __init__(
        self,
        model_dir: Path,
        slots: int,
        budget: int,
        tiering: Tiering,
        blocks: int = 2000,
        async_scheduling: bool = False,
    ) -> None:
        import torch
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )
        from vllm.v1.structured_output import StructuredOutputManager

        model = ModelConfig(
            model=str(model_dir), skip_tokenizer_init=True, max_model_len=2048, dtype="float32"
        )
        scheduler = SchedulerConfig(
            max_num_seqs=slots,
            max_num_batched_tokens=budget,
            max_model_len=2048,
            policy="priority",
            is_encoder_decoder=False,
        )
        cache = CacheConfig(block_size=BLOCK)
        cache.num_gpu_blocks = blocks
        config = VllmConfig(
            model_config=model,
            cache_config=cache,
            scheduler_config=scheduler,
            additional_config=tiering.to_config(),
            **_device_config(),
        )
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
        kv = KVCacheConfig(
            num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)]
        )
        # The CPU platform turns async scheduling off as the config is built; the GPU
        # platforms leave it on. What the scheduler reads of it is this one field.
        config.scheduler_config.async_scheduling = async_scheduling
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.scheduler: Any = TieredScheduler(
            vllm_config=config,
            kv_cache_config=kv,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
        )
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        assert isinstance(self.scheduler, AsyncScheduler) is async_scheduling
        self.async_scheduling = async_scheduling
        self.sampled: dict[str, int] = {}  # request id -> tokens the model sampled for it
        self.in_flight: collections.deque[tuple[Any, Any]] = collections.deque()
        self.serial = 0

    def add(
        self,
        name: str,
        priority: int,
        prompt_len: int = 40,
        max_tokens: int = 12,
        arrival_time: float | None = None,  # default: long ago (the serial number)
    ) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self.serial += 1
        # Distinct prompts: the prefix cache must not make anyone's prefill free.
        prompt = [(self.serial * 7919 + i) % 997 + 1 for i in range(prompt_len)]
        request = Request(
            name,
            prompt,
            SamplingParams(max_tokens=max_tokens),
            None,
            arrival_time=float(self.serial) if arrival_time is None else arrival_time,
            priority=priority,
            block_hasher=self.hasher,
        )
        self.scheduler.add_request(request)
        return request

    def step(self) -> Any:
        """Schedule one step and return what it scheduled. Synchronous: its results are
        applied at once. Async: the step joins the one in flight, and the older of the two
        is applied (only that one, if nothing more can be scheduled)."""
        from vllm.v1.outputs import ModelRunnerOutput

        out = self.scheduler.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in ids:
            # The model samples where a request's prompt and output (the tokens of steps
            # still in flight included) are all computed: vLLM's own mark of it.
            r = self.scheduler.requests[rid]
            done = not r.is_prefill_chunk
            # The position of the token sampled: the async scheduler has counted it already.
            position = r.num_output_tokens + r.num_output_placeholders - self.async_scheduling
            sampled.append([FIRST_TOKEN + position] if done else [])
            self.sampled[rid] = self.sampled.get(rid, 0) + done
        runner = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
        )
        self.in_flight.appendleft((out, runner))
        busy = out.total_num_scheduled_tokens > 0 or self.scheduler.has_requests()
        if self.async_scheduling and len(self.in_flight) < 2 and busy:
            return out
        self.scheduler.update_from_output(*self.in_flight.pop())
        return out

    def run(self, steps: int) -> Iterator[Any]:
        for _ in range(steps):
            yield self.step()


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(model_dir: Path, request: pytest.FixtureRequest) -> Callable[..., Engine]:
    """Every test on vLLM's real scheduler runs on its synchronous scheduler (the CPU
    build's) and on its async one (the GPU default)."""

    def make(slots: int = 4, budget: int = 256, blocks: int = 2000, **tiering: Any) -> Engine:
        return Engine(model_dir, slots, budget, Tiering(**tiering), blocks, request.param)

    return make


def generated(r: Any) -> int:
    """Tokens a request has generated, those of a step still in flight included (async)."""
    return int(len(r.output_token_ids) + r.num_output_placeholders)


def full_output(max_tokens: int) -> list[int]:
    return [FIRST_TOKEN + i for i in range(max_tokens)]


def test_an_interactive_request_is_scheduled_in_the_next_step_on_an_engine_full_of_batch_work(
    engine: Callable[..., Engine],
) -> None:
    from vllm.v1.request import RequestStatus

    e = engine(slots=4)
    batch = [e.add(f"batch{i}", 100) for i in range(4)]
    list(e.run(3))  # every slot busy: prompts done, decoding
    assert len(e.scheduler.running) == 4 and all(generated(b) == 3 for b in batch)
    chat = e.add("chat", 0)
    out = e.step()
    # In the very next step: the chat's prompt goes in, in the slot of the newest batch request.
    assert out.num_scheduled_tokens["chat"] == 40
    victim = batch[-1]
    assert out.preempted_req_ids == {victim.request_id}
    assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
    assert list(victim.output_token_ids) == full_output(3)  # its output is kept
    assert e.scheduler.priority_preemptions == 1
    steps = list(e.run(40))
    # The victim came back once a slot freed, recomputed its KV, and finished with its full
    # output: every token sampled once, none lost or sampled again.
    assert any("batch3" in s.scheduled_cached_reqs.resumed_req_ids for s in steps)
    for r in [*batch, chat]:
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED, r.request_id
        assert list(r.output_token_ids) == full_output(12), r.request_id
        assert e.sampled[r.request_id] == 12
    assert victim.num_preemptions == 1


def test_the_victim_is_the_batch_request_with_least_kv_to_recompute_in_vllms_scheduler(
    engine: Callable[..., Engine],
) -> None:
    """Four batch requests whose computed tokens end at different places in their last KV
    block: the one with the fewest past a full block is preempted, and on resuming only
    those are computed again (vLLM's prefix cache gives it the full blocks back)."""
    from vllm.v1.request import RequestStatus

    e = engine(slots=4)
    # After 3 steps each has computed its prompt and 2 output tokens: 42, 49, 35, 42, so
    # 10, 1, 3 and 10 tokens past their last full block of 16.
    batch = [e.add(f"batch{i}", 100, prompt_len=n) for i, n in enumerate([40, 47, 33, 40])]
    list(e.run(3))
    assert [b.num_computed_tokens for b in batch] == [42, 49, 35, 42]
    e.add("chat", 0)
    out = e.step()
    victim = batch[1]  # not the newest (batch3): the least to compute again
    assert out.preempted_req_ids == {victim.request_id}
    steps = list(e.run(40))
    resumed = [s for s in steps if "batch1" in s.scheduled_cached_reqs.resumed_req_ids]
    assert resumed
    # Its 47 + 3 tokens less the 48 the cache held: two computed again.
    assert resumed[0].num_scheduled_tokens["batch1"] == 2
    assert victim.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert list(victim.output_token_ids) == full_output(12) and e.sampled["batch1"] == 12


def test_requests_of_one_priority_never_preempt_each_other(
    engine: Callable[..., Engine],
) -> None:
    e = engine(slots=2)
    first = [e.add(f"b{i}", 100) for i in range(2)]
    list(e.run(2))
    late = e.add("b-late", 100)
    list(e.run(3))
    assert e.scheduler.priority_preemptions == 0
    assert all(r.num_preemptions == 0 for r in [*first, late])
    assert late not in e.scheduler.running


def test_a_request_is_preempted_at_most_max_preemptions_times(
    engine: Callable[..., Engine],
) -> None:
    """One slot, one long batch request, interactive requests one after another: the first
    preempts it; the second finds it at its bound and waits (no livelock)."""
    from vllm.v1.request import RequestStatus

    e = engine(slots=1, max_preemptions=1)
    batch = e.add("batch", 100, max_tokens=30)
    list(e.run(3))
    chat1 = e.add("chat1", 0, max_tokens=3)
    assert e.step().num_scheduled_tokens == {"chat1": 40}
    list(e.run(3))  # chat1 finishes; batch resumes
    assert chat1.status == RequestStatus.FINISHED_LENGTH_CAPPED
    list(e.run(2))
    assert batch in e.scheduler.running and batch.num_preemptions == 1
    chat2 = e.add("chat2", 0, max_tokens=3)
    out = e.step()
    assert "chat2" not in out.num_scheduled_tokens and batch.num_preemptions == 1
    while batch.status == RequestStatus.RUNNING:
        e.step()
    assert list(batch.output_token_ids) == full_output(30) and e.sampled["batch"] == 30
    list(e.run(4))
    assert chat2.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_the_step_budget_follows_interactive_work_in_vllms_scheduler(
    engine: Callable[..., Engine],
) -> None:
    e = engine(slots=8, budget=512, latency_step_tokens=64, latency_hold_s=3600)
    # A cold burst of batch prompts: vLLM's full budget.
    for i in range(6):
        e.add(f"b{i}", 100, prompt_len=200, max_tokens=40)
    assert e.step().total_num_scheduled_tokens == 512
    list(e.run(3))
    # An interactive request arrives: steps shrink to 64 tokens (its prompt fits beside the
    # decodes), and stay small while it runs and for the hold after it.
    e.add("chat", 0, prompt_len=40, max_tokens=4)
    e.add("b-more", 100, prompt_len=400, max_tokens=4)
    for out in e.run(10):
        assert out.total_num_scheduled_tokens <= 64
    assert e.scheduler.full_budget == e.scheduler.max_num_scheduled_tokens == 512


def test_an_interactive_request_that_waited_long_is_prefilled_alone_in_vllms_scheduler(
    engine: Callable[..., Engine],
) -> None:
    """A chat that arrived early in the step under way (here: long ago) gets a step of its
    prompt alone, the batch decodes sitting it out; in the next every decode goes on, and
    every batch request still finishes with its full output. A chat that arrived after the
    last step began shares its first step with them."""
    import time

    from vllm.v1.request import RequestStatus

    e = engine(slots=6, budget=256, latency_step_tokens=64, latency_hold_s=3600)
    batch = [e.add(f"batch{i}", 100, max_tokens=20) for i in range(4)]
    list(e.run(3))  # decoding
    e.add("chat", 0, max_tokens=4)
    assert e.step().num_scheduled_tokens == {"chat": 40}
    names = {b.request_id for b in batch}
    assert set(e.step().num_scheduled_tokens) == names | {"chat"}
    # Arrived after the step that just ended began, and past its middle whatever this
    # machine's load makes of the time between a step and the next (it waited not long).
    e.add("late-chat", 0, max_tokens=4, arrival_time=time.time() + 1.0)
    assert set(e.step().num_scheduled_tokens) == names | {"chat", "late-chat"}
    for _ in range(40):
        e.step()
    for b in batch:
        assert b.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert list(b.output_token_ids) == full_output(20) and e.sampled[b.request_id] == 20
    # INTERACTIVE_FIRST_STEP_ALONE=false: the chat shares its first step with the decodes.
    off = engine(
        slots=6, budget=256, latency_step_tokens=64, latency_hold_s=3600, first_step_alone=False
    )
    batch = [off.add(f"batch{i}", 100, max_tokens=20) for i in range(4)]
    list(off.run(3))
    off.add("chat", 0, max_tokens=4)
    assert set(off.step().num_scheduled_tokens) == {b.request_id for b in batch} | {"chat"}


def test_a_cleared_step_never_stalls_an_engine_out_of_kv_blocks(
    engine: Callable[..., Engine],
) -> None:
    """A chat that waited long but finds no KV blocks free gets one cleared step, no more:
    the batch decodes go on, finish, free their blocks, and the chat runs then."""
    from vllm.v1.request import RequestStatus

    # 13 blocks of 16 tokens: the four batch requests hold 12 after their prompts and 3
    # tokens each; the chat's 40-token prompt needs 3.
    e = engine(slots=6, budget=256, blocks=13, latency_step_tokens=64, latency_hold_s=3600)
    batch = [e.add(f"batch{i}", 100, max_tokens=20) for i in range(4)]
    list(e.run(3))
    chat = e.add("chat", 0, max_tokens=4)
    assert "chat" not in e.step().num_scheduled_tokens  # cleared, yet not admitted
    assert e.scheduler.first_steps.cleared == 1
    assert set(e.step().num_scheduled_tokens) & {b.request_id for b in batch}  # not again
    for _ in range(80):
        e.step()
    assert e.scheduler.first_steps.cleared == 1
    for r in [*batch, chat]:
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED, r.request_id
    assert list(chat.output_token_ids) == full_output(4)


@pytest.mark.parametrize("fails", ["at-once", "part-way", "after"])
def test_a_preemption_that_raises_leaves_its_victim_in_a_queue_and_it_finishes(
    engine: Callable[..., Engine], fails: str
) -> None:
    """vLLM's `_preempt_request` raising — before it touched the victim, after freeing its
    KV blocks, or once it was back in the waiting queue — strands nothing: the victim is in
    a queue, tierq's scheduler steps aside for vLLM's own (it does not fit this vLLM), and
    every request finishes with its whole output."""
    from vllm.v1.request import RequestStatus

    e = engine(slots=2)
    batch = [e.add(f"batch{i}", 100) for i in range(2)]
    list(e.run(3))
    scheduler = e.scheduler
    preempt = scheduler._preempt_request

    def failing(request: Any, *args: Any, **kwargs: Any) -> None:
        if fails == "part-way":
            scheduler.kv_cache_manager.free(request)
            request.status = RequestStatus.PREEMPTED
        elif fails == "after":
            preempt(request, *args, **kwargs)
        raise RuntimeError("injected: _preempt_request failed")

    scheduler._preempt_request = failing
    chat = e.add("chat", 0)
    e.step()
    victim = batch[-1]
    assert scheduler._tiering is False
    queued = [*scheduler.running, *scheduler.waiting]
    assert sum(r is victim for r in queued) == 1
    assert (victim.status == RequestStatus.RUNNING) is (fails == "at-once")
    scheduler._preempt_request = preempt
    for _ in range(60):
        e.step()
    for r in [*batch, chat]:
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED, r.request_id
        assert list(r.output_token_ids) == full_output(12), r.request_id
    assert not scheduler.running and not len(scheduler.waiting) and not scheduler.requests


def test_vllms_preemptions_are_counted_from_its_step_statistics() -> None:
    """The worker's vLLM stat logger adds each step's preempted requests to
    tierq_engine_preemptions_total (vLLM's own IterationStats, as its engine reports them)."""
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.stats import IterationStats

    from tierq.workers.engine.vllm_engine import _preemption_counter

    def counted() -> float:
        return REGISTRY.get_sample_value("tierq_engine_preemptions_total") or 0.0

    logger = _preemption_counter()(vllm_config=None)
    before = counted()
    stats = IterationStats()
    stats.num_preempted_reqs = 2
    logger.record(None, stats)
    logger.record(None, None)  # a step that reported no iteration statistics
    logger.record(None, IterationStats())  # one without a preemption
    assert counted() == before + 2
