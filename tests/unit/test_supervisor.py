"""The one supervisor (tierq/launch/supervisor.py) of `tierq run`, `tierq worker --gpus` and the
benchmarks' platforms, on real child processes: an exit it did not cause is counted and
started again after a backoff that doubles while the child keeps failing, a child it
killed starts again at once, and stopping leaves no process behind."""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tierq.core.retry import Backoff
from tierq.launch.supervisor import Child, Supervisor


def _child(tmp_path: Path, name: str, code: str) -> Child:
    return Child(name, [sys.executable, "-c", code], None, tmp_path / f"{name}.pid")


def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_failing_child_is_started_again_later_each_time_and_a_killed_one_at_once(
    tmp_path: Path,
) -> None:
    failing = _child(tmp_path, "failing", "import sys; sys.exit(3)")
    steady = _child(tmp_path, "steady", "import time; time.sleep(60)")
    seen: list[tuple[str, int | None]] = []
    lives: list[str] = []

    def restarted(c: Child, env: dict[str, str]) -> None:
        env["LIFE"] = str(int(env["LIFE"]) + 1)
        lives.append(env["LIFE"])

    sup = Supervisor(
        [failing, steady],
        {"failing": {"LIFE": "0"}, "steady": {"LIFE": "0"}},
        backoff=Backoff(0.1, 0.4, jitter=False),
        healthy_s=30.0,
        on_exit=lambda c: seen.append((c.name, c.proc.returncode if c.proc else None)),
        before_restart=restarted,
    )
    sup.start_all()
    try:
        starts: list[float] = []
        while len(starts) < 4:
            before = failing.proc
            sup.tick()
            if failing.proc is not before:
                starts.append(time.monotonic())
            time.sleep(0.01)
        gaps = [b - a for a, b in itertools.pairwise(starts)]
        # Exits in a row wait 0.1, 0.2, then 0.4 s (each gap also holds the child's own
        # short life).
        assert gaps[0] >= 0.1 and gaps[1] >= 0.2 and gaps[2] >= 0.4, gaps
        assert sup.unplanned["failing"] >= 3 and seen[0] == ("failing", 3)
        assert lives[:3] == ["1", "2", "3"]  # each life got its changed environment

        old = steady.proc
        assert old is not None
        sup.kill("steady", signal.SIGKILL)

        def started_again() -> bool:
            sup.tick()
            return steady.proc is not old

        _until(started_again, 5.0)
        assert sup.unplanned["steady"] == 0 and sup.restarts["steady"] == 1
    finally:
        sup.kill_all()
    for c in (failing, steady):
        assert c.proc is not None and c.proc.poll() is not None
        assert not c.pid_path.exists()


def test_stopping_sends_sigterm_first_and_names_what_had_to_be_killed(tmp_path: Path) -> None:
    ready = tmp_path / "ignoring"
    polite = _child(tmp_path, "polite", "import time; time.sleep(60)")
    stubborn = _child(
        tmp_path,
        "stubborn",
        "import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "pathlib.Path(sys.argv[1]).touch(); time.sleep(60)",
    )
    stubborn.argv.append(str(ready))
    sup = Supervisor([polite, stubborn], {"polite": dict(os.environ), "stubborn": {}})
    sup.start_all()
    _until(ready.exists)  # the stubborn child ignores SIGTERM from here on
    assert sup.stop_all(timeout_s=0.5) == ["stubborn"]
    assert polite.proc is not None and polite.proc.returncode == -signal.SIGTERM
    assert stubborn.proc is not None and stubborn.proc.returncode == -signal.SIGKILL
