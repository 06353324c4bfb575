"""What a trace found, and its verdict (pure): records, rows, groups, bounds, the event's state.

Guarantees: the verdict (:func:`event_state`) is a pure function of what was
found; the partitions a key maps to are computed as Kafka's murmur2 (Java
client, ``murmur2_random``) and librdkafka's CRC32 (``consistent_random``) do.

States (:class:`EventState`)::

    outbox row, no record ..................... NOT_RELAYED  (relay behind, or outside the bounds)
    record, sink group not past it ............ PENDING
    record, sink group past it, no parked row . DELIVERED
    parked row FAILED/PENDING ................. PARKED
    parked row DONE ........................... DELIVERED_ON_RETRY
    dead-letter record ........................ DEAD_LETTERED
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from cdc import constants as c
from cdc.router import iso_utc_us
from sinks.core.delivery import Envelope
from sinks.ops.errors import OpsError

#: Records read per partition at most, from the start offset (``--max-records``).


#: Records read per partition at most, from the start offset (``--max-records``).
DEFAULT_MAX_RECORDS = 20_000


#: Without an outbox row or ``--since``, records committed this long ago are searched.
DEFAULT_LOOKBACK_S = 24 * 3600


#: The commit time follows the row's ``created_at`` (the transaction's start);
#: both come from the database's clock. The margin covers rounding only.
CLOCK_SKEW_MS = 1_000


#: Outbox rows shown per key at most.
MAX_KEY_ROWS = 1_000


#: Bytes of a value shown (the full value is in Kafka).
VALUE_PREVIEW_BYTES = 200


TP = tuple[str, int]


class TraceNotFound(OpsError):  # noqa: N818 - an answer, named like the others of sinks.ops
    """Nothing of the event was found within the bounds; the message says which to widen."""


class EventState(enum.StrEnum):
    NOT_RELAYED = "not_relayed"  # in the outbox, no Kafka record found (yet)
    PENDING = "pending"  # in Kafka; the sink's group has not committed past it
    DELIVERED = "delivered"  # the sink's group committed past it and it was never parked
    PARKED = "parked"  # in failed_sync_events, FAILED or PENDING
    DELIVERED_ON_RETRY = "delivered_on_retry"  # parked, then a retry delivered it (DONE)
    DEAD_LETTERED = "dead_lettered"  # Kafka refused it: it is on the dead-letter topic


class GroupPosition(enum.StrEnum):
    CONSUMED = "consumed"  # committed offset is past the record: delivered or parked
    PENDING = "pending"  # committed offset at or before the record: not processed yet
    NO_COMMIT = "no_commit"  # the group never committed on this partition


_M = 0x5BD1E995


_MASK32 = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (``org.apache.kafka.common.utils.Utils.murmur2``), unsigned 32 bits."""
    length = len(data)
    h = (0x9747B28C ^ length) & _MASK32
    whole = length & ~3
    for i in range(0, whole, 4):
        k = data[i] | data[i + 1] << 8 | data[i + 2] << 16 | data[i + 3] << 24
        k = (k * _M) & _MASK32
        k ^= k >> 24
        k = (k * _M) & _MASK32
        h = ((h * _M) & _MASK32) ^ k
    rest = length & 3
    if rest == 3:
        h ^= data[whole + 2] << 16
    if rest >= 2:
        h ^= data[whole + 1] << 8
    if rest >= 1:
        h ^= data[whole]
        h = (h * _M) & _MASK32
    h ^= h >> 13
    h = (h * _M) & _MASK32
    h ^= h >> 15
    return h


def murmur2_partition(key: bytes, partitions: int) -> int:
    """The partition of ``key`` under the Java client's default (and ``murmur2_random``)."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def crc32_partition(key: bytes, partitions: int) -> int:
    """The partition of ``key`` under librdkafka's default (``consistent_random``)."""
    return zlib.crc32(key) % partitions


def likely_partitions(key: bytes, partitions: int) -> list[int]:
    """Where ``key`` lands under either partitioner (murmur2 first), without duplicates."""
    out = [murmur2_partition(key, partitions)]
    crc = crc32_partition(key, partitions)
    if crc != out[0]:
        out.append(crc)
    return out


def search_order(
    tps: Iterable[TP], counts: Mapping[str, int], key: bytes | None
) -> tuple[list[TP], list[TP]]:
    """(the key's likely partitions, the others), each sorted; all "others" without a key."""
    everything = sorted(set(tps))
    if key is None:
        return [], everything
    likely = {(t, p) for t in counts for p in likely_partitions(key, counts[t])}
    first = [tp for tp in everything if tp in likely]
    return first, [tp for tp in everything if tp not in likely]


def scan_window(
    start: int | None, *, low: int, high: int, max_records: int
) -> tuple[int, int, bool]:
    """(first, end, truncated) of a bounded scan from ``start`` (``None``: nothing after the time).

    ``truncated``: records beyond ``end`` exist that the bound leaves unread.
    """
    if start is None:
        return high, high, False
    first = min(max(start, low), high)
    end = min(high, first + max_records)
    return first, end, end < high


def group_position(committed: int | None, offset: int) -> GroupPosition:
    """Where a group stands relative to the record at ``offset``."""
    if committed is None:
        return GroupPosition.NO_COMMIT
    return GroupPosition.CONSUMED if committed > offset else GroupPosition.PENDING


@dataclass(frozen=True, kw_only=True)
class OutboxRow:
    """The event's outbox row, while it still exists."""

    event_id: str
    aggregate_type: str
    aggregate_id: str
    event_type: str
    created_at: datetime
    traceparent: str | None

    def as_json(self) -> dict[str, Any]:
        return {
            "aggregatetype": self.aggregate_type,
            "aggregateid": self.aggregate_id,
            "type": self.event_type,
            "created_at": self.created_at.isoformat(),
            "tracingspancontext": self.traceparent,
        }


@dataclass(frozen=True, kw_only=True)
class FoundRecord:
    """A Kafka record of the event (on its topic or on the dead-letter topic)."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int | None
    key: str | None
    headers: dict[str, str]
    value_size: int
    value_preview: str

    @classmethod
    def of(cls, env: Envelope) -> FoundRecord:
        value = env.value or b""
        return cls(
            topic=env.topic,
            partition=env.partition,
            offset=env.offset,
            timestamp_ms=env.timestamp_ms,
            key=env.key.decode("utf-8", "replace") if env.key is not None else None,
            headers={k: v.decode("utf-8", "replace") for k, v in env.headers.items()},
            value_size=len(value),
            value_preview=value[:VALUE_PREVIEW_BYTES].decode("utf-8", "replace"),
        )

    @property
    def event_id(self) -> str:
        return self.headers.get(c.HEADER_ID, "")

    @property
    def where(self) -> str:
        return f"{self.topic}[{self.partition}]@{self.offset}"

    @property
    def timestamp_iso(self) -> str | None:
        return None if self.timestamp_ms is None else iso_utc_us(self.timestamp_ms * 1000)

    def as_json(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "partition": self.partition,
            "offset": self.offset,
            "timestamp": self.timestamp_iso,
            "key": self.key,
            "headers": self.headers,
            "value_size": self.value_size,
            "value_preview": self.value_preview,
        }


@dataclass(frozen=True, kw_only=True)
class ParkedRow:
    """The event's row in ``failed_sync_events`` (its retry history in brief)."""

    id: int
    sync_type: str
    status: str
    retry_count: int
    last_error: str | None
    next_retry_at: datetime | None
    created_at: datetime
    updated_at: datetime
    kafka_topic: str | None
    kafka_partition: int | None
    kafka_offset: int | None

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "event_type": self.sync_type,
            "status": self.status,
            "retry_count": self.retry_count,
            "last_error": self.last_error,
            "next_retry_at": self.next_retry_at.isoformat() if self.next_retry_at else None,
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
            "kafka": (
                f"{self.kafka_topic}[{self.kafka_partition}]@{self.kafka_offset}"
                if self.kafka_topic
                else None
            ),
        }


@dataclass(frozen=True, kw_only=True)
class GroupView:
    """One consumer group's committed offset on the record's partition."""

    group: str
    committed: int | None
    position: GroupPosition
    records_before: int | None  # records the group still has to process before this one

    def as_json(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "committed": self.committed,
            "position": self.position.value,
            "records_before": self.records_before,
        }


def group_view(group: str, committed: int | None, offset: int) -> GroupView:
    position = group_position(committed, offset)
    before = (
        offset - committed if committed is not None and position is GroupPosition.PENDING else None
    )
    return GroupView(group=group, committed=committed, position=position, records_before=before)


@dataclass(frozen=True, kw_only=True)
class SearchBounds:
    """Where the Kafka search looked."""

    since_ms: int
    since_source: str  # "outbox row" | "--since" | "default lookback"
    max_records: int
    topics: tuple[str, ...]
    truncated: tuple[str, ...] = ()  # partitions where max_records stopped the scan
    scanned: int = 0

    def as_json(self) -> dict[str, Any]:
        return {
            "since": iso_utc_us(self.since_ms * 1000),
            "since_from": self.since_source,
            "max_records_per_partition": self.max_records,
            "topics": list(self.topics),
            "truncated_partitions": list(self.truncated),
            "records_scanned": self.scanned,
        }

    def advice(self) -> str:
        """Which bound to widen, for a message."""
        hints = []
        if self.truncated:
            hints.append(
                f"--max-records (the scan stopped after {self.max_records} record(s) per"
                f" partition in {', '.join(self.truncated[:4])}"
                f"{' ...' if len(self.truncated) > 4 else ''})"
            )
        if self.since_source != "outbox row":
            hints.append(
                f"--since (the search began at {iso_utc_us(self.since_ms * 1000)},"
                f" {'as given' if self.since_source == '--since' else 'the default lookback'})"
            )
        return " or ".join(hints) if hints else "no bound: every record since then was read"


@dataclass(frozen=True, kw_only=True)
class EventTrace:
    """Everything found about one event, and the verdict."""

    event_id: str
    state: EventState
    sink_group: str
    outbox: OutboxRow | None
    record: FoundRecord | None
    dead_letter: FoundRecord | None
    parked: ParkedRow | None
    groups: tuple[GroupView, ...]
    bounds: SearchBounds

    @property
    def commit_lsn(self) -> str | None:
        found = self.record or self.dead_letter
        return found.headers.get(c.HEADER_LSN) if found else None

    @property
    def commit_ts(self) -> str | None:
        found = self.record or self.dead_letter
        if found is None:
            return None
        return found.headers.get(c.HEADER_COMMIT_TS) or found.timestamp_iso

    @property
    def summary(self) -> str:
        """One line: the verdict in words."""
        return describe(self)

    def as_json(self) -> dict[str, Any]:
        dlq = self.dead_letter
        return {
            "event_id": self.event_id,
            "state": self.state.value,
            "summary": self.summary,
            "commit": {"lsn": self.commit_lsn, "timestamp": self.commit_ts},
            "outbox_row": self.outbox.as_json() if self.outbox else None,
            "kafka_record": self.record.as_json() if self.record else None,
            "groups": [g.as_json() for g in self.groups],
            "sink_group": self.sink_group,
            "parked": self.parked.as_json() if self.parked else None,
            "dead_letter": None
            if dlq is None
            else {
                **dlq.as_json(),
                "reason": dlq.headers.get(c.HEADER_DLQ_REASON),
                "original_topic": dlq.headers.get(c.HEADER_DLQ_TOPIC) or None,  # (empty: none made)
            },
            "search": self.bounds.as_json(),
        }


def event_state(
    *,
    outbox: OutboxRow | None,
    record: FoundRecord | None,
    dead_letter: FoundRecord | None,
    parked: ParkedRow | None,
    sink_position: GroupPosition | None,
) -> EventState | None:
    """The verdict from what was found (see the module docstring); None: nothing found."""
    if parked is not None:
        return EventState.DELIVERED_ON_RETRY if parked.status == "DONE" else EventState.PARKED
    if dead_letter is not None:
        return EventState.DEAD_LETTERED
    if record is not None:
        consumed = sink_position is GroupPosition.CONSUMED
        return EventState.DELIVERED if consumed else EventState.PENDING
    if outbox is not None:
        return EventState.NOT_RELAYED
    return None


def describe(t: EventTrace) -> str:
    """The verdict of ``t`` as one sentence."""
    parked, dead = t.parked, t.dead_letter
    if t.state is EventState.PARKED and parked is not None:
        return (
            f"parked as failed_sync_events #{parked.id} ({parked.status}, {parked.retry_count}"
            f" retries): {parked.last_error or 'no error text'}"
        )
    if t.state is EventState.DELIVERED_ON_RETRY and parked is not None:
        return f"delivered on a retry of failed_sync_events #{parked.id}"
    if t.state is EventState.DEAD_LETTERED and dead is not None:
        return f"dead-lettered to {dead.where}: {dead.headers.get(c.HEADER_DLQ_REASON, '?')}"
    if t.state is EventState.DELIVERED:
        return f"delivered: group {t.sink_group} committed past {_where(t.record)}"
    if t.state is EventState.PENDING:
        return f"in Kafka at {_where(t.record)}; {_sink_position(t)}"
    return (
        "in the outbox, but no Kafka record found: the relay has not streamed it yet,"
        f" or it lies beyond the bounds (widen {t.bounds.advice()})"
    )


def _sink_position(t: EventTrace) -> str:
    sink = next((g for g in t.groups if g.group == t.sink_group), None)
    if sink is None or sink.position is GroupPosition.NO_COMMIT:
        return f"group {t.sink_group} has not committed on that partition yet"
    return f"group {t.sink_group} has {sink.records_before} record(s) to process before it"


def _where(record: FoundRecord | None) -> str:
    return record.where if record is not None else "?"
