"""Publishing a worker's job events: batched into one Redis round trip per flush.

Every running job yields a delta per engine step; sending each on its own would cost one
round trip per token per job. Events wait here instead and a single flusher writes
whatever has gathered in one pipeline — while one flush is in flight the next batch
collects, so batching adapts to load, and adjacent deltas of one job merge into one.
Order per job is kept (one flusher, FIFO), and `send()` returns once an event is written,
which the terminal events use so that `done` follows every delta.

Nothing is dropped when Redis is unreachable: a batch that failed goes back to the front
of the queue and is retried with backoff, so a client following the job sees every delta
once Redis is back. Every event carries its job's delivery number; Redis refuses those of
a delivery that a later one superseded, and `on_fenced` hears of each such job once.

Nothing is renumbered when Redis loses its data either (a restart without persistence, a
flush): the publisher keeps every event of each job it runs (the ones an earlier delivery
wrote included) and the sequence number it expects next; when Redis reports the job's
buffer shorter than that, the publisher rewrites it whole, so a client reconnecting with
Last-Event-ID gets exactly what it missed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from tierq.core.aio import raise_if_cancelled
from tierq.core.messages import JobEvent
from tierq.core.queue import EventLog
from tierq.core.redis_conn import is_unavailable
from tierq.core.retry import Backoff

log = logging.getLogger(__name__)

RETRY_FIRST_S = 0.05  # the first wait before writing again while Redis is unreachable

# (job id, event, future of a send(), the job's delivery when the event was queued)
_Pending = tuple[str, JobEvent, asyncio.Future[None] | None, int | None]


class EventPublisher:
    def __init__(
        self,
        events: EventLog,
        on_fenced: Callable[[str], None] | None = None,
        retry_max_s: float = 2.0,
    ) -> None:
        self.events = events
        self.on_fenced = on_fenced
        self._batch: list[_Pending] = []
        self._last_delta: dict[str, int] = {}  # job id -> index of its last delta in _batch
        self._deliveries: dict[str, int] = {}  # job id -> the delivery this worker runs
        # job id -> every event of it written so far, encoded (its buffer, as Redis had it)
        self._written: dict[str, list[str]] = {}
        self._wake = asyncio.Event()
        self._abandoned = False
        self._backoff = Backoff(RETRY_FIRST_S, retry_max_s)
        self._in_flight: set[str] = set()  # jobs with events in the flush under way
        self._flushed = asyncio.Condition()

    def abandon(self) -> None:
        """Stop retrying while Redis is unreachable (a hard stop): pending sends fail."""
        self._abandoned = True
        self._wake.set()

    def fence(self, job_id: str, delivery: int, earlier: list[JobEvent] | None = None) -> None:
        """Events of this job are written only while `delivery` is its newest; `earlier`
        are the events earlier deliveries wrote (its buffer when this one started)."""
        self._deliveries[job_id] = delivery
        self._written[job_id] = [e.encode() for e in earlier or []]

    def forget(self, job_id: str) -> None:
        self._deliveries.pop(job_id, None)
        self._written.pop(job_id, None)

    async def flush(self, job_id: str) -> None:
        """Wait until every event queued for the job so far is written (or dropped by a
        hard stop): the worker records a job as finished only after its deltas are in
        Redis, so whoever sees it finished in the database finds every delta there."""
        async with self._flushed:
            await self._flushed.wait_for(
                lambda: (
                    job_id not in self._in_flight
                    and all(pending[0] != job_id for pending in self._batch)
                )
            )

    def delta(
        self, job_id: str, text: str, logprobs: Sequence[dict[str, Any]] = (), index: int = 0
    ) -> None:
        """Queue a text delta (with its tokens' log probabilities, when the job asked) of
        the job's choice `index` (0 unless it asked for n > 1)."""
        delivery = self._deliveries.get(job_id)
        i = self._last_delta.get(job_id)
        if (
            i is not None
            and self._batch[i][3] == delivery
            and self._batch[i][1].data.get("index", 0) == index
        ):
            data = self._batch[i][1].data
            data["text"] += text
            if logprobs:
                data.setdefault("logprobs", []).extend(logprobs)
            return
        self._last_delta[job_id] = len(self._batch)
        data = {"text": text, **({"logprobs": list(logprobs)} if logprobs else {})}
        if index:
            data["index"] = index
        self._batch.append((job_id, JobEvent("delta", data), None, delivery))
        self._wake.set()

    async def send(self, job_id: str, event: JobEvent) -> None:
        """Queue an event after everything queued for the job so far; wait until written."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._last_delta.pop(job_id, None)  # later deltas must not merge into earlier ones
        self._batch.append((job_id, event, done, self._deliveries.get(job_id)))
        self._wake.set()
        await done

    def _requeue(self, batch: list[_Pending]) -> None:
        """Put a failed batch back in front of what gathered meanwhile, keeping order."""
        self._batch = batch + self._batch
        self._last_delta = {}
        for i, (job_id, event, _, _) in enumerate(self._batch):
            if event.kind == "delta":
                self._last_delta[job_id] = i
            else:
                self._last_delta.pop(job_id, None)

    def _items(self, batch: list[_Pending]) -> list[tuple[str, JobEvent, int | None, int | None]]:
        """Each event with the delivery it was queued under (the fence) and, while that
        delivery still runs here, the sequence number it should get."""
        nxt = {job_id: len(events) + 1 for job_id, events in self._written.items()}
        items: list[tuple[str, JobEvent, int | None, int | None]] = []
        for job_id, event, _, delivery in batch:
            expected = nxt.get(job_id) if self._deliveries.get(job_id) == delivery else None
            if expected is not None:
                nxt[job_id] = expected + 1
            items.append((job_id, event, delivery, expected))
        return items

    async def _restore_lost(self, batch: list[_Pending], written: list[int]) -> None:
        """Rewrite the buffers Redis lost (-1): the job's earlier events, then the ones of
        this batch that were refused — published, so live followers get them."""
        lost: dict[str, list[str]] = {}
        for i, ((job_id, event, _, _), n) in enumerate(zip(batch, written, strict=True)):
            if n == -1:
                lost.setdefault(job_id, []).append(event.encode())
                written[i] = 1  # written by the restore below
        for job_id, refused in lost.items():
            earlier = self._written.get(job_id, [])
            log.warning(
                "job %s: Redis lost its replay buffer; restoring %d events",
                job_id,
                len(earlier) + len(refused),
            )
            await self.events.restore(job_id, [*earlier, *refused], len(earlier))

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._batch, self._last_delta = self._batch, [], {}
            if not batch:
                continue
            self._in_flight = {pending[0] for pending in batch}
            try:
                await self._write(batch)
            finally:
                self._in_flight = set()
                async with self._flushed:
                    self._flushed.notify_all()

    async def _write(self, batch: list[_Pending]) -> None:
        """Write one batch; on an outage put it back in front, to be retried after a wait."""
        try:
            written = await self.events.append_many(self._items(batch))
            await self._restore_lost(batch, written)
        except Exception as exc:
            raise_if_cancelled(exc)  # our own shutdown, not a failure to carry on past
            if not is_unavailable(exc) or self._abandoned:
                for _, _, fut, _ in batch:
                    if fut is not None and not fut.done():
                        fut.set_exception(exc)
                log.exception("publishing %d job events failed", len(batch))
                return
            # Some of the batch may have been written before the connection went: the
            # expected sequence numbers make the retry skip those (no event twice).
            delay = self._backoff.next_s()
            log.warning("Redis unreachable; retrying %d job events in %.2f s", len(batch), delay)
            self._requeue(batch)
            await asyncio.sleep(delay)
            self._wake.set()
            return
        self._backoff.reset()
        for (job_id, event, _, delivery), n in zip(batch, written, strict=True):
            if n != 0 and job_id in self._written and self._deliveries.get(job_id) == delivery:
                self._written[job_id].append(event.encode())
        fenced = {
            job_id
            for (job_id, _, _, delivery), n in zip(batch, written, strict=True)
            if n == 0 and self._deliveries.get(job_id) == delivery
        }
        for job_id in fenced:
            log.warning("job %s runs in a later delivery elsewhere; this run stops", job_id)
            if self.on_fenced is not None:
                self.on_fenced(job_id)
        for _, _, fut, _ in batch:
            if fut is not None and not fut.done():
                fut.set_result(None)
