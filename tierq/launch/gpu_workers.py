"""`tierq worker --gpus`: one engine per GPU group on a host with several GPUs.

Each group of TENSOR_PARALLEL_SIZE GPUs gets a `tierq worker` process of its own, so each
engine has its own identity, inbox and heartbeat, and one engine's death costs only its
own jobs:

- `CUDA_VISIBLE_DEVICES` names the group's GPUs (vLLM sees them as devices 0..k-1): with
  `CUDA_DEVICE_ORDER=PCI_BUS_ID` where they are indices as `nvidia-smi` prints them; taken
  from this process's own CUDA_VISIBLE_DEVICES, they are read as it was given;
- its worker id is `<WORKER_ID or host name>-gpu<indices joined by "-">`: the same after a
  restart of the host's process, so a restarted engine reads the inbox it left;
- `--metrics-port P` gives the i-th group P+i (and `--tenant-metrics-port Q`, Q+i).

This process supervises them: a child that exits (its engine died: status 3) is started
again after a backoff; one that cannot run (its configuration refused, status 2; its id
held by a live worker elsewhere, 4) stops them all, and this process exits with its status.
SIGTERM, SIGINT or SIGHUP reaches every child, each drains (DRAIN_TIMEOUT_S) and hands back
what it cannot finish, and what outlives the drain is killed (exit status 1). If this
process is killed outright, the kernel sends each child SIGTERM (its parent-death signal),
so none is left running without a supervisor; where this process is a container's first
process, run it under an init (compose's `init: true`) so that orphans are reaped.
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
from dataclasses import dataclass

from tierq.core.settings import Settings
from tierq.launch.exits import EXIT_REFUSED, EXIT_WORKER_ID_TAKEN
from tierq.launch.supervisor import Child, StopSignals, Supervisor

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


@dataclass(frozen=True)
class Gpus:
    """The GPUs a host's engines share out, and how their names are to be read."""

    names: list[str]
    # The names are CUDA_VISIBLE_DEVICES as this process was given it (a container
    # runtime's or a scheduler's choice): read in the order it was given with
    # (CUDA_DEVICE_ORDER as set, if at all). Otherwise they are nvidia-smi's indices,
    # which are in PCI bus order.
    inherited: bool = False


def visible_gpus(spec: str) -> Gpus:
    """The GPUs `--gpus` names: a comma-separated list of indices or GPU UUIDs, or `all`:
    this process's CUDA_VISIBLE_DEVICES when it is set (a container runtime's or a
    scheduler's choice; set and empty means no GPU), else every GPU `nvidia-smi` lists."""
    spec = spec.strip()
    inherited = spec == "all" and "CUDA_VISIBLE_DEVICES" in os.environ
    if spec != "all":
        listed = spec
    elif inherited:
        listed = os.environ["CUDA_VISIBLE_DEVICES"]
    else:
        listed = ",".join(_nvidia_smi_indices())
    gpus = [g.strip() for g in listed.split(",") if g.strip()]
    source = "CUDA_VISIBLE_DEVICES" if inherited else f"--gpus {spec!r}"
    if not gpus:
        raise GpuSpecError(f"{source} names no GPU")
    bad = [g for g in gpus if not (g.isdigit() or g.startswith(("GPU-", "MIG-")))]
    if bad:  # CUDA reads a list up to its first invalid entry: "-1" hides every GPU
        raise GpuSpecError(f"{source}: {', '.join(bad)} is not a GPU index or UUID")
    if len(set(gpus)) != len(gpus):
        raise GpuSpecError(f"{source} names a GPU twice")
    return Gpus(gpus, inherited)


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
    if per_engine > 1 and any(g.startswith("MIG-") for g in gpus):
        # CUDA gives a process one MIG instance at most: no tensor parallelism across them.
        raise GpuSpecError(f"MIG instances take TENSOR_PARALLEL_SIZE=1, not {per_engine}")
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


def check_ports(first: int | None, other_first: int | None, engines: int) -> None:
    """The engines' metrics ports (first + i) and per-tenant ports (other_first + i): real
    ports, and no port in both ranges."""
    ranges = [range(p, p + engines) for p in (first, other_first) if p is not None]
    for r in ranges:
        if r.start < 1 or r.stop - 1 > 65535:
            raise GpuSpecError(f"ports {r.start}-{r.stop - 1} for {engines} engines are not ports")
    if len(ranges) == 2 and set(ranges[0]) & set(ranges[1]):
        raise GpuSpecError(
            f"--metrics-port {first} and --tenant-metrics-port {other_first} overlap for "
            f"{engines} engines (each takes one port an engine)"
        )


def group_children(
    settings: Settings,
    groups: list[tuple[str, ...]],
    worker_argv: list[str],
    metrics_port: int | None,
    tenant_metrics_port: int | None,
    inherited: bool = False,
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
        env = {"CUDA_VISIBLE_DEVICES": ",".join(group), "WORKER_ID": worker_id}
        if not inherited:  # nvidia-smi's numbering
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
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
    from tierq.workers.engine import vllm_build

    if settings.engine == "vllm" and vllm_build.vllm_cpu_build():
        log.error("--gpus needs vLLM's CUDA build (pip install .[gpu]); this is the CPU build")
        return EXIT_REFUSED
    try:
        gpus = visible_gpus(spec)
        groups = gpu_groups(gpus.names, settings.tensor_parallel_size)
        check_ports(metrics_port, tenant_metrics_port, len(groups))
    except GpuSpecError as exc:
        log.error("%s", exc)
        return EXIT_REFUSED
    argv = [sys.executable, "-m", "tierq", "worker"]
    if engine:
        argv += ["--engine", engine]
    children = group_children(
        settings, groups, argv, metrics_port, tenant_metrics_port, gpus.inherited
    )
    stopping = StopSignals()
    env = dict(os.environ)
    status = 0
    sup = Supervisor(children, {c.name: env for c in children})
    try:
        for c in children:
            log.info("%s runs on GPUs %s", c.name, c.env["CUDA_VISIBLE_DEVICES"])
        sup.start_all()
        while not stopping and not status:
            time.sleep(0.5)
            status = _fatal_exit(children)
            if not stopping and not status:
                sup.tick()
    finally:
        killed = sup.stop_all(settings.drain_timeout_s + STOP_MARGIN_S)
    return status or (1 if killed else 0)


def _fatal_exit(children: list[Child]) -> int:
    """The exit status of a child that starting again would not help (its configuration
    refused, its id held by a live worker elsewhere), else 0."""
    for c in children:
        code = c.proc.poll() if c.proc is not None else None
        if code in (EXIT_REFUSED, EXIT_WORKER_ID_TAKEN):
            log.error("%s exited with %d: stopping every engine of this host", c.name, code)
            return int(code)
    return 0
