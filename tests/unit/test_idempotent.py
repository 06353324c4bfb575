"""The idempotent consumer's pure parts: the event id of a record, the attempt book."""

from __future__ import annotations

import pytest

from sinks.core.delivery import Envelope
from sinks.idempotent import (
    RETRY_BACKOFF_CAP_S,
    AttemptBook,
    BadEvent,
    ConsumerOptions,
    ConsumerUsageError,
    FailurePolicy,
    Outcome,
    Stats,
    event_id_of,
)


def _record(headers: dict[str, bytes]) -> Envelope:
    return Envelope(topic="t", partition=0, offset=7, key=b"k", value=b"{}", headers=headers)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"5f7c2a0e-0d7e-4b8e-9c53-3f1f7d0c2a11", "5f7c2a0e-0d7e-4b8e-9c53-3f1f7d0c2a11"),
        (b"5F7C2A0E-0D7E-4B8E-9C53-3F1F7D0C2A11", "5f7c2a0e-0d7e-4b8e-9c53-3f1f7d0c2a11"),
        (b'"5f7c2a0e-0d7e-4b8e-9c53-3f1f7d0c2a11"', "5f7c2a0e-0d7e-4b8e-9c53-3f1f7d0c2a11"),
        (b"{5f7c2a0e-0d7e-4b8e-9c53-3f1f7d0c2a11}", "5f7c2a0e-0d7e-4b8e-9c53-3f1f7d0c2a11"),
        (b"order-42", "order-42"),
        (b" 1234 ", "1234"),
        ("événement-1".encode(), "événement-1"),
        (b'"unterminated', '"unterminated'),  # not a JSON string: the literal id
    ],
)
def test_event_id_comes_from_the_id_header_in_one_canonical_spelling(
    raw: bytes, expected: str
) -> None:
    assert event_id_of(_record({"id": raw, "__debezium.context.taskId": b"0"})) == expected


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ({}, "no id header"),
        ({"id": b""}, "1-200 characters"),
        ({"id": b"   "}, "1-200 characters"),
        ({"id": b"x" * 201}, "1-200 characters"),
        ({"id": b"\xff\xfe"}, "not UTF-8"),
    ],
)
def test_a_record_without_a_usable_id_is_bad_input_with_the_reason(
    headers: dict[str, bytes], reason: str
) -> None:
    with pytest.raises(BadEvent, match=reason):
        event_id_of(_record(headers))


def test_attempt_book_backs_off_doubling_then_gives_up_at_max_attempts() -> None:
    book = AttemptBook(max_attempts=4, backoff_base_s=0.5)
    pos = ("t", 0, 7)
    assert [book.failed(pos) for _ in range(3)] == [0.5, 1.0, 2.0]
    assert book.failed(pos) is None
    assert book.failures(pos) == 4
    book.settle(pos)
    assert book.failures(pos) == 0


def test_attempt_book_caps_the_backoff_and_forgets_revoked_partitions() -> None:
    book = AttemptBook(max_attempts=100, backoff_base_s=10)
    pos = ("t", 1, 3)
    delays = [book.failed(pos) for _ in range(10)]
    assert max(d for d in delays if d is not None) == RETRY_BACKOFF_CAP_S
    other = ("u", 0, 1)
    book.failed(other)
    book.forget_partitions([("t", 1)])
    assert book.failures(pos) == 0
    assert book.failures(other) == 1


def test_options_refuse_what_would_break_the_guarantees() -> None:
    with pytest.raises(ConsumerUsageError, match="name"):
        ConsumerOptions(name="").check()
    with pytest.raises(ConsumerUsageError, match="dead_letter_topic"):
        ConsumerOptions(name="n", on_failure=FailurePolicy.DEAD_LETTER).check()
    with pytest.raises(ConsumerUsageError, match="max_attempts"):
        AttemptBook(max_attempts=0, backoff_base_s=1)


def test_stats_count_each_outcome() -> None:
    stats = Stats()
    for outcome in (Outcome.HANDLED, Outcome.HANDLED, Outcome.DUPLICATE, Outcome.PARKED):
        stats.count(outcome)
    assert (stats.handled, stats.duplicate, stats.parked, stats.retry) == (2, 1, 1, 0)
