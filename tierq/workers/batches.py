"""The life of a batch, driven by Celery: validate, expand, finalise, cancel, expire.

`BatchRunner.advance(batch_id)` looks at the batch in the database and does the next
thing its status calls for, under the batch's lease (tierq/workers/batch_lease.py). Every step
is idempotent and keeps its progress in the database (the status, the expansion cursor,
the jobs keyed by (batch, line)), so a Celery worker killed at any point leaves nothing
that the next advance cannot pick up: beat's tick advances every active batch, and
workers and the API ask for an advance when something changed.

- validating: the input file is read once, line by line (tierq/services/batch_input.py);
  structural problems fail the batch with `errors` naming the lines (OpenAI's contract).
  Then what the whole file can cost is reserved against the tenant's budgets, or the batch
  fails `budget_exceeded` (tierq/services/admission.py, the rules of every admission).
- in_progress: lines become batch-tier jobs a chunk at a time, keeping at most
  `batch_max_outstanding` of the batch queued or running; each line is parsed, checked and
  reserved as an online request is (tierq/services/admission.py). A line whose body is refused
  (unknown model, too long) becomes a failed job: it answers in the error file.
- finalising: output and error files are written from the jobs in input order (streamed,
  a page at a time; their format is tierq/workers/batch_output.py) and the batch completes.
- cancelling: queued jobs are dropped, running ones aborted; finished results are kept.
- expiry: when the completion window passes, unfinished work is stopped and every request
  that did not finish gets a `batch_expired` line in the error file.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis

from tierq.core import clock, metrics, tracing
from tierq.core.file_store import file_store
from tierq.core.ids import new_id
from tierq.core.queue import EventLog, enqueue
from tierq.core.redis_names import RedisNames
from tierq.core.settings import Settings
from tierq.core.states import BatchStatus, JobStatus
from tierq.core.tiers import Tier
from tierq.models import batches as batch_repo
from tierq.models import files as file_repo
from tierq.models import webhooks as webhook_repo
from tierq.models.batches import BatchLine
from tierq.models.db import Database
from tierq.models.records import BatchRecord
from tierq.services import admission, cancellation
from tierq.services.batch_input import RawLine, read_requests, validate_file
from tierq.services.stored_files import forget
from tierq.workers import batch_lease, batch_output

log = logging.getLogger(__name__)

EXPAND_CHUNK = 500  # lines per transaction
FINALIZE_PAGE = 1000  # jobs read per query while writing the output
MAX_STEPS = 20  # status changes in one advance (validating -> in_progress -> ... -> done)


class BatchRunner:
    def __init__(
        self,
        settings: Settings,
        db: Database,
        r: aioredis.Redis,
        on_deliveries: Callable[[], None] | None = None,
    ) -> None:
        """`on_deliveries`: called when a batch's end recorded webhook deliveries (Celery's
        tasks send them at once; beat's webhook tick sends them otherwise)."""
        self.on_deliveries = on_deliveries
        self.settings = settings
        self.db = db
        self.r = r
        self.names = RedisNames(settings.redis_prefix)
        self.events = EventLog.for_settings(r, self.names, settings)

    async def tick(self) -> None:
        """Advance every active batch (beat runs this periodically)."""
        async with self.db.session() as s:
            ids = await batch_repo.active_batch_ids(s)
        for batch_id in ids:
            try:
                await self.advance(batch_id)
            except Exception:
                log.exception("advancing batch %s failed; the next tick retries", batch_id)
        async with self.db.session() as s:
            lines = await batch_repo.line_states(s)
        for state, n in lines.items():
            metrics.BATCH_LINES.labels(state).set(n)

    async def advance(self, batch_id: str) -> None:
        await self.r.delete(self.names.batch_poke(batch_id))  # later requests start anew
        ms = int(self.settings.batch_lease_s * 1000)
        async with batch_lease.lease(self.r, self.names.batch_lock(batch_id), ms) as held:
            if not held.held:
                return  # another Celery worker is on it; it loops until nothing changes
            async with self.db.transaction() as s:
                fence = await batch_repo.take_fence(s, batch_id)
            if fence is None:
                return
            try:
                for _ in range(MAX_STEPS):
                    if held.lost or not await self._step(batch_id, fence):
                        break
            except batch_repo.LeaseLost as exc:
                # Another worker took the batch over (this one's lease ran out unnoticed):
                # nothing of this one's was written after that; it has the batch now.
                log.warning("stopped advancing: %s", exc)

    async def _step(self, batch_id: str, fence: int) -> bool:
        """Do what the batch's status calls for; True when its status changed. Every write
        is in a transaction that holds the batch's fence (LeaseLost when it moved on)."""
        async with self.db.session() as s:
            batch = await batch_repo.get_batch(s, batch_id)
        if batch is None or batch.status in batch_repo.TERMINAL:
            return False
        if batch.status == BatchStatus.VALIDATING:
            return await self._validate(batch, fence)
        if batch.status == BatchStatus.CANCELLING:
            return await self._wind_up(batch, fence, BatchStatus.CANCELLED, "batch_cancelled")
        if batch.status == BatchStatus.FINALIZING:
            return await self._finalize(batch, fence, BatchStatus.COMPLETED)
        # in_progress
        if batch.expired_at is None and clock.utcnow() >= batch.expires_at:
            async with self.db.transaction() as s:
                await batch_repo.hold(s, batch.id, fence)
                await batch_repo.mark_expired(s, batch.id)
            return True
        if batch.expired_at is not None:
            return await self._wind_up(batch, fence, BatchStatus.EXPIRED, "batch_expired")
        return await self._pump(batch, fence)

    # --- validating --------------------------------------------------------------------

    async def _validate(self, batch: BatchRecord, fence: int) -> bool:
        async with self.db.session() as s:
            source = await file_repo.get_file(
                s, batch.input_file_id, batch.tenant_id, include_expired=True
            )
        store = file_store(self.settings)
        if source is None or not await asyncio.to_thread(store.exists, source.id):
            return await self._fail(
                batch, fence, [_error("file_not_found", "The input file no longer exists.")]
            )
        if source.bytes > self.settings.batch_max_bytes:
            return await self._fail(
                batch,
                fence,
                [
                    _error(
                        "file_too_large",
                        f"The input file has {source.bytes} bytes; a batch may read at most "
                        f"{self.settings.batch_max_bytes}.",
                    )
                ],
            )
        result = await asyncio.to_thread(
            validate_file,
            store,
            source.id,
            batch.endpoint,
            max_requests=self.settings.batch_max_requests,
            max_errors=self.settings.batch_error_limit,
        )
        if result.errors:
            return await self._fail(batch, fence, result.errors)
        return await self._start(batch, fence, result.requests)

    async def _start(self, batch: BatchRecord, fence: int, requests: int) -> bool:
        """Reserve what the whole file can cost and start the batch — or refuse it
        (failed, `budget_exceeded`), never half run. The check and the reservation are one
        transaction under the tenant's lock, like an online admission's: batches and
        online jobs started together are counted against the budget together."""
        async with self.db.session() as s:
            price_in, price_out = await admission.batch_prices(s, self.settings, batch.created_at)
        # Always reserved (a budget set while the batch runs counts what it will cost).
        tokens, cost = await asyncio.to_thread(
            admission.file_reservation,
            self.settings,
            file_store(self.settings),
            batch.input_file_id,
            batch.endpoint,
            price_in,
            price_out,
        )
        async with self.db.transaction() as s:
            await batch_repo.hold(s, batch.id, fence)
            refusal = await admission.batch_refusal(s, batch.tenant_id, tokens, cost)
            moved = None
            if refusal is None:
                moved = await batch_repo.transition(
                    s,
                    batch.id,
                    BatchStatus.IN_PROGRESS,
                    (BatchStatus.VALIDATING,),
                    in_progress_at=clock.utcnow(),
                    request_total=requests,
                    reserved_tokens=tokens,
                    reserved_cost=cost,
                )
        if refusal is not None:  # nothing was written
            return await self._fail(batch, fence, [_error(refusal.code, refusal.message)])
        if moved is not None:
            metrics.BATCHES.labels(status=BatchStatus.IN_PROGRESS).inc()
        return moved is not None

    async def _fail(self, batch: BatchRecord, fence: int, errors: list[dict[str, Any]]) -> bool:
        deliveries = 0
        async with self.db.transaction() as s:
            await batch_repo.hold(s, batch.id, fence)
            moved = await batch_repo.transition(
                s,
                batch.id,
                BatchStatus.FAILED,
                (BatchStatus.VALIDATING,),
                failed_at=clock.utcnow(),
                errors=errors,
            )
            if moved is not None:
                deliveries = await webhook_repo.record_batch_event(s, moved)
        if moved is not None:
            metrics.BATCHES.labels(status=BatchStatus.FAILED).inc()
            self._announced(deliveries)
        return moved is not None

    # --- in_progress -------------------------------------------------------------------

    async def _pump(self, batch: BatchRecord, fence: int) -> bool:
        """Top the batch's outstanding jobs up to the bound; finalise when all are done."""
        async with self.db.session() as s:
            source = await file_repo.get_file(s, batch.input_file_id, include_expired=True)
            counts = await batch_repo.job_counts(s, batch.id)
        size = source.bytes if source is not None else batch.next_offset
        outstanding = counts.get(JobStatus.QUEUED, 0) + counts.get(JobStatus.RUNNING, 0)
        while batch.next_offset < size and outstanding < self.settings.batch_max_outstanding:
            room = min(EXPAND_CHUNK, self.settings.batch_max_outstanding - outstanding)
            raw, offset, line = await asyncio.to_thread(
                read_requests,
                file_store(self.settings),
                batch.input_file_id,
                batch.next_offset,
                batch.next_line,
                room,
                batch.endpoint,
            )
            # Parsed and counted in a thread (the tokenizer lets go of the GIL): the event
            # loop keeps renewing the batch's lock meanwhile.
            lines = await asyncio.to_thread(self._lines, batch, raw)
            async with self.db.transaction() as s:
                await batch_repo.hold(s, batch.id, fence)
                prices = await admission.batch_prices(s, self.settings, batch.created_at)
                queued = await batch_repo.expand(s, batch, lines, line, offset, prices)
                if queued is None:
                    await s.rollback()
                    return False  # someone else expanded meanwhile
            batch_trace = await tracing.recall(self.r, self.names.trace_context(batch.id))
            for job in queued:
                with tracing.batch_line(msg := job.to_message(), batch_trace):
                    await enqueue(self.r, self.names, msg)
            metrics.JOBS_SUBMITTED.labels(Tier.BATCH.value).inc(len(queued))  # lines admitted
            outstanding += len(queued)
            async with self.db.session() as s:
                current = await batch_repo.get_batch(s, batch.id)
            if current is None:
                return False
            batch = current
        if batch.next_offset >= size and outstanding == 0:
            async with self.db.session() as s:
                counts = await batch_repo.job_counts(s, batch.id)
            if counts.get(JobStatus.QUEUED, 0) + counts.get(JobStatus.RUNNING, 0) == 0:
                async with self.db.transaction() as s:
                    await batch_repo.hold(s, batch.id, fence)
                    moved = await batch_repo.transition(
                        s,
                        batch.id,
                        BatchStatus.FINALIZING,
                        (BatchStatus.IN_PROGRESS,),
                        finalizing_at=clock.utcnow(),
                    )
                return moved is not None
        return False

    def _lines(self, batch: BatchRecord, raw: list[RawLine]) -> list[BatchLine]:
        return [admission.batch_line(self.settings, batch.endpoint, item) for item in raw]

    # --- cancelling and expiry ---------------------------------------------------------

    async def _wind_up(self, batch: BatchRecord, fence: int, final: BatchStatus, code: str) -> bool:
        """Stop what is unfinished, then write what finished and close the batch."""
        reason = "the batch was cancelled" if code == "batch_cancelled" else "the batch expired"
        async with self.db.transaction() as s:
            await batch_repo.hold(s, batch.id, fence)
            stopped = await batch_repo.stop_unfinished(s, batch.id, code, reason)
        await cancellation.announce(self.r, self.names, self.events, stopped)
        return await self._finalize(batch, fence, final)

    # --- finalising --------------------------------------------------------------------

    async def _finalize(self, batch: BatchRecord, fence: int, final: BatchStatus) -> bool:
        """Write the output and error files (in input order) and close the batch. The
        files being written are this holder's own (new file ids): a stale holder that
        still writes never writes into the files of the one that took over."""
        store = file_store(self.settings)
        names = new_id("file"), new_id("file")
        writers: list[batch_output.Lines] = []
        completed = failed = 0
        output_id = error_id = None
        moved, kept_files = None, False
        deliveries = 0
        try:
            for name in names:
                writers.append(batch_output.Lines(await asyncio.to_thread(store.create, name)))
            out, err = writers
            after = -1
            while True:
                async with self.db.session() as s:
                    page = await batch_repo.batch_jobs(s, batch.id, after, FINALIZE_PAGE)
                if not page:
                    break
                after = page[-1].batch_line or after
                c, f = batch_output.write_results(page, batch.endpoint, out, err)
                completed, failed = completed + c, failed + f
                # Both are alive while written, an unwritten error file too: the expiry
                # task removes only writes left untouched (tierq/workers/files_expiry.py).
                for lines in (out, err):
                    await asyncio.to_thread(lines.flush)
            if final == BatchStatus.EXPIRED:
                failed += await asyncio.to_thread(batch_output.write_unexpanded, store, batch, err)
            output_id = await asyncio.to_thread(
                batch_output.keep, out, names[0], f"{batch.id}_output.jsonl"
            )
            error_id = await asyncio.to_thread(
                batch_output.keep, err, names[1], f"{batch.id}_errors.jsonl"
            )
            now = clock.utcnow()
            stamp = {
                BatchStatus.COMPLETED: "completed_at",
                BatchStatus.CANCELLED: "cancelled_at",
                BatchStatus.EXPIRED: "expired_at",
            }[final]
            sources = {
                BatchStatus.COMPLETED: (BatchStatus.FINALIZING,),
                BatchStatus.CANCELLED: (BatchStatus.CANCELLING,),
                BatchStatus.EXPIRED: (BatchStatus.IN_PROGRESS, BatchStatus.VALIDATING),
            }[final]
            values: dict[str, Any] = {
                "output_file_id": output_id[0] if output_id else None,
                "error_file_id": error_id[0] if error_id else None,
                "request_completed": completed,
                "request_failed": failed,
            }
            if final != BatchStatus.EXPIRED or batch.expired_at is None:
                values[stamp] = now
            async with self.db.transaction() as s:
                await batch_repo.hold(s, batch.id, fence)
                moved = await batch_repo.transition(s, batch.id, final, sources, **values)
                if moved is not None:
                    deliveries = await webhook_repo.record_batch_event(s, moved)
                    for kept in (output_id, error_id):
                        if kept is not None:
                            await file_repo.add_file(
                                s,
                                kept[0],
                                batch.tenant_id,
                                "batch_output",
                                kept[1],
                                kept[2],
                                expires_after_s=self.settings.file_expiry_s,
                            )
            kept_files = moved is not None  # committed
        finally:
            if not kept_files:  # another closed it or took it over, or it failed: not needed
                stored = [k[0] for k in (output_id, error_id) if k]
                await forget(store, self.db, [lines.writer for lines in writers], stored)
        if moved is None:
            return False
        metrics.BATCHES.labels(status=final).inc()
        self._announced(deliveries)
        log.info("batch %s %s: %d completed, %d failed", batch.id, final, completed, failed)
        return True

    def _announced(self, deliveries: int) -> None:
        if deliveries and self.on_deliveries is not None:
            try:
                self.on_deliveries()
            except Exception:  # the broker unreachable: beat's webhook tick sends them
                log.warning("could not ask for webhook deliveries now", exc_info=True)


def _error(code: str, message: str, line: int | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": None, "line": line}
