"""An engine process dies with the worker that started it, however the worker ends.

vLLM runs its engine core in a child process (multiprocessing, spawn). When the worker is
SIGKILLed nothing tells that child, and it was found alive half an hour later holding
750 MB (on a GPU, the GPU's memory, so the restarted worker's engine cannot start). Linux's
parent-death signal makes the kernel SIGKILL the child the moment its parent dies; vLLM's
own workers already follow their engine core through a death pipe. The supervisor
(`tierq run`) also kills a dead child's whole process group before restarting it.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


def die_with_parent() -> bool:
    """In a process that multiprocessing started: ask the kernel to SIGKILL it when its
    parent dies (and exit now if the parent is already gone). True if armed."""
    parent = multiprocessing.parent_process()
    if parent is None or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        return False
    if os.getppid() != parent.pid:  # the parent died before the signal was armed
        os._exit(1)
    # Said on stderr, which the worker's log collects (logging is not set up here yet).
    print(f"tierq: process {os.getpid()} dies with its parent {parent.pid}", file=sys.stderr)
    return True
