"""The worker's own threads and vLLM's engine core off the engine's compute cores (CPU build).

vLLM's CPU backend binds its model worker process (the OpenMP compute threads, and every
other thread of that process) to its compute cores — on this 2-core machine core 0, the
last core being left to the front end — and binds nothing else: the worker process that
hosts AsyncLLM (its front end: detokenising, and here also publishing every token to
Redis) and vLLM's engine-core process (scheduling, the rings to the model worker) may run
on any core. The kernel often wakes a thread on the core of the thread that woke it, so
when the model worker hands a step's result to the engine core, or the engine core an
output to the front end, the woken thread lands beside the compute thread and takes turns
with it — every step is slowed by what those processes do. Those two processes, and the
embedded Redis (`tierq/launch/supervisor.py`), land on the compute core too, and the time per
output token then trails `vllm serve`'s (`bench serve` shows it).

So once the engine has started, `pin_off_compute()` binds every thread of this process
and of each unbound process under it (the engine core) to the cores the model worker was
not bound to. Threads started later inherit their creator's binding. It binds nothing
when vLLM bound nothing (a GPU build) or left no other core (one core), and nothing with
PIN_AUX_PROCESSES=false. It must come after the process's only engine start: an engine
started later from a bound process would inherit the free cores and vLLM would place its
compute there (`run_worker` starts one engine; a dead engine ends the process, and the
supervisor starts a fresh, unbound one).

Where this differs from `tierq run`'s choice for its other processes (`aux_cpus` in
tierq/launch/supervisor.py, the last core): on this kind of host (one NUMA node, no SMT) vLLM
keeps exactly the last core free and both are the same; on a host with several NUMA
nodes vLLM binds one node's cores and the free set here spans the other nodes too.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import psutil

log = logging.getLogger("tierq.worker")


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def bind_threads(pid: int, cpus: set[int]) -> int:
    """Every thread of `pid` onto `cpus`; how many were bound."""
    bound = 0
    for tid in _threads(pid):
        with contextlib.suppress(OSError):  # a thread that has just ended
            os.sched_setaffinity(tid, cpus)
            bound += 1
    return bound


def thread_cores(pid: int) -> set[frozenset[int]]:
    """The distinct bindings of a process's threads (none once it has ended)."""
    masks: set[frozenset[int]] = set()
    for tid in _threads(pid):
        with contextlib.suppress(OSError):
            masks.add(frozenset(os.sched_getaffinity(tid)))
    return masks


def _siblings(cores: set[int]) -> set[int]:
    """The logical CPUs that share a physical core with `cores` (SMT), themselves included."""
    found = set(cores)
    for core in cores:
        path = Path(f"/sys/devices/system/cpu/cpu{core}/topology/thread_siblings_list")
        with contextlib.suppress(OSError, ValueError):
            for part in path.read_text().strip().split(","):
                lo, _, hi = part.partition("-")
                found.update(range(int(lo), int(hi or lo) + 1))
    return found


def placement(pid: int | None = None) -> tuple[set[int], list[int]]:
    """The cores vLLM bound its model workers to under process `pid` (this one by default),
    and the processes it left unbound there (`pid` included): what `pin_off_compute` binds.
    A process is bound when any of its threads is (vLLM may bind one core per thread, and
    the main thread then holds only the first); its compute cores are all its threads'."""
    me = psutil.Process(pid)
    allowed = frozenset(os.sched_getaffinity(me.pid))
    compute: set[int] = set()
    unbound = [me.pid]
    for child in me.children(recursive=True):
        masks = thread_cores(child.pid)
        if any(m < allowed for m in masks):
            compute.update(*(m for m in masks if m < allowed))
        elif masks:
            unbound.append(child.pid)
    return compute, unbound


def pin_off_compute(pid: int | None = None) -> set[int] | None:
    """Bind the processes vLLM left unbound to the cores it left free; those cores, or None."""
    compute, unbound = placement(pid)
    allowed = os.sched_getaffinity(unbound[0])
    free = allowed - compute
    if not compute or not free:
        return None
    # Not beside the compute threads on their own physical cores either (SMT siblings),
    # unless nothing else is left.
    free = (allowed - _siblings(compute)) or free
    # Twice: a thread started by a thread not yet bound, during the first pass, is bound
    # in the second (threads started after it inherit their creator's binding).
    for _ in range(2):
        threads = sum(bind_threads(p, free) for p in unbound)
    log.info(
        "engine compute on cores %s; front end and engine core (%d threads) pinned to %s",
        sorted(compute),
        threads,
        sorted(free),
    )
    return free
