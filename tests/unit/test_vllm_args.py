"""The one builder of vLLM's engine arguments (tierq/workers/engine/vllm_args.py)."""

from __future__ import annotations

import pytest

from tierq.core.settings import Settings
from tierq.launch.supervisor import aux_cpus
from tierq.workers.engine import vllm_build
from tierq.workers.engine.vllm_args import (
    CPU_MAX_NUM_BATCHED_TOKENS,
    build_defaults,
    command_line,
    engine_core_config,
    engine_environment,
    engine_kwargs,
    step_token_budget,
)


@pytest.fixture(params=["cpu", "cuda"])
def build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each vLLM build stood in for, whichever is installed here: the settings resolve by
    what `vllm_build.vllm_cpu_build()` answers."""
    monkeypatch.setattr(vllm_build, "vllm_cpu_build", lambda: request.param == "cpu")
    return str(request.param)


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
        kv_cache_dtype="fp8",
        quantization="fp8",
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
        "kv_cache_dtype": "fp8",
        "quantization": "fp8",
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
    from tierq.workers.engine.quiet_waits import CONFIG_KEY, wanted

    assert wanted(engine_core_config(Settings())) == vllm_build.vllm_cpu_build()
    assert wanted(engine_core_config(Settings(engine_quiet_waits=True)))
    assert engine_core_config(Settings(engine_quiet_waits=False)) == {}
    assert CONFIG_KEY not in engine_core_config(Settings(engine_quiet_waits=False))


def test_unset_engine_settings_take_the_builds_defaults(build: str) -> None:
    kwargs = engine_kwargs(_settings())
    if build == "cpu":
        assert kwargs["dtype"] == "float32"
        assert kwargs["enforce_eager"] is True
        assert kwargs["max_num_batched_tokens"] == CPU_MAX_NUM_BATCHED_TOKENS == 2048
        assert build_defaults(_settings()).pin_aux_processes is True
    else:
        # vLLM's own choices on a GPU: the model's dtype, CUDA graphs, its step budget.
        assert kwargs["dtype"] == "auto"
        assert kwargs["enforce_eager"] is False
        assert "max_num_batched_tokens" not in kwargs
        assert "--enforce-eager" not in command_line(kwargs)
        assert "--max-num-batched-tokens" not in command_line(kwargs)
        assert build_defaults(_settings()).pin_aux_processes is False
    # Neither build is given a quantization it did not ask for.
    assert "quantization" not in kwargs
    assert kwargs["kv_cache_dtype"] == "auto"
    # What models the engine always has a number for its step budget.
    assert step_token_budget(_settings()) == CPU_MAX_NUM_BATCHED_TOKENS


def test_settings_that_are_set_win_on_either_build(build: str) -> None:
    s = _settings(dtype="bfloat16", enforce_eager=True, max_num_batched_tokens=512)
    kwargs = engine_kwargs(s)
    assert (kwargs["dtype"], kwargs["enforce_eager"], kwargs["max_num_batched_tokens"]) == (
        "bfloat16",
        True,
        512,
    )
    assert step_token_budget(s) == 512
    assert build_defaults(_settings(pin_aux_processes=True)).pin_aux_processes is True
    assert build_defaults(_settings(pin_aux_processes=False)).pin_aux_processes is False


def test_the_environment_spells_the_build_settings_as_operators_do(
    build: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ENFORCE_EAGER", "false")
    monkeypatch.setenv("MAX_NUM_BATCHED_TOKENS", "8192")
    monkeypatch.setenv("DTYPE", "bfloat16")
    monkeypatch.setenv("KV_CACHE_DTYPE", "fp8")
    monkeypatch.setenv("QUANTIZATION", "awq")
    kwargs = engine_kwargs(_settings())
    assert kwargs["enforce_eager"] is False and kwargs["max_num_batched_tokens"] == 8192
    assert (kwargs["dtype"], kwargs["kv_cache_dtype"], kwargs["quantization"]) == (
        "bfloat16",
        "fp8",
        "awq",
    )


def test_the_platforms_processes_are_pinned_only_on_the_cpu_build(
    build: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    cpus = aux_cpus(_settings(engine="vllm"))
    assert cpus == ({3} if build == "cpu" else None)
    # Pinning asked for on a CUDA build still binds nothing: vLLM bound no compute there.
    assert aux_cpus(_settings(engine="vllm", pin_aux_processes=True)) == cpus
    assert aux_cpus(_settings(engine="vllm", pin_aux_processes=False)) is None
    assert aux_cpus(_settings(engine="simulated")) is None


def test_the_engine_compiles_schemas_with_the_library_admission_checks_them_with() -> None:
    """llguidance in both places (tierq/services/structured.py): what admission takes compiles."""
    from tierq.workers.engine.vllm_args import worker_engine_args
    from tierq.workers.engine.vllm_engine import structured_outputs
    from tierq.workers.engine.vllm_scheduler import Tiering

    args = worker_engine_args(Settings(), Tiering())
    assert args.structured_outputs_config.backend == "guidance"
    assert args.structured_outputs_config.disable_any_whitespace is True
    assert structured_outputs(None) is None
    assert structured_outputs({"json_object": True}).json_object is True
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert (
        structured_outputs({"json": schema}).json
        == '{"type":"object","properties":{"a":{"type":"integer"}}}'
    )
