"""Celery tasks. Each is idempotent: running one twice changes nothing more.

Tasks are thin: they run a coroutine on this process's event loop, with one database
pool and one Redis client kept for the life of the process (made after a prefork fork).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

import redis.asyncio as aioredis

from models.db import Database
from tierq.redis_conn import connect
from workers.batches import BatchRunner
from workers.billing import roll_up_invoices
from workers.celery_app import app, settings
from workers.files_expiry import remove_expired_files
from workers.reconcile import reconcile

T = TypeVar("T")


class _Runtime:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.db = Database(settings.resolved_database_url)
        self.r: aioredis.Redis = self.loop.run_until_complete(
            connect(settings, attempts=3, role="celery")
        )

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)


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
    return rt.run(reconcile(settings, rt.db, rt.r))


@app.task(name="tierq.batches.tick")
def batches_tick() -> None:
    """Advance every active batch (expansion, finalisation, cancellation, expiry)."""
    rt = _rt()
    rt.run(BatchRunner(settings, rt.db, rt.r).tick())


@app.task(name="tierq.batches.advance")
def batch_advance(batch_id: str) -> None:
    """Advance one batch now (asked for by the API or a worker when something changed)."""
    rt = _rt()
    rt.run(BatchRunner(settings, rt.db, rt.r).advance(batch_id))


@app.task(name="tierq.billing.rollup")
def billing_rollup(period: str | None = None) -> list[str]:
    """Roll the ledger up into invoices: the given month, else this one and the last (so
    the last month's invoice is final once its late-finishing jobs are in). Idempotent."""
    rt = _rt()
    return rt.run(roll_up_invoices(rt.db, period))


@app.task(name="tierq.files.expire")
def files_expire() -> int:
    """Remove expired files (rows and bytes), except the input of a batch in progress."""
    rt = _rt()
    return len(rt.run(remove_expired_files(settings, rt.db)))
