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
