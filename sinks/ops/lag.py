"""Lag of the pipeline: the group's offsets against the topics' ends, the slot, the parking lot.

Guarantees: read-only (:mod:`sinks.ops.kafka`); lag and the oldest
unprocessed age are measured from where the group really resumes
(:mod:`sinks.ops.offsets`); an age that could not be read in time stays
unknown (``None``), never zero.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import psycopg

from cdc.errors import CdcError
from cdc.ops import SlotStatus, slot_status
from cdc.settings import Settings
from sinks.ops.errors import KafkaOpsError
from sinks.ops.kafka import FIRST_RECORD_TIMEOUT_S, KafkaOps
from sinks.ops.offsets import (
    LagTotals,
    PartitionLag,
    counting_position,
    lag_totals,
    partition_lag,
    sink_offset_reset,
)
from sinks.ops.parking import parking_counts
from sinks.ops.selection import TP, TopicSelection, now_ms

log = logging.getLogger("sinks.ops")


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
    ``group`` defaults to ``SINK_GROUP_ID``; ``topics`` to the sink's.
    :class:`~sinks.ops.errors.GroupNotFoundError` when the group does not exist."""
    group = group or settings.sink_group_id
    reset = sink_offset_reset(settings)
    with KafkaOps(settings) as kafka:
        kafka.require_group(group)
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
    ``kafka_error`` is set when Kafka could not be read: the partitions are then
    unknown (empty) and the JSON totals ``null``, never shown as "no lag".
    """

    group: str
    at_ms: int
    partitions: tuple[PartitionLag, ...]
    slot: SlotStatus | None
    parking: dict[str, int] | None
    problems: tuple[str, ...] = ()
    kafka_error: str | None = None

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
            # Kafka unread: the totals are unknown (null), never 0 - which reads "no lag"
            "totals": None if self.kafka_error is not None else self.totals.as_json(),
            "partitions": [p.as_json() for p in self.partitions],
            "slot": dict(self.slot) if self.slot is not None else None,
            "parking_lot": self.parking,
            "kafka": {"readable": self.kafka_error is None, "error": self.kafka_error},
            "warnings": list(self.warnings),
            "problems": list(self.problems),
        }


def pipeline_lag(
    settings: Settings,
    *,
    group: str | None = None,
    topics: Sequence[TopicSelection] | None = None,
) -> PipelineLag:
    """Group lag (:func:`group_lag`) plus the slot's WAL lag and the parking-lot counts.

    Kafka unreachable is not the end of the report: the slot and the parking lot
    are still read and shown, the partitions are marked unknown
    (``kafka_error``), and the Kafka failure is the report's first problem. A group
    that does not exist (:class:`~sinks.ops.errors.GroupNotFoundError`) ends it.
    """
    group = group or settings.sink_group_id
    kafka_error: str | None = None
    try:
        partitions = group_lag(settings, group=group, topics=topics)
    except KafkaOpsError as exc:  # unreachable, or a request that timed out
        partitions, kafka_error = [], str(exc)
    at = now_ms()
    problems: list[str] = [kafka_error] if kafka_error else []
    slot: SlotStatus | None = None
    parking: dict[str, int] | None = None
    if settings.pg_dsn:
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
        kafka_error=kafka_error,
    )
