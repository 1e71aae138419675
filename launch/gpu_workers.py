"""`tierq worker --gpus`: one engine per GPU group on a host with several GPUs.

Each group of TENSOR_PARALLEL_SIZE GPUs gets a `tierq worker` process of its own, so each
engine has its own identity, inbox and heartbeat, and one engine's death costs only its
own jobs:

- `CUDA_VISIBLE_DEVICES` names the group's GPUs (vLLM sees them as devices 0..k-1), with
  `CUDA_DEVICE_ORDER=PCI_BUS_ID` so that the indices are the ones `nvidia-smi` prints;
- its worker id is `<WORKER_ID or host name>-gpu<indices joined by "-">`: the same after a
  restart of the host's process, so a restarted engine reads the inbox it left;
- `--metrics-port P` gives the i-th group P+i (and `--tenant-metrics-port Q`, Q+i).

This process supervises them: a child that exits (its engine died: status 3) is started
again after a backoff; SIGTERM or SIGINT reaches every child, each drains (DRAIN_TIMEOUT_S)
and hands back what it cannot finish, and what outlives the drain is killed. If this
process is killed outright, the kernel sends each child SIGTERM (its parent-death signal),
so none is left running without a supervisor.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from launch.supervisor import Child, StopSignals, restart_exited, stop_all
from tierq.settings import Settings

log = logging.getLogger("tierq.gpus")

# What the drain may take beyond DRAIN_TIMEOUT_S before a child is killed: handing its
# jobs back and closing its engine.
STOP_MARGIN_S = 15.0


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _terminated_with(parent: int) -> None:
    """In the child, before its command runs: SIGTERM when `parent` dies (a drain, as a
    planned stop), and exit at once if it already has."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


class GpuSpecError(ValueError):
    """The --gpus value names no GPU, or cannot be split into engines."""


def visible_gpus(spec: str) -> list[str]:
    """The GPUs `--gpus` names: a comma-separated list of indices (or GPU UUIDs), or `all`:
    the host's CUDA_VISIBLE_DEVICES when it is set (a container runtime's or a scheduler's
    choice), else every GPU `nvidia-smi` lists."""
    spec = spec.strip()
    if spec != "all":
        gpus = [g.strip() for g in spec.split(",") if g.strip()]
    elif os.environ.get("CUDA_VISIBLE_DEVICES", "").strip():
        gpus = [g.strip() for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    else:
        gpus = _nvidia_smi_indices()
    if not gpus:
        raise GpuSpecError(f"--gpus {spec!r} names no GPU")
    if len(set(gpus)) != len(gpus):
        raise GpuSpecError(f"--gpus {spec!r} names a GPU twice")
    return gpus


def _nvidia_smi_indices() -> list[str]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        raise GpuSpecError("--gpus all: no CUDA_VISIBLE_DEVICES and no nvidia-smi on PATH")
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError) as exc:
        raise GpuSpecError(f"--gpus all: nvidia-smi failed: {exc}") from None
    return [line.strip() for line in out.splitlines() if line.strip()]


def gpu_groups(gpus: list[str], per_engine: int) -> list[tuple[str, ...]]:
    """The GPUs in consecutive groups of `per_engine` (TENSOR_PARALLEL_SIZE), one engine each."""
    if per_engine < 1 or len(gpus) % per_engine:
        raise GpuSpecError(
            f"{len(gpus)} GPUs ({','.join(gpus)}) do not split into engines of "
            f"TENSOR_PARALLEL_SIZE={per_engine}"
        )
    return [tuple(gpus[i : i + per_engine]) for i in range(0, len(gpus), per_engine)]


def group_worker_id(base: str, group: tuple[str, ...]) -> str:
    """`<base>-gpu0`, `<base>-gpu2-3`; a UUID's characters other than letters, digits, '.'
    and '_' become '_' (ids are Redis key parts and log fields)."""
    return f"{base}-gpu" + "-".join(re.sub(r"[^A-Za-z0-9._]", "_", g) for g in group)


def group_children(
    settings: Settings,
    groups: list[tuple[str, ...]],
    worker_argv: list[str],
    metrics_port: int | None,
    tenant_metrics_port: int | None,
) -> list[Child]:
    """One `tierq worker` per group: its devices, its id, its ports."""
    base = settings.worker_id or os.uname().nodename
    pids = settings.state_dir / "pids"
    pids.mkdir(parents=True, exist_ok=True)
    children = []
    for i, group in enumerate(groups):
        worker_id = group_worker_id(base, group)
        argv = list(worker_argv)
        if metrics_port is not None:
            argv += ["--metrics-port", str(metrics_port + i)]
        if tenant_metrics_port is not None:
            argv += ["--tenant-metrics-port", str(tenant_metrics_port + i)]
        env = {
            "CUDA_VISIBLE_DEVICES": ",".join(group),
            "CUDA_DEVICE_ORDER": os.environ.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID"),
            "WORKER_ID": worker_id,
        }
        child = Child(worker_id, argv, None, pids / f"{worker_id}.pid", env=env)
        child.preexec = functools.partial(_terminated_with, os.getpid())
        children.append(child)
    return children


def run_gpu_workers(
    settings: Settings,
    spec: str,
    engine: str | None,
    metrics_port: int | None,
    tenant_metrics_port: int | None,
) -> int:
    """Run and supervise one worker per GPU group until SIGTERM or SIGINT; the exit status."""
    from workers.engine import vllm_build

    if settings.engine == "vllm" and vllm_build.vllm_cpu_build():
        log.error("--gpus needs vLLM's CUDA build (pip install .[gpu]); this is the CPU build")
        return 2
    try:
        groups = gpu_groups(visible_gpus(spec), settings.tensor_parallel_size)
    except GpuSpecError as exc:
        log.error("%s", exc)
        return 2
    argv = [sys.executable, "-m", "cli.main", "worker"]
    if engine:
        argv += ["--engine", engine]
    children = group_children(settings, groups, argv, metrics_port, tenant_metrics_port)
    stopping = StopSignals()
    env = dict(os.environ)
    for c in children:
        c.start(env)
        pid = c.proc.pid if c.proc else "?"
        log.info("started %s on GPUs %s (pid %s)", c.name, c.env["CUDA_VISIBLE_DEVICES"], pid)
    try:
        while not stopping:
            time.sleep(0.5)
            if not stopping:
                restart_exited(children, env)
    finally:
        stop_all(children, settings.drain_timeout_s + STOP_MARGIN_S)
    return 0
