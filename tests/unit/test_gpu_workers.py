"""`tierq worker --gpus`: which GPUs, in which groups, under which ids and ports (pure, and
`nvidia-smi` as a real program on PATH: a script that lists four GPUs as it does)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tierq.core.settings import Settings
from tierq.launch.gpu_workers import (
    Gpus,
    GpuSpecError,
    check_ports,
    gpu_groups,
    group_children,
    group_worker_id,
    run_gpu_workers,
    visible_gpus,
)
from tierq.workers.engine import vllm_build


def fake_nvidia_smi(folder: Path, indices: list[int]) -> Path:
    """An `nvidia-smi` that answers the query `--gpus all` asks, as the real one prints it."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nvidia-smi"  # written again if there: the same list
    lines = "\n".join(str(i) for i in indices)
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--query-gpu=index" ] && [ "$2" = "--format=csv,noheader" ]; then\n'
        f"  printf '{lines}\\n'\nelse\n  exit 9\nfi\n"
    )
    script.chmod(0o755)
    return folder


def test_a_list_names_its_gpus_and_all_takes_the_hosts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert visible_gpus("0, 2,3") == Gpus(["0", "2", "3"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path / 'bin', [0, 1, 2, 3])}:/usr/bin:/bin")
    assert visible_gpus("all") == Gpus(["0", "1", "2", "3"])
    # A container runtime's or a scheduler's choice comes first, read as it was given.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aa11,GPU-bb22")
    assert visible_gpus("all") == Gpus(["GPU-aa11", "GPU-bb22"], inherited=True)


def test_what_names_no_gpu_or_one_twice_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    with pytest.raises(GpuSpecError, match="no nvidia-smi"):
        visible_gpus("all")
    monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path / 'bin', [])}:/usr/bin:/bin")
    with pytest.raises(GpuSpecError, match="names no GPU"):
        visible_gpus("all")
    with pytest.raises(GpuSpecError, match="twice"):
        visible_gpus("0,1,0")
    with pytest.raises(GpuSpecError, match="names no GPU"):
        visible_gpus(" , ")
    with pytest.raises(GpuSpecError, match="-1 is not a GPU index"):
        visible_gpus("0,-1")
    # Set and empty (or -1) means no GPU, not every GPU nvidia-smi lists.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(GpuSpecError, match="CUDA_VISIBLE_DEVICES names no GPU"):
        visible_gpus("all")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    with pytest.raises(GpuSpecError, match="not a GPU index"):
        visible_gpus("all")


def test_gpus_split_into_engines_of_tensor_parallel_size() -> None:
    four = ["0", "1", "2", "3"]
    assert gpu_groups(four, 1) == [("0",), ("1",), ("2",), ("3",)]
    assert gpu_groups(four, 2) == [("0", "1"), ("2", "3")]
    assert gpu_groups(four, 4) == [("0", "1", "2", "3")]
    with pytest.raises(GpuSpecError, match="TENSOR_PARALLEL_SIZE=2"):
        gpu_groups(["0", "1", "2"], 2)
    assert gpu_groups(["MIG-a", "MIG-b"], 1) == [("MIG-a",), ("MIG-b",)]
    with pytest.raises(GpuSpecError, match="MIG instances take TENSOR_PARALLEL_SIZE=1"):
        gpu_groups(["MIG-a", "MIG-b"], 2)


def test_the_engines_ports_are_ports_and_never_shared() -> None:
    check_ports(9102, 9202, 8)
    check_ports(None, 9103, 4)
    with pytest.raises(GpuSpecError, match="overlap for 2 engines"):
        check_ports(9102, 9103, 2)  # engine 1's metrics port would be engine 0's tenant port
    with pytest.raises(GpuSpecError, match="not ports"):
        check_ports(0, None, 2)
    with pytest.raises(GpuSpecError, match="not ports"):
        check_ports(65535, None, 2)


def test_each_engine_has_its_own_id_devices_ports_and_pid_file(tmp_path: Path) -> None:
    settings = Settings(state_dir=tmp_path, worker_id="node7")
    children = group_children(settings, [("0", "1"), ("2", "3")], ["tierq", "worker"], 9102, 9202)
    assert [c.name for c in children] == ["node7-gpu0-1", "node7-gpu2-3"]
    assert [c.env["WORKER_ID"] for c in children] == ["node7-gpu0-1", "node7-gpu2-3"]
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in children] == ["0,1", "2,3"]
    assert all(c.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" for c in children)  # nvidia-smi's
    assert [c.argv[2:] for c in children] == [
        ["--metrics-port", "9102", "--tenant-metrics-port", "9202"],
        ["--metrics-port", "9103", "--tenant-metrics-port", "9203"],
    ]
    assert len({c.pid_path for c in children}) == 2
    # Without WORKER_ID the host's name: the same ids after the host's process restarts.
    plain = group_children(Settings(state_dir=tmp_path), [("0",)], ["tierq"], None, None)
    assert plain[0].name == f"{os.uname().nodename}-gpu0" and plain[0].argv == ["tierq"]
    # An inherited CUDA_VISIBLE_DEVICES is read in the order it was given with.
    given = group_children(settings, [("GPU-a",)], ["tierq"], None, None, inherited=True)
    assert "CUDA_DEVICE_ORDER" not in given[0].env


def test_a_uuid_becomes_an_id_of_safe_characters() -> None:
    assert group_worker_id("h", ("GPU-3f2a:9c",)) == "h-gpuGPU_3f2a_9c"


def test_the_cpu_build_of_vllm_or_a_bad_spec_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--gpus with vLLM's CPU build, or GPUs or ports that cannot work, starts nothing and
    exits 2."""
    monkeypatch.setattr(vllm_build, "vllm_cpu_build", lambda: True)
    settings = Settings(state_dir=tmp_path, engine="vllm")
    assert run_gpu_workers(settings, "0,1", None, None, None) == 2
    simulated = Settings(state_dir=tmp_path, engine="simulated", tensor_parallel_size=2)
    assert run_gpu_workers(simulated, "0,1,2", None, None, None) == 2
    assert run_gpu_workers(simulated, "0,1,2,3", None, 9102, 9103) == 2
    assert not (tmp_path / "pids").exists()
