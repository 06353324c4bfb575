"""The console's lag history (sinks.console.history.LagHistory) against a reference model.

Reads arrive with times that go forward (or repeat), for partitions that come and go,
some with an unknown lag. The model keeps every sample ever recorded. After every step:

* memory is bounded: at most ``max_series`` partitions, at most ``max_points`` samples
  each (the sparkline's bound whatever the run's length);
* every sample shown was recorded, for that partition, with that lag: nothing made up,
  an unknown lag never shown as a number;
* a partition's samples are in time order, one per time, none older than
  ``history_ms`` before the newest read;
* the newest sample of a partition kept is one recorded at its newest time (nothing recent
  is lost while its series is kept; a series forgotten and made again within one
  millisecond starts from the lag recorded then).

Mutants at the bottom - no expiry, no bound on partitions, unknown lags kept as 0 - show
the model catches each.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from sinks.console.history import LagHistory

MAX_POINTS = 4
MAX_SERIES = 3
HISTORY_MS = 10_000
PARTITIONS = [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("c", 0)]
MODEL_SETTINGS = settings(
    max_examples=200, stateful_step_count=40, suppress_health_check=[HealthCheck.too_slow]
)


@dataclass
class Reference:
    """Every recorded (time, lag) per partition, and the newest read's time."""

    samples: dict[tuple[str, int], list[tuple[int, int]]] = field(default_factory=dict)
    now_ms: int = 0


class HistoryModel(RuleBasedStateMachine):
    make = LagHistory

    def __init__(self) -> None:
        super().__init__()
        self.history = self.make(
            max_points=MAX_POINTS, max_series=MAX_SERIES, history_ms=HISTORY_MS
        )
        self.ref = Reference()

    @rule(
        step_ms=st.integers(min_value=0, max_value=6_000),
        lags=st.lists(
            st.tuples(st.sampled_from(PARTITIONS), st.none() | st.integers(0, 1000)),
            max_size=4,
        ),
    )
    def read(self, step_ms: int, lags: list[tuple[tuple[str, int], int | None]]) -> None:
        self.ref.now_ms += step_ms
        self.history.record(self.ref.now_ms, ((t, p, lag) for (t, p), lag in lags))
        for tp, lag in lags:
            if lag is not None:
                self.ref.samples.setdefault(tp, []).append((self.ref.now_ms, lag))

    def _kept(self) -> Iterable[tuple[tuple[str, int], list[tuple[int, int]]]]:
        for tp in PARTITIONS:
            series = self.history.series(*tp)
            if series:
                yield tp, series

    @invariant()
    def memory_is_bounded(self) -> None:
        kept = list(self._kept())
        assert len(kept) <= MAX_SERIES, f"{len(kept)} partitions kept"
        assert all(len(s) <= MAX_POINTS for _, s in kept), "a series past its bound"

    @invariant()
    def every_sample_shown_was_recorded(self) -> None:
        for tp, series in self._kept():
            recorded = set(self.ref.samples.get(tp, []))
            made_up = [s for s in series if s not in recorded]
            assert not made_up, f"{tp}: samples never recorded {made_up}"

    @invariant()
    def samples_are_ordered_one_per_time_and_recent(self) -> None:
        for tp, series in self._kept():
            times = [at for at, _ in series]
            assert times == sorted(set(times)), f"{tp}: out of order or repeated {times}"
            assert times[0] >= self.ref.now_ms - HISTORY_MS, f"{tp}: a sample past its age"

    @invariant()
    def the_newest_recorded_sample_is_kept(self) -> None:
        """The series ends at the partition's newest recorded time, with a lag recorded
        then: the first one, or - when the series was forgotten (past ``max_series``) and
        made again within the same millisecond - one recorded after it at that time."""
        for tp, series in self._kept():
            newest_time = self.ref.samples[tp][-1][0]
            at_newest = [s for s in self.ref.samples[tp] if s[0] == newest_time]
            assert series[-1] in at_newest, f"{tp}: newest {series[-1]} not in {at_newest}"


TestLagHistoryModel = HistoryModel.TestCase
TestLagHistoryModel.settings = MODEL_SETTINGS


class _NoExpiry(LagHistory):
    def _expire(self, now_ms: int) -> None:
        return


class _Unbounded(LagHistory):
    def _forget_oldest(self) -> None:
        self.max_series += 1


class _UnknownAsZero(LagHistory):
    def record(self, at_ms: int, lags: Iterable[tuple[str, int, int | None]]) -> None:
        super().record(at_ms, ((t, p, 0 if lag is None else lag) for t, p, lag in lags))


@pytest.mark.parametrize(
    ("mutant", "finding"),
    [
        (_NoExpiry, "past its age"),
        (_Unbounded, "partitions kept"),
        (_UnknownAsZero, "never recorded|not"),
    ],
)
def test_the_model_catches_each_mutant(mutant: type[LagHistory], finding: str) -> None:
    machine = type("Mutant", (HistoryModel,), {"make": mutant})
    with pytest.raises(AssertionError, match=finding):
        run_state_machine_as_test(
            machine,
            settings=settings(
                MODEL_SETTINGS,
                max_examples=2000,
                database=None,
                print_blob=False,
                report_multiple_bugs=False,
                derandomize=True,
                phases=[Phase.generate],
            ),
        )
