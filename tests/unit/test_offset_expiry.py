"""The sink's answer to an offset out of range (pure): where it goes on, and what it skipped."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sinks.kafka.offset_expiry import (
    OFFSET_BEGINNING,
    OFFSET_END,
    Cause,
    Policy,
    decide,
    incremental,
)


@pytest.mark.parametrize(
    ("spelling", "policy"),
    [
        ("earliest", Policy.EARLIEST),
        ("smallest", Policy.EARLIEST),
        ("beginning", Policy.EARLIEST),
        ("latest", Policy.LATEST),
        ("LARGEST", Policy.LATEST),
        ("end", Policy.LATEST),
        ("error", Policy.ERROR),
    ],
)
def test_the_policy_reads_every_librdkafka_spelling(spelling: str, policy: Policy) -> None:
    assert Policy.parse(spelling) is policy


def test_a_partition_never_committed_starts_where_the_policy_says_and_skips_nothing() -> None:
    assert decide(None, low=30, high=100, policy=Policy.EARLIEST).start == OFFSET_BEGINNING
    assert decide(None, low=30, high=100, policy=Policy.LATEST).start == OFFSET_END
    stopped = decide(None, low=30, high=100, policy=Policy.ERROR)
    assert stopped.start is None and stopped.cause is Cause.NO_COMMIT
    assert decide(-1001, low=30, high=100, policy=Policy.EARLIEST).skipped is None


def test_records_removed_before_the_group_read_them_are_named_and_skipped_to_the_log_start() -> (
    None
):
    got = decide(10, low=30, high=100, policy=Policy.EARLIEST)
    assert got.cause is Cause.EXPIRED
    assert got.start == 30
    assert got.skipped == (10, 30)
    assert got.skipped_count == 20


def test_under_latest_the_skipped_range_reaches_the_end() -> None:
    got = decide(10, low=30, high=100, policy=Policy.LATEST)
    assert (got.start, got.skipped, got.skipped_count) == (100, (10, 100), 90)


def test_policy_error_stays_stopped_but_still_names_what_was_removed() -> None:
    got = decide(10, low=30, high=100, policy=Policy.ERROR)
    assert got.start is None and got.skipped == (10, 30)


def test_past_the_end_goes_back_to_the_log_start_skipping_nothing() -> None:
    got = decide(700, low=30, high=100, policy=Policy.EARLIEST)
    assert (got.cause, got.start, got.skipped) == (Cause.PAST_END, 30, None)


def test_an_offset_in_range_again_is_fetched_again() -> None:
    got = decide(50, low=30, high=100, policy=Policy.EARLIEST)
    assert (got.cause, got.start, got.skipped) == (Cause.IN_RANGE, 50, None)


@given(
    failed=st.integers(-1001, 200),
    low=st.integers(0, 120),
    width=st.integers(0, 80),
    policy=st.sampled_from(list(Policy)),
)
def test_nothing_the_group_had_is_skipped_without_being_counted(
    failed: int, low: int, width: int, policy: Policy
) -> None:
    """Every offset the group had not processed and the new start passes over is counted."""
    high = low + width
    got = decide(failed, low=low, high=high, policy=policy)
    if got.start is None or failed < 0 or got.start < 0:
        return
    passed_over = max(0, got.start - failed)
    assert got.skipped_count == passed_over
    assert got.start <= max(high, failed)


def test_the_assignment_is_incremental_with_a_cooperative_assignor_only() -> None:
    assert incremental({"partition.assignment.strategy": "cooperative-sticky"})
    assert incremental({"group.protocol": "consumer"})
    assert not incremental({})
    assert not incremental({"partition.assignment.strategy": "range,roundrobin"})
