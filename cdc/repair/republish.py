"""Publishing outbox rows again: one path for gap recovery, the start-up check, the audit repair.

A gap recovery (:func:`cdc.relay.gaps.recovery.recover`) streams its window's rows
through a :class:`~cdc.repair.publisher.Publisher`; the start-up check and the audit
repair chosen rows with :func:`republish`. Both produce the record the relay's
streaming path would have produced (:func:`outbox_record`: same topic, key, value
bytes and headers) plus the ``recovered`` header.

Guarantees (the publisher's - every record acknowledged, a refused one
dead-lettered, bounded Kafka transactions in exactly-once mode, an aborted one
redone - are :mod:`cdc.repair.publisher`'s):

* a row the router refuses is dead-lettered with the reason, never dropped;
* rows are published in commit order as far as the table knows it
  (:func:`order_column`: the commit time when ``track_commit_timestamp`` is on,
  else ``created_at``, then id): one aggregate's rows keep their order; a
  record's timestamp is its row's commit time (else ``created_at``);
* every topic is recorded as the relay's before its first record
  (:func:`topic_manager`), so the gap check reads its tail.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg import IsolationLevel, sql

from cdc import constants as c
from cdc import gaps
from cdc.evidence import recovery_rule
from cdc.kafka.producer import TopicManager
from cdc.outbox import table_identifier
from cdc.pgconn import Use
from cdc.pgconn import connect as pg_connect
from cdc.records import ID_BYTES
from cdc.repair.publisher import (
    DLQ_MAX_VALUE_BYTES,
    Acks,
    Again,
    Publisher,
    publishing_producer,
)
from cdc.repair.rows import (
    FETCH_ROWS,
    ORDER_ALIAS,
    WINDOW_PLAN,
    Ids,
    enough_for_window,
    fill_ids,
    republish_query,
    session_settings,
    window_query,
)
from cdc.repair.transactional import present_ids
from cdc.router import KafkaRecord, RouteError, TxContext, dead_letter, route_fields
from cdc.settings import Settings
from cdc.wal.slots import identify_system, in_snapshot

log = logging.getLogger("cdc.relay")

Conn = psycopg.Connection[Any]


def _one(conn: Conn, query: str) -> Any:
    """The one value ``query`` returns."""
    row = conn.execute(query).fetchone()
    assert row is not None
    return row[0]


def _connect(settings: Settings) -> Conn:
    """A connection for a run's reads and its topics' record (:data:`Use.WORK`)."""
    return pg_connect(settings.pg_dsn.get_secret_value(), Use.WORK)


def commit_time_tracked(conn: Conn) -> bool:
    """Whether the server records its transactions' commit times."""
    row = conn.execute("SHOW track_commit_timestamp").fetchone()
    return row is not None and str(row[0]).lower() == "on"


def order_column(conn: Conn, alias: str = "") -> sql.Composable:
    """The rows' commit time when the server tracks it, else their transaction's start."""
    return order_expression(commit_time_tracked(conn), alias)


def order_expression(tracked: bool, alias: str = "") -> sql.Composable:
    """:func:`order_column` when the server does (``tracked``) or does not track commit times."""
    prefix = f"{alias}." if alias else ""
    if tracked:
        return sql.SQL(f"COALESCE(pg_xact_commit_timestamp({prefix}xmin), {prefix}created_at)")
    return sql.SQL(f"{prefix}created_at")


def topic_manager(settings: Settings) -> TopicManager:
    """The topics of a recovery run outside the relay (the CLI): each recorded as the
    relay's before its first record (the relay's own manager does it through its ledger)."""

    def note(topics: list[str]) -> None:
        with _connect(settings) as conn:
            gaps.note_output(
                conn,
                settings.slot,
                gaps.OUTPUT_TOPIC,
                [t for t in topics if t != settings.dlq_topic],
            )

    return TopicManager(
        bootstrap=settings.kafka_bootstrap_servers,
        overrides=settings.kafka_config,
        partitions=settings.topic_partitions,
        replication_factor=settings.topic_replication_factor,
        before_first_use=note,
    )


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def epoch_us(ts: datetime) -> int:
    """A commit time as exact Unix microseconds (no float rounding)."""
    return (ts - _EPOCH) // timedelta(microseconds=1)


def outbox_record(
    row: tuple[Any, ...], tx: TxContext, settings: Settings, mark: bytes
) -> KafkaRecord:
    """The record of an outbox row (id, aggregate type and id, type, payload, trace) as
    the streaming path writes it - its dead letter if the router refuses it - plus
    ``recovered: mark``."""
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


#: A redo's rows by id: :data:`cdc.repair.rows.REPUBLISH_SQL`'s columns (and a gap
#: recovery's window query's), the order column ``{when}`` last.
_AGAIN_SQL = """
SELECT x.id::text, x.aggregatetype, x.aggregateid, x.type, x.payload::text,
       x.tracingspancontext, {when}
FROM {table} AS x WHERE x.id::uuid = ANY(%(ids)s::uuid[])
"""


def rows_again(
    settings: Settings,
    snapshot: str,
    *,
    tracked: bool,
    lsn: str,
    origin: tuple[str, bytes],
    mark: bytes,
) -> Again:
    """A run's redo source (:data:`cdc.repair.publisher.Again`): the records of the given
    event ids made again from their rows as the run read them - in the run's snapshot
    (``snapshot``: exported by the run's reading transaction, open while the run
    publishes), by id, as :func:`outbox_record` made them (``lsn``, ``origin``,
    ``mark`` the run's; ``tracked``: the server records commit times) - in the order
    given; a row the snapshot does not hold is passed by."""
    query = sql.SQL(_AGAIN_SQL).format(
        when=order_expression(tracked, "x"), table=table_identifier(settings.outbox_table)
    )

    def again(ids: list[str]) -> Iterator[KafkaRecord]:
        with _connect(settings) as conn:
            in_snapshot(conn, snapshot)
            rows = {row[0]: row for row in conn.execute(query, {"ids": ids})}
            conn.execute("COMMIT")
        for event_id in ids:
            row = rows.get(event_id)
            if row is not None:
                tx = TxContext(lsn, epoch_us(row[6]), origin)
                yield outbox_record(row, tx, settings, mark)

    return again


def republish(
    settings: Settings,
    ids: Ids,
    *,
    origin: str,
    mark: str,
    lsn: str = "",
    created: tuple[datetime, datetime] | None = None,
) -> int:
    """Publish the outbox rows ``ids`` (16-byte uuids, concatenated) again: the record
    the relay would have produced (same topic, key, value bytes and headers, ``origin``
    the given one, ``lsn`` the given position - a row's own commit LSN is not in the
    table - and the timestamp its commit time, else ``created_at``) plus
    ``recovered: mark``. The one re-publish path of chosen rows: the start-up check's
    (``verify``) and the audit's (``audit-<run id>``).

    The ids go to the server in chunks (a temporary table of the run's connection:
    memory stays bounded at any number of ids); the rows are streamed from one ordered
    query and published in commit order as far as the table knows it (commit time,
    else ``created_at``, then id) - ``created``: every id's row was created in
    ``[since, until)`` (the audit's window: the window's order may be taken,
    :mod:`cdc.repair.rows`); rows no longer in the table are skipped; a row the
    router or Kafka refuses is dead-lettered with the reason, never dropped. Returns
    the records published once Kafka acknowledged every one; any other Kafka error
    raises :class:`KafkaUnavailableError` (a second run
    republishes again, which is harmless: consumers dedupe on ``id``)."""
    if len(ids) % ID_BYTES:
        raise ValueError(f"ids must be {ID_BYTES}-byte uuids, concatenated")
    if not ids:
        return 0
    # (the start-up check and the audit run under the audit lock, never at once: one id
    # of theirs, apart from a gap recovery's, which may run alongside)
    producer, txs = publishing_producer(
        settings, system_id=origin.split("/", 1)[0], purpose="repair"
    )
    origin_header = (c.HEADER_ORIGIN, origin.encode())
    publisher = Publisher(
        settings, producer, topic_manager(settings), Acks(), tx=txs, origin=origin_header
    )
    marked = mark.encode()
    send = publisher.send
    try:
        with _connect(settings) as conn:
            session_settings(conn)
            tracked = commit_time_tracked(conn)
            table = table_identifier(settings.outbox_table)
            count = len(ids) // ID_BYTES
            by_window = created is not None and not tracked and enough_for_window(count)
            fill_ids(conn, ids, indexed=by_window)
            query = None
            if by_window:  # (the window's order when it fits: cdc.repair.rows)
                assert created is not None
                query = window_query(conn, table, created, count)
            log.info(
                "republishing %d rows, %s",
                count,
                "read in the window's order (an index on created_at)"
                if query is not None
                else "their places sorted by the server first",
            )
            conn.isolation_level = IsolationLevel.REPEATABLE_READ  # (a redo reads its snapshot)
            with conn.transaction():
                if query is not None:
                    conn.execute(WINDOW_PLAN)
                else:
                    query = republish_query(
                        table, order_expression(tracked, ORDER_ALIAS), by_commit_time=tracked
                    )
                # (a redo, and a record refused with its batch, read their rows in it)
                snapshot = str(_one(conn, "SELECT pg_export_snapshot()"))
                publisher.again = rows_again(
                    settings, snapshot, tracked=tracked, lsn=lsn, origin=origin_header, mark=marked
                )
                tx: TxContext | None = None
                tx_ts: datetime | None = None
                with conn.cursor() as cur:
                    for row in cur.stream(query, size=FETCH_ROWS):
                        if tx is None and txs is not None:
                            # exactly-once: only what Kafka does not hold; the rows come in
                            # commit order, so the first one's time is the earliest
                            # (only records of this server's lineage and slot vouch for an id)
                            server = identify_system(settings.pg_dsn.get_secret_value())
                            owner = recovery_rule(server, settings.slot)
                            txs.present = present_ids(settings, epoch_us(row[6]) // 1000, owner)
                        if tx is None or row[6] != tx_ts:  # (one transaction's rows: one time)
                            tx_ts = row[6]
                            tx = TxContext(lsn, epoch_us(row[6]), origin_header)
                        send(outbox_record(row, tx, settings, marked))
                # (inside the reading transaction: a redo reads the rows in its snapshot)
                publisher.wait_acked()
    finally:
        publisher.producer.flush(0)  # (a redo may have renewed it)
    if txs is not None:
        log.info(
            "republished %d records (%d rows already in Kafka skipped) in %d Kafka"
            " transactions of at most %d records (%d redone)",
            publisher.sent,
            txs.skipped,
            txs.committed,
            txs.max_records,
            publisher.redone,
        )
    return publisher.sent
