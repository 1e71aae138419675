"""The deployment's monitoring files as the tests read them: Grafana's dashboards and
provisioning, Prometheus' scrape configuration, and the metric names the dashboards'
PromQL queries use."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DASHBOARDS = DEPLOY / "grafana" / "dashboards"
PROVISIONING = DEPLOY / "grafana" / "provisioning"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"

# A metric name in PromQL: tierq's own all start so; label names and values do not (a
# label value is quoted, and none of the dashboards' starts with tierq_).
_METRIC = re.compile(r"(?<![\w\"])(tierq_[a-zA-Z0-9_]+)")
# The suffixes a histogram's (or counter's) samples add to its family's name.
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def dashboards() -> dict[Path, dict[str, Any]]:
    return {path: json.loads(path.read_text()) for path in sorted(DASHBOARDS.glob("*.json"))}


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel but rows, rows' own panels included."""
    out: list[dict[str, Any]] = []
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            out.extend(panel.get("panels", []))
        else:
            out.append(panel)
    return out


def queries() -> list[str]:
    return [
        target["expr"]
        for dashboard in dashboards().values()
        for panel in panels(dashboard)
        for target in panel.get("targets", [])
    ]


def metric_names(expr: str) -> set[str]:
    """The metric names one PromQL expression reads (quoted strings left out)."""
    unquoted = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    return set(_METRIC.findall(unquoted))


def dashboard_metric_names() -> set[str]:
    return {name for expr in queries() for name in metric_names(expr)}


def yaml_file(path: Path) -> Any:
    return yaml.safe_load(path.read_text())
