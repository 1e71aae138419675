"""Celery tasks. Each is idempotent: running one twice changes nothing more.

Tasks are thin: they run a coroutine on this process's event loop, with one database
pool and one Redis client kept for the life of the process (made after a prefork fork).
"""

from __future__ import annotations

import asyncio
import logging
import os
import traceback
from collections.abc import Coroutine
from typing import Any, TypeVar

import redis.asyncio as aioredis

from models.db import Database
from tierq import metrics
from tierq.redis_conn import connect
from workers.batches import BatchRunner
from workers.billing import roll_up_invoices
from workers.celery_app import app, settings
from workers.files_expiry import remove_expired_files
from workers.reconcile import reconcile

T = TypeVar("T")
log = logging.getLogger(__name__)


class _Runtime:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.db = Database(settings.resolved_database_url)
        self.r: aioredis.Redis = self.loop.run_until_complete(
            connect(settings, attempts=3, role="celery")
        )

    def run(self, task: str, coro: Coroutine[Any, Any, T]) -> T | None:
        """Run a task's coroutine. An error is logged, counted and cleared here, not
        raised to Celery: every task is idempotent and re-run by beat's next tick (a
        batch's advance too: the tick advances every active batch), and Celery keeps
        each raised error's traceback info alive (celery/celery#8882: its memory grew
        tens of MB an hour while Redis restarts failed tasks)."""
        try:
            return self.loop.run_until_complete(coro)
        except Exception as exc:
            log.exception("task %s failed; its next run does its work", task)
            metrics.CELERY_TASK_ERRORS.labels(task).inc()
            traceback.clear_frames(exc.__traceback__)
            return None


_runtime: _Runtime | None = None


def _rt() -> _Runtime:
    global _runtime
    if _runtime is None or _runtime.pid != os.getpid():
        _runtime = _Runtime()
    return _runtime


@app.task(name="tierq.reconcile")
def reconcile_task() -> list[str]:
    """Re-enqueue the jobs Postgres holds as unfinished that no Redis stream holds."""
    rt = _rt()
    return rt.run("reconcile", reconcile(settings, rt.db, rt.r)) or []


@app.task(name="tierq.batches.tick")
def batches_tick() -> None:
    """Advance every active batch (expansion, finalisation, cancellation, expiry)."""
    rt = _rt()
    rt.run("batches.tick", BatchRunner(settings, rt.db, rt.r).tick())


@app.task(name="tierq.batches.advance")
def batch_advance(batch_id: str) -> None:
    """Advance one batch now (asked for by the API or a worker when something changed)."""
    rt = _rt()
    rt.run("batches.advance", BatchRunner(settings, rt.db, rt.r).advance(batch_id))


@app.task(name="tierq.billing.rollup")
def billing_rollup(period: str | None = None) -> list[str]:
    """Roll the ledger up into invoices: the given month, else this one and the last (so
    the last month's invoice is final once its late-finishing jobs are in). Idempotent."""
    rt = _rt()
    return rt.run("billing.rollup", roll_up_invoices(rt.db, period)) or []


@app.task(name="tierq.files.expire")
def files_expire() -> int:
    """Remove expired files (rows and bytes), except the input of a batch in progress."""
    rt = _rt()
    return len(rt.run("files.expire", remove_expired_files(settings, rt.db)) or [])
