"""Offset and lag arithmetic of a consumer group (pure): clamping, resume points, lag, rates.

Guarantees: where a group resumes is where the sink's consumer really starts
reading - the committed offset when it lies in ``[low, high]``, else (never
committed, or out of range: below the low watermark or past the end) where the
sink's ``auto.offset.reset`` sends it (earliest today, so the low watermark,
for a commit past the end too: librdkafka's behaviour against a real broker).
Lag, the oldest unprocessed age and a replay's counts are measured from there,
and an out-of-range commit is reported with a warning naming the likely causes.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from cdc.settings import Settings
from sinks.kafka.config import consumer_config
from sinks.ops.errors import OpsUsageError
from sinks.ops.selection import TP


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
    (:func:`sinks.kafka.config.consumer_config`, ``KAFKA_CONFIG_*`` overrides included)."""
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
