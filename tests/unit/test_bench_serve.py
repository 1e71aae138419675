"""`tierq bench serve`'s pure parts: the client's arguments, its result as figures, the report."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks.serve import (
    ServeConfig,
    client_argv,
    ratios,
    report,
    scenarios,
    server_keys,
    summarize,
)


def _result(lens: list[int], errors: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """What vllm.benchmarks.serve saves with --save-detailed (the fields used)."""
    completed = sum(1 for n in lens if n)
    return {
        "duration": 10.0,
        "completed": completed,
        "failed": len(lens) - completed,
        "total_output_tokens": sum(lens),
        "output_throughput": sum(lens) / 10.0,
        "output_lens": lens,
        "itls": [[0.1] * (n - 1) + [0.0] if n else [] for n in lens],
        "errors": errors or ["" for _ in lens],
        "median_ttft_ms": 250.04,
        "p99_ttft_ms": 300.0,
        "mean_tpot_ms": 140.0,
        "median_tpot_ms": 138.0,
        "p99_tpot_ms": 160.0,
        "mean_e2el_ms": 9000.0,
        "median_e2el_ms": 8900.0,
        "p99_e2el_ms": 9900.0,
        **extra,
    }


def test_scenarios_are_the_paced_rate_and_a_burst() -> None:
    paced, burst = scenarios(ServeConfig(rate=2.0, n_rate=96, n_burst=128))
    assert (paced.name, paced.request_rate, paced.num_prompts) == ("rate_2", 2.0, 96)
    assert burst.name == "burst" and math.isinf(burst.request_rate) and burst.num_prompts == 128


def test_client_argv_pins_the_workload() -> None:
    cfg = ServeConfig(input_len=64, output_len=64, seed=3)
    _, burst = scenarios(cfg)
    argv = client_argv(cfg, burst, "http://h:1", "/m", "Small", Path("/r"), "f.json")

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert value("--backend") == "openai-chat"
    assert value("--dataset-name") == "random"
    assert (value("--random-input-len"), value("--random-output-len")) == ("64", "64")
    assert value("--request-rate") == "inf"
    assert value("--tokenizer") == "/m"  # the local folder: nothing from a hub
    assert value("--served-model-name") == "Small"
    assert value("--seed") == "3"
    assert "--ignore-eos" in argv and "--save-detailed" in argv


def test_summarize_a_complete_run() -> None:
    fig = summarize(_result([64] * 4), num_prompts=4, output_len=64)
    assert fig["all_complete"] is True
    assert (fig["completed"], fig["failed"], fig["output_tokens"]) == (4, 0, 256)
    assert fig["ttft_p50_ms"] == 250.0 and fig["tpot_mean_ms"] == 140.0
    assert fig["chunks_per_request"] == 65.0
    assert fig["first_error"] is None


def test_summarize_flags_a_failed_or_short_request() -> None:
    failed = summarize(_result([64, 0], ["", "boom"]), num_prompts=2, output_len=64)
    assert failed["all_complete"] is False and failed["failed"] == 1
    assert failed["first_error"] == "boom"
    short = summarize(_result([64, 63]), num_prompts=2, output_len=64)
    assert short["all_complete"] is False and short["wrong_length"] == 1


def test_a_request_refused_for_its_content_is_not_lost() -> None:
    """vLLM's random dataset can draw a NUL, which tierq refuses by contract (400)."""
    result = _result([64, 0, 0], ["", "Bad Request", "Bad Request"])
    fig = summarize(result, 3, 64, ["fine", "a \x00 in it", "fine too"])
    assert fig["all_complete"] is False
    assert (fig["refused_unstorable"], fig["lost"]) == (1, 1)
    assert summarize(result, 3, 64)["lost"] == 2  # without the prompts: nothing excused


def test_ratios_and_the_verdicts() -> None:
    cfg = ServeConfig()
    paced, burst = (s.name for s in scenarios(cfg))
    vllm = summarize(_result([64] * 2), 2, 64)
    tierq = {**vllm, "tpot_mean_ms": 147.0, "ttft_p99_ms": None}
    assert ratios(tierq, vllm)["tpot_mean_ms"] == 1.05
    assert ratios(tierq, vllm)["ttft_p99_ms"] is None
    out = report(cfg, {"vllm": {paced: vllm, burst: vllm}, "tierq": {paced: tierq, burst: vllm}})
    assert out["tpot_ratio"] == 1.05 and out["tpot_within_target"] is True
    assert out["burst_all_complete"] is True and out["burst_lost"] == 0
    slow = {**vllm, "tpot_mean_ms": 148.0}
    out = report(cfg, {"vllm": {paced: vllm}, "tierq": {paced: slow}})
    assert out["tpot_within_target"] is False
    assert "burst_all_complete" not in out and "burst_lost" not in out


def test_a_server_run_twice_gets_a_second_name() -> None:
    assert server_keys(("vllm", "tierq")) == ["vllm", "tierq"]
    assert server_keys(("vllm", "tierq", "vllm")) == ["vllm", "tierq", "vllm#2"]
