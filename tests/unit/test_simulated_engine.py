"""The simulated engine's step model: the two schedulers it stands for (no services)."""

from __future__ import annotations

import asyncio
import time

from workers.simulated_engine import CostModel, SimulatedEngine

# Fast and budget-bound: 32 tokens a step, one slot left for the interactive request.
COST = CostModel(
    prefill_s_per_token=0.001,
    decode_step_base_s=0.02,
    decode_step_per_seq_s=0.001,
    slots=4,
    max_model_len=4096,
    max_batched_tokens=32,
)


async def _first_token_steps(priority_steps: bool) -> float:
    """Three batch requests with 100-token prompts are mid-prefill when an interactive
    request arrives: how long until its first token, in full steps (32 tokens)."""
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
        batch = [asyncio.create_task(drain(f"b{i}", "x" * 4 * 100, 100, 2)) for i in range(3)]
        await asyncio.sleep(0.02)  # their prefill is under way
        ttft = await drain("chat", "x" * 4 * 20, 0, 1)
        await asyncio.gather(*batch)
    finally:
        await engine.shutdown()
    return ttft / (COST.step_s(0) + 32 * COST.prefill_s_per_token)


async def test_stock_vllm_steps_make_a_waiting_interactive_request_wait_for_older_prefills() -> (
    None
):
    tiered = await _first_token_steps(priority_steps=True)
    stock = await _first_token_steps(priority_steps=False)
    # tierq's order serves the interactive prompt in the step after the one under way;
    # vLLM's stock order first hands the budget to the running batch prompts (some 270
    # tokens left at 32 a step).
    assert tiered < 3, tiered
    assert stock > 6, stock
