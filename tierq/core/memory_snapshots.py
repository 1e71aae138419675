"""Memory snapshots on demand, for finding what a long-running process accumulates.

With MEMORY_SNAPSHOTS_DIR set in its environment, a tierq process (API, dispatcher, worker,
Celery) answers SIGUSR2: the first one starts tracing its Python allocations (`tracemalloc`,
which slows it: a diagnostic, nothing is traced until asked), each later one writes a
snapshot there as `<role>-<pid>-<unix seconds>.tracemalloc`. Two snapshots of one process
compare with `Snapshot.load(b).compare_to(Snapshot.load(a), "traceback")`: what was
allocated between them and is still held. Growth that no snapshot shows is outside
Python's allocator (a C library's own heap, fragmentation)."""

from __future__ import annotations

import os
import signal
import time
import tracemalloc
from pathlib import Path
from types import FrameType

ENV = "MEMORY_SNAPSHOTS_DIR"
FRAMES = 16  # of each allocation's traceback


def install(role: str) -> bool:
    """Answer SIGUSR2 if the environment asks for it (from the main thread: signal
    handlers are set there)."""
    folder = os.environ.get(ENV)
    if not folder:
        return False
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)

    def dump(_signum: int, _frame: FrameType | None) -> None:
        if not tracemalloc.is_tracing():
            tracemalloc.start(FRAMES)
            return
        path = out / f"{role}-{os.getpid()}-{time.time():.0f}.tracemalloc"
        tracemalloc.take_snapshot().dump(str(path.with_suffix(".part")))
        path.with_suffix(".part").rename(path)  # whole when it appears

    signal.signal(signal.SIGUSR2, dump)
    return True
