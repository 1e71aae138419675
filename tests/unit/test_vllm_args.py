"""The one builder of vLLM's engine arguments (workers/engine/vllm_args.py)."""

from __future__ import annotations

from tierq.settings import Settings
from workers.engine.vllm_args import (
    command_line,
    engine_core_config,
    engine_environment,
    engine_kwargs,
)


def _settings(**values: object) -> Settings:
    return Settings(model_path="/models/m", served_model_name="m-served", **values)


def test_every_engine_setting_reaches_the_arguments() -> None:
    s = _settings(
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        tensor_parallel_size=2,
        gpu_memory_utilization=0.5,
        enforce_eager=False,
        dtype="bfloat16",
    )
    assert engine_kwargs(s) == {
        "model": "/models/m",
        "served_model_name": ["m-served"],
        "dtype": "bfloat16",
        "max_model_len": 1024,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.5,
        "enforce_eager": False,
    }


def test_overrides_win_and_add() -> None:
    kwargs = engine_kwargs(_settings(), max_num_seqs=64, enable_prefix_caching=False)
    assert kwargs["max_num_seqs"] == 64
    assert kwargs["enable_prefix_caching"] is False


def test_the_command_line_says_the_same() -> None:
    argv = command_line(engine_kwargs(_settings(enforce_eager=True, max_num_seqs=4)))
    assert argv[:4] == ["--model", "/models/m", "--served-model-name", "m-served"]
    assert argv[argv.index("--max-num-seqs") + 1] == "4"
    assert "--enforce-eager" in argv
    assert "--enforce-eager" not in command_line(engine_kwargs(_settings(enforce_eager=False)))


def test_the_environment_names_the_kv_cache() -> None:
    env = engine_environment(_settings(cpu_kvcache_space_gib=3))
    assert env == {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "3"}


def test_the_engine_core_waits_quietly_on_the_cpu_build_unless_told_otherwise() -> None:
    from workers.engine.quiet_waits import CONFIG_KEY, wanted
    from workers.engine.vllm_build import vllm_cpu_build

    assert wanted(engine_core_config(Settings())) == vllm_cpu_build()
    assert wanted(engine_core_config(Settings(engine_quiet_waits=True)))
    assert engine_core_config(Settings(engine_quiet_waits=False)) == {}
    assert CONFIG_KEY not in engine_core_config(Settings(engine_quiet_waits=False))
