"""Replay plans (pure): where a replay moves each partition's committed offset, and why.

Guarantees:

* Targets are Kafka's (``kafka-consumer-groups --reset-offsets``), clamped to
  each partition's ``[low, high]`` watermarks: a shift is the committed offset
  plus N, then clamped, also when the committed offset is itself out of range;
  a time target (``--to-datetime`` / ``--by-duration``) is the first record
  whose timestamp - the commit time, by the record contract - is at or after
  the time, or the partition's end when there is none.
* A replay never skips what the group has not processed unless the operator
  says so: partitions the group never committed are left alone by
  ``--all-topics`` and ``--topic T`` (moved only when named, ``T:p``, or with
  ``include_uncommitted``), and a shift of a partition without a committed
  offset is refused unless ``from_earliest_if_uncommitted`` says to shift from
  the low watermark.
* A group with members, or in any state but EMPTY/DEAD, is active: a plan for
  it is shown but never applied.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime

from sinks.ops.errors import OpsUsageError
from sinks.ops.offsets import (
    CommitRange,
    OffsetReset,
    clamp_offset,
    commit_range,
    counting_position,
    out_of_range_warning,
    resume_offset,
)
from sinks.ops.selection import parse_datetime_ms, parse_iso_duration_s

#: Group states in which nothing consumes, so offsets may be changed.
_IDLE_GROUP_STATES = frozenset({"EMPTY", "DEAD"})


class ReplayKind(enum.Enum):
    """Where a replay moves each partition's committed offset."""

    EARLIEST = "to-earliest"  # the low watermark: everything still in Kafka again
    LATEST = "to-latest"  # the end: skip everything not yet processed
    DATETIME = "to-datetime"  # first record committed at or after a time
    DURATION = "by-duration"  # first record committed at or after now minus a duration
    SHIFT = "shift-by"  # the committed offset plus N (negative: back), as Kafka
    OFFSET = "to-offset"  # an absolute offset


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplaySpec:
    """The operator's target. ``value``: ms since epoch (DATETIME), ms (DURATION),
    a delta (SHIFT), an offset (OFFSET); unused otherwise.
    ``from_earliest_if_uncommitted``: a SHIFT may start from the low watermark of a
    partition the group never committed (otherwise such a shift is refused)."""

    kind: ReplayKind
    value: int = 0
    from_earliest_if_uncommitted: bool = False

    @classmethod
    def from_option(
        cls, kind: ReplayKind, raw: str | None = None, *, from_earliest_if_uncommitted: bool = False
    ) -> ReplaySpec:
        """The spec of one CLI option and its text (``PT15M``, ``-100``, an ISO time)."""
        if from_earliest_if_uncommitted and kind is not ReplayKind.SHIFT:
            raise OpsUsageError("--from-earliest-if-uncommitted goes with --shift-by only")
        if kind in (ReplayKind.EARLIEST, ReplayKind.LATEST):
            return cls(kind=kind)
        text = (raw or "").strip()
        if kind is ReplayKind.DATETIME:
            return cls(kind=kind, value=parse_datetime_ms(text))
        if kind is ReplayKind.DURATION:
            return cls(kind=kind, value=round(parse_iso_duration_s(text) * 1000))
        try:
            number = int(text)
        except ValueError as exc:
            raise OpsUsageError(f"--{kind.value} {text!r}: not an integer") from exc
        if kind is ReplayKind.OFFSET and number < 0:
            raise OpsUsageError(f"--to-offset {number}: offsets are not negative")
        return cls(
            kind=kind, value=number, from_earliest_if_uncommitted=from_earliest_if_uncommitted
        )

    def timestamp_ms(self, *, now_ms: int) -> int | None:
        """The time a DATETIME/DURATION target resolves to; ``None`` for the others."""
        if self.kind is ReplayKind.DATETIME:
            return self.value
        if self.kind is ReplayKind.DURATION:
            return now_ms - self.value
        return None

    def describe(self) -> str:
        if self.kind in (ReplayKind.EARLIEST, ReplayKind.LATEST):
            return f"--{self.kind.value}"
        if self.kind is ReplayKind.DATETIME:
            return f"--to-datetime {_iso_ms(self.value)}"
        if self.kind is ReplayKind.DURATION:
            return f"--by-duration PT{self.value / 1000:g}S"
        if self.kind is ReplayKind.SHIFT:
            extra = " --from-earliest-if-uncommitted" if self.from_earliest_if_uncommitted else ""
            return f"--shift-by {self.value:+d}{extra}"
        return f"--to-offset {self.value}"


def _iso_ms(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000).astimezone().isoformat(timespec="milliseconds")


def replay_target(
    spec: ReplaySpec, *, current: int | None, low: int, high: int, time_offset: int | None
) -> int:
    """The offset a partition moves to, inside ``[low, high]``, as Kafka's
    ``kafka-consumer-groups --reset-offsets`` computes it.

    A shift is the committed offset plus N, then clamped - also when the committed
    offset is itself out of range (700 with end 200, shift -50 -> 200); ``current=None``
    shifts from ``low`` (only asked for with ``--from-earliest-if-uncommitted``).
    ``time_offset`` is ``offsets_for_times``' answer for time targets: the first
    offset at or after the time, or ``None``/negative when no record is that recent
    (then the partition goes to its end).
    """
    kind = spec.kind
    if kind is ReplayKind.EARLIEST:
        return low
    if kind is ReplayKind.LATEST:
        return high
    if kind is ReplayKind.OFFSET:
        return clamp_offset(spec.value, low=low, high=high)
    if kind is ReplayKind.SHIFT:
        base = low if current is None else current
        return clamp_offset(base + spec.value, low=low, high=high)
    if time_offset is None or time_offset < 0:
        return high
    return clamp_offset(time_offset, low=low, high=high)


class PartitionAction(enum.Enum):
    """What a replay does to one partition of the group."""

    MOVE = "move"  # commit target_offset
    UNTOUCHED = "untouched"  # never committed, not named by partition: left alone
    REFUSED = "refused"  # a shift with no committed offset to shift from


def partition_action(
    spec: ReplaySpec, *, current: int | None, named: bool, include_uncommitted: bool
) -> PartitionAction:
    """The rules that keep a replay from skipping what the group never processed.

    A partition the group never committed is left alone unless the operator named it
    (``--topic T:p``) or passed ``--include-uncommitted``; a shift of such a partition
    is refused unless ``--from-earliest-if-uncommitted`` says where to shift from.
    """
    if current is not None:
        return PartitionAction.MOVE
    if not (named or include_uncommitted):
        return PartitionAction.UNTOUCHED
    if spec.kind is ReplayKind.SHIFT and not spec.from_earliest_if_uncommitted:
        return PartitionAction.REFUSED
    return PartitionAction.MOVE


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionPlan:
    """One partition of a replay: where the group is, where it resumes, where it would go."""

    topic: str
    partition: int
    low_offset: int
    high_offset: int
    current_offset: int | None  # the committed offset; None: never committed
    action: PartitionAction
    target_offset: int | None  # None unless the action is MOVE
    reset: OffsetReset  # the sink's auto.offset.reset, which decides the resume point
    shifted_from_earliest: bool = False  # a SHIFT of an uncommitted partition from low

    @property
    def resume_offset(self) -> int | None:
        """Where the sink's consumer resumes today (None: it stops with an error)."""
        return resume_offset(
            self.current_offset, low=self.low_offset, high=self.high_offset, reset=self.reset
        )

    @property
    def start_offset(self) -> int:
        """The position today that the counts are measured from."""
        return counting_position(
            self.current_offset, low=self.low_offset, high=self.high_offset, reset=self.reset
        )

    @property
    def redeliver_count(self) -> int:
        """Records below where the group resumes today that it will process again."""
        if self.target_offset is None:
            return 0
        return max(0, self.start_offset - self.target_offset)

    @property
    def skip_count(self) -> int:
        """Records at or after where the group resumes today that it will never process."""
        if self.target_offset is None:
            return 0
        return max(0, self.target_offset - self.start_offset)

    @property
    def changes(self) -> bool:
        return self.target_offset is not None and self.current_offset != self.target_offset

    @property
    def commit_range(self) -> CommitRange:
        return commit_range(self.current_offset, low=self.low_offset, high=self.high_offset)

    @property
    def warning(self) -> str | None:
        """Why the committed offset is out of range and what the sink does today."""
        return out_of_range_warning(
            self.topic,
            self.partition,
            self.current_offset,
            low=self.low_offset,
            high=self.high_offset,
            reset=self.reset,
        )

    @property
    def note(self) -> str:
        """What the table says beside the numbers."""
        if self.action is PartitionAction.UNTOUCHED:
            return "not committed — untouched"
        if self.action is PartitionAction.REFUSED:
            return "not committed — shift refused"
        if self.shifted_from_earliest:
            return f"not committed — shifted from the low watermark {self.low_offset}"
        if self.commit_range in (CommitRange.BELOW_LOW, CommitRange.PAST_END):
            return "committed offset out of range"
        return ""

    def as_json(self) -> dict[str, object]:
        return {
            "topic": self.topic,
            "partition": self.partition,
            "low_offset": self.low_offset,
            "high_offset": self.high_offset,
            "current_offset": self.current_offset,
            "commit_range": self.commit_range.value,
            "resume_offset": self.resume_offset,
            "action": self.action.value,
            "target_offset": self.target_offset,
            "redeliver_count": self.redeliver_count,
            "skip_count": self.skip_count,
            "note": self.note,
            "warning": self.warning,
        }


def plan_partition(
    spec: ReplaySpec,
    *,
    topic: str,
    partition: int,
    current: int | None,
    low: int,
    high: int,
    reset: OffsetReset,
    time_offset: int | None = None,
    named: bool = False,
    include_uncommitted: bool = False,
) -> PartitionPlan:
    """The plan of one partition (pure); ``named``: the operator listed this partition."""
    action = partition_action(
        spec, current=current, named=named, include_uncommitted=include_uncommitted
    )
    target = None
    if action is PartitionAction.MOVE:
        target = replay_target(spec, current=current, low=low, high=high, time_offset=time_offset)
    return PartitionPlan(
        topic=topic,
        partition=partition,
        low_offset=low,
        high_offset=high,
        current_offset=current,
        action=action,
        target_offset=target,
        reset=reset,
        shifted_from_earliest=(
            action is PartitionAction.MOVE and current is None and spec.kind is ReplayKind.SHIFT
        ),
    )


@dataclass(frozen=True, kw_only=True)
class ReplayPlan:
    """A whole replay: per partition current -> target, and the group's state when planned."""

    group: str
    spec: ReplaySpec
    at_ms: int | None  # the resolved time of a time target
    partitions: tuple[PartitionPlan, ...]
    group_state: str
    active_members: int
    reset: OffsetReset = OffsetReset.EARLIEST
    include_uncommitted: bool = False

    @property
    def active(self) -> bool:
        """Members are consuming: :func:`apply_replay` would refuse."""
        return group_is_active(self.group_state, self.active_members)

    def with_action(self, action: PartitionAction) -> tuple[PartitionPlan, ...]:
        """The partitions the plan treats this way."""
        return tuple(p for p in self.partitions if p.action is action)

    @property
    def refusal(self) -> str | None:
        """Why :func:`apply_replay` refuses this plan whatever the group's state, or None."""
        refused = self.with_action(PartitionAction.REFUSED)
        if not refused:
            return None
        names = ", ".join(f"{p.topic}[{p.partition}]" for p in refused)
        return (
            f"cannot shift {names}: the group has no committed offset there to shift from"
            " (Kafka refuses the same); add --from-earliest-if-uncommitted to shift from"
            " the low watermark, or pick a target that needs no committed offset"
        )

    @property
    def redeliver_count(self) -> int:
        return sum(p.redeliver_count for p in self.partitions)

    @property
    def skip_count(self) -> int:
        return sum(p.skip_count for p in self.partitions)

    @property
    def warnings(self) -> tuple[str, ...]:
        """One line per partition whose committed offset is out of range."""
        return tuple(p.warning for p in self.partitions if p.warning is not None)

    def as_json(self) -> dict[str, object]:
        return {
            "group": self.group,
            "target": self.spec.describe(),
            "at": _iso_ms(self.at_ms) if self.at_ms is not None else None,
            "group_state": self.group_state,
            "active_members": self.active_members,
            "auto_offset_reset": self.reset.value,
            "include_uncommitted": self.include_uncommitted,
            "refused": self.refusal is not None,
            "refusal": self.refusal,
            "redeliver_count": self.redeliver_count,
            "skip_count": self.skip_count,
            "untouched_count": len(self.with_action(PartitionAction.UNTOUCHED)),
            "partitions": [p.as_json() for p in self.partitions],
            "warnings": list(self.warnings),
        }


def group_is_active(state: str, members: int) -> bool:
    """A group with members, or in any state but EMPTY/DEAD, is consuming."""
    return members > 0 or state.upper() not in _IDLE_GROUP_STATES
