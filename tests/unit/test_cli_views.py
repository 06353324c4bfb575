"""The command line's views: what an operator reads in an 80-column terminal."""

from __future__ import annotations

import io
from datetime import UTC, datetime, timedelta, timezone

from rich.console import Console

from sinks.cli.render import lag_view, parked_line, parked_table
from sinks.ops.lag import PipelineLag
from sinks.ops.offsets import PartitionLag
from sinks.parking.lot import ParkedEvent
from sinks.trace.model import ParkedRow

NOW = datetime(2026, 12, 1, 6, 0, tzinfo=UTC)


def _render(renderable: object, width: int = 80) -> str:
    buffer = io.StringIO()
    Console(file=buffer, width=width, highlight=False, soft_wrap=True).print(renderable)
    return buffer.getvalue()


def _lag_row(topic: str, partition: int) -> PartitionLag:
    return PartitionLag(
        topic=topic,
        partition=partition,
        committed_offset=123_456,
        low_offset=0,
        end_offset=223_456,
        resume_offset=123_456,
        lag=100_000,
        oldest_unprocessed_ts_ms=None,
        oldest_unprocessed_age_s=4_000.0,
    )


def test_the_lag_table_shows_whole_topic_names_in_80_columns() -> None:
    """user and quiz_attempt topics differ at the end: a cut name makes the rows look alike."""
    topics = ["outbox.event.user_0a1b2c3d4e", "outbox.event.quiz_attempt_0a1b2c3d4e"]
    report = PipelineLag(
        group="engine-sync-0a1b2c3d4e",
        at_ms=0,
        partitions=tuple(_lag_row(t, p) for t in topics for p in range(3)),
        slot=None,
        parking=None,
    )

    text = _render(lag_view(report, rates=None))

    for topic in topics:
        assert topic in text, text
    assert "…" not in text


def _parked(**changes: object) -> ParkedRow:
    values: dict[str, object] = {
        "id": 7,
        "sync_type": "USER_SYNC",
        "status": "DONE",
        "retry_count": 1,
        "last_error": None,
        "next_retry_at": None,
        "created_at": NOW,
        "updated_at": NOW,
        "kafka_topic": "t",
        "kafka_partition": 0,
        "kafka_offset": 1,
    }
    values.update(changes)
    return ParkedRow(**values)  # type: ignore[arg-type]


def test_a_parked_row_without_next_retry_or_error_shows_neither() -> None:
    line = parked_line(_parked())
    assert "next retry" not in line
    assert not line.endswith(":")
    assert line.startswith("#7 USER_SYNC DONE, 1 retries")


def test_a_parked_row_with_next_retry_and_error_shows_both() -> None:
    line = parked_line(_parked(status="FAILED", next_retry_at=NOW, last_error="HTTP 422"))
    assert f"next retry {NOW}: HTTP 422" in line


def test_the_parking_table_heading_names_the_statuses_listed() -> None:
    assert "0 done sync event(s)" in _render(parked_table([], statuses=("DONE",)))
    assert "0 failed or pending sync event(s)" in _render(
        parked_table([], statuses=("FAILED", "PENDING"))
    )


def test_the_parking_table_says_the_time_zone_of_its_times() -> None:
    row = ParkedEvent(
        event_id=7,
        event_type="USER_SYNC",
        payload_json="{}",
        status="FAILED",
        retry_count=1,
        last_error="HTTP 422",
        next_retry_at=datetime(2026, 12, 1, 7, 30, tzinfo=timezone(timedelta(hours=1))),
        created_at=NOW,
        updated_at=NOW,
        outbox_event_id=None,
        kafka_topic="t",
        kafka_partition=0,
        kafka_offset=1,
        kafka_key=None,
        kafka_headers={},
    )

    text = _render(parked_table([row], statuses=("FAILED",)), width=160)

    assert "next retry (UTC)" in text
    assert "2026-12-01 06:30:00Z" in text


def _lot_row(event_id: int, sync_type: str, record_type: str, error: str) -> ParkedEvent:
    return ParkedEvent(
        event_id=event_id,
        event_type=sync_type,
        payload_json="{}",
        status="FAILED",
        retry_count=0,
        last_error=error,
        next_retry_at=NOW,
        created_at=NOW,
        updated_at=NOW,
        outbox_event_id="7b0c2b1e-5f0e-4a59-9e43-7f1c2a3d4e5f",
        kafka_topic="outbox.event.order",
        kafka_partition=0,
        kafka_offset=1,
        kafka_key=None,
        kafka_headers={"type": record_type},
        routes_fingerprint="fp",
    )


def test_the_parking_table_keeps_id_status_retries_and_reason_in_80_columns() -> None:
    rows = [
        _lot_row(12, "UNROUTABLE", "OrderPlaced", "no route for event type 'OrderPlaced'"),
        _lot_row(1234, "QUIZ_SYNC", "QuizAttemptSubmitted", "HTTP 422 invalid score"),
    ]
    text = _render(parked_table(rows, statuses=("FAILED", "PENDING"), scheduled=lambda i: i != 12))
    assert max(len(line) for line in text.splitlines()) <= 80
    header = "".join(text.splitlines()[1:5])
    for column in ("id", "type", "status", "retries", "next retry", "event id", "reason"):
        assert column in header, text
    first, second = (
        next(line for line in text.splitlines() if line.startswith(f"│ {n:>4} │"))
        for n in (12, 1234)
    )
    assert " FAILED " in first and " 0 " in first and " no route " in first
    assert " - " in first  # the scheduler leaves it alone: no next retry shown
    assert "2026-12-01" in second and " HTTP 422 " in second


def test_a_row_is_scheduled_only_when_the_scheduler_would_take_it() -> None:
    from dataclasses import replace

    from sinks.ops.parking import retry_scheduled

    unroutable = _lot_row(1, "UNROUTABLE", "OrderPlaced", "no route")
    quiz = _lot_row(2, "QUIZ_SYNC", "QuizAttemptSubmitted", "HTTP 422")
    assert not retry_scheduled(unroutable, fingerprint="fp", max_attempts=5)
    assert retry_scheduled(unroutable, fingerprint="routes-changed", max_attempts=5)
    assert retry_scheduled(quiz, fingerprint="fp", max_attempts=5)
    assert not retry_scheduled(replace(quiz, retry_count=5), fingerprint="fp", max_attempts=5)
    assert not retry_scheduled(replace(quiz, status="DONE"), fingerprint="fp", max_attempts=5)


def test_the_json_row_names_its_fields_for_what_they_hold_and_keeps_the_old_ones() -> None:
    from sinks.ops.parking import parked_json

    doc = parked_json(_lot_row(12, "UNROUTABLE", "OrderPlaced", "no route"), scheduled=False)
    assert (doc["id"], doc["sync_type"], doc["type"], doc["retry_scheduled"]) == (
        12,
        "UNROUTABLE",
        "OrderPlaced",
        False,
    )
    assert (doc["event_id"], doc["event_type"]) == (12, "UNROUTABLE")  # as before
    assert doc["outbox_event_id"] == "7b0c2b1e-5f0e-4a59-9e43-7f1c2a3d4e5f"
