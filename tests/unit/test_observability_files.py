"""The alert rules, the dashboard, the code and the observability docs agree with each other.

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
    doc_page,
    metric_names,
    promql_for_promtool,
    promtool,
    referenced_metrics,
)

#: Where an alert's runbook annotation points: the docs page with the runbook table.
RUNBOOK_PAGE = "docs/observability/alerts.md"


def _site_url() -> str:
    """mkdocs.yml's ``site_url`` (the published docs site), ending in ``/``."""
    found = re.search(r"^site_url:\s*(\S+)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert found, "mkdocs.yml names no site_url: the runbook annotations need one"
    return found.group(1).rstrip("/") + "/"


#: The runbook annotation: the built page of RUNBOOK_PAGE under the site's URL (the offline
#: plugin builds ``page.html``, not ``page/``), absolute: a relative path means nothing to
#: whoever reads the alert.
RUNBOOK_URL = _site_url() + RUNBOOK_PAGE.removeprefix("docs/").removesuffix(".md") + ".html"

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
        runbook = rule["annotations"]["runbook"]
        assert runbook.startswith(_site_url()) and runbook.startswith("https://"), name
        assert runbook == RUNBOOK_URL, name
    assert (ROOT / RUNBOOK_PAGE).is_file()


def test_every_alert_has_a_runbook_line_in_the_docs() -> None:
    rows = _table_rows(doc_page("alerts"))
    for rule in alert_rules():
        assert rule["alert"] in rows, f"{rule['alert']} has no runbook line in {RUNBOOK_PAGE}"
        fires_when, runbook = rows[rule["alert"]]
        assert fires_when and len(runbook) > 20, rule["alert"]


def test_the_docs_list_every_dashboard_panel() -> None:
    rows = _table_rows(doc_page("dashboard"))
    titles = [p["title"] for p in dashboard()["panels"]]
    assert len(titles) == len(set(titles)), "panel titles must be unique"
    for title in titles:
        assert title in rows, f"panel {title!r} is not described in docs/observability/dashboard.md"


def test_dashboard_shows_what_the_issue_asks_for() -> None:
    shown = set().union(*(metric_names(expr) for _, expr in dashboard_queries()))
    assert shown >= REQUIRED_DASHBOARD_METRICS, REQUIRED_DASHBOARD_METRICS - shown


def test_every_metric_the_rules_or_dashboard_use_is_in_the_metrics_reference() -> None:
    rows = _table_rows(doc_page("metrics"))
    for name, users in referenced_metrics().items():
        assert name in rows, f"{name} (used by {users}) is missing from the metrics reference"
        kind, _labels, meaning = rows[name]
        assert kind in {"counter", "gauge", "histogram"} and meaning, name


#: A metric family the code defines: the name given to a prometheus_client constructor.
_DEFINED = re.compile(r"(?:Counter|Gauge|Histogram|Summary)\(\s*\"(outbox_[a-z0-9_]+)\"")


def _defined_metrics() -> set[str]:
    source = "".join(
        p.read_text() for p in [*(ROOT / "cdc").rglob("*.py"), *(ROOT / "sinks").rglob("*.py")]
    )
    return set(_DEFINED.findall(source))


def test_the_metrics_reference_and_the_code_name_the_same_metrics() -> None:
    documented = {name for name in _table_rows(doc_page("metrics")) if name.startswith("outbox_")}
    defined = _defined_metrics()
    assert len(defined) > 40, "the scan of the code found too few metrics: is it broken?"
    assert not documented - defined, f"documented, defined nowhere: {documented - defined}"
    assert not defined - documented, f"defined, not in the reference: {defined - documented}"
    for name, (kind, _labels, meaning) in _table_rows(doc_page("metrics")).items():
        if name.startswith("outbox_"):
            assert kind in {"counter", "gauge", "histogram"} and meaning, name


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
