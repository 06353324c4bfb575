"""FetchWatch (pure): which partitions are suspects, and when a suspect is restarted."""

from __future__ import annotations

from sinks.kafka.fetch_watch import FetchWatch, Restart

A, B = ("t", 0), ("t", 1)


def test_a_silent_partition_is_a_suspect_once_a_period_restarted_only_with_records_waiting() -> (
    None
):
    watch = FetchWatch(stall_after_s=30)
    watch.assigned([A, B], now=0)
    watch.fetched(A, 41, now=5)
    assert watch.suspects(29) == []
    assert watch.suspects(30) == [(B, 30)]  # A fetched at 5: not yet
    assert watch.suspects(35) == [(A, 30)]
    assert watch.suspects(40) == []  # each checked: the next check a period later
    # idle: the end is the next offset, or one past it (a transaction marker)
    assert watch.judge(A, watch.next_offset(A), 42, 30) is None
    assert watch.judge(A, 42, 43, 30) is None
    assert watch.judge(A, 42, 44, 30) == Restart(A, 42, 44, 30)
    assert watch.judge(B, None, 100, 30) is None  # no evidence of where it should be


def test_paused_stopped_revoked_and_held_back_partitions_are_never_suspects() -> None:
    watch = FetchWatch(stall_after_s=10)
    watch.assigned([A, B], now=0)
    watch.paused((A,))
    watch.stopped(B)
    assert watch.suspects(100) == []
    watch.resumed((A,), now=100)  # silence counts from the resume
    assert watch.suspects(105) == []
    watch.held_back(now=108)  # the thread fetched nothing on purpose
    assert watch.suspects(115) == []
    assert watch.suspects(118) == [(A, 10)]
    watch.revoked([A, B])
    assert len(watch) == 0 and watch.suspects(1_000) == []
    assert watch.judge(A, 1, 100, 10) is None  # not watched any more


def test_a_resume_of_a_partition_not_paused_does_not_reset_its_silence() -> None:
    watch = FetchWatch(stall_after_s=10)
    watch.assigned([A], now=0)
    watch.resumed((A,), now=9)  # (the core resumes every newly assigned partition)
    assert watch.suspects(10) == [(A, 10)]


def test_an_offset_reset_is_where_the_partition_is_expected_never_the_removed_offset() -> None:
    """Issue 47 item 7: after the reset policy restarted a partition at 500 (its offset
    41 removed by retention), a silent partition is judged from 500 - it was sought
    back to 42 every 30 s (out of range: a reset, an ERROR, a count, again)."""
    watch = FetchWatch(stall_after_s=30)
    watch.assigned([A], now=0)
    watch.fetched(A, 41, now=0)
    watch.stopped(A)  # (reset=error stops it; a policy that restarts un-stops it)
    watch.reset(A, 500, now=10)
    assert watch.next_offset(A) == 500
    assert watch.suspects(39) == []
    assert watch.suspects(40) == [(A, 30)]
    assert watch.judge(A, watch.next_offset(A), 501, 30) is None  # idle at the new start
    watch.reset(A, -2, now=50)  # a logical offset (the beginning): the position decides
    assert watch.next_offset(A) is None


def test_an_answer_asked_for_before_the_partition_showed_life_is_stale() -> None:
    """Issue 47 item 6: the broker's answer comes back later, from another thread."""
    watch = FetchWatch(stall_after_s=30)
    watch.assigned([A, B], now=0)
    assert watch.suspects(30) == [(A, 30), (B, 30)]
    watch.fetched(A, 7, now=31)
    assert watch.lively_since(A, 30) and not watch.lively_since(B, 30)
    watch.revoked([B])
    assert watch.lively_since(B, 30)  # not watched any more: nothing to restart
