"""A Celery worker's /metrics: its pool's processes summed, without per-tenant series.

Celery's prefork pool runs tasks in child processes, each with its own counters, so the
worker uses prometheus_client's multiprocess mode: every process writes its values to
files in PROMETHEUS_MULTIPROC_DIR (prometheus_client reads the variable when it is first
imported, so it must be in the worker's environment, not set from here), and the main
process serves their sum on CELERY_METRICS_PORT. The folder must be empty when the worker
starts (docker-compose.yml mounts a tmpfs there): values left by an earlier run would be
added in. Any per-tenant series (tierq_tenant_*) a task counted would be left out, as on
every unauthenticated endpoint (none does today: batch lines are admitted without them).
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, start_http_server

from tierq.core import metrics
from tierq.core.settings import Settings

log = logging.getLogger(__name__)


def registry(settings: Settings) -> CollectorRegistry:
    """The registry that sums every process's values (those written under the folder)."""
    if settings.prometheus_multiproc_dir is None or not metrics.multiprocess():
        raise RuntimeError(
            "CELERY_METRICS_PORT needs PROMETHEUS_MULTIPROC_DIR (an empty folder) in the "
            "Celery worker's environment"
        )
    return metrics.summed_registry(str(settings.prometheus_multiproc_dir), tenants=False)


def serve(settings: Settings) -> None:
    """Serve the pool's metrics on CELERY_METRICS_PORT (called in the main process)."""
    if settings.celery_metrics_port is None:
        return
    start_http_server(
        settings.celery_metrics_port, addr=settings.metrics_host, registry=registry(settings)
    )
    log.info("metrics on %s:%d", settings.metrics_host, settings.celery_metrics_port)
