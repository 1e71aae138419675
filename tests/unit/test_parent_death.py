"""An engine process dies with the worker that started it, even when the worker is
SIGKILLed: real processes, no engine needed (vLLM's engine core arms the same call)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

# A "worker" that starts a multiprocessing (spawn) child arming the parent-death signal,
# as vLLM starts its engine core, prints the child's pid, and waits to be killed.
WORKER = textwrap.dedent(
    """
    import multiprocessing, sys, time

    def engine_core(armed):
        from tierq.workers.engine.parent_death import die_with_parent
        armed.put(die_with_parent())
        time.sleep(600)

    if __name__ == "__main__":
        ctx = multiprocessing.get_context("spawn")
        armed = ctx.Queue()
        child = ctx.Process(target=engine_core, args=(armed,))
        child.start()
        assert armed.get(timeout=60) is True
        print(child.pid, flush=True)
        time.sleep(600)
    """
)


def test_the_engine_process_dies_when_its_worker_is_sigkilled(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    root = Path(__file__).resolve().parents[2]
    worker = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    child_pid = None
    try:
        assert worker.stdout is not None
        child_pid = int(worker.stdout.readline())
        child = psutil.Process(child_pid)
        assert child.is_running()
        os.kill(worker.pid, signal.SIGKILL)  # only the worker: nothing tells the child
        worker.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if not child.is_running() or child.status() == psutil.STATUS_ZOMBIE:
                break
            time.sleep(0.05)
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    finally:
        worker.kill()
        if child_pid is not None and psutil.pid_exists(child_pid):
            psutil.Process(child_pid).kill()  # leave nothing behind, even on failure


def test_outside_multiprocessing_nothing_is_armed() -> None:
    from tierq.workers.engine.parent_death import die_with_parent

    assert die_with_parent() is False  # the test process: no parent to die with
