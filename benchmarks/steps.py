"""`tierq bench steps`: tierq's scheduler inside vLLM against vLLM's stock scheduler.

The real engine and bundled model, started once per scheduler with the same settings (the
engine start is not timed). `slots - 1` batch-priority requests with long prompts, each
distinct from its first token (no prefix-cache hits), are replaced as soon as they finish,
so the engine is always prefilling some of them in chunks; meanwhile interactive-priority
requests arrive one after another (a pause between them) and the time to each one's first
token is measured. Printed last, one JSON line: per scheduler the interactive TTFT mean,
p50, p95, max and the batch tokens generated per second over the same window, and the
ratios `ttft_mean_stock_over_tierq` and `batch_tokens_tierq_over_stock`.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from tierq.core.settings import Settings
from tierq.workers.engine.vllm_args import step_token_budget

BATCH_PROMPT = "Tell me about the history of bridges and rivers. "
QUESTION = "What is the capital of France? Answer briefly please now. "


async def _measure(settings: Settings, interactive: int, prompt_repeat: int) -> dict[str, Any]:
    from tierq.workers.engine.vllm_engine import VllmEngine

    engine = VllmEngine(settings)
    await engine.start()
    stop = asyncio.Event()
    generated = 0

    async def batch_slot(slot: int) -> None:
        nonlocal generated
        n = 0
        while not stop.is_set():
            n += 1
            prompt = f"Request {slot} {n}: " + BATCH_PROMPT * prompt_repeat
            params = {"max_tokens": 40 + (slot * 7) % 60, "temperature": 0.0, "ignore_eos": True}
            async for chunk in engine.generate(f"b{slot}-{n}", None, prompt, params, 100):
                generated += chunk.new_tokens
                if stop.is_set():
                    break

    slots = [asyncio.create_task(batch_slot(i)) for i in range(settings.max_num_seqs - 1)]
    try:
        await asyncio.sleep(10)  # the batch work fills the engine
        ttfts: list[float] = []
        started, generated_before = time.monotonic(), generated
        for i in range(interactive):
            sent = time.monotonic()
            prompt = f"Question {i}: " + QUESTION * 3
            params = {"max_tokens": 2, "temperature": 0.0}
            async for chunk in engine.generate(f"i{i}", None, prompt, params, 0):
                if chunk.new_tokens:
                    ttfts.append(time.monotonic() - sent)
                    break
            await asyncio.sleep(0.7)
        rate = (generated - generated_before) / (time.monotonic() - started)
    finally:
        stop.set()
        for task in slots:
            task.cancel()
        await asyncio.gather(*slots, return_exceptions=True)
        await engine.shutdown()
    ttfts.sort()
    return {
        "ttft_mean_s": round(statistics.mean(ttfts), 3),
        "ttft_p50_s": round(ttfts[len(ttfts) // 2], 3),
        "ttft_p95_s": round(ttfts[int(0.95 * (len(ttfts) - 1))], 3),
        "ttft_max_s": round(ttfts[-1], 3),
        "batch_tokens_per_s": round(rate, 2),
    }


async def run_steps(
    base: Settings, slots: int, interactive: int, prompt_repeat: int
) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name, tiered in (("tierq", True), ("stock", False)):
        print(f"running {name} scheduler ...", flush=True)
        settings = base.model_copy(update={"max_num_seqs": slots, "engine_priority_steps": tiered})
        result[name] = await _measure(settings, interactive, prompt_repeat)
        print(f"  {name}: {result[name]}", flush=True)
    result["ttft_mean_stock_over_tierq"] = round(
        result["stock"]["ttft_mean_s"] / result["tierq"]["ttft_mean_s"], 2
    )
    result["batch_tokens_tierq_over_stock"] = round(
        result["tierq"]["batch_tokens_per_s"] / result["stock"]["batch_tokens_per_s"], 3
    )
    result["_run"] = {
        "slots": slots,
        "max_num_batched_tokens": step_token_budget(base),
        "interactive_requests": interactive,
        "batch_prompt_tokens_about": 10 * prompt_repeat,
    }
    return result
