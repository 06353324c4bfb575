"""Where is event X? One view of an event's life: outbox commit -> Kafka -> groups -> engine.

Guarantees:

* Read-only. It reads the outbox table, ``failed_sync_events``, Kafka records
  (through :class:`sinks.ops.KafkaOps`: a throwaway consumer that only
  ``assign``s and never commits) and committed offsets. No offset moves, no row
  changes.
* Bounded. Kafka is searched from a time, never from the start of a topic:
  ``offsets_for_times`` of the commit time (the outbox row's ``created_at`` -
  the transaction's start - less :data:`CLOCK_SKEW_MS`), else ``--since``,
  else :data:`DEFAULT_LOOKBACK_S` ago; from there at most ``max_records`` per
  partition. Record timestamps are commit times (the record contract), so the
  record of a commit is never before that offset.
* Partitioner-independent. When the key is known, the partitions it maps to
  under Kafka's murmur2 (Java client, ``murmur2_random``) and librdkafka's
  CRC32 (``consistent_random``) are read first and an event-id search stops at
  its first match; the other partitions are read only when needed. A key search
  reads every partition of the topics (within the bounds), so it is complete
  whichever partitioner the relay uses.
* Complete where it looks: the dead-letter topic is searched too (a record is
  matched by its ``id`` header), the parking-lot row by ``outbox_event_id``,
  and every consumer group that committed on the record's partition is shown
  with its position relative to the record.
* Not found within the bounds -> :class:`TraceNotFound`, whose message names
  the bound to widen (``--since`` and/or ``--max-records``).
* The verdict (:func:`event_state`) is a pure function of what was found.

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
import uuid
import zlib
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psycopg
from confluent_kafka import ConsumerGroupTopicPartitions, KafkaException, TopicPartition
from psycopg import sql
from psycopg.rows import dict_row

from cdc import constants as c
from cdc.router import iso_utc_us
from cdc.settings import Settings
from sinks.core.delivery import Envelope
from sinks.errors import KafkaOpsError, OpsError
from sinks.ops.kafka import KAFKA_REQUEST_TIMEOUT_S, OPS_GROUP_PREFIX, SCAN_IDLE_TIMEOUT_S, KafkaOps
from sinks.ops.selection import default_topic_filter, now_ms, select_topics

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


# --- pure: partitions ------------------------------------------------------------------------

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


# --- what was found --------------------------------------------------------------------------


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
                f"--max-records (now {self.max_records}; the scan stopped early in "
                f"{', '.join(self.truncated[:4])}{' ...' if len(self.truncated) > 4 else ''})"
            )
        if self.since_source != "outbox row":
            hints.append(f"--since (now {iso_utc_us(self.since_ms * 1000)})")
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
                "original_topic": dlq.headers.get(c.HEADER_DLQ_TOPIC),
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


# --- the shell -------------------------------------------------------------------------------


def _uuid(text: str) -> str:
    try:
        return str(uuid.UUID(text))
    except ValueError as exc:
        raise OpsError(f"event id {text!r} is not a UUID") from exc


def _table(settings: Settings) -> sql.Composable:
    return sql.Identifier(*settings.outbox_table.split(".", 1))


_OUTBOX_COLUMNS = sql.SQL(
    "id::text AS id, aggregatetype, aggregateid, type, created_at, tracingspancontext"
)


def _outbox_row(r: Mapping[str, Any]) -> OutboxRow:
    return OutboxRow(
        event_id=r["id"],
        aggregate_type=r["aggregatetype"],
        aggregate_id=r["aggregateid"],
        event_type=r["type"],
        created_at=r["created_at"],
        traceparent=r["tracingspancontext"],
    )


def outbox_rows(
    conn: psycopg.Connection[Any],
    settings: Settings,
    *,
    event_id: str | None = None,
    key: str | None = None,
    since_ms: int | None = None,
) -> list[OutboxRow]:
    """The event's outbox row, or a key's rows created since ``since_ms`` (oldest first)."""
    if event_id is not None:
        query = sql.SQL("SELECT {} FROM {} WHERE id = %s").format(_OUTBOX_COLUMNS, _table(settings))
        params: tuple[Any, ...] = (event_id,)
    else:
        since = datetime.fromtimestamp((since_ms or 0) / 1000, UTC)
        query = sql.SQL(
            "SELECT {} FROM {} WHERE aggregateid = %s AND created_at >= %s"
            " ORDER BY created_at LIMIT %s"
        ).format(_OUTBOX_COLUMNS, _table(settings))
        params = (key, since, MAX_KEY_ROWS)
    with conn.cursor(row_factory=dict_row) as cur:
        try:
            cur.execute(query, params)
        except psycopg.errors.UndefinedTable as exc:
            raise OpsError(f"outbox table {settings.outbox_table} does not exist") from exc
        return [_outbox_row(r) for r in cur.fetchall()]


def parked_row(conn: psycopg.Connection[Any], event_id: str) -> ParkedRow | None:
    """The event's ``failed_sync_events`` row, if it was ever parked."""
    with conn.cursor(row_factory=dict_row) as cur:
        try:
            cur.execute(
                "SELECT event_id, event_type, status, retry_count, last_error, next_retry_at,"
                " created_at, updated_at, kafka_topic, kafka_partition, kafka_offset"
                " FROM failed_sync_events WHERE outbox_event_id = %s",
                (event_id,),
            )
        except psycopg.errors.UndefinedTable:
            return None  # no sink ever ran on this database: nothing was parked
        r = cur.fetchone()
    if r is None:
        return None
    return ParkedRow(
        id=r["event_id"],
        sync_type=r["event_type"],
        status=r["status"],
        retry_count=r["retry_count"],
        last_error=r["last_error"],
        next_retry_at=r["next_retry_at"],
        created_at=r["created_at"],
        updated_at=r["updated_at"],
        kafka_topic=r["kafka_topic"],
        kafka_partition=r["kafka_partition"],
        kafka_offset=r["kafka_offset"],
    )


@dataclass
class _Scan:
    """Accumulates what a bounded search read."""

    since_ms: int
    max_records: int
    truncated: list[str] = field(default_factory=list)
    scanned: int = 0


def _partition_counts(kafka: KafkaOps, topics: Sequence[str]) -> dict[str, int]:
    try:
        meta = kafka.consumer.list_topics(timeout=KAFKA_REQUEST_TIMEOUT_S).topics
    except KafkaException as exc:
        raise KafkaOpsError(f"Kafka metadata: {exc}") from exc
    return {t: len(meta[t].partitions) for t in topics if t in meta and meta[t].error is None}


def _existing_topics(kafka: KafkaOps, accept: Callable[[str], bool]) -> list[str]:
    try:
        names = kafka.consumer.list_topics(timeout=KAFKA_REQUEST_TIMEOUT_S).topics
    except KafkaException as exc:
        raise KafkaOpsError(f"Kafka metadata: {exc}") from exc
    return select_topics(names, accept)


def _search(
    kafka: KafkaOps,
    tps: Sequence[TP],
    scan: _Scan,
    match: Callable[[Envelope], bool],
    *,
    stop_at_first: bool,
) -> list[Envelope]:
    """Matching records of ``tps`` read from the scan's time, at most max_records each."""
    if not tps:
        return []
    marks = kafka.watermarks(tps)
    by_time = kafka.offsets_for_time(list(tps), scan.since_ms)
    starts: dict[TP, int] = {}
    ends: dict[TP, int] = {}
    for tp in tps:
        low, high = marks[tp]
        first, end, truncated = scan_window(
            by_time.get(tp), low=low, high=high, max_records=scan.max_records
        )
        starts[tp], ends[tp] = first, end
        if truncated:
            scan.truncated.append(f"{tp[0]}[{tp[1]}]")
    found: list[Envelope] = []
    records = kafka.read(starts, ends=ends, idle_timeout_s=SCAN_IDLE_TIMEOUT_S)
    try:
        for record in records:
            scan.scanned += 1
            if match(record):
                found.append(record)
                if stop_at_first:
                    break
    finally:  # the reader unassigns now, not whenever the generator is collected
        if isinstance(records, Generator):
            records.close()
    return found


def _find(
    kafka: KafkaOps,
    topics: Sequence[str],
    scan: _Scan,
    match: Callable[[Envelope], bool],
    *,
    key: bytes | None,
    stop_at_first: bool,
) -> list[Envelope]:
    """Search the key's likely partitions first, then (if still needed) the others."""
    counts = _partition_counts(kafka, topics)
    tps = [(t, p) for t, n in counts.items() for p in range(n)]
    first, rest = search_order(tps, counts, key)
    found = _search(kafka, first, scan, match, stop_at_first=stop_at_first)
    if found and stop_at_first:
        return found
    return found + _search(kafka, rest, scan, match, stop_at_first=stop_at_first)


def _group_views(kafka: KafkaOps, sink_group: str, tp: TP, offset: int) -> tuple[GroupView, ...]:
    """Every group that committed on ``tp`` (and the sink's group in any case)."""
    try:
        listed = kafka.admin.list_consumer_groups(request_timeout=KAFKA_REQUEST_TIMEOUT_S).result(
            timeout=KAFKA_REQUEST_TIMEOUT_S
        )
    except KafkaException as exc:
        raise KafkaOpsError(f"list consumer groups: {exc}") from exc
    names = sorted(
        {g.group_id for g in listed.valid if not g.group_id.startswith(OPS_GROUP_PREFIX)}
        | {sink_group}
    )
    futures = {
        name: kafka.admin.list_consumer_group_offsets(
            [ConsumerGroupTopicPartitions(name, [TopicPartition(tp[0], tp[1])])],
            request_timeout=KAFKA_REQUEST_TIMEOUT_S,
        )[name]
        for name in names
    }
    views = []
    for name, future in futures.items():
        try:
            result = future.result(timeout=KAFKA_REQUEST_TIMEOUT_S)
        except KafkaException as exc:
            raise KafkaOpsError(f"committed offsets of group {name}: {exc}") from exc
        committed = next((int(p.offset) for p in result.topic_partitions if p.offset >= 0), None)
        if committed is None and name != sink_group:
            continue  # not a consumer of this partition
        views.append(group_view(name, committed, offset))
    return tuple(views)


def _since(settings_since_ms: int | None, rows: Sequence[OutboxRow], at_ms: int) -> tuple[int, str]:
    if settings_since_ms is not None:
        return settings_since_ms, "--since"
    if rows:
        created = min(r.created_at for r in rows)
        return int(created.timestamp() * 1000) - CLOCK_SKEW_MS, "outbox row"
    return at_ms - DEFAULT_LOOKBACK_S * 1000, "default lookback"


def _assemble(
    kafka: KafkaOps,
    conn: psycopg.Connection[Any],
    *,
    event_id: str,
    sink_group: str,
    outbox: OutboxRow | None,
    records: Sequence[Envelope],
    dead_letters: Sequence[Envelope],
    bounds: SearchBounds,
) -> EventTrace | None:
    record = FoundRecord.of(records[0]) if records else None
    dead = FoundRecord.of(dead_letters[0]) if dead_letters else None
    shown = record or dead
    groups: tuple[GroupView, ...] = ()
    if shown is not None:
        groups = _group_views(kafka, sink_group, (shown.topic, shown.partition), shown.offset)
    sink = next((g.position for g in groups if g.group == sink_group and record), None)
    parked = parked_row(conn, event_id)
    state = event_state(
        outbox=outbox, record=record, dead_letter=dead, parked=parked, sink_position=sink
    )
    if state is None:
        return None
    return EventTrace(
        event_id=event_id,
        state=state,
        sink_group=sink_group,
        outbox=outbox,
        record=record,
        dead_letter=dead,
        parked=parked,
        groups=groups,
        bounds=bounds,
    )


def _topics_for(kafka: KafkaOps, settings: Settings, rows: Sequence[OutboxRow]) -> list[str]:
    if rows:
        wanted = {settings.topic_prefix + r.aggregate_type for r in rows}
        return _existing_topics(kafka, wanted.__contains__)
    return _existing_topics(kafka, default_topic_filter(settings))


def trace_event(
    settings: Settings,
    event_id: str,
    *,
    since_ms: int | None = None,
    max_records: int = DEFAULT_MAX_RECORDS,
    group: str | None = None,
    at_ms: int | None = None,
) -> EventTrace:
    """Everything about one event (see the module docstring); :class:`TraceNotFound` else."""
    settings.require("pg_dsn", "kafka_bootstrap_servers")
    event_id = _uuid(event_id)
    sink_group = group or settings.sink_group_id
    with psycopg.connect(
        settings.pg_dsn.get_secret_value(), autocommit=True, connect_timeout=10
    ) as conn:
        rows = outbox_rows(conn, settings, event_id=event_id)
        since, source = _since(since_ms, rows, now_ms() if at_ms is None else at_ms)
        scan = _Scan(since, max_records)
        key = rows[0].aggregate_id.encode() if rows else None

        def match(env: Envelope) -> bool:
            return env.headers.get(c.HEADER_ID) == event_id.encode()

        with KafkaOps(settings) as kafka:
            topics = _topics_for(kafka, settings, rows)
            records = _find(kafka, topics, scan, match, key=key, stop_at_first=True)
            dlq_topics = _existing_topics(kafka, lambda t: t == settings.dlq_topic)
            dead = (
                []
                if records
                else _find(kafka, dlq_topics, scan, match, key=key, stop_at_first=True)
            )
            bounds = _bounds(scan, source, [*topics, *dlq_topics])
            trace = _assemble(
                kafka,
                conn,
                event_id=event_id,
                sink_group=sink_group,
                outbox=rows[0] if rows else None,
                records=records,
                dead_letters=dead,
                bounds=bounds,
            )
    if trace is None:
        raise TraceNotFound(
            f"event {event_id} not found: no outbox row, no parked row, and no record with"
            f" that id among {bounds.scanned} record(s) of {', '.join(bounds.topics) or 'no topic'}"
            f" committed since {iso_utc_us(since * 1000)}; widen {bounds.advice()}"
        )
    return trace


def _bounds(scan: _Scan, source: str, topics: Sequence[str]) -> SearchBounds:
    return SearchBounds(
        since_ms=scan.since_ms,
        since_source=source,
        max_records=scan.max_records,
        topics=tuple(topics),
        truncated=tuple(scan.truncated),
        scanned=scan.scanned,
    )


def trace_key(
    settings: Settings,
    key: str,
    *,
    since_ms: int | None = None,
    max_records: int = DEFAULT_MAX_RECORDS,
    group: str | None = None,
    at_ms: int | None = None,
) -> list[EventTrace]:
    """Every event of aggregate ``key`` committed since ``since_ms`` (default: the lookback),
    in commit order; :class:`TraceNotFound` when there is none within the bounds."""
    settings.require("pg_dsn", "kafka_bootstrap_servers")
    sink_group = group or settings.sink_group_id
    now = now_ms() if at_ms is None else at_ms
    since = since_ms if since_ms is not None else now - DEFAULT_LOOKBACK_S * 1000
    source = "--since" if since_ms is not None else "default lookback"
    raw = key.encode()
    with psycopg.connect(
        settings.pg_dsn.get_secret_value(), autocommit=True, connect_timeout=10
    ) as conn:
        rows = outbox_rows(conn, settings, key=key, since_ms=since)
        scan = _Scan(since, max_records)
        with KafkaOps(settings) as kafka:
            sink_topic = default_topic_filter(settings)
            topics = _existing_topics(kafka, lambda t: sink_topic(t) or t == settings.dlq_topic)

            row_ids = {r.event_id.encode() for r in rows}

            def match(env: Envelope) -> bool:  # the key, or the id of one of its rows
                return env.key == raw or env.headers.get(c.HEADER_ID) in row_ids

            found = _find(kafka, topics, scan, match, key=raw, stop_at_first=False)
            bounds = _bounds(scan, source, topics)
            traces = _key_traces(kafka, conn, settings, sink_group, rows, found, bounds)
    if not traces:
        raise TraceNotFound(
            f"no event with key {key!r}: no outbox row created and no record among"
            f" {bounds.scanned} record(s) of {', '.join(topics) or 'no topic'} since"
            f" {iso_utc_us(since * 1000)}; widen {bounds.advice()}"
        )
    return traces


def _key_traces(
    kafka: KafkaOps,
    conn: psycopg.Connection[Any],
    settings: Settings,
    sink_group: str,
    rows: Sequence[OutboxRow],
    found: Sequence[Envelope],
    bounds: SearchBounds,
) -> list[EventTrace]:
    """One trace per event id seen in the rows or the records, ordered by commit."""
    by_id: dict[str, tuple[list[Envelope], list[Envelope]]] = {}
    for env in found:
        records, dead = by_id.setdefault(env.event_id, ([], []))
        (dead if env.topic == settings.dlq_topic else records).append(env)
    row_of = {r.event_id: r for r in rows}
    ids = list(dict.fromkeys([*(e.event_id for e in found), *row_of]))
    traces = []
    for event_id in ids:
        if not event_id:
            continue
        records, dead = by_id.get(event_id, ([], []))
        trace = _assemble(
            kafka,
            conn,
            event_id=event_id,
            sink_group=sink_group,
            outbox=row_of.get(event_id),
            records=records,
            dead_letters=dead,
            bounds=bounds,
        )
        if trace is not None:
            traces.append(trace)
    traces.sort(key=_commit_order)
    return traces


def _commit_order(t: EventTrace) -> tuple[str, str]:
    created = t.outbox.created_at.isoformat() if t.outbox else ""
    return (t.commit_ts or created or "~", t.event_id)
