"""Publishing a worker's job events: batched into one Redis round trip per flush.

Every running job yields a delta per engine step; sending each on its own would cost one
round trip per token per job. Events wait here instead and a single flusher writes
whatever has gathered in one pipeline — while one flush is in flight the next batch
collects, so batching adapts to load, and adjacent deltas of one job merge into one.
Order per job is kept (one flusher, FIFO), and `send()` returns once an event is written,
which the terminal events use so that `done` follows every delta.
"""

from __future__ import annotations

import asyncio
import logging

from tierq.messages import JobEvent
from tierq.queue import EventLog

log = logging.getLogger(__name__)


class EventPublisher:
    def __init__(self, events: EventLog) -> None:
        self.events = events
        self._batch: list[tuple[str, JobEvent, asyncio.Future[None] | None]] = []
        self._last_delta: dict[str, int] = {}  # job id -> index of its last delta in _batch
        self._wake = asyncio.Event()

    def delta(self, job_id: str, text: str) -> None:
        i = self._last_delta.get(job_id)
        if i is not None:
            _, event, _ = self._batch[i]
            event.data["text"] += text
            return
        self._last_delta[job_id] = len(self._batch)
        self._batch.append((job_id, JobEvent("delta", {"text": text}), None))
        self._wake.set()

    async def send(self, job_id: str, event: JobEvent) -> None:
        """Queue an event after everything queued for the job so far; wait until written."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._last_delta.pop(job_id, None)  # later deltas must not merge into earlier ones
        self._batch.append((job_id, event, done))
        self._wake.set()
        await done

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._batch, self._last_delta = self._batch, [], {}
            if not batch:
                continue
            try:
                await self.events.append_many([(job_id, event) for job_id, event, _ in batch])
            except Exception as exc:
                for _, _, fut in batch:
                    if fut is not None and not fut.done():
                        fut.set_exception(exc)
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    # redis-py may report a cancelled read as a ConnectionError: this is
                    # our own cancellation (shutdown), not a failure to carry on past.
                    raise asyncio.CancelledError from exc
                log.exception("publishing %d job events failed", len(batch))
                continue
            for _, _, fut in batch:
                if fut is not None and not fut.done():
                    fut.set_result(None)
