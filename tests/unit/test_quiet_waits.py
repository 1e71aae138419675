"""Quiet waits (workers/engine/quiet_waits.py) on vLLM's real shared-memory ring condition:
vLLM's reader returns at once (one sched_yield, to be called again in a loop) for a second
after each read; once quieted it blocks until the writer's notification or its timeout."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from workers.engine import quiet_waits

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")


@pytest.fixture
def condition(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[object, object]]:
    cls = shm_broadcast.SpinCondition
    # quiet_waits() patches the class: put vLLM's own back afterwards.
    monkeypatch.setattr(cls, "wait", cls.wait)
    monkeypatch.setattr(cls, "_tierq_quiet", False, raising=False)
    context = zmq.Context()
    address = shm_broadcast.get_open_zmq_ipc_path()
    writer = cls(is_reader=False, context=context, notify_address=address)
    reader = cls(is_reader=True, context=context, notify_address=address)
    time.sleep(0.3)  # the subscriber has joined before anything is published
    yield reader, writer
    context.destroy(linger=0)


def _timed_wait(reader: object, timeout_ms: int) -> float:
    reader.record_read()  # type: ignore[attr-defined]
    started = time.monotonic()
    reader.wait(timeout_ms=timeout_ms)  # type: ignore[attr-defined]
    return time.monotonic() - started


def test_a_quieted_reader_blocks_until_the_writer_notifies(
    condition: tuple[object, object],
) -> None:
    reader, writer = condition
    assert _timed_wait(reader, 400) < 0.1  # vLLM's own: a yield, straight back to spinning
    assert quiet_waits.quiet_waits() is True
    assert quiet_waits.quiet_waits() is True  # once is enough; a second call changes nothing
    assert _timed_wait(reader, 400) >= 0.35  # nothing written: it slept to its timeout
    timer = threading.Timer(0.2, writer.notify)  # type: ignore[attr-defined]
    timer.start()
    woke = _timed_wait(reader, 5000)
    timer.join()
    assert 0.15 <= woke < 2.0  # woken by the notification, not the timeout


def test_only_a_worker_that_asked_gets_quiet_waits() -> None:
    assert quiet_waits.wanted({quiet_waits.CONFIG_KEY: True, "tierq": {}})
    assert not quiet_waits.wanted({"tierq": {}})
    assert not quiet_waits.wanted(None)
