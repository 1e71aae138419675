"""MEMORY_SNAPSHOTS_DIR: a real process answers SIGUSR2 — the first starts tracing, the next
writes a snapshot that loads and holds what the process allocated after tracing began."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

PROGRAM = """
import sys, time, tracemalloc
from tierq.core import memory_snapshots
assert memory_snapshots.install("probe")
print("up", flush=True)
deadline = time.monotonic() + 10
while not tracemalloc.is_tracing() and time.monotonic() < deadline:
    time.sleep(0.01)          # until the first SIGUSR2 is answered
print("tracing" if tracemalloc.is_tracing() else "not tracing", flush=True)
held = [bytearray(1000) for _ in range(5000)]  # ~5 MB, allocated on this line
print("allocated", flush=True)
sys.stdin.readline()
"""


def test_sigusr2_starts_tracing_then_snapshots(tmp_path: Path) -> None:
    env = {**os.environ, "MEMORY_SNAPSHOTS_DIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", PROGRAM],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "up"
        proc.send_signal(signal.SIGUSR2)  # tracing starts
        assert proc.stdout.readline().strip() == "tracing"
        assert list(tmp_path.iterdir()) == []  # the first signal wrote no snapshot
        assert proc.stdout.readline().strip() == "allocated"
        proc.send_signal(signal.SIGUSR2)  # a snapshot
        deadline = time.monotonic() + 10
        while not list(tmp_path.glob("*.tracemalloc")) and time.monotonic() < deadline:
            time.sleep(0.05)
        (snap,) = tmp_path.glob("*.tracemalloc")
        assert snap.name.startswith(f"probe-{proc.pid}-")
        stats = tracemalloc.Snapshot.load(str(snap)).statistics("lineno")
        assert stats[0].size > 4_000_000, stats[:3]  # the bytearrays, traced to their line
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(10) == 0
    finally:
        proc.kill()


def test_without_the_setting_nothing_is_installed() -> None:
    from tierq.core import memory_snapshots

    env = os.environ.pop(memory_snapshots.ENV, None)
    try:
        before = signal.getsignal(signal.SIGUSR2)
        assert memory_snapshots.install("x") is False
        assert signal.getsignal(signal.SIGUSR2) is before
    finally:
        if env is not None:
            os.environ[memory_snapshots.ENV] = env
