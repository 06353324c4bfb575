"""Finding a slot gap and closing it: recovery from the outbox table, or an accepted loss.

Guarantees:

* :func:`inspect` reads only (the slot, ``IDENTIFY_SYSTEM``, the tails of the
  outbox topics, the slot history) and gives :func:`cdc.relay.gap.decide`'s verdict;
* :func:`open_gap` writes the gap ``open`` in the slot history before anything
  is done about it (so a recovery that dies half-way is done again);
* :func:`recover` creates the new slot **with an exported snapshot**, reads in
  that snapshot every outbox row of the gap's window (``created_at`` - or the
  commit time when ``track_commit_timestamp`` is on - at or after the window's
  start), in commit order as far as the table knows it (commit time, else
  ``created_at``, then id: one aggregate's rows keep their order), publishes them
  through the router (the streaming path's record, plus the ``recovered``
  header), waits for Kafka to acknowledge every one, and only then marks the
  gap recovered. The slot then streams from its consistent point: every
  transaction committed before it is in the snapshot, every later one in the
  slot. A row that cannot become a record is dead-lettered, never dropped. Any
  Kafka error raises; the gap stays open and the next attempt starts over
  (re-publishing is harmless: consumers dedupe on ``id``);
* :func:`accept_loss` creates the slot without recovering and records who accepted
  which window; it is the only way out of an unrecoverable gap.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from confluent_kafka import KafkaError, KafkaException, Message, Producer
from psycopg import sql

from cdc import constants as c
from cdc import gaps
from cdc.errors import CdcError, KafkaUnavailableError, SlotInUseError
from cdc.lineage import LastRecord, last_published, origin_value
from cdc.outbox import table_identifier
from cdc.producer import IdsInFlight, TopicManager, is_record_error, make_producer
from cdc.relay.gap import Action, Verdict, decide, unrecoverable_reason
from cdc.relay.standby_safe import wait_standby_flushed
from cdc.router import KafkaRecord, RouteError, TxContext, dead_letter, route_fields
from cdc.settings import Settings
from cdc.wal.replproto import lsn_to_str
from cdc.wal.slots import (
    ServerIdentity,
    SlotRow,
    exported_slot,
    identify_system,
    in_snapshot,
    read_slot,
)
from cdc.wal.stream import publication_row_filter, resolve_table

log = logging.getLogger("cdc.relay")

Conn = psycopg.Connection[Any]

#: Rows per chunk of the recovery's streamed query.
FETCH_ROWS = 2_000
#: Records produced between two polls of the delivery reports (the queue's room is
#: polled for as well whenever it is full).
POLL_EVERY = 100
#: Longest wait for Kafka to acknowledge the recovered records.
ACK_TIMEOUT_S = 120.0
#: A dead letter's value above this is replaced by a note (as the streaming path does).
DLQ_MAX_VALUE_BYTES = 512 * 1024


class GapUnrecoverableError(CdcError):
    """The outbox table cannot replay the gap: only `slot accept-gap` ends it."""


@dataclass(frozen=True)
class Inspection:
    """Everything the gap check read, and its verdict."""

    slot: SlotRow | None
    server: ServerIdentity
    last: LastRecord | None
    history: gaps.HistoryRow | None
    verdict: Verdict


def connect(settings: Settings) -> Conn:
    return psycopg.connect(settings.pg_dsn.get_secret_value(), autocommit=True, connect_timeout=10)


def inspect(settings: Settings, *, slot_survives_failover: bool = False) -> Inspection:
    """Read the slot, the server, Kafka and the history; decide (reads only)."""
    dsn = settings.pg_dsn.get_secret_value()
    try:
        last = last_published(settings)
    except KafkaException as exc:
        raise KafkaUnavailableError(f"cannot read the outbox topics' tails: {exc}") from exc
    server = identify_system(dsn)
    with connect(settings) as conn:
        slot = read_slot(conn, settings.slot)
        history = gaps.latest(conn, settings.slot)
    verdict = decide(
        slot_name=settings.slot,
        slot=slot,
        server=server,
        last=last,
        history=history,
        margin_s=settings.gap_margin_s,
        slot_survives_failover=slot_survives_failover,
    )
    return Inspection(slot, server, last, history, verdict)


def open_gap(settings: Settings, found: Inspection) -> gaps.HistoryRow:
    """The gap's history row: the open one found, or a new one written now."""
    verdict = found.verdict
    assert verdict.action is Action.GAP and verdict.cause is not None
    with connect(settings) as conn:
        if verdict.gap_id is None:
            reason = why_unrecoverable(conn, settings, found.last)
            last = found.last
            gaps.record_gap(
                conn,
                gaps.NewGap(
                    slot=settings.slot,
                    cause=verdict.cause.value,
                    detail=verdict.detail + (f"; {reason}" if reason else ""),
                    last_published_ts=last.commit_ts if last else None,
                    last_published_origin=str(last.origin) if last and last.origin else None,
                    window_start=verdict.window_start,
                    unrecoverable=reason is not None,
                ),
            )
        row = gaps.latest(conn, settings.slot)
    assert row is not None and row.is_open
    return row


def why_unrecoverable(conn: Conn, settings: Settings, last: LastRecord | None) -> str | None:
    """Why the table cannot replay a gap after ``last`` (None: it can)."""
    ids_in_table = 0
    if last is not None and last.newest_ids and settings.outbox_keeps_rows:
        row = conn.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE id::text = ANY(%s)").format(
                table_identifier(settings.outbox_table)
            ),
            (list(last.newest_ids),),
        ).fetchone()
        ids_in_table = int(row[0]) if row else 0
    horizon = datetime.now(UTC) - timedelta(seconds=settings.recovery_horizon_s)
    return unrecoverable_reason(
        keeps_rows=settings.outbox_keeps_rows,
        last=last,
        ids_in_table=ids_in_table,
        horizon_start=horizon,
    )


def _order_column(conn: Conn) -> sql.Composable:
    """The rows' commit time when the server tracks it, else their transaction's start."""
    row = conn.execute("SHOW track_commit_timestamp").fetchone()
    if row is not None and str(row[0]).lower() == "on":
        return sql.SQL("COALESCE(pg_xact_commit_timestamp(xmin), created_at)")
    return sql.SQL("created_at")


def _window_query(conn: Conn, settings: Settings, start: datetime | None) -> sql.Composed:
    """The window's rows in commit order: those of the publication's row filter only
    (a shard of the outbox, ``CDC_PUBLICATION_FILTERED``): the other shares are the
    other relays' to recover."""
    when = _order_column(conn)
    schema, name = resolve_table(conn, settings.outbox_table)
    conditions: list[sql.Composable] = []
    if start is not None:
        conditions.append(sql.SQL("{} >= %s").format(when))
    row_filter = publication_row_filter(conn, settings.publication, schema, name)
    if row_filter is not None:  # the server's own text of the filter (pg_publication_tables)
        conditions.append(sql.SQL("(" + row_filter + ")"))
    where = sql.SQL("WHERE ") + sql.SQL(" AND ").join(conditions) if conditions else sql.SQL("")
    return sql.SQL(
        "SELECT id::text, aggregatetype, aggregateid, type, payload::text, tracingspancontext,"
        " {when} AS ts FROM {table} {where} ORDER BY ts, created_at, id"
    ).format(when=when, table=sql.Identifier(schema, name), where=where)


def count_window(settings: Settings, start: datetime | None) -> int:
    """Outbox rows in a window starting at ``start`` (the dry run's count)."""
    with connect(settings) as conn:
        query = sql.SQL("SELECT count(*) FROM ({}) AS w").format(
            _window_query(conn, settings, start)
        )
        row = conn.execute(query, (start,) if start is not None else ()).fetchone()
    return int(row[0]) if row else 0


def _clear_slot(settings: Settings) -> None:
    """Drop the slot the gap left (lost, half-made or of another origin); refuse if active."""
    with connect(settings) as conn:
        slot = read_slot(conn, settings.slot)
        if slot is None:
            return
        if slot.active:
            raise SlotInUseError(f"slot {settings.slot} is active: another process streams it")
        log.warning(
            "dropping slot %s (wal_status %s) to make it again with a snapshot",
            settings.slot,
            slot.wal_status,
        )
        conn.execute("SELECT pg_drop_replication_slot(%s)", (settings.slot,))


class _Acks:
    """Failed delivery reports of the recovery's records: records Kafka refused for
    themselves (to dead-letter), the first other error. The producer runs with
    ``delivery.report.only.error``: a delivered record calls nothing, and
    ``flush()`` returning 0 means every report was served."""

    def __init__(self) -> None:
        self.refused: list[tuple[KafkaError, KafkaRecord]] = []
        self.error: KafkaError | None = None

    def failed(self, err: KafkaError, msg: Message, event_id: bytes | None) -> None:
        if is_record_error(err):
            self.refused.append((err, _refused_record(msg, event_id)))
        else:
            self.error = self.error or err


class _Run(IdsInFlight):
    """The delivery-report callback of up to :data:`RUN_RECORDS` recovered records:
    a failed report finds its record's event id (reports carry no headers)."""

    __slots__ = ("acks",)

    acks: _Acks

    def __call__(self, err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            self.acks.failed(err, msg, self.event_id_of(msg) if is_record_error(err) else None)


#: Records that share one :class:`_Run` (it is freed once all their reports are served).
RUN_RECORDS = 1_000


#: A dead letter Kafka refused for its size is sent again with every field cut to this.
DLQ_MINIMAL_FIELD_BYTES = 1024


def _refused_record(msg: Message, event_id: bytes | None) -> KafkaRecord:
    """A refused record back from its delivery report, with the event id its run
    found (the report itself carries no headers)."""
    headers = [(c.HEADER_ID, event_id)] if event_id else []
    return KafkaRecord(
        str(msg.topic()),
        msg.key() or b"",
        msg.value() or b"",
        headers,
        int(msg.timestamp()[1]),
        (event_id or b"").decode(errors="replace"),
    )


def _dead_letter_of(err: KafkaError, record: KafkaRecord, settings: Settings) -> KafkaRecord:
    """The dead letter of a recovered record Kafka refused (as the streaming path writes
    it); the minimal form when the refused record is itself a dead letter."""
    minimal = record.topic == settings.dlq_topic
    if minimal and b'"original_key_size"' in record.value:  # already the minimal form
        raise KafkaUnavailableError(f"recovery: Kafka refused a dead letter: {err.str()}")
    return dead_letter(
        reason=f"Kafka refused the record: {err.str()}",
        event_id=record.event_id,
        original_topic=record.topic,
        key=record.key,
        raw=record.value,
        headers=record.headers,
        tx=TxContext("", record.timestamp_ms * 1000),
        dlq_topic=settings.dlq_topic,
        max_value_bytes=0 if minimal else DLQ_MAX_VALUE_BYTES,
        max_field_bytes=DLQ_MINIMAL_FIELD_BYTES if minimal else None,
    )


@dataclass
class _Publisher:
    settings: Settings
    producer: Producer
    topics: TopicManager
    acks: _Acks
    sent: int = 0
    run: _Run | None = None

    def send(self, record: KafkaRecord) -> None:
        if record.topic not in self.topics.known:
            self.topics.ensure([record.topic])
        run = self.run
        if run is None or len(run) >= RUN_RECORDS:
            run = self.run = _Run()
            run.acks = self.acks
        while True:
            try:
                # Positional (topic, value, key, partition, callback, on_delivery,
                # timestamp, headers), as the streaming path: keywords cost a tenth.
                self.producer.produce(
                    record.topic,
                    record.value,
                    record.key,
                    -1,
                    run,
                    None,
                    record.timestamp_ms,
                    record.headers,  # type: ignore[arg-type]  # (list is invariant)
                )
                break
            except BufferError:
                self.producer.poll(0.1)
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if isinstance(err, KafkaError) and is_record_error(err):
                    record = _dead_letter_of(err, record, self.settings)
                    continue
                raise KafkaUnavailableError(f"recovery produce failed: {exc}") from exc
        run.append((hash((record.key, record.value)), record.event_id.encode()))
        self.sent += 1
        if not self.sent % POLL_EVERY:  # delivery reports: served in batches, not per row
            self.producer.poll(0)

    def wait_acked(self) -> None:
        """Until Kafka acknowledged every record; refused ones are dead-lettered (and
        acknowledged) first; any other error raises (the gap stays open)."""
        self.run = None  # (its reports can free it)
        deadline = time.monotonic() + ACK_TIMEOUT_S
        while True:
            left = self.producer.flush(1.0)  # (serves the reports)
            if self.acks.error is not None:
                raise KafkaUnavailableError(f"recovery: Kafka error: {self.acks.error}")
            if self.acks.refused:
                self._dead_letter_refused()
                self.run = None
                continue
            if not left:
                return
            if time.monotonic() > deadline:
                raise KafkaUnavailableError(f"recovery: {left} records not acknowledged")

    def _dead_letter_refused(self) -> None:
        refused, self.acks.refused = self.acks.refused, []
        for err, record in refused:
            self.sent -= 1  # the refused record is replaced by its dead letter
            self.send(_dead_letter_of(err, record, self.settings))


def topic_manager(settings: Settings) -> TopicManager:
    return TopicManager(
        bootstrap=settings.kafka_bootstrap_servers,
        overrides=settings.kafka_config,
        partitions=settings.topic_partitions,
        replication_factor=settings.topic_replication_factor,
    )


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _epoch_us(ts: datetime) -> int:
    """A commit time as exact Unix microseconds (no float rounding)."""
    return (ts - _EPOCH) // timedelta(microseconds=1)


def _record(row: tuple[Any, ...], tx: TxContext, settings: Settings, mark: bytes) -> KafkaRecord:
    event_id, aggtype, aggid, etype, payload, trace = row[:6]
    try:
        record = route_fields(
            event_id, aggtype, aggid, etype, payload, trace, tx, settings.topic_prefix
        )
    except RouteError as exc:
        record = dead_letter(
            reason=exc.reason,
            event_id=exc.event_id or str(event_id or ""),
            original_topic=settings.topic_prefix + str(aggtype or ""),
            key=str(aggid or "").encode(),
            raw=exc.raw,
            headers=[],
            tx=tx,
            dlq_topic=settings.dlq_topic,
            max_value_bytes=DLQ_MAX_VALUE_BYTES,
        )
    record.headers.append((c.HEADER_RECOVERED, mark))
    return record


def recover(
    settings: Settings, gap: gaps.HistoryRow, *, topics: TopicManager | None = None
) -> gaps.Recovered:
    """Close ``gap`` from the outbox table (see the module docstring)."""
    if gap.unrecoverable:
        raise GapUnrecoverableError(
            f"gap {gap.id} cannot be recovered ({gap.detail}): `outbox-cdc slot accept-gap`"
        )
    started = time.monotonic()
    with connect(settings) as lock:
        _lock_recovery(lock, settings)
        done = _recover(settings, gap, topics, started)
        gaps.mark_recovered(lock, gap.id, done)
    return done


def _lock_recovery(conn: Conn, settings: Settings) -> None:
    """One recovery of a slot at a time (two relays, or a relay and the CLI)."""
    row = conn.execute(
        "SELECT pg_try_advisory_lock(hashtext(%s))", (f"outbox_cdc_recovery:{settings.slot}",)
    ).fetchone()
    if not row or not row[0]:
        raise SlotInUseError(f"another process is recovering slot {settings.slot}")


def _recover(
    settings: Settings, gap: gaps.HistoryRow, topics: TopicManager | None, started: float
) -> gaps.Recovered:
    dsn = settings.pg_dsn.get_secret_value()
    _clear_slot(settings)
    server = identify_system(dsn)
    origin = origin_value(server, settings.slot)
    acks = _Acks()
    # Delivered records call nothing (a _Run per RUN_RECORDS finds a refused one's id).
    producer = make_producer(
        settings.kafka_bootstrap_servers, settings.kafka_config, failed_reports_only=True
    )
    publisher = _Publisher(settings, producer, topics or topic_manager(settings), acks)
    mark = str(gap.id).encode()
    origin_header = (c.HEADER_ORIGIN, origin.encode())
    try:
        with (
            exported_slot(dsn, settings.slot, failover=settings.failover_slot) as made,
            connect(settings) as conn,
        ):
            in_snapshot(conn, made.snapshot)
            if settings.standby_safe:  # every row of the snapshot on the standby first
                wait_standby_flushed(settings, made.consistent_lsn)
            window_end = datetime.now(UTC)
            lsn = lsn_to_str(made.consistent_lsn)
            query = _window_query(conn, settings, gap.window_start)
            params = (gap.window_start,) if gap.window_start is not None else ()
            # Streamed (chunks of FETCH_ROWS as the server sends them): the server
            # keeps sending while the rows are published; a server-side cursor waited
            # for a round trip per FETCH (half the loop's time, docs/performance.md).
            with conn.cursor() as cur:
                tx, tx_ts = None, None
                for row in cur.stream(query, params, size=FETCH_ROWS):
                    if row[6] != tx_ts:  # rows of one transaction share its commit time
                        tx_ts = row[6]
                        tx = TxContext(lsn, _epoch_us(tx_ts), origin_header)
                    assert tx is not None
                    publisher.send(_record(row, tx, settings, mark))
            conn.execute("COMMIT")
        publisher.wait_acked()
    finally:
        producer.flush(0)
    return gaps.Recovered(
        window_start=gap.window_start,
        window_end=window_end,
        origin=origin,
        consistent_lsn=lsn,
        rows=publisher.sent,
        seconds=time.monotonic() - started,
    )


def accept_loss(settings: Settings, gap: gaps.HistoryRow, *, by: str) -> str:
    """Create the slot without recovering; record that ``by`` accepted the loss. The origin."""
    dsn = settings.pg_dsn.get_secret_value()
    _clear_slot(settings)
    server = identify_system(dsn)
    origin = origin_value(server, settings.slot)
    with (
        exported_slot(dsn, settings.slot, failover=settings.failover_slot) as made,
        connect(settings) as conn,
    ):
        gaps.mark_accepted(
            conn, gap.id, by=by, origin=origin, consistent_lsn=lsn_to_str(made.consistent_lsn)
        )
    return origin
