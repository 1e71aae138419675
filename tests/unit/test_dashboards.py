"""The monitoring files of the deployment are valid and agree with each other: Grafana's
provisioning and dashboards, Prometheus' scrape configuration and docker-compose.yml, and
every metric a dashboard queries is one tierq declares (that a running platform exports
each is tests/integration/test_metrics.py)."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import REGISTRY

from tests.dashboards import (
    DASHBOARDS,
    HISTOGRAM_SUFFIXES,
    PROMETHEUS,
    PROVISIONING,
    ROOT,
    dashboard_metric_names,
    dashboards,
    metric_names,
    panels,
    queries,
    yaml_file,
)
from tierq.core import metrics


def _datasource_uids() -> set[str]:
    uids: set[str] = set()
    for path in sorted((PROVISIONING / "datasources").glob("*.y*ml")):
        doc = yaml_file(path)
        assert doc["apiVersion"] == 1
        for ds in doc["datasources"]:
            assert ds["type"] == "prometheus" and ds["uid"], ds
            assert ds["url"] == "http://prometheus:9090"  # the compose service
            uids.add(ds["uid"])
    return uids


def _compose() -> dict[str, Any]:
    services: dict[str, Any] = yaml_file(ROOT / "docker-compose.yml")["services"]
    return services


def test_every_panel_has_a_query_on_a_provisioned_datasource() -> None:
    uids = _datasource_uids()
    assert uids, "no datasource is provisioned"
    found = dashboards()
    assert found, f"no dashboard in {DASHBOARDS}"
    seen_uids: set[str] = set()
    for path, dashboard in found.items():
        assert dashboard["uid"] not in seen_uids, path
        seen_uids.add(dashboard["uid"])
        ids = [p["id"] for p in dashboard["panels"]]
        assert len(ids) == len(set(ids)), f"{path.name}: panel ids repeat"
        assert panels(dashboard), path
        for panel in panels(dashboard):
            where = f"{path.name}: panel {panel.get('title')!r}"
            assert panel["datasource"]["uid"] in uids, where
            targets = panel.get("targets", [])
            assert targets, f"{where} has no query"
            for target in targets:
                assert target["datasource"]["uid"] in uids, where
                assert target["expr"].strip(), f"{where}: an empty query"


@pytest.mark.parametrize("expr", queries())
def test_each_query_is_balanced_and_reads_tierq_metrics(expr: str) -> None:
    for opening, closing in ("()", "[]", "{}"):
        depth = 0
        for ch in expr:
            depth += (ch == opening) - (ch == closing)
            assert depth >= 0, expr
        assert depth == 0, expr
    assert metric_names(expr), f"reads no tierq metric: {expr}"


def test_the_dashboards_cover_what_an_operator_looks_at() -> None:
    titles = " | ".join(
        str(p.get("title")).lower() for d in dashboards().values() for p in d["panels"]
    )
    for row in ("tiers", "engines", "tenants", "batches", "errors"):
        assert row in titles, row
    names = dashboard_metric_names()
    for needed in (
        "tierq_queue_depth",
        "tierq_queue_oldest_job_age_seconds",
        "tierq_time_to_first_token_seconds_bucket",
        "tierq_jobs_started_within_slo_total",
        "tierq_tier_served_token_share",
        "tierq_tier_min_share",
        "tierq_worker_slots",
        "tierq_preemptions_total",
        "tierq_tenant_tokens_served_total",
        "tierq_jobs_refused_total",
        "tierq_batch_lines",
        "tierq_jobs_dead_lettered_total",
    ):
        assert needed in names, needed
    ttft = [q for q in queries() if "tierq_time_to_first_token_seconds_bucket" in q]
    assert {q.split(",")[0] for q in ttft} >= {
        "histogram_quantile(0.5",
        "histogram_quantile(0.95",
        "histogram_quantile(0.99",
    }


def test_every_queried_metric_is_declared() -> None:
    declared: set[str] = set()
    for registry in (REGISTRY, metrics.TENANT_REGISTRY):
        for family in registry.collect():
            declared |= {s.name for s in family.samples}
            declared.add(family.name)
            if family.type == "histogram":
                declared |= {family.name + s for s in HISTOGRAM_SUFFIXES}
            if family.type == "counter":  # its family drops the _total its samples have
                declared.add(family.name + "_total")
    missing = {n for n in dashboard_metric_names() if n not in declared}
    assert not missing, missing


def test_the_dashboard_provider_loads_the_folder_compose_mounts() -> None:
    providers = yaml_file(PROVISIONING / "dashboards" / "tierq.yml")["providers"]
    [provider] = providers
    assert provider["type"] == "file"
    grafana = _compose()["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"] if v.startswith("./"))
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    prometheus = _compose()["prometheus"]
    assert any(v.startswith("./deploy/prometheus/prometheus.yml:") for v in prometheus["volumes"])


def _port_after(command: list[str], option: str) -> int | None:
    return int(command[command.index(option) + 1]) if option in command else None


def test_prometheus_scrapes_every_component_on_the_port_it_serves() -> None:
    config = yaml_file(PROMETHEUS)
    targets: set[str] = set()
    paths: dict[str, str] = {}
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                targets.add(target)
                paths.setdefault(target, job.get("metrics_path", "/metrics"))
        for dns in job.get("dns_sd_configs", []):
            for name in dns["names"]:
                targets.add(f"{name}:{dns['port']}")
    served: set[str] = set()
    for name, service in _compose().items():
        command = service.get("command")
        env = service.get("environment") or {}
        if not isinstance(command, list):
            continue
        if command[:2] == ["tierq", "api"]:
            served.add(f"{name}:{_port_after(command, '--port')}")
        for option in ("--metrics-port", "--tenant-metrics-port"):
            port = _port_after(command, option)
            if port is not None:
                served.add(f"{name}:{port}")
        if command[0] == "celery" and "worker" in command:
            assert env.get("PROMETHEUS_MULTIPROC_DIR") in service.get("tmpfs", []), name
            served.add(f"{name}:{env['CELERY_METRICS_PORT']}")
        if name != "migrate" and command[0] in ("tierq", "celery"):
            assert env.get("METRICS_HOST", "0.0.0.0") == "0.0.0.0" or name == "celery-beat"
    assert served >= {
        "api:8000",
        "dispatcher:9101",
        "worker:9102",
        "worker:9103",
        "celery-worker:9104",
        "celery-reconciler:9104",
    }
    assert served <= targets, served - targets
    # The per-tenant series: the admin API's, with the admin key.
    tenant_jobs = [j for j in config["scrape_configs"] if j.get("metrics_path") == "/admin/metrics"]
    assert tenant_jobs and tenant_jobs[0]["authorization"]["credentials_file"]


def test_every_series_is_in_the_reference_with_its_type_and_labels() -> None:
    section = (ROOT / "docs/reference/metrics.md").read_text()
    rows = {}
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`tierq_"):
            labels = {x.strip(" `") for x in cells[2].split(",") if x.strip()}
            rows[cells[0].strip("`")] = (cells[1], labels)
    declared = {}
    for registry in (REGISTRY, metrics.TENANT_REGISTRY):
        for collector in list(registry._collector_to_names):  # type: ignore[attr-defined]
            name = getattr(collector, "_name", "")
            if not name.startswith("tierq_"):
                continue
            kind = collector._type
            full = name + "_total" if kind == "counter" else name
            declared[full] = (kind, set(collector._labelnames))
    assert declared == rows
