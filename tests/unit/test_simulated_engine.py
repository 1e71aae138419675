"""The simulated engine's step model: the two schedulers it stands for (no services)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from prometheus_client import REGISTRY

from tierq.workers.engine.simulated_engine import CostModel, SimulatedEngine

# Fast and budget-bound: 32 tokens a step, one slot left for the interactive request.
COST = CostModel(
    prefill_s_per_token=0.0002,
    decode_step_base_s=0.005,
    decode_step_per_seq_s=0.0002,
    slots=4,
    max_model_len=4096,
    max_batched_tokens=32,
)


async def _first_token_steps(priority_steps: bool) -> float:
    """A batch request's 600-token prompt is being prefilled when an interactive request
    arrives: how long until the interactive one's first token, in full steps (32 tokens)."""
    engine = SimulatedEngine(COST, priority_steps=priority_steps)
    await engine.start()

    async def drain(rid: str, prompt: str, priority: int, max_tokens: int) -> float:
        sent = time.monotonic()
        first = 0.0
        params = {"max_tokens": max_tokens}
        async for _chunk in engine.generate(rid, None, prompt, params, priority):
            first = first or time.monotonic() - sent
        return first

    try:
        batch = asyncio.create_task(drain("batch", "x" * 4 * 600, 100, 2))
        await asyncio.sleep(0.03)  # its prefill is under way, two or three steps in
        ttft = await drain("chat", "x" * 4 * 20, 0, 1)
        await batch
    finally:
        await engine.shutdown()
    return ttft / (COST.step_s(0) + 32 * COST.prefill_s_per_token)


async def test_stock_vllm_steps_make_a_waiting_interactive_request_wait_for_older_prefills() -> (
    None
):
    tiered = await _first_token_steps(priority_steps=True)
    stock = await _first_token_steps(priority_steps=False)
    # tierq's scheduler defers the batch prompt's chunk for a step and the interactive
    # prompt goes in the step after the one under way; vLLM's stock order hands every
    # step's budget to the running batch prompt until its 600 tokens are done.
    assert tiered < 3, tiered
    assert stock > 10, stock


async def _interactive_behind_full_slots(priority_steps: bool) -> tuple[float, list[int], int]:
    """Both slots busy with batch requests when an interactive one arrives: its first token,
    in steps, the tokens each batch request ended with, and the engine's preemptions."""
    engine = SimulatedEngine(COST, priority_steps=priority_steps)
    await engine.start()

    async def drain(rid: str, priority: int, max_tokens: int) -> tuple[float, int]:
        sent = time.monotonic()
        first, tokens = 0.0, 0
        async for chunk in engine.generate(
            rid, None, "x" * 40, {"max_tokens": max_tokens}, priority
        ):
            first = first or time.monotonic() - sent
            tokens += chunk.new_tokens
        return first, tokens

    try:
        batch = [asyncio.create_task(drain(f"b{i}", 100, 60)) for i in range(4)]
        await asyncio.sleep(0.05)  # all four slots decoding
        ttft, _ = await drain("chat", 0, 1)
        outputs = [tokens for _, tokens in await asyncio.gather(*batch)]
    finally:
        await engine.shutdown()
    return ttft / (COST.step_s(4) + 32 * COST.prefill_s_per_token), outputs, engine.preemptions


def _engine_preemptions() -> float:
    return REGISTRY.get_sample_value("tierq_engine_preemptions_total") or 0.0


async def test_an_interactive_request_preempts_a_batch_one_which_still_finishes_whole() -> None:
    counted = _engine_preemptions()
    tiered, outputs, preemptions = await _interactive_behind_full_slots(priority_steps=True)
    assert tiered < 3, tiered  # the step under way, then its own
    assert outputs == [60, 60, 60, 60] and preemptions == 1
    assert _engine_preemptions() == counted + 1  # tierq_engine_preemptions_total, as vLLM's
    stock, outputs, preemptions = await _interactive_behind_full_slots(priority_steps=False)
    assert stock > 20, stock  # it waited for a batch request to finish (60 decode steps)
    assert outputs == [60, 60, 60, 60] and preemptions == 0


# --- the simulated prefix cache ---------------------------------------------------------------

CACHED = CostModel(
    prefill_s_per_token=0.0001,
    decode_step_base_s=0.001,
    decode_step_per_seq_s=0.0,
    slots=4,
    max_model_len=4096,
    max_batched_tokens=4096,
    prefix_cache_entries=2,
)
SYSTEM = "s" * 2000  # 500 prompt tokens, the first 256 (PREFIX_CHARS / 4) cacheable


def _chat(system: str, user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


async def _run(engine: SimulatedEngine, rid: str, system: str) -> float:
    sent = time.monotonic()
    async for _chunk in engine.generate(rid, _chat(system, rid), None, {"max_tokens": 1}, 10):
        pass
    return time.monotonic() - sent


async def test_a_cached_prefix_skips_its_prefill() -> None:
    engine = SimulatedEngine(CACHED)
    await engine.start()
    try:
        cold = await _run(engine, "first", SYSTEM)
        warm = await _run(engine, "second", SYSTEM)
    finally:
        await engine.shutdown()
    assert (engine.prefix_lookups, engine.prefix_hits) == (2, 1)
    # About 500 prefill tokens cold, about 250 warm (50 ms and 25 ms at 0.1 ms a token).
    assert warm < cold * 0.75, (cold, warm)


async def test_the_prefix_cache_evicts_the_least_recently_used() -> None:
    engine = SimulatedEngine(CACHED)
    a, b, c = ("a" * 1100, "b" * 1100, "c" * 1100)
    await engine.start()
    try:
        for rid, system in [("1", a), ("2", b), ("3", a), ("4", c), ("5", a), ("6", b)]:
            await _run(engine, rid, system)
    finally:
        await engine.shutdown()
    # a miss, b miss, a hit, c miss (evicts b), a hit, b miss (evicted).
    assert (engine.prefix_lookups, engine.prefix_hits) == (6, 2)


async def test_no_prefix_cache_by_default() -> None:
    engine = SimulatedEngine(CostModel(prefill_s_per_token=0.0, decode_step_base_s=0.001))
    await engine.start()
    try:
        for rid in ("1", "2"):
            await _run(engine, rid, SYSTEM)
    finally:
        await engine.shutdown()
    assert (engine.prefix_lookups, engine.prefix_hits) == (0, 0)


async def test_a_resumed_request_generates_only_the_rest_and_its_text_continues_exactly() -> None:
    """`resume`: the tokens an earlier run generated; the run continues after them (their
    ids, then its own), reports the request's own prompt, and stops at max_tokens overall."""
    engine = SimulatedEngine(COST)
    await engine.start()
    params = {"max_tokens": 10, "min_tokens": 4}
    try:
        whole = [c async for c in engine.generate("a", None, "x" * 40, params, 0)]
        rest = [
            c async for c in engine.generate("b", None, "x" * 40, params, 0, resume=(1, 2, 3, 4))
        ]
    finally:
        await engine.shutdown()
    assert "".join(c.text for c in whole[:4]) + "".join(c.text for c in rest) == "".join(
        c.text for c in whole
    )
    assert sum(c.new_tokens for c in rest) == 6 and rest[-1].finish_reason == "length"
    assert [t for c in rest for t in c.token_ids] == [t for c in whole[4:] for t in c.token_ids]
    assert rest[0].prompt_tokens == whole[0].prompt_tokens == 10


async def test_chunks_say_how_much_of_the_prompt_the_prefix_cache_held() -> None:
    engine = SimulatedEngine(dataclasses.replace(COST, prefix_cache_entries=2))
    await engine.start()
    prompt = "x" * 4 * 600
    try:
        cold = [c async for c in engine.generate("a", None, prompt, {"max_tokens": 2}, 0)]
        warm = [c async for c in engine.generate("b", None, prompt, {"max_tokens": 2}, 0)]
    finally:
        await engine.shutdown()
    assert {c.cached_tokens for c in cold} == {0}
    assert {c.cached_tokens for c in warm} == {256}  # PREFIX_CHARS / 4 of its 600 tokens


async def test_the_simulated_prefix_cache_is_salted_as_vllms() -> None:
    engine = SimulatedEngine(dataclasses.replace(COST, prefix_cache_entries=4))
    await engine.start()
    prompt, params = "x" * 4 * 600, {"max_tokens": 2}
    try:
        runs = [
            [c.cached_tokens async for c in engine.generate(rid, None, prompt, params, 0, (), salt)]
            for rid, salt in (("a1", "ten_a"), ("b1", "ten_b"), ("a2", "ten_a"), ("b2", "ten_b"))
        ]
    finally:
        await engine.shutdown()
    assert [set(r) for r in runs] == [{0}, {0}, {256}, {256}]


async def test_the_qos_bench_measures_how_fast_the_engine_runs_now() -> None:
    """`tierq bench qos --engine vllm` runs at the engine's speed at the hour it runs
    (benchmarks/qos.py `engine_speed`): here an engine at half the speed its cost model
    was calibrated at, and one at that speed."""
    from benchmarks.qos import engine_speed

    calibrated = CostModel(
        prefill_s_per_token=0.00001,
        decode_step_base_s=0.02,
        decode_step_per_seq_s=0.0025,
        slots=8,
        max_model_len=4096,
    )
    for speed in (0.5, 1.0):
        engine = SimulatedEngine(calibrated.scaled(speed))
        await engine.start()
        try:
            measured = await engine_speed(engine, calibrated)
        finally:
            await engine.shutdown()
        assert 0.75 * speed < measured < 1.25 * speed, (speed, measured)


def test_the_real_engine_qos_bench_starts_each_engine_once() -> None:
    """With the real engine the baselines (vLLM's stock scheduler) run before tierq's
    policy and its idle baseline, so that each engine starts once; the speed is measured
    on the first, and tierq's starts with its step hold stretched to that speed."""
    from benchmarks.qos import _run_order

    everything = ("tierq", "fcfs", "engine-priority")
    assert _run_order(everything, "simulated") == ["idle", "tierq", "fcfs", "engine-priority"]
    assert _run_order(everything, "vllm") == ["fcfs", "engine-priority", "idle", "tierq"]
    assert _run_order(("tierq",), "vllm") == ["idle", "tierq"]
    assert _run_order(("fcfs", "tierq"), "vllm") == ["fcfs", "idle", "tierq"]
