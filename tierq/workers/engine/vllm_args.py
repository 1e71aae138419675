"""The one builder of vLLM's engine arguments from Settings.

The worker's engine (`vllm_engine.py`), `tierq bench calibrate` and every benchmark that runs
vLLM beside the platform (`bench overhead`'s offline `LLM`, `bench batch`'s `run_batch`
child, `bench serve`'s `vllm serve`) build their engine from `engine_kwargs`, so that a
benchmark compares against an engine configured as the worker's is. The worker's own
additions (priority scheduling, tierq's scheduler inside vLLM, quiet waits in its engine
core) are `worker_engine_args`, which `bench serve` gives `vllm serve` too; what a
measurement needs (calibration's batch sizes, no prefix cache) is passed as overrides, in
the open.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tierq.core.settings import Settings
from tierq.workers.engine import vllm_build
from tierq.workers.engine.bundled_model import resolve_model_path

if TYPE_CHECKING:
    from tierq.workers.engine.vllm_scheduler import Tiering

# Resolved by name in vLLM's engine-core process (both also arm its parent-death signal).
TIERED_SCHEDULER = "tierq.workers.engine.vllm_scheduler.TieredScheduler"
STOCK_SCHEDULER = "tierq.workers.engine.vllm_scheduler.StockScheduler"


def engine_environment(settings: Settings) -> dict[str, str]:
    """What vLLM reads from the environment: no hub, and the CPU build's KV cache size."""
    return {
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(settings.cpu_kvcache_space_gib),
    }


def set_engine_environment(settings: Settings) -> None:
    """`engine_environment` in this process, where the operator has not set it already."""
    for name, value in engine_environment(settings).items():
        os.environ.setdefault(name, value)


# The CPU build's step budget where MAX_NUM_BATCHED_TOKENS is unset (vLLM's own default
# on the CPU), and what the simulated engine's cost model assumes when none is set.
CPU_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class BuildDefaults:
    """The engine settings that depend on the installed vLLM build, resolved: a setting
    left unset (None) takes its build's value. None here means vLLM's own default."""

    dtype: str
    enforce_eager: bool
    max_num_batched_tokens: int | None
    pin_aux_processes: bool


def build_defaults(settings: Settings) -> BuildDefaults:
    """The CPU build keeps float32 (bfloat16 is emulated on CPUs without native support,
    several times slower), eager mode (no compilation; the CPU build has no Triton), a
    2048-token step and the platform's processes off its compute cores. A CUDA build gets
    vLLM's own choices: the model's dtype, CUDA graphs, the step budget vLLM picks for the
    GPU, and no CPU pinning (vLLM binds nothing there)."""
    # Read through the module, so that a test can stand in for either build.
    cpu = vllm_build.vllm_cpu_build()

    def pick(value: Any, on_cpu: Any, on_gpu: Any) -> Any:
        if value is not None:
            return value
        return on_cpu if cpu else on_gpu

    return BuildDefaults(
        dtype=pick(settings.dtype, "float32", "auto"),
        enforce_eager=pick(settings.enforce_eager, True, False),
        max_num_batched_tokens=pick(
            settings.max_num_batched_tokens, CPU_MAX_NUM_BATCHED_TOKENS, None
        ),
        pin_aux_processes=pick(settings.pin_aux_processes, True, False),
    )


def step_token_budget(settings: Settings) -> int:
    """The engine's per-step token budget as a number, for what models the engine (the
    simulated engine's cost model, benchmark reports): MAX_NUM_BATCHED_TOKENS, else the CPU
    build's default (vLLM's GPU default depends on the GPU and is only known inside it)."""
    return build_defaults(settings).max_num_batched_tokens or CPU_MAX_NUM_BATCHED_TOKENS


def engine_kwargs(settings: Settings, **overrides: Any) -> dict[str, Any]:
    """vLLM's `EngineArgs` fields from Settings (for `AsyncEngineArgs(**...)` or `LLM(**...)`),
    with `overrides` on top; a field whose value is vLLM's default for this build is left
    out. Resolves the model folder (preparing the bundled one once)."""
    build = build_defaults(settings)
    kwargs: dict[str, Any] = {
        "model": resolve_model_path(settings),
        "served_model_name": [settings.served_model_name],
        "dtype": build.dtype,
        "max_model_len": settings.max_model_len,
        "max_num_seqs": settings.max_num_seqs,
        "max_num_batched_tokens": build.max_num_batched_tokens,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "kv_cache_dtype": settings.kv_cache_dtype,
        "quantization": settings.quantization,
        "enforce_eager": build.enforce_eager,
    }
    kwargs = {name: value for name, value in kwargs.items() if value is not None}
    kwargs.update(overrides)
    return kwargs


def engine_core_config(settings: Settings) -> dict[str, Any]:
    """What tierq's scheduler classes set up in vLLM's engine-core process beyond the tiers
    (`additional_config`): quiet waits (tierq/workers/engine/quiet_waits.py) where wanted."""
    from tierq.workers.engine.quiet_waits import CONFIG_KEY

    quiet = settings.engine_quiet_waits
    if quiet is None:
        quiet = vllm_build.vllm_cpu_build()
    return {CONFIG_KEY: True} if quiet else {}


def worker_engine_args(settings: Settings, tiering: Tiering, stock_scheduler: bool = False) -> Any:
    """The AsyncEngineArgs of the worker's engine (and the environment vLLM reads): priority
    scheduling, tierq's scheduler unless ENGINE_PRIORITY_STEPS is off or `stock_scheduler`
    (`tierq bench serve`'s default: vLLM's own scheduler, without tierq's policy)."""
    set_engine_environment(settings)
    from vllm.config import StructuredOutputsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    tiered = settings.engine_priority_steps and not stock_scheduler
    return AsyncEngineArgs(
        **engine_kwargs(
            settings,
            scheduling_policy="priority",
            scheduler_cls=TIERED_SCHEDULER if tiered else STOCK_SCHEDULER,
            additional_config={**tiering.to_config(), **engine_core_config(settings)},
            disable_log_stats=True,
            # llguidance, with whitespace off: admission checks each schema with the same
            # library and options (tierq/services/structured.py), so what is admitted compiles
            # here. (The guidance backend reads whitespace from this config, not from a
            # request's own flag.)
            structured_outputs_config=StructuredOutputsConfig(
                backend="guidance", disable_any_whitespace=True
            ),
        )
    )


def command_line(kwargs: dict[str, Any]) -> list[str]:
    """`engine_kwargs` as vLLM's command-line flags (`vllm serve`, `run_batch`): a list is
    one flag with several values; a true boolean is a bare flag, a false one is left out
    (every boolean the builder sets is off by default in vLLM)."""
    argv: list[str] = []
    for name, value in kwargs.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                argv.append(flag)
        elif isinstance(value, list | tuple):
            argv += [flag, *(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv
