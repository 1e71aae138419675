"""A Celery worker's /metrics: per-tenant families are left out, and it refuses to start
without the multiprocess folder (its pool's counts would be lost)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from tierq.core.metrics import Filtered
from tierq.core.settings import Settings
from tierq.workers.celery_metrics import registry


class _Both(Collector):
    def __init__(self) -> None:
        self.inner = CollectorRegistry()
        Counter("tierq_jobs_reenqueued_total", "x", registry=self.inner).inc()
        Counter("tierq_tenant_jobs_admitted_total", "x", ["tenant"], registry=self.inner).labels(
            "ten_1"
        ).inc()

    def collect(self) -> Iterator[Metric]:
        return self.inner.collect()


def test_tenant_families_are_left_out() -> None:
    out = CollectorRegistry()
    out.register(Filtered(_Both(), tenants=False))
    text = generate_latest(out).decode()
    assert "tierq_jobs_reenqueued_total 1.0" in text
    assert "tierq_tenant_" not in text and "ten_1" not in text


def test_it_needs_the_multiprocess_folder(tmp_path: Path) -> None:
    settings = Settings(celery_metrics_port=9999, _env_file=None)  # type: ignore[call-arg]
    with pytest.raises(RuntimeError, match="PROMETHEUS_MULTIPROC_DIR"):
        registry(settings)
    # Set, but after prometheus_client was imported (as here): its values are not in files.
    with pytest.raises(RuntimeError, match="PROMETHEUS_MULTIPROC_DIR"):
        registry(settings.model_copy(update={"prometheus_multiproc_dir": tmp_path}))


def test_the_tenant_endpoint_gets_the_tenant_families_only() -> None:
    out = CollectorRegistry()
    out.register(Filtered(_Both(), tenants=True))
    text = generate_latest(out).decode()
    assert 'tierq_tenant_jobs_admitted_total{tenant="ten_1"} 1.0' in text
    assert "tierq_jobs_reenqueued_total" not in text
