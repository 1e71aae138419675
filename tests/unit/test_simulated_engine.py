"""The simulated engine's step model: the two schedulers it stands for (no services)."""

from __future__ import annotations

import asyncio
import time

from workers.simulated_engine import CostModel, SimulatedEngine

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
