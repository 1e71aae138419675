"""Celery tasks. Each is idempotent: running one twice changes nothing more.

Tasks are thin: they run a coroutine on this process's event loop, with one database
pool and one Redis client kept for the life of the process (made after a prefork fork).
"""

from __future__ import annotations

import asyncio
import logging
import os
import traceback
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import redis.asyncio as aioredis
from celery.exceptions import SoftTimeLimitExceeded

from tierq.core import clock, fleet, metrics
from tierq.core.redis_conn import connect
from tierq.models.db import Database
from tierq.models.store import SqlJobStore
from tierq.workers.batches import BatchRunner
from tierq.workers.billing import roll_up_invoices
from tierq.workers.celery_app import app, names, settings
from tierq.workers.files_expiry import remove_expired_files
from tierq.workers.reconcile import reconcile
from tierq.workers.webhooks import deliver_due

T = TypeVar("T")
log = logging.getLogger(__name__)


class _Runtime:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.db = Database.for_settings(settings)
        self.jobs = SqlJobStore(self.db)
        self.r: aioredis.Redis = self.loop.run_until_complete(
            connect(settings, attempts=3, role="celery")
        )


_runtime: _Runtime | None = None


def _rt() -> _Runtime:
    global _runtime
    if _runtime is None or _runtime.pid != os.getpid():
        _runtime = _Runtime()
    return _runtime


def _run(task: str, work: Callable[[_Runtime], Coroutine[Any, Any, T]]) -> T | None:
    """Run a task's coroutine on this process's runtime (made on first use). An error —
    the runtime's own too (Redis unreachable, or refused) — is logged, counted and
    cleared here, not raised to Celery: every task is idempotent and re-run by beat's
    next tick (a batch's advance too: the tick advances every active batch), and Celery
    keeps each raised error's traceback info alive (celery/celery#8882: its memory grew
    tens of MB an hour while Redis restarts failed tasks)."""

    async def on_one_clock() -> T:
        await clock.refresh(rt.r)
        await fleet.refresh(rt.r, names, settings)  # what batch lines are checked against
        return await work(rt)

    try:
        rt = _rt()
        return rt.loop.run_until_complete(on_one_clock())
    except SoftTimeLimitExceeded:
        raise
    except Exception as exc:
        log.exception("task %s failed; its next run does its work", task)
        metrics.CELERY_TASK_ERRORS.labels(task).inc()
        error: BaseException | None = exc
        seen: set[int] = set()
        while error is not None and id(error) not in seen:  # the chain's frames too
            seen.add(id(error))
            traceback.clear_frames(error.__traceback__)
            error = error.__cause__ or error.__context__
        return None


@app.task(name="tierq.reconcile")
def reconcile_task() -> list[str]:
    """Re-enqueue the jobs Postgres holds as unfinished that no Redis stream holds."""
    return _run("reconcile", lambda rt: reconcile(settings, rt.db, rt.jobs, rt.r)) or []


def _batches(rt: _Runtime) -> BatchRunner:
    # A batch's end that recorded webhook deliveries has them sent now, not at the tick.
    return BatchRunner(settings, rt.db, rt.r, on_deliveries=webhooks_deliver.delay)


@app.task(name="tierq.batches.tick")
def batches_tick() -> None:
    """Advance every active batch (expansion, finalisation, cancellation, expiry)."""
    _run("batches.tick", lambda rt: _batches(rt).tick())


@app.task(name="tierq.batches.advance")
def batch_advance(batch_id: str) -> None:
    """Advance one batch now (asked for by the API or a worker when something changed)."""
    _run("batches.advance", lambda rt: _batches(rt).advance(batch_id))


@app.task(name="tierq.webhooks.deliver")
def webhooks_deliver() -> int:
    """Send the webhook deliveries that are due (beat's tick, and each batch's end)."""
    return _run("webhooks.deliver", lambda rt: deliver_due(settings, rt.db, rt.r)) or 0


@app.task(name="tierq.billing.rollup")
def billing_rollup(period: str | None = None) -> list[str]:
    """Roll the ledger up into invoices: the given month, else this one and the last (so
    the last month's invoice is final once its late-finishing jobs are in). Idempotent."""
    return _run("billing.rollup", lambda rt: roll_up_invoices(rt.db, period)) or []


@app.task(name="tierq.files.expire")
def files_expire() -> int:
    """Remove expired files (rows and bytes), except the input of a batch in progress."""
    return len(_run("files.expire", lambda rt: remove_expired_files(settings, rt.db)) or [])
