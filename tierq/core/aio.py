"""asyncio habits every long-running loop of tierq shares: noticing its own cancel when a
library reports it as an error, and stopping side tasks within a bound."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable
from typing import Any

log = logging.getLogger(__name__)


def being_cancelled() -> bool:
    """Whether the running task has been asked to stop. redis-py (and asyncpg under
    SQLAlchemy) may report a read cut short by a cancel as a ConnectionError or a
    TimeoutError, so a loop that carries on past errors must ask this before it does:
    otherwise the cancel is swallowed and the loop never ends."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def raise_if_cancelled(error: BaseException) -> None:
    """Raise CancelledError (from `error`) if the running task is being cancelled: the
    error is then its own cancel, reported by a library as a failure."""
    if being_cancelled():
        raise asyncio.CancelledError from error


async def cancel_and_wait(
    tasks: Iterable[asyncio.Task[Any]], timeout_s: float, *, recancel_s: float = 0.5
) -> set[asyncio.Task[Any]]:
    """Cancel the tasks and wait up to `timeout_s` for them to end, cancelling again every
    `recancel_s` any that swallowed its cancel (a library that turned it into an error
    the task carried on past). Returns the tasks still running, each logged: a stop must
    not hang on one (a task waiting for a connection of a busy redis-py
    BlockingConnectionPool has been seen never to end)."""
    pending = set(tasks)
    done = {t for t in pending if t.done()}
    pending -= done
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while pending:
        for task in pending:
            task.cancel()
        left = deadline - loop.time()
        if left <= 0:
            break
        ended, pending = await asyncio.wait(pending, timeout=min(recancel_s, left))
        done |= ended
    for task in done:
        if not task.cancelled():
            task.exception()  # retrieved: how it ended is not this stop's concern
    for task in pending:
        log.warning("task %s did not end within %.0f s of its cancel", task.get_name(), timeout_s)
    return pending


class Detached:
    """Work run in tasks of its own, kept until each ends: clean-up that must finish even
    when its caller is being cancelled (a stream's response is cancelled while its
    clean-up runs, where every await of its own would be cancelled again), or that no
    caller waits for. Errors are logged, as `what` failed; `wait` and `stop` give the work
    a bounded time to end when its owner stops."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, work: Awaitable[Any]) -> None:
        async def run() -> None:
            try:
                await work
            except Exception as exc:
                log.warning("%s failed: %s", self.what, exc)

        task = asyncio.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait(self, timeout_s: float) -> None:
        """Until every piece of work has ended (work spawned meanwhile included), or for
        `timeout_s` at most."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._tasks and (left := deadline - loop.time()) > 0:
            await asyncio.wait(set(self._tasks), timeout=left)

    async def stop(self, timeout_s: float, cancel_s: float = 1.0) -> None:
        """`wait`, then cancel what still runs (waiting `cancel_s` at most for it)."""
        await self.wait(timeout_s)
        await cancel_and_wait(set(self._tasks), cancel_s)
