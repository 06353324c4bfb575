"""RepeatLog and BoundedLabels: what a flood of distinct event types may cost (issue 35).

Pure: a fake clock, a list handler. Each test names the edge it covers.
"""

from __future__ import annotations

import logging
import re
import tracemalloc

import pytest

from sinks.shared.logs import MAX_KINDS, NEW_KINDS_PER_PERIOD, BoundedLabels, RepeatLog


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def lines() -> _Lines:
    logger = logging.getLogger("test.repeatlog")
    logger.handlers[:] = []
    handler = _Lines()
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    return handler


def _log(clock: _Clock, **kwargs: object) -> RepeatLog:
    return RepeatLog(logging.getLogger("test.repeatlog"), "parked", clock=clock, **kwargs)  # type: ignore[arg-type]


def _counted(lines: list[str]) -> int:
    """Events the lines account for: one per full line, N per summary line."""
    total = 0
    for line in lines:
        summary = re.match(r"parked (\d+) (?:more )?events of", line)
        total += int(summary.group(1)) if summary else 1
    return total


def test_one_kind_is_written_once_then_summed_up_once_per_period(lines: _Lines) -> None:
    clock = _Clock()
    repeat = _log(clock)
    for _ in range(300_000):
        repeat.event("UserEmailChanged", "event of type %r parked", "UserEmailChanged")
    clock.now = 61.0
    repeat.tick()
    assert lines.lines == [
        "event of type 'UserEmailChanged' parked",
        "parked 299999 more events of type 'UserEmailChanged' in the last 61 s",
    ]
    repeat.tick()
    assert len(lines.lines) == 2, "nothing more to sum up"


def test_a_hundred_thousand_distinct_kinds_keep_the_lines_and_the_memory_bounded(
    lines: _Lines,
) -> None:
    """Edge: every event of a new kind - the kinds kept stay at most MAX_KINDS, the lines of
    a period at most NEW_KINDS_PER_PERIOD named + one "other types" line, and the counts
    in the lines add up to every event."""
    clock = _Clock()
    repeat = _log(clock)
    tracemalloc.start()
    try:
        for i in range(100_000):
            repeat.event(f"Type{i}", "event of type %r parked", f"Type{i}")
            if i == 10_000:
                early, _ = tracemalloc.get_traced_memory()
            clock.now += 0.0003  # 30 s in all: one period
        late, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert repeat.kinds <= MAX_KINDS
    assert late - early < 64 * 1024, f"{late - early} bytes more after 90,000 more kinds"
    repeat.flush()
    assert len(lines.lines) == NEW_KINDS_PER_PERIOD + 1
    assert lines.lines[-1].startswith(f"parked {100_000 - NEW_KINDS_PER_PERIOD} events of other")
    assert _counted(lines.lines) == 100_000


def test_each_period_names_new_kinds_again_within_its_budget(lines: _Lines) -> None:
    """Edge: a flood over many periods - at most NEW_KINDS_PER_PERIOD + MAX_KINDS + 1 lines per
    period whatever comes; kinds forgotten by the LRU are counted, not lost."""
    clock = _Clock()
    repeat = _log(clock)
    per_period: list[int] = []
    kind = 0
    for _ in range(5):
        before = len(lines.lines)
        for _ in range(20_000):
            repeat.event(f"Type{kind % 5_000}", "event of type %r parked", kind)
            kind += 1
        clock.now += 60.0
        repeat.tick()
        per_period.append(len(lines.lines) - before)
    assert max(per_period) <= NEW_KINDS_PER_PERIOD + MAX_KINDS + 1, per_period
    assert repeat.kinds <= MAX_KINDS
    assert _counted(lines.lines) == 100_000


def test_a_kind_forgotten_by_the_lru_has_its_repeats_counted_as_other_types(
    lines: _Lines,
) -> None:
    clock = _Clock()
    repeat = _log(clock, max_kinds=2, new_per_period=10)
    for kind in ("a", "a", "a", "b", "c"):  # "c" pushes "a" (2 repeats unwritten) out
        repeat.event(kind, "first %s", kind)
    repeat.flush()
    assert lines.lines == [
        "first a",
        "first b",
        "first c",
        "parked 2 events of other types in the last 0 s (more types than are named in the"
        " log; the metrics count each one)",
    ]


def test_deliberate_events_name_each_kind_once_and_sum_up_only_the_unnamed(
    lines: _Lines,
) -> None:
    """Edge: skipped (SINK_IGNORED_TYPES) types - logged once each, repeats not summed up;
    a flood of distinct skipped types still ends in one "other types" line per period."""
    clock = _Clock()
    repeat = _log(clock, summarize_kinds=False, new_per_period=3)
    for i in range(1_000):
        repeat.event(f"Legacy{i % 10}", "skipping %s", f"Legacy{i % 10}")
    clock.now = 60.0
    repeat.tick()
    assert lines.lines[:3] == ["skipping Legacy0", "skipping Legacy1", "skipping Legacy2"]
    assert len(lines.lines) == 4
    assert lines.lines[3].startswith("parked 700 events of other types")


def test_bounded_labels_name_the_first_values_and_count_the_rest_as_other() -> None:
    labels = BoundedLabels(2)
    assert [labels.label(v) for v in ("a", "b", "c", "a", "d")] == ["a", "b", "other", "a", "other"]
