"""The relay's start-up check and the audit cannot repair at once: one lock, one comparison.

The start-up check is :func:`cdc.audit.verify_since` (the audit's comparison), run
under the slot's audit lock. These tests replace what is below the decision (the
database, Kafka): the lock's own exclusion is tested against PostgreSQL in
``tests/integration/test_audit.py``.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from cdc.audit import run
from cdc.audit.ids import IdList
from cdc.audit.run import Verification
from cdc.audit.window import Window
from cdc.relay.gaps import start_check
from cdc.relay.gaps.start_check import StartCheck
from cdc.relay.health.metrics import RelayMetrics
from cdc.repair.lock import AuditBusyError
from cdc.settings import Settings
from cdc.wal.slots import ServerIdentity

SETTINGS = Settings(pg_dsn="postgresql://u@h/db", kafka_bootstrap_servers="k:9092")
SERVER = ServerIdentity("7301", 2, ((1, 0x3000060),))
NOW = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
WINDOW = Window.between(NOW - timedelta(minutes=5), NOW)


def _check() -> StartCheck:
    """The start-up check as the slot guard holds it."""
    return StartCheck(SETTINGS, RelayMetrics(CollectorRegistry()), threading.Event())


@pytest.fixture
def checked(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """The start-up check's calls of verify_since; the topics come from a fake history."""

    @contextmanager
    def no_db(settings: Settings) -> Iterator[None]:
        yield None

    monkeypatch.setattr(start_check.recovery, "connect", no_db)
    monkeypatch.setattr(start_check.gaps, "outputs", lambda conn, slot, kind: ["t.user"])
    monkeypatch.setattr(start_check, "START_CHECK_POLL_S", 0.001)
    yield []


def _outcomes(
    monkeypatch: pytest.MonkeyPatch, calls: list[dict[str, Any]], outcomes: list[Any]
) -> None:
    def fake_verify_since(settings: Settings, since: datetime, **kwargs: Any) -> Verification:
        calls.append({"since": since, **kwargs})
        outcome = outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome  # type: ignore[no-any-return]

    monkeypatch.setattr(start_check, "verify_since", fake_verify_since)


def test_the_start_check_waits_while_an_audit_holds_the_lock_then_checks_once(
    monkeypatch: pytest.MonkeyPatch,
    checked: list[dict[str, Any]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Edge: the periodic audit (or `audit --repair`) holds the slot's audit lock when the
    start-up check is ready: the check does not repair beside it - it waits, then checks
    (and sees what the audit republished). The wait is logged once when it begins and once
    when the check proceeds, not at every poll (a 30-minute wait was ~900 lines)."""
    busy = AuditBusyError("another audit of slot outbox_slot is running")
    missing = IdList([uuid.uuid4().bytes])
    done = Verification(WINDOW, table_rows=3, missing=missing, republished=1)
    _outcomes(monkeypatch, checked, [busy] * 5 + [done])
    g = _check()
    with caplog.at_level(logging.INFO, logger="cdc.relay"):
        assert g.check_window(WINDOW, SERVER, "7301/2/outbox_slot") is True
    assert len(checked) == 6
    call = checked[-1]
    assert call["server"] == SERVER and call["origin"] == "7301/2/outbox_slot"
    assert call["topics"] == ["t.user"] and call["max_rows"] == SETTINGS.start_verify_max_rows
    assert (call["since"], call["until"]) == (WINDOW.since, WINDOW.until)
    assert sum("waits (at most" in r.message for r in caplog.records) == 1
    assert sum("proceeds: the audit lock was free" in r.message for r in caplog.records) == 1
    assert g.metrics.start_check_republished._value.get() == 1
    assert "re-published (header recovered=verify)" in caplog.text


def test_the_start_check_gives_up_waiting_at_its_bound_and_is_tried_again(
    monkeypatch: pytest.MonkeyPatch,
    checked: list[dict[str, Any]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Edge: the lock stays taken past the bound: the check gives up (tried again at the
    next session) after many polls, with one line when the wait began and one when it gave
    up."""
    clock = iter(range(1_000))  # one second per look at the clock
    monkeypatch.setattr(start_check, "time", SimpleNamespace(monotonic=lambda: float(next(clock))))
    monkeypatch.setattr(start_check, "START_CHECK_BUSY_WAIT_S", 10.0)
    busy = AuditBusyError("another audit of slot s is running")
    _outcomes(monkeypatch, checked, [busy] * 100)
    g = _check()
    with caplog.at_level(logging.INFO, logger="cdc.relay"):
        assert g.check_window(WINDOW, SERVER, "o") is False  # (not marked checked)
    assert len(checked) == 11  # (polled until the bound)
    lines = [r.message for r in caplog.records]
    assert sum("waits (at most" in m for m in lines) == 1
    assert len(lines) == 2 and "tried again at the next session" in lines[1]
    assert g.metrics.start_check_republished._value.get() == 0


def test_a_stopping_relay_stops_waiting_for_the_lock(
    monkeypatch: pytest.MonkeyPatch, checked: list[dict[str, Any]]
) -> None:
    _outcomes(monkeypatch, checked, [AuditBusyError("busy")] * 3)
    g = _check()
    g._stop.set()
    assert g.check_window(WINDOW, SERVER, "o") is False
    assert len(checked) == 1


def test_the_start_check_takes_the_audits_lock_before_reading_anything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """verify_since (the start-up check) and run_audit(repair=True) (the periodic audit,
    `audit --repair`) take the same lock, the one of the slot; neither reads a thing
    while another holds it."""
    taken: list[str] = []

    @contextmanager
    def held_elsewhere(settings: Settings) -> Iterator[None]:
        taken.append(settings.slot)
        raise AuditBusyError(f"another audit of slot {settings.slot} is running")
        yield  # (never)

    def no_read(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("read while another run holds the lock")

    monkeypatch.setattr(run, "audit_lock", held_elsewhere)
    monkeypatch.setattr(run, "_compare", no_read)
    monkeypatch.setattr(run, "identify_system", no_read)
    with pytest.raises(AuditBusyError):
        run.verify_since(SETTINGS, WINDOW.since, until=WINDOW.until, server=SERVER)
    with pytest.raises(AuditBusyError):
        run.run_audit(SETTINGS, WINDOW, repair=True)
    assert taken == [SETTINGS.slot, SETTINGS.slot]


def test_a_window_too_large_is_skipped_with_the_setting_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    @contextmanager
    def free(settings: Settings) -> Iterator[None]:
        yield

    def too_many(*args: Any, **kwargs: Any) -> Any:
        assert kwargs["max_rows"] == 10 and kwargs["topics_only"] == ["t.user"]
        assert kwargs["owner"].timelines == {1, 2}  # (the server's lineage: ancestors count)
        raise run.WindowTooLargeError(
            "11 rows in the window, more than 10 (CDC_START_VERIFY_MAX_ROWS)"
        )

    monkeypatch.setattr(run, "audit_lock", free)
    monkeypatch.setattr(run, "_compare", too_many)
    found = run.verify_since(
        SETTINGS, WINDOW.since, until=WINDOW.until, server=SERVER, topics=["t.user"], max_rows=10
    )
    assert "CDC_START_VERIFY_MAX_ROWS" in found.skipped and not len(found.missing)


def test_a_repair_tells_republish_where_its_rows_were_created(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The audit's and the start-up check's repair hand their table read's bounds (the
    window, from its margin before: every missing row was read there) to republish, so a
    large repair may read the window in its order (cdc.repair.rows)."""
    seen: dict[str, Any] = {}

    def republish(settings: Settings, ids: Any, **kwargs: Any) -> int:
        seen.update(kwargs, ids=bytes(ids))
        return 1

    monkeypatch.setattr(run, "republish", republish)
    found = SimpleNamespace(table=SimpleNamespace(snapshot_lsn=0x16B3748))
    missing = IdList([uuid.UUID(int=7).bytes])
    assert run._republish(SETTINGS, missing, "o", found, "audit-1", WINDOW) == 1  # type: ignore[arg-type]
    margin = timedelta(seconds=SETTINGS.gap_margin_s)
    assert seen["created"] == (WINDOW.since - margin, WINDOW.until)
    assert seen["ids"] == uuid.UUID(int=7).bytes and seen["lsn"] == "0/16B3748"
