"""The relay's periodic audit (its decisions and what it reports; the audit itself replaced)."""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from cdc.audit import table as pg
from cdc.audit.compare import Comparison, TopicCounts
from cdc.audit.ids import IdBuckets, IdList, uuid_text
from cdc.audit.kafka import Expired, GroupCheck, KafkaRead
from cdc.audit.run import AuditReport
from cdc.audit.window import BeforeFirstStartError, Window
from cdc.errors import KafkaUnavailableError
from cdc.relay.gaps import periodic_audit as periodic
from cdc.relay.gaps.periodic_audit import ACTIVE_STATES, PeriodicAudit, finding_line
from cdc.relay.health.state import RelayState
from cdc.repair.lock import AuditBusyError
from cdc.settings import Settings

SETTINGS = Settings(pg_dsn="postgresql://u@h/db", kafka_bootstrap_servers="k:9092")


def _report(
    *,
    missing: int = 0,
    expired: int = 0,
    repaired: int = 0,
    slot_known: bool = True,
    in_flight: int = 0,
    cannot_judge: str | None = None,
) -> AuditReport:
    ids = [uuid.uuid4().bytes for _ in range(missing)]
    expired_list = [Expired("t.user", 2, 10, 10 + expired)] if expired else []
    return AuditReport(
        run_id="abc123",
        window=Window(1_700_000_000_000, 1_700_003_600_000),
        time_basis=pg.COMMIT_TIME,
        comparison=Comparison(
            {"t.user": TopicCounts(missing=missing, in_flight=in_flight)}, IdList(ids), IdList(), 0
        ),
        table=pg.TableRead(0, pg.COMMIT_TIME, judged_rows=100),
        pending=pg.Pending(IdBuckets() if slot_known else None, 0, "" if slot_known else "gone"),
        kafka=KafkaRead(),
        plans=[],
        group=GroupCheck("engine-sync", expired_list, 3),
        parked=pg.Parked({}),
        missing_rows=[],
        judge_phantoms=True,
        repaired=repaired,
        repair_mark="audit-abc123" if repaired else None,
        cannot_judge=cannot_judge,
    )


def _audit(monkeypatch: pytest.MonkeyPatch, outcome: Any) -> tuple[PeriodicAudit, list[Any]]:
    calls: list[Any] = []

    def fake_run_audit(settings: Settings, window: Window, **kwargs: Any) -> AuditReport:
        calls.append((window, kwargs))
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome  # type: ignore[no-any-return]

    monkeypatch.setattr(periodic, "run_audit", fake_run_audit)
    audit = PeriodicAudit(
        SETTINGS, registry=CollectorRegistry(), active=lambda: True, stop=threading.Event()
    )
    return audit, calls


def _value(audit: PeriodicAudit, name: str, **labels: str) -> float:
    metric = {
        "runs": audit.metrics.runs,
        "missing": audit.metrics.missing,
        "expired": audit.metrics.expired,
        "repaired": audit.metrics.repaired,
    }[name]
    child = metric.labels(**labels) if labels else metric
    return float(child._value.get())  # type: ignore[union-attr]


def test_a_run_that_found_something_writes_one_warning_naming_counts_and_first_ids(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    report = _report(missing=7, expired=4, repaired=7)
    audit, calls = _audit(monkeypatch, report)
    with caplog.at_level(logging.INFO, logger="cdc.audit"):
        assert audit.run_once() is report
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    line = warnings[0].getMessage()
    assert "7 events missing from Kafka" in line
    assert ", ".join(uuid_text(i) for i in report.comparison.missing.first(5)) in line
    assert "4 records removed before group engine-sync processed them (t.user[2] 10..13)" in line
    assert "republished 7 (audit-abc123)" in line
    assert _value(audit, "missing") == 7
    assert _value(audit, "expired") == 4
    assert _value(audit, "repaired") == 7
    assert _value(audit, "runs", result="found") == 1
    window, kwargs = calls[0]
    assert window.width_s == SETTINGS.audit_window_s
    assert kwargs == {"repair": True, "repair_unproven": False}


def test_a_clean_run_writes_no_warning_and_zeroes_the_gauge(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    audit, _ = _audit(monkeypatch, _report())
    audit.metrics.missing.set(5)
    with caplog.at_level(logging.INFO, logger="cdc.audit"):
        audit.run_once()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert _value(audit, "missing") == 0
    assert _value(audit, "runs", result="clean") == 1


def test_without_repair_the_line_says_nothing_was_republished() -> None:
    assert "not republished (CDC_AUDIT_REPAIR=off)" in finding_line(_report(missing=2))


def test_a_run_whose_slot_could_not_be_read_judges_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    audit, _ = _audit(monkeypatch, _report(missing=3, slot_known=False))
    audit.metrics.missing.set(0)
    audit.run_once()
    assert _value(audit, "runs", result="skipped") == 1
    assert _value(audit, "missing") == 0  # in flight and missing are one count: not judged


def test_rows_still_in_the_slot_are_in_flight_never_clean_and_never_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A stuck relay's rows (committed, still in the slot): the run is counted
    ``in_flight``, the missing gauge says 0, one INFO line names how many."""
    audit, _ = _audit(monkeypatch, _report(in_flight=12))
    audit.metrics.missing.set(4)
    with caplog.at_level(logging.INFO, logger="cdc.audit"):
        report = audit.run_once()
    assert report is not None and report.verdict == "in flight" and not report.clean
    assert _value(audit, "runs", result="in_flight") == 1
    assert _value(audit, "runs", result="clean") == 0
    assert _value(audit, "missing") == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("12 rows still in the slot (in flight)" in r.getMessage() for r in caplog.records)


def test_an_audit_that_cannot_judge_is_skipped_with_a_warning_and_leaves_the_gauge(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The server cannot be identified (no REPLICATION): nothing is judged, so the run
    is ``skipped``, never ``clean``; the missing gauge keeps its last judged value."""
    why = "cannot judge: IDENTIFY_SYSTEM failed: must be superuser or replication role"
    audit, _ = _audit(monkeypatch, _report(cannot_judge=why))
    audit.metrics.missing.set(2)
    with caplog.at_level(logging.INFO, logger="cdc.audit"):
        report = audit.run_once()
    assert report is not None and report.verdict == "cannot judge" and not report.clean
    assert _value(audit, "runs", result="skipped") == 1
    assert _value(audit, "runs", result="clean") == 0
    assert _value(audit, "missing") == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"audit abc123 not judged: {why}"]


def test_a_busy_lock_skips_and_a_failure_is_counted_never_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    audit, _ = _audit(monkeypatch, AuditBusyError("another audit of slot s is running"))
    assert audit.run_once() is None
    assert _value(audit, "runs", result="skipped") == 1
    audit, _ = _audit(monkeypatch, KafkaUnavailableError("brokers down"))
    assert audit.run_once() is None
    assert _value(audit, "runs", result="failed") == 1


def test_a_window_that_ends_before_the_first_start_is_skipped_not_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Edge: the first CDC_AUDIT_SETTLE_S after `slot init --from now`: the whole window is
    before the first start, nothing in it is the relay's - a skip, not a failure."""
    audit, _ = _audit(monkeypatch, BeforeFirstStartError("the window ... ends before"))
    assert audit.run_once() is None
    assert _value(audit, "runs", result="skipped") == 1
    assert _value(audit, "runs", result="failed") == 0


def test_only_a_relay_that_streams_its_slot_audits() -> None:
    assert RelayState.STREAMING in ACTIVE_STATES
    assert RelayState.BACKPRESSURE in ACTIVE_STATES
    for idle in (RelayState.STANDBY, RelayState.GAP, RelayState.STARTING, RelayState.STOPPING):
        assert idle not in ACTIVE_STATES


def test_interval_zero_turns_it_off() -> None:
    off = Settings(audit_interval_s=0)
    audit = PeriodicAudit(
        off, registry=CollectorRegistry(), active=lambda: True, stop=threading.Event()
    )
    assert audit.start() is None
