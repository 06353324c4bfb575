"""The pure parts of ``outbox-cdc trace``: partitions, scan windows, positions, verdicts."""

from __future__ import annotations

import zlib
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sinks.trace.model import (
    EventState,
    FoundRecord,
    GroupPosition,
    OutboxRow,
    ParkedRow,
    SearchBounds,
    crc32_partition,
    event_state,
    group_view,
    likely_partitions,
    murmur2,
    murmur2_partition,
    scan_window,
    search_order,
)

NOW = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)


# Kafka's own test vectors (clients UtilsTest.testMurmur2), as Java's signed ints.
@pytest.mark.parametrize(
    ("data", "java_int"),
    [
        (b"21", -973932308),
        (b"foobar", -790332482),
        (b"a-little-bit-long-string", -985981536),
        (b"a-little-bit-longer-string", -1486304829),
        (b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
        (b"abc", 479470107),
    ],
)
def test_murmur2_matches_kafkas_vectors(data: bytes, java_int: int) -> None:
    assert murmur2(data) == java_int & 0xFFFFFFFF


@given(st.binary(max_size=64), st.integers(min_value=1, max_value=64))
def test_partitions_are_in_range_and_likely_ones_cover_both_partitioners(
    key: bytes, count: int
) -> None:
    likely = likely_partitions(key, count)
    assert murmur2_partition(key, count) == likely[0]
    assert crc32_partition(key, count) in likely
    assert crc32_partition(key, count) == zlib.crc32(key) % count
    assert all(0 <= p < count for p in likely)
    assert len(set(likely)) == len(likely) <= 2


def test_search_order_reads_the_keys_partitions_first_and_every_partition_once() -> None:
    tps = [("a", p) for p in range(6)] + [("b", p) for p in range(3)]
    first, rest = search_order(tps, {"a": 6, "b": 3}, b"user-1")
    assert sorted(first + rest) == sorted(tps)
    assert not set(first) & set(rest)
    assert ("a", murmur2_partition(b"user-1", 6)) in first
    assert ("b", crc32_partition(b"user-1", 3)) in first
    assert search_order(tps, {"a": 6, "b": 3}, None) == ([], sorted(tps))


def test_scan_window_is_bounded_and_says_when_it_stopped_early() -> None:
    assert scan_window(100, low=0, high=150, max_records=1000) == (100, 150, False)
    assert scan_window(100, low=0, high=5000, max_records=1000) == (100, 1100, True)
    assert scan_window(None, low=0, high=5000, max_records=1000) == (5000, 5000, False)
    assert scan_window(3, low=10, high=20, max_records=5) == (10, 15, True)  # deleted records


def test_group_position_relative_to_the_record() -> None:
    assert group_view("g", 8, 7).position is GroupPosition.CONSUMED
    pending = group_view("g", 3, 7)
    assert (pending.position, pending.records_before) == (GroupPosition.PENDING, 4)
    assert group_view("g", 7, 7).position is GroupPosition.PENDING  # 7 is next to read
    none = group_view("g", None, 7)
    assert (none.position, none.records_before) == (GroupPosition.NO_COMMIT, None)


def _row() -> OutboxRow:
    return OutboxRow(
        event_id="e",
        aggregate_type="user",
        aggregate_id="u",
        event_type="UserRegistered",
        created_at=NOW,
        traceparent=None,
    )


def _record(topic: str = "outbox.event.user") -> FoundRecord:
    return FoundRecord(
        topic=topic,
        partition=0,
        offset=5,
        timestamp_ms=1,
        key="u",
        headers={"id": "e"},
        value_size=2,
        value_preview="{}",
    )


def _parked(status: str) -> ParkedRow:
    return ParkedRow(
        id=1,
        sync_type="USER_SYNC",
        status=status,
        retry_count=0,
        last_error="HTTP 400",
        next_retry_at=None,
        created_at=NOW,
        updated_at=NOW,
        kafka_topic="outbox.event.user",
        kafka_partition=0,
        kafka_offset=5,
    )


@pytest.mark.parametrize(
    ("found", "expected"),
    [
        ({"outbox": _row()}, EventState.NOT_RELAYED),
        ({"outbox": _row(), "record": _record()}, EventState.PENDING),
        (
            {"record": _record(), "sink_position": GroupPosition.NO_COMMIT},
            EventState.PENDING,
        ),
        ({"record": _record(), "sink_position": GroupPosition.CONSUMED}, EventState.DELIVERED),
        (
            {
                "record": _record(),
                "sink_position": GroupPosition.CONSUMED,
                "parked": _parked("FAILED"),
            },
            EventState.PARKED,
        ),
        ({"record": _record(), "parked": _parked("PENDING")}, EventState.PARKED),
        ({"record": _record(), "parked": _parked("DONE")}, EventState.DELIVERED_ON_RETRY),
        ({"outbox": _row(), "dead_letter": _record("outbox.dlq")}, EventState.DEAD_LETTERED),
        ({}, None),
    ],
)
def test_event_state_from_what_was_found(found: dict[str, object], expected: object) -> None:
    args: dict[str, object] = {
        "outbox": None,
        "record": None,
        "dead_letter": None,
        "parked": None,
        "sink_position": None,
    }
    args.update(found)
    assert event_state(**args) is expected  # type: ignore[arg-type]


def test_not_found_advice_names_the_bound_to_widen() -> None:
    base = {"since_ms": 0, "max_records": 10, "topics": ("t",)}
    truncated = SearchBounds(since_source="outbox row", truncated=("t[0]",), **base)  # type: ignore[arg-type]
    assert "--max-records" in truncated.advice() and "--since" not in truncated.advice()
    lookback = SearchBounds(since_source="default lookback", **base)  # type: ignore[arg-type]
    assert "--since" in lookback.advice() and "--max-records" not in lookback.advice()
    both = SearchBounds(since_source="--since", truncated=("t[1]",), **base)  # type: ignore[arg-type]
    assert "--since" in both.advice() and "--max-records" in both.advice()


def test_a_dead_letters_empty_original_topic_is_said_so_not_printed_bare() -> None:
    """Edge: a dead letter of a row no valid topic could be made of carries an empty
    ``dlq.original.topic`` (the record contract): `trace` names the absence instead of
    printing ``dlq.original.topic=``; a present topic and other headers print as they are."""
    from sinks.cli.render import NO_ORIGINAL_TOPIC, header_text

    empty = header_text({"id": "e-1", "dlq.reason": "bad topic", "dlq.original.topic": ""})
    assert empty == f"id=e-1, dlq.reason=bad topic, dlq.original.topic={NO_ORIGINAL_TOPIC}"
    assert "dlq.original.topic=," not in empty + ","
    given_topic = header_text({"dlq.original.topic": "outbox.event.user", "type": ""})
    assert given_topic == "dlq.original.topic=outbox.event.user, type="
