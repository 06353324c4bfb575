"""cdc.backoff.Backoff: growing delays, never below the minimum, reset by success or calm."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdc.backoff import Backoff


def test_delays_double_from_the_minimum_up_to_the_maximum() -> None:
    backoff = Backoff(min_s=1.0, max_s=8.0)
    assert [backoff.failed(0.0) for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert backoff.failures == 6


def test_reset_starts_again_from_the_minimum() -> None:
    backoff = Backoff(min_s=0.5, max_s=30.0)
    backoff.failed(0.0)
    backoff.failed(1.0)
    backoff.reset()
    assert backoff.failed(2.0) == 0.5


def test_an_attempt_that_ran_the_calm_period_starts_again_from_the_minimum() -> None:
    backoff = Backoff(min_s=1.0, max_s=60.0, calm_s=300.0)
    assert backoff.failed(0.0) == 1.0  # next attempt starts at 1.0
    assert backoff.failed(100.0) == 2.0  # it ran 99 s: still a loop
    assert backoff.failed(102.0 + 300.0) == 1.0  # it ran 300 s: calm


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="min_s"):
        Backoff(min_s=0.0, max_s=1.0)
    with pytest.raises(ValueError, match="min_s"):
        Backoff(min_s=2.0, max_s=1.0)
    with pytest.raises(ValueError, match="calm_s"):
        Backoff(min_s=1.0, max_s=2.0, calm_s=0.0)


@given(
    gaps=st.lists(st.floats(min_value=0.0, max_value=1000.0), max_size=200),
    resets=st.lists(st.booleans(), max_size=200),
)
def test_attempts_are_never_closer_than_the_minimum_nor_waits_longer_than_the_maximum(
    gaps: list[float], resets: list[bool]
) -> None:
    """However failures and successes interleave (a crash loop included), every
    delay lies in [min_s, max_s]: no two attempts closer than min_s."""
    backoff = Backoff(min_s=1.0, max_s=60.0, calm_s=300.0)
    now = 0.0
    for gap, reset in zip(gaps, resets + [False] * len(gaps), strict=False):
        if reset:
            backoff.reset()
        delay = backoff.failed(now)
        assert 1.0 <= delay <= 60.0
        now += delay + gap
