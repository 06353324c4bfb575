"""Ops over the sink's side of Kafka: group lag, offset replay, redelivery, parking lot.

Guarantees:

* Read-only unless named otherwise. :func:`group_lag`, :func:`plan_replay` and
  :func:`redeliver` never move an offset of any group: they read committed
  offsets with the AdminClient's *listing* call and read records with a
  consumer whose group id is a throwaway (``outbox-cdc-ops-<uuid>``) that only
  ``assign``s partitions - it never joins a group and never commits.
* :func:`apply_replay` is the only writer: it commits exactly the plan's
  targets for the plan's group, and refuses with :class:`GroupActiveError`
  while the group has members (Kafka itself also refuses an offset change of
  a non-empty group; that answer is reported the same way).
* Replay targets are Kafka's (``kafka-consumer-groups --reset-offsets``), clamped
  to each partition's ``[low, high]`` watermarks: a shift is the committed offset
  plus N, then clamped, also when the committed offset is itself out of range; a
  time target (``--to-datetime`` / ``--by-duration``) is the first record whose
  timestamp - the commit time, by the record contract - is at or after the
  time, or the partition's end when there is none.
* A replay never skips what the group has not processed unless the operator says
  so: partitions the group never committed are left alone by ``--all-topics`` and
  ``--topic T`` (moved only when named, ``T:p``, or with ``include_uncommitted``),
  and a shift of a partition without a committed offset is refused unless
  ``from_earliest_if_uncommitted`` says to shift from the low watermark.
* Where a group resumes is where the sink's consumer really starts reading: the
  committed offset when it lies in ``[low, high]``, else (never committed, or
  out of range: below the low watermark or past the end) where the sink's
  ``auto.offset.reset`` sends it - earliest today, so the low watermark, for a
  commit past the end too (librdkafka's behaviour against a real broker). Lag,
  the oldest unprocessed age and a replay's counts are measured from there, and
  an out-of-range commit is reported with a warning naming the likely causes.
* :func:`redeliver` sends each chosen record through
  :func:`sinks.dispatch.deliver` with its own ``id`` header as
  ``Idempotency-Key``, one at a time, in commit order (LSN header, else the
  record timestamp; offset order within a partition is never changed). After
  engine-wide trouble the rest are reported ``not_sent``, never skipped silently.
* Everything computed from offsets alone (lag, clamping, targets, counts,
  rates, ISO-8601 durations, topic selection) is a pure function below.

Kafka failures surface as :class:`KafkaOpsError` with the librdkafka error
chained; usage mistakes as :class:`OpsUsageError`; a refused plan as
:class:`GroupActiveError` or :class:`UncommittedShiftError`.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, TypeVar

import psycopg
from confluent_kafka import (
    Consumer,
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from cdc.constants import HEADER_LSN
from cdc.errors import CdcError
from cdc.kafkalog import KafkaClientEvents
from cdc.ops import SlotStatus, slot_status
from cdc.replproto import str_to_lsn
from cdc.settings import Settings
from sinks.consumer import consumer_config
from sinks.delivery import Envelope
from sinks.dispatch import deliver
from sinks.engine import EngineClient
from sinks.errors import EngineUnavailable, SinkError, Unroutable
from sinks.parking import ParkedEvent, ParkingLot
from sinks.retrier import Retrier, RetrySummary

log = logging.getLogger(__name__)

#: Every AdminClient / metadata / offset request gives up after this: long
#: enough for a broker to elect a leader, short enough for an operator waiting.
KAFKA_REQUEST_TIMEOUT_S = 15.0
#: Reading the first unprocessed record of each lagging partition stops after this.
FIRST_RECORD_TIMEOUT_S = 10.0
#: A redelivery scan gives up when no record arrived for this long before the
#: snapshot end offsets were reached (a broker gone, a partition unreadable).
SCAN_IDLE_TIMEOUT_S = 20.0
#: Records handed back per consume() call while scanning.
SCAN_BATCH = 500
#: Throwaway consumer groups of ops reads; never joined, never committed.
OPS_GROUP_PREFIX = "outbox-cdc-ops-"
#: Group states in which nothing consumes, so offsets may be changed.
_IDLE_GROUP_STATES = frozenset({"EMPTY", "DEAD"})

#: (topic, partition)
TP = tuple[str, int]
_T = TypeVar("_T")
#: progress(phase, done, total): phases ``scan`` and ``deliver``; total may be None.
ProgressFn = Callable[[str, int, int | None], None]


class OpsError(SinkError):
    """Root of the ops errors (a :class:`SinkError`, so one ``except`` catches the package)."""

    retriable = False
    spends_attempt = False


class OpsUsageError(OpsError):
    """The operator asked for something that does not make sense (bad topic, bad duration)."""


class GroupActiveError(OpsError):
    """The group has active members: its offsets cannot be changed under it."""

    def __init__(self, group: str, *, state: str, members: int) -> None:
        super().__init__(
            f"consumer group {group} is active ({state}, {members} member(s)): "
            "stop every sink of the group, then run the replay again"
        )
        self.group = group
        self.state = state
        self.members = members


class UncommittedShiftError(OpsError):
    """A shift of partitions the group never committed: there is nothing to shift from."""


class KafkaOpsError(OpsError):
    """Kafka did not answer as needed (unreachable, timed out, refused)."""

    retriable = True


# --- pure: durations, times, topics ---------------------------------------------------

_DURATION = re.compile(
    r"P(?:(?P<weeks>\d+(?:[.,]\d+)?)W)?(?:(?P<days>\d+(?:[.,]\d+)?)D)?"
    r"(?:T(?:(?P<hours>\d+(?:[.,]\d+)?)H)?(?:(?P<minutes>\d+(?:[.,]\d+)?)M)?"
    r"(?:(?P<seconds>\d+(?:[.,]\d+)?)S)?)?"
)
_DURATION_UNIT_S = {"weeks": 604_800, "days": 86_400, "hours": 3_600, "minutes": 60, "seconds": 1}


def parse_iso_duration_s(text: str) -> float:
    """An ISO-8601 duration in seconds: ``PT15M`` -> 900.0, ``P1DT2H`` -> 93600.0.

    Weeks, days, hours, minutes and seconds, each optional, any may carry a
    fraction (``PT1.5H``). Years and months are refused: they have no fixed
    length. Raises :class:`OpsUsageError` naming the problem.
    """
    raw = text.strip().upper()
    date_part = raw.partition("T")[0]
    if raw.startswith("P") and ("Y" in date_part or "M" in date_part):
        raise OpsUsageError(
            f"duration {text!r}: years and months have no fixed length; use days (P30D)"
        )
    match = _DURATION.fullmatch(raw)
    if match is None or raw in {"P", "PT"} or raw.endswith("T"):
        raise OpsUsageError(f"not an ISO-8601 duration: {text!r} (e.g. PT15M, PT1H30M, P1D, P1W)")
    return float(
        sum(
            float(value.replace(",", ".")) * _DURATION_UNIT_S[unit]
            for unit, value in match.groupdict().items()
            if value is not None
        )
    )


def parse_datetime_ms(text: str) -> int:
    """An ISO-8601 date-time as Unix epoch milliseconds; without an offset it is UTC."""
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError as exc:
        raise OpsUsageError(
            f"not an ISO-8601 date-time: {text!r} (e.g. 2024-05-01T10:00:00+02:00)"
        ) from exc
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


def now_ms() -> int:
    """The wall clock in Unix epoch milliseconds (Kafka's record timestamp unit)."""
    return time.time_ns() // 1_000_000


@dataclass(frozen=True, slots=True, kw_only=True)
class TopicSelection:
    """A topic and, optionally, some of its partitions (``None`` = all)."""

    topic: str
    partitions: tuple[int, ...] | None = None


def parse_topic_spec(spec: str) -> TopicSelection:
    """``"T"`` -> all partitions of T; ``"T:0,2"`` -> partitions 0 and 2 of T."""
    topic, sep, parts = spec.strip().partition(":")
    if not topic:
        raise OpsUsageError(f"topic spec {spec!r}: empty topic name")
    if not sep:
        return TopicSelection(topic=topic)
    try:
        partitions = tuple(sorted({int(p) for p in parts.split(",") if p.strip()}))
    except ValueError as exc:
        raise OpsUsageError(
            f"topic spec {spec!r}: partitions must be integers (e.g. {topic}:0,2)"
        ) from exc
    if not partitions or min(partitions) < 0:
        raise OpsUsageError(f"topic spec {spec!r}: give partitions as {topic}:0,2")
    return TopicSelection(topic=topic, partitions=partitions)


def default_topic_filter(settings: Settings) -> Callable[[str], bool]:
    """The sink's own topics: ``SINK_TOPICS_PATTERN`` when set, else ``CDC_TOPIC_PREFIX``."""
    if settings.sink_topics_pattern:
        pattern = re.compile(settings.sink_topics_pattern.removeprefix("^"))
        return lambda name: pattern.match(name) is not None
    prefix = settings.topic_prefix
    return lambda name: name.startswith(prefix)


def select_topics(names: Iterable[str], accept: Callable[[str], bool]) -> list[str]:
    """The accepted topic names, sorted; Kafka's internal ``__*`` topics never."""
    return sorted(n for n in names if not n.startswith("__") and accept(n))


# --- pure: offsets ----------------------------------------------------------------------


def clamp_offset(offset: int, *, low: int, high: int) -> int:
    """``offset`` moved into ``[low, high]`` (``high`` = the next offset to be written)."""
    return min(max(offset, low), high)


class OffsetReset(enum.Enum):
    """librdkafka's ``auto.offset.reset``: where a consumer starts reading a partition
    whose committed offset it cannot use - none, or one outside ``[low, high]``, which
    the broker answers with OFFSET_OUT_OF_RANGE (checked against a real broker, both
    below the low watermark and past the end)."""

    EARLIEST = "earliest"  # the low watermark (librdkafka also says smallest, beginning)
    LATEST = "latest"  # the end (largest, end; librdkafka's default)
    ERROR = "error"  # nowhere: the consumer reports an error for the partition

    @classmethod
    def parse(cls, value: str) -> OffsetReset:
        """The policy of one librdkafka spelling (``smallest`` -> EARLIEST)."""
        try:
            return _RESET_SPELLINGS[value.strip().lower()]
        except KeyError:
            raise OpsUsageError(
                f"auto.offset.reset {value!r}: not one of {', '.join(sorted(_RESET_SPELLINGS))}"
            ) from None


_RESET_SPELLINGS = {
    "smallest": OffsetReset.EARLIEST,
    "earliest": OffsetReset.EARLIEST,
    "beginning": OffsetReset.EARLIEST,
    "largest": OffsetReset.LATEST,
    "latest": OffsetReset.LATEST,
    "end": OffsetReset.LATEST,
    "error": OffsetReset.ERROR,
}
#: librdkafka's own default when a consumer's configuration does not name one.
LIBRDKAFKA_DEFAULT_RESET = "largest"


def sink_offset_reset(settings: Settings) -> OffsetReset:
    """The sink's ``auto.offset.reset`` exactly as its consumer is configured
    (:func:`sinks.consumer.consumer_config`, ``KAFKA_CONFIG_*`` overrides included)."""
    value = consumer_config(settings).get("auto.offset.reset", LIBRDKAFKA_DEFAULT_RESET)
    return OffsetReset.parse(str(value))


class CommitRange(enum.Enum):
    """Where a group's committed offset lies against a partition's ``[low, high]``."""

    NONE = "none"  # the group never committed here
    IN_RANGE = "in_range"  # low <= committed <= high: the consumer resumes at it
    BELOW_LOW = "below_low"  # records were deleted before the group processed them
    PAST_END = "past_end"  # the topic was recreated, its log truncated, or set by hand


def commit_range(committed: int | None, *, low: int, high: int) -> CommitRange:
    """Classify a committed offset against the partition's watermarks."""
    if committed is None:
        return CommitRange.NONE
    if committed < low:
        return CommitRange.BELOW_LOW
    if committed > high:
        return CommitRange.PAST_END
    return CommitRange.IN_RANGE


def resume_offset(committed: int | None, *, low: int, high: int, reset: OffsetReset) -> int | None:
    """Where a consumer of the group really starts reading: its committed offset when
    that lies in ``[low, high]``, else where ``reset`` sends it; ``None`` for ERROR
    (the consumer stops on the partition with an error)."""
    if committed is not None and low <= committed <= high:
        return committed
    if reset is OffsetReset.EARLIEST:
        return low
    if reset is OffsetReset.LATEST:
        return high
    return None


def counting_position(committed: int | None, *, low: int, high: int, reset: OffsetReset) -> int:
    """The position lag and replay counts are measured from: :func:`resume_offset`,
    or, where the consumer stops (ERROR), its committed offset clamped (``low`` if none)."""
    resume = resume_offset(committed, low=low, high=high, reset=reset)
    if resume is not None:
        return resume
    return clamp_offset(low if committed is None else committed, low=low, high=high)


def lag_count(committed: int | None, *, low: int, high: int, reset: OffsetReset) -> int:
    """Records the group has still to process in one partition, from where it resumes."""
    return high - counting_position(committed, low=low, high=high, reset=reset)


def out_of_range_warning(
    topic: str, partition: int, committed: int | None, *, low: int, high: int, reset: OffsetReset
) -> str | None:
    """One line saying a committed offset is out of range, why that happens and what
    the sink will do about it; ``None`` when it is in range (or absent)."""
    where = commit_range(committed, low=low, high=high)
    name = f"{topic}[{partition}]: committed offset {committed}"
    if where is CommitRange.BELOW_LOW:
        cause = (
            f"{name} is below the low watermark {low} (out of range): records"
            f" {committed}..{low - 1} were deleted (retention, DeleteRecords) before the"
            " group processed them"
        )
    elif where is CommitRange.PAST_END:
        cause = (
            f"{name} is past the end {high} (out of range): the topic was deleted and"
            " recreated, its log was truncated (unclean leader election), or the offset"
            " was set by hand"
        )
    else:
        return None
    return f"{cause}; {_reset_outcome(reset, low=low, high=high)}"


def _reset_outcome(reset: OffsetReset, *, low: int, high: int) -> str:
    if reset is OffsetReset.EARLIEST:
        return (
            f"the sink resumes at the low watermark {low} (auto.offset.reset=earliest)"
            f" and processes the {high - low} record(s) from there"
        )
    if reset is OffsetReset.LATEST:
        return (
            f"the sink resumes at the end {high} (auto.offset.reset=latest) and skips the"
            f" {high - low} record(s) still in Kafka"
        )
    return (
        "the sink's consumer stops on this partition with an offset-out-of-range error"
        " (auto.offset.reset=error)"
    )


def age_s(timestamp_ms: int | None, *, now_ms: int) -> float | None:
    """Seconds since ``timestamp_ms`` (never negative); ``None`` when unknown."""
    if timestamp_ms is None:
        return None
    return max(0, now_ms - timestamp_ms) / 1000


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionLag:
    """How far a group is behind in one partition."""

    topic: str
    partition: int
    committed_offset: int | None  # None: the group never committed here
    low_offset: int
    end_offset: int
    #: Where the sink's consumer really starts reading (auto.offset.reset applied to a
    #: missing or out-of-range commit); None when it stops with an error instead.
    resume_offset: int | None
    lag: int
    #: Timestamp (= commit time) of the first record not yet processed; None when lag is 0.
    oldest_unprocessed_ts_ms: int | None
    #: Its age; 0.0 when lag is 0, None when the record could not be read in time.
    oldest_unprocessed_age_s: float | None
    commit_range: CommitRange = CommitRange.IN_RANGE
    #: Why the committed offset is out of range and what the sink does; None when in range.
    warning: str | None = None

    @property
    def position(self) -> int:
        """The offset lag is counted from (records at and after it are unprocessed)."""
        return self.end_offset - self.lag

    def as_json(self) -> dict[str, object]:
        return {
            "topic": self.topic,
            "partition": self.partition,
            "committed_offset": self.committed_offset,
            "low_offset": self.low_offset,
            "end_offset": self.end_offset,
            "resume_offset": self.resume_offset,
            "commit_range": self.commit_range.value,
            "lag": self.lag,
            "oldest_unprocessed_ts_ms": self.oldest_unprocessed_ts_ms,
            "oldest_unprocessed_age_s": self.oldest_unprocessed_age_s,
            "warning": self.warning,
        }


def partition_lag(
    *,
    topic: str,
    partition: int,
    committed: int | None,
    low: int,
    high: int,
    reset: OffsetReset,
    first_ts_ms: int | None,
    now_ms: int,
) -> PartitionLag:
    """The lag row of one partition from its offsets, the sink's reset policy and the
    timestamp of the first record at the position the group resumes from."""
    lag = lag_count(committed, low=low, high=high, reset=reset)
    ts_ms = first_ts_ms if lag > 0 else None
    return PartitionLag(
        topic=topic,
        partition=partition,
        committed_offset=committed,
        low_offset=low,
        end_offset=high,
        resume_offset=resume_offset(committed, low=low, high=high, reset=reset),
        lag=lag,
        oldest_unprocessed_ts_ms=ts_ms,
        oldest_unprocessed_age_s=age_s(ts_ms, now_ms=now_ms) if lag > 0 else 0.0,
        commit_range=commit_range(committed, low=low, high=high),
        warning=out_of_range_warning(topic, partition, committed, low=low, high=high, reset=reset),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class LagTotals:
    """The whole group: records behind and the oldest unprocessed event's age."""

    lag: int
    oldest_unprocessed_age_s: float | None
    partitions: int
    lagging_partitions: int

    def as_json(self) -> dict[str, object]:
        return {
            "lag": self.lag,
            "oldest_unprocessed_age_s": self.oldest_unprocessed_age_s,
            "partitions": self.partitions,
            "lagging_partitions": self.lagging_partitions,
        }


def lag_totals(rows: Sequence[PartitionLag]) -> LagTotals:
    """Sum of lag; the largest known age (``None`` only if a lagging age is unknown
    and no other is known)."""
    ages = [r.oldest_unprocessed_age_s for r in rows if r.oldest_unprocessed_age_s is not None]
    return LagTotals(
        lag=sum(r.lag for r in rows),
        oldest_unprocessed_age_s=max(ages) if ages else (None if rows else 0.0),
        partitions=len(rows),
        lagging_partitions=sum(1 for r in rows if r.lag > 0),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class LagRate:
    """Records per second between two lag snapshots of one partition."""

    produced_per_s: float  # end offset growth
    processed_per_s: float  # growth of the position lag is counted from


def lag_rates(
    before: Sequence[PartitionLag], after: Sequence[PartitionLag], *, elapsed_s: float
) -> dict[TP, LagRate]:
    """Per-partition rates; partitions missing from ``before`` are left out."""
    if elapsed_s <= 0:
        return {}
    old = {(r.topic, r.partition): r for r in before}
    rates: dict[TP, LagRate] = {}
    for row in after:
        prev = old.get((row.topic, row.partition))
        if prev is None:
            continue
        rates[(row.topic, row.partition)] = LagRate(
            produced_per_s=max(0, row.end_offset - prev.end_offset) / elapsed_s,
            processed_per_s=max(0, row.position - prev.position) / elapsed_s,
        )
    return rates


# --- pure: replay plans -------------------------------------------------------------------


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


def named_partitions(selections: Sequence[TopicSelection] | None) -> frozenset[TP]:
    """The partitions the operator listed one by one (``--topic T:0,2``)."""
    return frozenset(
        (sel.topic, p)
        for sel in selections or ()
        if sel.partitions is not None
        for p in sel.partitions
    )


# --- pure: redelivery selection -------------------------------------------------------------


def normalize_event_id(value: str) -> str:
    """A uuid in its canonical lower-case form (as the ``id`` header carries it)."""
    try:
        return str(uuid.UUID(value.strip()))
    except ValueError:
        return value.strip()


@dataclass(frozen=True, slots=True, kw_only=True)
class RedeliverySelector:
    """Which records to send again: by event id (the ``id`` header) or by key."""

    event_ids: frozenset[str] = frozenset()
    key: bytes | None = None

    @classmethod
    def of(cls, *, event_ids: Iterable[str] | None, key: str | None) -> RedeliverySelector:
        ids = frozenset(normalize_event_id(e) for e in event_ids or ())
        if bool(ids) == (key is not None):
            raise OpsUsageError("choose the events by event id or by key (exactly one)")
        return cls(event_ids=ids, key=key.encode() if key is not None else None)

    def matches(self, record: Envelope) -> bool:
        if self.key is not None:
            return record.key == self.key
        return record.event_id in self.event_ids


def commit_order_key(record: Envelope) -> tuple[int, int]:
    """Commit order across partitions: the ``lsn`` header, then the record timestamp."""
    try:
        lsn = str_to_lsn(record.header(HEADER_LSN))
    except ValueError:
        lsn = 0
    return (lsn, record.timestamp_ms or 0)


def in_commit_order(per_partition: Iterable[Sequence[Envelope]]) -> list[Envelope]:
    """Merge partitions (each in offset order, which is kept) into commit order; an
    event id seen twice (an at-least-once duplicate in Kafka) is kept once."""
    seen: set[str] = set()
    out: list[Envelope] = []
    for record in heapq.merge(*per_partition, key=commit_order_key):
        event_id = record.event_id
        if event_id and event_id in seen:
            continue
        seen.add(event_id)
        out.append(record)
    return out


# --- Kafka shell -----------------------------------------------------------------------------


def _client_config(settings: Settings) -> dict[str, Any]:
    config: dict[str, Any] = {
        "bootstrap.servers": settings.kafka_bootstrap_servers,
        "client.id": "outbox-cdc-ops",
        **KafkaClientEvents("ops").config(),
    }
    config.update(settings.kafka_config)
    return config


def _check(error: Any, what: str) -> None:
    if error is not None and error.code() != KafkaError.NO_ERROR:
        raise KafkaOpsError(f"{what}: {error.str()}")


class KafkaOps:
    """One AdminClient and one never-committing, never-joining consumer (context manager)."""

    def __init__(self, settings: Settings) -> None:
        settings.require("kafka_bootstrap_servers")
        base = _client_config(settings)
        self.settings = settings
        self._timeout_s = KAFKA_REQUEST_TIMEOUT_S
        self.admin = AdminClient(base)
        self.consumer = Consumer(
            {
                **base,
                "group.id": f"{OPS_GROUP_PREFIX}{uuid.uuid4().hex}",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "enable.partition.eof": True,
                "auto.offset.reset": "earliest",
            }
        )

    def __enter__(self) -> KafkaOps:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.consumer.close()

    def _metadata(self) -> Any:
        try:
            return self.consumer.list_topics(timeout=self._timeout_s)
        except KafkaException as exc:
            raise KafkaOpsError(f"Kafka metadata: {exc}") from exc

    def partitions(self, selections: Sequence[TopicSelection] | None) -> list[TP]:
        """Chosen topic-partitions, sorted; ``None`` = every partition of the sink's topics."""
        topics = self._metadata().topics
        if selections is None:
            names = select_topics(topics, default_topic_filter(self.settings))
            selections = [TopicSelection(topic=n) for n in names]
        out: set[TP] = set()
        for sel in selections:
            meta = topics.get(sel.topic)
            if meta is None or meta.error is not None:
                raise OpsUsageError(f"topic {sel.topic} does not exist")
            existing = set(meta.partitions)
            wanted = set(sel.partitions) if sel.partitions is not None else existing
            missing = sorted(wanted - existing)
            if missing:
                raise OpsUsageError(f"topic {sel.topic} has no partition(s) {missing}")
            out.update((sel.topic, p) for p in wanted)
        return sorted(out)

    def watermarks(self, tps: Iterable[TP]) -> dict[TP, tuple[int, int]]:
        """(low, high) of each partition, asked of the brokers (not cached)."""
        marks: dict[TP, tuple[int, int]] = {}
        for topic, part in tps:
            try:
                low, high = self.consumer.get_watermark_offsets(
                    TopicPartition(topic, part), timeout=self._timeout_s, cached=False
                )
            except KafkaException as exc:
                raise KafkaOpsError(f"watermarks of {topic}[{part}]: {exc}") from exc
            marks[(topic, part)] = (int(low), int(high))
        return marks

    def committed(self, group: str, tps: Sequence[TP]) -> dict[TP, int | None]:
        """The group's committed offsets (``None`` where it never committed)."""
        if not tps:
            return {}
        request = ConsumerGroupTopicPartitions(group, [TopicPartition(t, p) for t, p in tps])
        try:
            result = self.admin.list_consumer_group_offsets(
                [request], request_timeout=self._timeout_s
            )[group].result(timeout=self._timeout_s)
        except KafkaException as exc:
            raise KafkaOpsError(f"committed offsets of group {group}: {exc}") from exc
        out: dict[TP, int | None] = dict.fromkeys(tps)
        for tp in result.topic_partitions:
            _check(tp.error, f"committed offset of {tp.topic}[{tp.partition}]")
            out[(tp.topic, tp.partition)] = None if tp.offset < 0 else int(tp.offset)
        return out

    def offsets_for_time(self, tps: Sequence[TP], ts_ms: int) -> dict[TP, int | None]:
        """The first offset at or after ``ts_ms`` per partition; ``None`` when none is."""
        if not tps:
            return {}
        try:
            found = self.consumer.offsets_for_times(
                [TopicPartition(t, p, ts_ms) for t, p in tps], timeout=self._timeout_s
            )
        except KafkaException as exc:
            raise KafkaOpsError(f"offsets for time {ts_ms}: {exc}") from exc
        out: dict[TP, int | None] = {}
        for tp in found:
            _check(tp.error, f"offset for time in {tp.topic}[{tp.partition}]")
            out[(tp.topic, tp.partition)] = None if tp.offset < 0 else int(tp.offset)
        return out

    def group_state(self, group: str) -> tuple[str, int]:
        """(state name, member count) of ``group``; a group that never existed is DEAD."""
        try:
            desc = self.admin.describe_consumer_groups([group], request_timeout=self._timeout_s)[
                group
            ].result(timeout=self._timeout_s)
        except KafkaException as exc:
            raise KafkaOpsError(f"describe consumer group {group}: {exc}") from exc
        state = getattr(desc.state, "name", str(desc.state))
        return str(state), len(desc.members or [])

    def commit_for_group(self, group: str, offsets: Mapping[TP, int]) -> None:
        """Set the group's committed offsets (Kafka refuses for a non-empty group)."""
        request = ConsumerGroupTopicPartitions(
            group, [TopicPartition(t, p, o) for (t, p), o in sorted(offsets.items())]
        )
        try:
            result = self.admin.alter_consumer_group_offsets(
                [request], request_timeout=self._timeout_s
            )[group].result(timeout=self._timeout_s)
        except KafkaException as exc:
            raise _alter_error(group, exc.args[0] if exc.args else None, exc) from exc
        for tp in result.topic_partitions:
            if tp.error is not None and tp.error.code() != KafkaError.NO_ERROR:
                raise _alter_error(group, tp.error, None)

    def read(
        self,
        starts: Mapping[TP, int],
        *,
        ends: Mapping[TP, int],
        idle_timeout_s: float,
        first_only: bool = False,
    ) -> Iterator[Envelope]:
        """Records of each partition from ``starts`` up to (excluding) ``ends``, as they
        arrive (offset order within a partition); with ``first_only`` just the first
        record of each. Stops when every partition is done, or raises
        :class:`KafkaOpsError` after ``idle_timeout_s`` without progress."""
        todo = {tp for tp, start in starts.items() if start < ends[tp]}
        if not todo:
            return
        self.consumer.assign([TopicPartition(t, p, starts[(t, p)]) for t, p in sorted(todo)])
        last_progress = time.monotonic()
        try:
            while todo:
                batch = self.consumer.consume(SCAN_BATCH, 0.5)
                if batch:
                    last_progress = time.monotonic()
                elif time.monotonic() - last_progress > idle_timeout_s:
                    raise KafkaOpsError(
                        f"no record from {sorted(todo)} for {idle_timeout_s:g}s: Kafka unreachable?"
                    )
                for msg in batch:
                    for record in _take(msg, todo, ends):
                        if first_only:
                            todo.discard(record.topic_partition)
                            self.consumer.pause([TopicPartition(record.topic, record.partition)])
                        yield record
        finally:
            self.consumer.unassign()


def _take(msg: Any, todo: set[TP], ends: Mapping[TP, int]) -> Iterator[Envelope]:
    """One consumed message: a record below its end is yielded; an end is noted."""
    tp = (msg.topic(), msg.partition())
    error = msg.error()
    if error is not None:
        if error.code() == KafkaError._PARTITION_EOF:
            todo.discard(tp)
            return
        raise KafkaOpsError(f"reading {tp[0]}[{tp[1]}]: {error.str()}")
    if tp not in todo:
        return
    if msg.offset() >= ends[tp]:
        todo.discard(tp)
        return
    if msg.offset() >= ends[tp] - 1:
        todo.discard(tp)
    yield Envelope.from_kafka(msg)


def _alter_error(group: str, error: Any, cause: BaseException | None) -> OpsError:
    """Kafka's answer to an offset change of a group that has members, or another failure."""
    code = error.code() if error is not None and hasattr(error, "code") else None
    if code in (KafkaError.UNKNOWN_MEMBER_ID, KafkaError.REBALANCE_IN_PROGRESS):
        return GroupActiveError(group, state="members joined", members=1)
    detail = error.str() if error is not None and hasattr(error, "str") else str(cause)
    return KafkaOpsError(f"commit offsets of group {group}: {detail}")


# --- lag ---------------------------------------------------------------------------------------


def group_lag(
    settings: Settings,
    *,
    group: str | None = None,
    topics: Sequence[TopicSelection] | None = None,
    at_ms: int | None = None,
) -> list[PartitionLag]:
    """Per topic/partition: committed and end offsets, where the sink resumes, lag, and
    the oldest unprocessed event's age (the timestamp of the record at the resume
    position, read with a throwaway consumer). Resume positions follow the sink's
    ``auto.offset.reset`` for a missing or out-of-range commit (:func:`resume_offset`).
    ``group`` defaults to ``SINK_GROUP_ID``; ``topics`` to the sink's."""
    group = group or settings.sink_group_id
    reset = sink_offset_reset(settings)
    with KafkaOps(settings) as kafka:
        tps = kafka.partitions(topics)
        marks = kafka.watermarks(tps)
        committed = kafka.committed(group, tps)
        positions = {
            tp: counting_position(committed[tp], low=marks[tp][0], high=marks[tp][1], reset=reset)
            for tp in tps
        }
        behind = {tp: pos for tp, pos in positions.items() if pos < marks[tp][1]}
        first_ts = _first_timestamps(kafka, behind, marks)
    now = now_ms() if at_ms is None else at_ms
    return [
        partition_lag(
            topic=t,
            partition=p,
            committed=committed[(t, p)],
            low=marks[(t, p)][0],
            high=marks[(t, p)][1],
            reset=reset,
            first_ts_ms=first_ts.get((t, p)),
            now_ms=now,
        )
        for t, p in tps
    ]


def _first_timestamps(
    kafka: KafkaOps, positions: Mapping[TP, int], marks: Mapping[TP, tuple[int, int]]
) -> dict[TP, int]:
    """The timestamp of the first record at or after each position (nothing committed)."""
    found: dict[TP, int] = {}
    ends = {tp: marks[tp][1] for tp in positions}
    try:
        for record in kafka.read(
            positions, ends=ends, idle_timeout_s=FIRST_RECORD_TIMEOUT_S, first_only=True
        ):
            if record.timestamp_ms is not None:
                found[record.topic_partition] = record.timestamp_ms
    except KafkaOpsError as exc:  # ages stay unknown (None) where nothing was read in time
        log.warning("oldest unprocessed record not read for every partition: %s", exc)
    return found


@dataclass(frozen=True, kw_only=True)
class PipelineLag:
    """``outbox-cdc lag``: the group's partitions, the slot, the parking lot, at one moment.

    ``slot`` / ``parking`` are ``None`` when ``CDC_PG_DSN`` is not set or they
    could not be read; ``problems`` then says why (a missing DSN is no problem).
    """

    group: str
    at_ms: int
    partitions: tuple[PartitionLag, ...]
    slot: SlotStatus | None
    parking: dict[str, int] | None
    problems: tuple[str, ...] = ()

    @property
    def totals(self) -> LagTotals:
        return lag_totals(self.partitions)

    @property
    def warnings(self) -> tuple[str, ...]:
        """One line per partition whose committed offset is out of range."""
        return tuple(p.warning for p in self.partitions if p.warning is not None)

    def as_json(self) -> dict[str, object]:
        return {
            "group": self.group,
            "at_ms": self.at_ms,
            "totals": self.totals.as_json(),
            "partitions": [p.as_json() for p in self.partitions],
            "slot": dict(self.slot) if self.slot is not None else None,
            "parking_lot": self.parking,
            "warnings": list(self.warnings),
            "problems": list(self.problems),
        }


def pipeline_lag(
    settings: Settings,
    *,
    group: str | None = None,
    topics: Sequence[TopicSelection] | None = None,
) -> PipelineLag:
    """Group lag (:func:`group_lag`) plus the slot's WAL lag and the parking-lot counts."""
    group = group or settings.sink_group_id
    partitions = group_lag(settings, group=group, topics=topics)
    at = now_ms()
    if not settings.pg_dsn:
        return PipelineLag(
            group=group, at_ms=at, partitions=tuple(partitions), slot=None, parking=None
        )
    problems: list[str] = []
    slot: SlotStatus | None = None
    parking: dict[str, int] | None = None
    try:
        slot = slot_status(settings)
    except CdcError as exc:
        problems.append(f"slot {settings.slot}: {exc}")
    try:
        parking = parking_counts(settings)
    except (OSError, psycopg.Error) as exc:
        problems.append(f"parking lot: {exc}")
    return PipelineLag(
        group=group,
        at_ms=at,
        partitions=tuple(partitions),
        slot=slot,
        parking=parking,
        problems=tuple(problems),
    )


# --- replay ----------------------------------------------------------------------------------


def plan_replay(
    settings: Settings,
    *,
    group: str,
    spec: ReplaySpec,
    topics: Sequence[TopicSelection] | None = None,
    include_uncommitted: bool = False,
    at_ms: int | None = None,
) -> ReplayPlan:
    """Per partition current -> target offsets and the records to deliver again or skip.

    ``topics=None`` takes every partition of the sink's topics. Partitions the group
    never committed are planned only when named (``T:p``) or ``include_uncommitted``
    (:func:`partition_action`). Reads only.
    """
    now = now_ms() if at_ms is None else at_ms
    reset = sink_offset_reset(settings)
    named = named_partitions(topics)
    with KafkaOps(settings) as kafka:
        tps = kafka.partitions(topics)
        if not tps:
            raise OpsUsageError(
                f"no topic matches the sink's topics (CDC_TOPIC_PREFIX={settings.topic_prefix!r})"
            )
        marks = kafka.watermarks(tps)
        committed = kafka.committed(group, tps)
        ts_ms = spec.timestamp_ms(now_ms=now)
        by_time = kafka.offsets_for_time(tps, ts_ms) if ts_ms is not None else {}
        state, members = kafka.group_state(group)
    partitions = tuple(
        plan_partition(
            spec,
            topic=t,
            partition=p,
            current=committed[(t, p)],
            low=marks[(t, p)][0],
            high=marks[(t, p)][1],
            reset=reset,
            time_offset=by_time.get((t, p)),
            named=(t, p) in named,
            include_uncommitted=include_uncommitted,
        )
        for t, p in tps
    )
    return ReplayPlan(
        group=group,
        spec=spec,
        at_ms=ts_ms,
        partitions=partitions,
        group_state=state,
        active_members=members,
        reset=reset,
        include_uncommitted=include_uncommitted,
    )


def apply_replay(settings: Settings, plan: ReplayPlan) -> None:
    """Commit the plan's targets (MOVE partitions only) for its group.

    :class:`UncommittedShiftError` when the plan shifts a partition without a
    committed offset; :class:`GroupActiveError` while the group has members.
    """
    if plan.refusal is not None:
        raise UncommittedShiftError(plan.refusal)
    with KafkaOps(settings) as kafka:
        state, members = kafka.group_state(plan.group)
        if group_is_active(state, members):
            raise GroupActiveError(plan.group, state=state, members=members)
        offsets = {
            (p.topic, p.partition): p.target_offset
            for p in plan.partitions
            if p.target_offset is not None
        }
        if offsets:
            kafka.commit_for_group(plan.group, offsets)


# --- redelivery ------------------------------------------------------------------------------


class Outcome(enum.StrEnum):
    """What became of one redelivered event."""

    DELIVERED = "delivered"  # the engine answered 2xx (a duplicate key included)
    REJECTED = "rejected"  # the healthy engine refused this event (4xx)
    UNROUTABLE = "unroutable"  # no route, bad payload or no id header: never sent
    ENGINE_UNAVAILABLE = "engine_unavailable"  # engine-wide trouble on this one
    NOT_SENT = "not_sent"  # not tried: the engine was unavailable before its turn


@dataclass(frozen=True, slots=True, kw_only=True)
class Redelivery:
    """One event sent again and what the engine said."""

    event_id: str
    event_type: str
    topic: str
    partition: int
    offset: int
    key: str | None
    outcome: Outcome
    detail: str = ""

    def as_json(self) -> dict[str, object]:
        return {
            "event_id": self.event_id,
            "event_type": self.event_type,
            "topic": self.topic,
            "partition": self.partition,
            "offset": self.offset,
            "key": self.key,
            "outcome": self.outcome.value,
            "detail": self.detail,
        }


@dataclass(frozen=True, kw_only=True)
class RedeliveryReport:
    """Everything a redelivery sent, in order; ids asked for but not found in Kafka."""

    items: tuple[Redelivery, ...]
    missing_event_ids: tuple[str, ...] = ()
    scanned_count: int = 0

    @property
    def ok(self) -> bool:
        """Every chosen event was found and delivered."""
        return not self.missing_event_ids and all(
            i.outcome is Outcome.DELIVERED for i in self.items
        )

    def counts(self) -> dict[str, int]:
        out = {o.value: 0 for o in Outcome}
        for item in self.items:
            out[item.outcome.value] += 1
        return out

    def as_json(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "counts": self.counts(),
            "scanned_count": self.scanned_count,
            "missing_event_ids": list(self.missing_event_ids),
            "events": [i.as_json() for i in self.items],
        }


def redeliver(
    settings: Settings,
    *,
    event_ids: Iterable[str] | None = None,
    key: str | None = None,
    since_ms: int | None = None,
    topics: Sequence[TopicSelection] | None = None,
    progress: ProgressFn | None = None,
) -> RedeliveryReport:
    """Find the chosen records in Kafka and deliver each to the engine again.

    By event id (``id`` header) or by key (every record with that key, commit
    order). The scan starts at ``offsets_for_times(since_ms)`` (epoch ms) or the beginning and
    ends at the end offsets seen when it starts. No group offset moves.
    """
    selector = RedeliverySelector.of(event_ids=event_ids, key=key)
    records, scanned = _find(
        settings, selector, since_ms=since_ms, topics=topics, progress=progress
    )
    found = {r.event_id for r in records}
    missing = tuple(sorted(selector.event_ids - found))
    items = asyncio.run(_send_all(settings, records, progress=progress))
    return RedeliveryReport(items=tuple(items), missing_event_ids=missing, scanned_count=scanned)


def _find(
    settings: Settings,
    selector: RedeliverySelector,
    *,
    since_ms: int | None,
    topics: Sequence[TopicSelection] | None,
    progress: ProgressFn | None,
) -> tuple[list[Envelope], int]:
    """The matching records in commit order, and how many records were read."""
    with KafkaOps(settings) as kafka:
        tps = kafka.partitions(topics)
        marks = kafka.watermarks(tps)
        starts = {tp: low for tp, (low, _high) in marks.items()}
        if since_ms is not None:
            by_time = kafka.offsets_for_time(tps, since_ms)
            starts = {tp: _scan_start(by_time.get(tp), marks[tp]) for tp in tps}
        ends = {tp: high for tp, (_low, high) in marks.items()}
        total = sum(max(0, ends[tp] - starts[tp]) for tp in tps)
        per_partition: dict[TP, list[Envelope]] = {tp: [] for tp in tps}
        scanned = 0
        wanted = set(selector.event_ids)
        for record in kafka.read(starts, ends=ends, idle_timeout_s=SCAN_IDLE_TIMEOUT_S):
            scanned += 1
            if selector.matches(record):
                per_partition[record.topic_partition].append(record)
                wanted.discard(record.event_id)
            if progress is not None and scanned % SCAN_BATCH == 0:
                progress("scan", scanned, total)
            if selector.event_ids and not wanted:
                break
        if progress is not None:
            progress("scan", total, total)
    return in_commit_order(per_partition.values()), scanned


def _scan_start(time_offset: int | None, mark: tuple[int, int]) -> int:
    low, high = mark
    return high if time_offset is None else clamp_offset(time_offset, low=low, high=high)


async def _send_all(
    settings: Settings, records: Sequence[Envelope], *, progress: ProgressFn | None
) -> list[Redelivery]:
    """Deliver one after another; after engine-wide trouble the rest are NOT_SENT."""
    out: list[Redelivery] = []
    unavailable = False
    async with EngineClient.from_settings(settings) as engine:
        for done, record in enumerate(records, start=1):
            if unavailable:
                out.append(_redelivery(record, Outcome.NOT_SENT, "engine unavailable earlier"))
                continue
            outcome, detail = await _send_one(engine, record)
            unavailable = outcome is Outcome.ENGINE_UNAVAILABLE
            out.append(_redelivery(record, outcome, detail))
            if progress is not None:
                progress("deliver", done, len(records))
    return out


async def _send_one(engine: EngineClient, record: Envelope) -> tuple[Outcome, str]:
    try:
        call = await deliver(
            engine, event_type=record.event_type, payload=record.value, event_id=record.event_id
        )
    except EngineUnavailable as exc:
        return Outcome.ENGINE_UNAVAILABLE, exc.reason
    except Unroutable as exc:
        return Outcome.UNROUTABLE, exc.reason
    except SinkError as exc:
        return Outcome.REJECTED, exc.reason
    return Outcome.DELIVERED, call.path


def _redelivery(record: Envelope, outcome: Outcome, detail: str) -> Redelivery:
    return Redelivery(
        event_id=record.event_id,
        event_type=record.event_type,
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=record.key.decode("utf-8", "replace") if record.key is not None else None,
        outcome=outcome,
        detail=detail,
    )


# --- parking lot (sync faces of the async repository, for the CLI) -----------------------------


def parked_events(
    settings: Settings,
    *,
    limit: int = 100,
    statuses: Sequence[str] = ("FAILED", "PENDING"),
    event_type: str | None = None,
) -> list[ParkedEvent]:
    """The oldest ``limit`` rows of the parking lot in ``statuses``, of ``event_type`` if given."""
    return asyncio.run(
        _with_lot(
            settings,
            lambda lot: lot.list_rows(statuses=statuses, event_type=event_type, limit=limit),
        )
    )


def count_acceptable(
    settings: Settings, *, ids: Sequence[int] | None, event_type: str | None
) -> int:
    """How many open rows :func:`accept_parked` would mark DONE."""
    return asyncio.run(
        _with_lot(
            settings,
            lambda lot: lot.count_acceptable(ids=list(ids) if ids else None, event_type=event_type),
        )
    )


def accept_parked(
    settings: Settings, *, ids: Sequence[int] | None, event_type: str | None
) -> list[int]:
    """Mark open rows DONE without sending them ("accept as skipped"); the ids marked."""
    if not ids and not event_type:
        raise OpsUsageError("give parked event ids or an event type")
    return asyncio.run(
        _with_lot(
            settings,
            lambda lot: lot.accept(ids=list(ids) if ids else None, event_type=event_type),
        )
    )


def parking_counts(settings: Settings) -> dict[str, int]:
    """Rows of the parking lot per status (FAILED, PENDING, DONE)."""
    return asyncio.run(_with_lot(settings, lambda lot: lot.counts()))


def retry_parked(settings: Settings, *, ids: Sequence[int] | None, retry_all: bool) -> RetrySummary:
    """Retry chosen rows (or every open row, up to 100) exactly as the admin API does."""
    if not ids and not retry_all:
        raise OpsUsageError("give parked event ids or retry_all")

    async def run(lot: ParkingLot) -> RetrySummary:
        async with EngineClient.from_settings(settings) as engine:
            retrier = Retrier(lot=lot, engine=engine, settings=settings)
            return await retrier.retry(list(ids) if ids else None, retry_all=retry_all)

    return asyncio.run(_with_lot(settings, run))


async def _with_lot(settings: Settings, use: Callable[[ParkingLot], Awaitable[_T]]) -> _T:
    lot = ParkingLot(settings.require("pg_dsn").pg_dsn.get_secret_value())
    try:
        return await use(lot)
    finally:
        await lot.close()


__all__ = [
    "CommitRange",
    "GroupActiveError",
    "KafkaOps",
    "KafkaOpsError",
    "LagRate",
    "LagTotals",
    "OffsetReset",
    "OpsError",
    "OpsUsageError",
    "Outcome",
    "PartitionAction",
    "PartitionLag",
    "PartitionPlan",
    "PipelineLag",
    "Redelivery",
    "RedeliveryReport",
    "RedeliverySelector",
    "ReplayKind",
    "ReplayPlan",
    "ReplaySpec",
    "TopicSelection",
    "UncommittedShiftError",
    "apply_replay",
    "clamp_offset",
    "commit_range",
    "group_lag",
    "lag_rates",
    "lag_totals",
    "parked_events",
    "parking_counts",
    "parse_iso_duration_s",
    "parse_topic_spec",
    "pipeline_lag",
    "plan_replay",
    "redeliver",
    "replay_target",
    "resume_offset",
    "retry_parked",
    "sink_offset_reset",
]
