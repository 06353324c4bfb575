"""Where is event X? The search: the outbox table, Kafka, the consumer groups, the parking lot.

Guarantees:

* Read-only. It reads the outbox table, ``failed_sync_events``, Kafka records
  (through :class:`sinks.ops.kafka.KafkaOps`: a throwaway consumer that only
  ``assign``s and never commits) and committed offsets. No offset moves, no row
  changes.
* Bounded. Kafka is searched from a time, never from the start of a topic:
  ``offsets_for_times`` of the commit time (the outbox row's ``created_at`` -
  the transaction's start - less :data:`~sinks.trace.model.CLOCK_SKEW_MS`), else
  ``--since``, else :data:`~sinks.trace.model.DEFAULT_LOOKBACK_S` ago; from
  there at most ``max_records`` per partition. Record timestamps are commit
  times (the record contract), so the record of a commit is never before that
  offset.
* Partitioner-independent. When the key is known, the partitions it maps to
  under either partitioner are read first and an event-id search stops at its
  first match; the other partitions are read only when needed. A key search
  reads every partition of the topics (within the bounds), so it is complete
  whichever partitioner the relay uses.
* Complete where it looks: the dead-letter topic is searched too (a record is
  matched by its ``id`` header), the parking-lot row by ``outbox_event_id``,
  and every consumer group that committed on the record's partition is shown
  with its position relative to the record.
* Not found within the bounds -> :class:`~sinks.trace.model.TraceNotFound`,
  whose message names the bound to widen (``--since`` and/or ``--max-records``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psycopg
from confluent_kafka import KafkaException
from psycopg import sql
from psycopg.rows import dict_row

from cdc import constants as c
from cdc.router import iso_utc_us
from cdc.settings import Settings
from sinks.core.delivery import Envelope
from sinks.ops.errors import KafkaOpsError, OpsError
from sinks.ops.kafka import KAFKA_REQUEST_TIMEOUT_S, OPS_GROUP_PREFIX, SCAN_IDLE_TIMEOUT_S, KafkaOps
from sinks.ops.selection import default_topic_filter, now_ms, select_topics

#: Records read per partition at most, from the start offset (``--max-records``).
from sinks.trace.model import (
    CLOCK_SKEW_MS,
    DEFAULT_LOOKBACK_S,
    DEFAULT_MAX_RECORDS,
    MAX_KEY_ROWS,
    TP,
    EventTrace,
    FoundRecord,
    GroupView,
    OutboxRow,
    ParkedRow,
    SearchBounds,
    TraceNotFound,
    event_state,
    group_view,
    scan_window,
    search_order,
)


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
    views = []
    for name in names:  # KafkaOps.committed: never the AdminClient's (it crashes librdkafka)
        committed = kafka.committed(name, [tp])[tp]
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
            if group is not None:
                kafka.require_group(group)
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
            if group is not None:
                kafka.require_group(group)
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
