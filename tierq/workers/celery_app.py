"""The Celery app (Redis broker): bulk and periodic work. Beat runs the reconciler first.

Run with `celery -A tierq.workers.celery_app worker` and `celery -A tierq.workers.celery_app beat`.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, signals
from celery.signals import worker_init
from kombu import Queue

from tierq.core import logs, memory_snapshots
from tierq.core.redis_names import RedisNames
from tierq.core.redis_url import SentinelTarget
from tierq.core.settings import get_settings

settings = get_settings()

if settings.log_format == "json":

    @signals.setup_logging.connect
    def _json_logs(loglevel: Any = None, **_: Any) -> None:
        """LOG_FORMAT=json: Celery's processes log as every tierq process does (a handler
        on this signal keeps Celery from setting logging up its own way)."""
        logs.setup(logging.getLevelName(loglevel) if isinstance(loglevel, int) else loglevel)


app = Celery(
    "tierq",
    broker=settings.celery_broker_url,
    backend=settings.celery_broker_url,
    include=["tierq.workers.tasks"],
)
names = RedisNames(settings.redis_prefix)
# Redis under Sentinel: kombu's sentinel:// URLs, with the primary's name as an option.
sentinel = SentinelTarget.parse(settings.resolved_redis_url)
if sentinel is not None:
    watched = {"master_name": sentinel.primary}
    app.conf.broker_transport_options = watched
    app.conf.result_backend_transport_options = watched

app.conf.update(
    # No pidbox (its fanout is a pub/sub subscription): tierq/workers/celery_flags.py says why.
    worker_enable_remote_control=False,
    task_acks_late=True,  # a task interrupted by a worker restart runs again
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_default_queue=names.celery_queue,
    # The reconciler has a queue of its own, and `tierq run` (and compose) a Celery worker
    # for it (`-Q` that queue): a large batch file being validated can never starve it. A
    # worker started without -Q consumes both.
    task_queues=[Queue(names.celery_queue), Queue(names.reconcile_queue)],
    task_routes={"tierq.reconcile": {"queue": names.reconcile_queue}},
    task_ignore_result=True,
    result_expires=3600,
    broker_connection_retry_on_startup=True,
    # However many beats run (one per host, or a worker's -B), one sends the tasks.
    beat_scheduler="tierq.workers.beat:LeasedScheduler",
    beat_schedule={
        "reconcile": {
            "task": "tierq.reconcile",
            "schedule": settings.reconcile_interval_s,
            "options": {"expires": settings.reconcile_interval_s},
        },
        "invoices": {
            "task": "tierq.billing.rollup",
            "schedule": settings.invoice_interval_s,
            "options": {"expires": settings.invoice_interval_s},
        },
        "batches": {
            "task": "tierq.batches.tick",
            "schedule": settings.batch_tick_s,
            "options": {"expires": settings.batch_tick_s},
        },
        "webhooks": {
            "task": "tierq.webhooks.deliver",
            "schedule": settings.webhook_tick_s,
            "options": {"expires": settings.webhook_tick_s},
        },
        "files": {
            "task": "tierq.files.expire",
            "schedule": settings.file_expiry_interval_s,
            "options": {"expires": settings.file_expiry_interval_s},
        },
    },
)


@worker_init.connect
def _memory_snapshots(**_: object) -> None:
    """MEMORY_SNAPSHOTS_DIR: a diagnostic (tierq.core.memory_snapshots)."""
    memory_snapshots.install("celery")


@worker_init.connect
def _serve_metrics(**_: object) -> None:
    """CELERY_METRICS_PORT: the pool's metrics, served by the main process."""
    from tierq.workers.celery_metrics import serve

    serve(settings)
