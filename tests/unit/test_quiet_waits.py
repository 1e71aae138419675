"""Quiet waits (tierq/workers/engine/quiet_waits.py) on vLLM's real shared-memory ring: a reader
of vLLM's `MessageQueue` in this process, its writer in another thread. vLLM's own reader
spins (sched_yield in a loop) for a second after each read; a quieted one blocks on the
writer's notification, and still finds a message whose notification was lost."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tierq.workers.engine import quiet_waits

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")


@pytest.fixture
def ring(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any]]:
    """vLLM's ring with one local reader: (writer, reader)."""
    cls = shm_broadcast.SpinCondition
    # quiet_waits() patches the class: put vLLM's own back afterwards.
    monkeypatch.setattr(cls, "wait", cls.wait)
    monkeypatch.setattr(cls, "_tierq_quiet", False, raising=False)
    writer = shm_broadcast.MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4)
    reader = shm_broadcast.MessageQueue.create_from_handle(writer.export_handle(), 0)
    ready = threading.Thread(target=reader.wait_until_ready)  # a collective call
    ready.start()
    writer.wait_until_ready()
    ready.join()
    yield writer, reader
    reader.shutdown()


def _read(reader: Any, timeout: float) -> tuple[object, float, float]:
    """Dequeue in another thread (as the engine core reads its worker's results): what it
    read (or the TimeoutError), the wall time and the thread's CPU time it took."""
    got: list[tuple[object, float, float]] = []

    def read() -> None:
        wall, cpu = time.monotonic(), time.thread_time()
        try:
            value: object = reader.dequeue(timeout=timeout)
        except TimeoutError as exc:
            value = exc
        got.append((value, time.monotonic() - wall, time.thread_time() - cpu))

    thread = threading.Thread(target=read)
    thread.start()
    thread.join(timeout + 10)
    return got[0]


def test_vllms_reader_spins_and_a_quieted_one_does_not(ring: tuple[Any, Any]) -> None:
    _writer, reader = ring
    value, wall, cpu = _read(reader, 0.6)  # within a second of its last read: it spins
    assert isinstance(value, TimeoutError) and wall >= 0.55
    assert cpu > 0.3 * wall, f"vLLM's reader took {cpu:.2f} s of CPU in {wall:.2f} s"
    assert quiet_waits.quiet_waits() is True
    assert quiet_waits.quiet_waits() is True  # once is enough; a second call changes nothing
    value, wall, cpu = _read(reader, 0.6)
    assert isinstance(value, TimeoutError) and wall >= 0.55
    assert cpu < 0.15 * wall, f"a quiet reader took {cpu:.2f} s of CPU in {wall:.2f} s"


def test_a_quieted_reader_reads_what_is_written_with_or_without_its_notification(
    ring: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    writer, reader = ring
    quiet_waits.quiet_waits()
    threading.Timer(0.2, writer.enqueue, args=("step 1",)).start()
    value, wall, _cpu = _read(reader, 10)
    assert value == "step 1" and wall < 1.0  # woken by the writer's notification
    # The notification lost (the writer's socket keeps one message and drops the rest):
    # vLLM's reader would sleep to its 5-second recheck; this one looks again within
    # quiet_waits.RECHECK_MS.
    monkeypatch.setattr(shm_broadcast.SpinCondition, "notify", lambda self: None)
    threading.Timer(0.2, writer.enqueue, args=("step 2",)).start()
    value, wall, _cpu = _read(reader, 10)
    assert value == "step 2" and wall < 1.0, f"read after {wall:.2f} s"


def test_only_a_worker_that_asked_gets_quiet_waits() -> None:
    assert quiet_waits.wanted({quiet_waits.CONFIG_KEY: True, "tierq": {}})
    assert not quiet_waits.wanted({"tierq": {}})
    assert not quiet_waits.wanted(None)
