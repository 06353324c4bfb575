"""The alert rules, the dashboard and the README agree with each other.

Whether the named metrics really exist on the running processes is proven in
tests/integration/test_observability.py; here only the files are checked (plus
the dashboard's PromQL, parsed by promtool).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from tests.observability import (
    ROOT,
    alert_rules,
    dashboard,
    dashboard_queries,
    metric_names,
    promql_for_promtool,
    promtool,
    readme_section,
    referenced_metrics,
)

#: The issue's list: one alert per way the pipeline hurts its users.
REQUIRED_ALERTS = {
    "OutboxRelayNotStreaming",
    "OutboxSlotRetainingWal",
    "OutboxCommitToAckSlow",
    "OutboxOldestEventTooOld",
    "OutboxSinkCircuitOpen",
    "OutboxEventsParked",
    "OutboxDeadLettered",
    "OutboxRelayStandbyMissing",
}
#: What the dashboard must show, as the metric families it must read.
REQUIRED_DASHBOARD_METRICS = {
    "outbox_relay_events_total",  # throughput
    "outbox_sink_delivered_total",
    "outbox_relay_commit_to_ack_seconds",  # commit -> ack
    "outbox_sink_commit_to_engine_seconds",  # commit -> engine
    "outbox_relay_slot_lag_bytes",  # slot lag
    "outbox_sink_consumer_lag",  # group lag
    "outbox_sink_oldest_unprocessed_age_seconds",  # oldest age
    "outbox_sink_circuit_open",  # circuit state
    "outbox_sink_parked_total",  # parked
    "outbox_relay_dead_lettered_total",  # dead-lettered
}


def _table_rows(section: str) -> dict[str, list[str]]:
    """First cell (backticks stripped) -> the other cells, of a markdown table."""
    rows = {}
    for line in section.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_every_required_alert_exists_with_severity_and_runbook_link() -> None:
    rules = {r["alert"]: r for r in alert_rules()}
    assert set(rules) >= REQUIRED_ALERTS
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in {"critical", "warning"}, name
        assert rule["annotations"]["summary"], name
        assert rule["annotations"]["runbook"] == "README.md#alerts-and-runbook", name


def test_every_alert_has_a_runbook_line_in_the_readme() -> None:
    rows = _table_rows(readme_section("### Alerts and runbook"))
    for rule in alert_rules():
        assert rule["alert"] in rows, f"{rule['alert']} has no runbook line in the README"
        fires_when, runbook = rows[rule["alert"]]
        assert fires_when and len(runbook) > 20, rule["alert"]


def test_readme_lists_every_dashboard_panel() -> None:
    rows = _table_rows(readme_section("### Dashboard"))
    titles = [p["title"] for p in dashboard()["panels"]]
    assert len(titles) == len(set(titles)), "panel titles must be unique"
    for title in titles:
        assert title in rows, f"panel {title!r} is not described in the README"


def test_dashboard_shows_what_the_issue_asks_for() -> None:
    shown = set().union(*(metric_names(expr) for _, expr in dashboard_queries()))
    assert shown >= REQUIRED_DASHBOARD_METRICS, REQUIRED_DASHBOARD_METRICS - shown


def test_every_metric_the_rules_or_dashboard_use_is_in_the_readme_reference() -> None:
    rows = _table_rows(readme_section("### Metrics reference"))
    for name, users in referenced_metrics().items():
        assert name in rows, f"{name} (used by {users}) is missing from the metrics reference"
        kind, _labels, meaning = rows[name]
        assert kind in {"counter", "gauge", "histogram"} and meaning, name


def test_readme_metrics_reference_names_only_metrics_the_code_defines() -> None:
    source = "".join(
        p.read_text() for p in [*(ROOT / "cdc").rglob("*.py"), *(ROOT / "sinks").rglob("*.py")]
    )
    rows = _table_rows(readme_section("### Metrics reference"))
    for name in rows:
        if name.startswith("outbox_"):
            assert f'"{name}"' in source, f"README documents {name}, the code has no such metric"


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    queries = dashboard_queries()
    rules = [
        {"record": f"dashboard:query_{n}", "expr": promql_for_promtool(expr)}
        for n, (_title, expr) in enumerate(queries)
    ]
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run(
        [promtool(), "check", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(rf"SUCCESS: {len(queries)} rules found", proc.stdout), proc.stdout
