"""What the alert rules and the dashboard name: shared by the unit and integration tests."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
RULES = sorted((ROOT / "compose" / "prometheus" / "rules").glob("*.rules.yml"))
DASHBOARD = ROOT / "compose" / "grafana" / "dashboards" / "outbox-cdc.json"
#: The documentation pages the rules, the dashboard and the code are held to.
OBSERVABILITY_DOCS = ROOT / "docs" / "observability"

_METRIC = re.compile(r"\b(outbox_(?:relay|sink)_[a-z0-9_]+)\b")
_HISTOGRAM_SUFFIX = re.compile(r"_(bucket|sum|count)$")
#: Grafana's variables, replaced by a plain duration so promtool can parse the query.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}


def alert_rules() -> list[dict[str, Any]]:
    rules = []
    for path in RULES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            rules += [r for r in group["rules"] if "alert" in r]
    return rules


def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel."""
    return [(p["title"], t["expr"]) for p in dashboard()["panels"] for t in p["targets"]]


def metric_names(expr: str) -> set[str]:
    """The outbox metric families an expression reads (``_bucket`` etc. stripped)."""
    return {_HISTOGRAM_SUFFIX.sub("", m) for m in _METRIC.findall(expr)}


def referenced_metrics() -> dict[str, list[str]]:
    """Metric family -> where it is used (``alert X`` / ``panel Y``)."""
    out: dict[str, list[str]] = {}
    for rule in alert_rules():
        for name in metric_names(rule["expr"]):
            out.setdefault(name, []).append(f"alert {rule['alert']}")
    for title, expr in dashboard_queries():
        for name in metric_names(expr):
            out.setdefault(name, []).append(f"panel {title}")
    return out


def promql_for_promtool(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def doc_page(name: str) -> str:
    """The text of docs/observability/<name>.md."""
    return (OBSERVABILITY_DOCS / f"{name}.md").read_text(encoding="utf-8")


IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def promtool() -> str:
    """promtool's path (compose/prometheus/promtool.sh fetches it when missing);
    fails under CI, skips elsewhere, when it cannot be had."""
    proc = subprocess.run(
        ["bash", str(ROOT / "compose" / "prometheus" / "promtool.sh"), "path"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        if IN_CI:
            pytest.fail(f"promtool unavailable in CI: {proc.stderr[-2000:]}", pytrace=False)
        pytest.skip(f"promtool unavailable: {proc.stderr[-500:]}")
    return proc.stdout.strip()
