"""Celery tasks. Each is idempotent: running one twice changes nothing more."""

from __future__ import annotations

import asyncio

from workers.celery_app import app, settings
from workers.reconcile import reconcile_once


@app.task(name="tierq.reconcile")
def reconcile_task() -> list[str]:
    """Re-enqueue the jobs Postgres holds as unfinished that no Redis stream holds."""
    return asyncio.run(reconcile_once(settings))
