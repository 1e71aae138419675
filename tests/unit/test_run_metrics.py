"""`tierq run` with RUN_METRICS_PORT: each process it starts serves its metrics on a port of
its own, and the Prometheus configuration it writes scrapes every one of them (Prometheus'
own `promtool` checks it, and the compose one; `make test` installs Debian's prometheus).
That a real Prometheus scrapes a running platform with it is tests/e2e/test_operating.py."""

from __future__ import annotations

import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.dashboards import PROMETHEUS
from tierq.core.settings import Settings
from tierq.launch.supervisor import (
    PROMETHEUS_KEY_COPY,
    MetricsPorts,
    components,
    run_platform,
    write_prometheus_config,
)


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RUN_METRICS_PORT", "API_PORT", "API_HOST", "METRICS_HOST", "ADMIN_API_KEY"):
        monkeypatch.delenv(name, raising=False)


def _settings(tmp_path: Path, **kw: object) -> Settings:
    return Settings(_env_file=None, state_dir=tmp_path, **kw)  # type: ignore[call-arg, arg-type]


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `make test` installs Debian's prometheus"
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)


def test_without_the_setting_no_process_opens_a_metrics_port(tmp_path: Path) -> None:
    children = components(_settings(tmp_path), None)
    assert not any("--metrics-port" in c.argv for c in children)
    assert all(c.env == {} and c.fresh_dir is None for c in children)


def test_each_process_gets_its_own_port_and_celery_its_own_folder(tmp_path: Path) -> None:
    settings = _settings(tmp_path, run_metrics_port=9201)
    ports = MetricsPorts.of(settings)
    assert ports == MetricsPorts(9201, 9202, 9203, 9204, 9205)
    by_name = {c.name: c for c in components(settings, None)}
    assert by_name["api"].argv[-1] == "api"  # the API serves /metrics on its own port
    assert by_name["dispatcher"].argv[-2:] == ["--metrics-port", "9201"]
    worker = by_name["worker"].argv
    assert worker[worker.index("--metrics-port") + 1] == "9202"
    assert worker[worker.index("--tenant-metrics-port") + 1] == "9203"
    folders = set()
    for name, port in (("celery-worker", "9204"), ("celery-reconciler", "9205")):
        c = by_name[name]
        assert c.env["CELERY_METRICS_PORT"] == port
        assert c.fresh_dir is not None and c.env["PROMETHEUS_MULTIPROC_DIR"] == str(c.fresh_dir)
        folders.add(c.fresh_dir)
    assert len(folders) == 2  # never shared: each sums its own processes
    assert by_name["celery-beat"].env == {}  # beat counts nothing


def test_a_celery_workers_folder_is_emptied_before_every_start(tmp_path: Path) -> None:
    settings = _settings(tmp_path, run_metrics_port=9201)
    celery = next(c for c in components(settings, None) if c.name == "celery-worker")
    assert celery.fresh_dir is not None
    celery.fresh_dir.mkdir(parents=True)
    (celery.fresh_dir / "counter_123.db").write_text("left by the run before")
    celery.argv = ["/bin/true"]  # the start itself is what is tested here
    celery.start({})
    assert celery.proc is not None and celery.proc.wait(10) == 0
    assert celery.fresh_dir.is_dir() and list(celery.fresh_dir.iterdir()) == []


def test_the_prometheus_configuration_scrapes_everything_and_is_valid(tmp_path: Path) -> None:
    settings = _settings(tmp_path, run_metrics_port=9201, api_port=8123)
    path = write_prometheus_config(settings, "the-admin-key")
    doc = yaml.safe_load(path.read_text())
    targets = {
        j["job_name"]: (j.get("metrics_path", "/metrics"), j["static_configs"][0]["targets"])
        for j in doc["scrape_configs"]
    }
    assert targets == {
        "api": ("/metrics", ["127.0.0.1:8123"]),
        "api-tenants": ("/admin/metrics", ["127.0.0.1:8123"]),
        "dispatcher": ("/metrics", ["127.0.0.1:9201"]),
        "worker": ("/metrics", ["127.0.0.1:9202"]),
        "worker-tenants": ("/metrics", ["127.0.0.1:9203"]),
        "celery": ("/metrics", ["127.0.0.1:9204"]),
        "celery-reconciler": ("/metrics", ["127.0.0.1:9205"]),
    }
    # The same jobs as the compose configuration (which finds replicas by DNS instead).
    compose = {j["job_name"] for j in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]}
    assert compose <= set(targets)
    key_file = Path(doc["scrape_configs"][1]["authorization"]["credentials_file"])
    assert key_file == (tmp_path / PROMETHEUS_KEY_COPY).resolve()  # an operator's key: a copy
    assert key_file.read_text().strip() == "the-admin-key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    checked = _promtool("check", "config", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_without_an_admin_key_the_tenant_endpoints_are_left_out(tmp_path: Path) -> None:
    settings = _settings(tmp_path, run_metrics_port=9201)
    doc = yaml.safe_load(write_prometheus_config(settings, None).read_text())
    assert "api-tenants" not in {j["job_name"] for j in doc["scrape_configs"]}
    assert not (tmp_path / "prometheus-admin-key").exists()


def test_the_compose_prometheus_configuration_is_valid() -> None:
    # --syntax-only: its admin key file exists only inside the prometheus container.
    checked = _promtool("check", "config", "--syntax-only", str(PROMETHEUS))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_key_tierq_run_made_is_read_where_it_is_not_copied(tmp_path: Path) -> None:
    settings = _settings(tmp_path, run_metrics_port=9201)
    settings.admin_key_file.write_text("made-by-tierq-run\n")
    (tmp_path / PROMETHEUS_KEY_COPY).write_text("a stale copy\n")
    doc = yaml.safe_load(write_prometheus_config(settings, "made-by-tierq-run").read_text())
    tenants = next(j for j in doc["scrape_configs"] if j["job_name"] == "api-tenants")
    assert tenants["authorization"]["credentials_file"] == str(settings.admin_key_file.resolve())
    assert not (tmp_path / PROMETHEUS_KEY_COPY).exists()


@pytest.mark.parametrize(
    ("host", "target"),
    [("0.0.0.0", "127.0.0.1:9201"), ("::", "[::1]:9201"), ("::1", "[::1]:9201")],
)
def test_targets_are_where_a_local_scraper_reaches_them(
    tmp_path: Path, host: str, target: str
) -> None:
    settings = _settings(tmp_path, run_metrics_port=9201, metrics_host=host)
    doc = yaml.safe_load(write_prometheus_config(settings, None).read_text())
    dispatcher = next(j for j in doc["scrape_configs"] if j["job_name"] == "dispatcher")
    assert dispatcher["static_configs"][0]["targets"] == [target]


def test_ports_that_take_in_the_api_port_are_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    settings = _settings(tmp_path / "state", run_metrics_port=7998, api_port=8000)
    assert run_platform(settings) == 2
    assert not (tmp_path / "state").exists()  # nothing made, nothing started
