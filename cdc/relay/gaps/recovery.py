"""Finding a slot gap and closing it: recovery from the outbox table, or an accepted loss.

Guarantees:

* :func:`inspect` reads only (the slot, ``IDENTIFY_SYSTEM`` with the timeline's
  ancestors, the slot history with the row that made the slot, the tails of the
  topics the relay published to - only its own records count, :mod:`cdc.lineage`
  - and, at a first start, whether the outbox is empty) and gives
  :func:`cdc.relay.gaps.gap.decide`'s verdict. A slot of another plugin or database
  is refused before anything else; with ``standby=True`` a slot another process
  streams ends the check at once (:class:`SlotInUseError`: no tail read);
* :func:`open_gap` writes the gap ``open`` in the slot history before anything
  is done about it (so a recovery that dies half-way is done again); at most one
  gap of a slot is open, whoever writes it;
* :func:`recover` creates the new slot **with an exported snapshot**, reads in
  that snapshot every outbox row of the gap's window (``created_at`` - or the
  commit time when ``track_commit_timestamp`` is on - at or after the window's
  start, or after the gap's recorded progress), in commit order as far as the
  table knows it (commit time, else ``created_at``, then id: one aggregate's
  rows keep their order), publishes them through the router (the streaming
  path's record, plus the ``recovered`` header), waits for Kafka to acknowledge
  every one, and only then marks the gap recovered, recording the new slot's
  identity. The slot then streams from its consistent point: every transaction
  committed before it is in the snapshot, every later one in the slot. A row
  that cannot become a record is dead-lettered, never dropped. Any Kafka error
  raises; the gap stays open;
* progress: every :data:`PROGRESS_EVERY_ROWS` rows or :data:`PROGRESS_EVERY_S`
  the rows sent so far are acknowledged and ``resume_from`` recorded: the next
  attempt starts there, or at this attempt's start minus the margin if that is
  earlier (rows committed after this snapshot were created after it, less the
  margin), so a retry re-publishes at most what was not acknowledged;
* :func:`accept_loss` creates the slot without recovering and records who accepted
  which window; it is the only way out of an unrecoverable gap;
* :func:`make_slot` (a first start, ``slot init --from now``) makes or adopts the
  slot and records its identity; ``slot init --from table`` opens a gap of cause
  ``first_start`` over the whole table (:func:`open_first_start`) and recovers it;
* the publishing itself (every record acknowledged, a refused one dead-lettered,
  exactly-once mode's transactions) is :mod:`cdc.repair.republish`'s, the one path
  of a recovery, the start-up check and the audit's repair.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from confluent_kafka import KafkaException
from psycopg import sql

from cdc import constants as c
from cdc import gaps
from cdc.errors import (
    CdcError,
    DatabaseSetupError,
    KafkaUnavailableError,
    SlotInUseError,
    StreamError,
)
from cdc.evidence import gap_rule, origin_value, recovery_rule
from cdc.kafka.producer import TopicManager
from cdc.lineage import LastRecord, TailRead, list_topics, read_tails, relay_topics
from cdc.outbox import table_identifier
from cdc.pgconn import Use
from cdc.pgconn import connect as pg_connect
from cdc.relay.gaps.gap import (
    Action,
    Evidence,
    GapCause,
    Verdict,
    decide,
    taken_back,
    taken_back_note,
    unrecoverable_reason,
)
from cdc.relay.standby.safe import wait_standby_flushed
from cdc.repair.lock import RecoveryLock
from cdc.repair.publisher import Acks, Publisher, publishing_producer
from cdc.repair.republish import (
    commit_time_tracked,
    epoch_us,
    order_column,
    outbox_record,
    rows_again,
    topic_manager,
)
from cdc.repair.rows import FETCH_ROWS
from cdc.repair.transactional import present_ids
from cdc.router import TxContext
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
from cdc.wal.stream import ensure_slot, publication_row_filter, resolve_table, row_filter_sql

log = logging.getLogger("cdc.relay")

Conn = psycopg.Connection[Any]

#: A recovery records its progress (after Kafka acknowledged every row sent) at
#: least this often: a retry re-publishes at most this many rows, or this long's worth.
PROGRESS_EVERY_ROWS = 50_000
PROGRESS_EVERY_S = 15.0


class GapUnrecoverableError(CdcError):
    """The outbox table cannot replay the gap: only `slot accept-gap` ends it."""


@dataclass(frozen=True)
class Inspection:
    """Everything the gap check read, and its verdict."""

    evidence: Evidence
    verdict: Verdict
    #: the tail read behind ``evidence.last`` (what it read and skipped)
    tails: TailRead
    #: the topics read came from the relay's record of them (else: the prefix's)
    topics_recorded: bool

    @property
    def slot(self) -> SlotRow | None:
        return self.evidence.slot

    @property
    def server(self) -> ServerIdentity:
        return self.evidence.server

    @property
    def last(self) -> LastRecord | None:
        return self.evidence.last

    @property
    def history(self) -> gaps.HistoryRow | None:
        return self.evidence.history


def connect(settings: Settings) -> Conn:
    """A connection for the gap check's and the recovery's work (:data:`Use.WORK`)."""
    return pg_connect(settings.pg_dsn.get_secret_value(), Use.WORK)


def check_slot_kind(slot: SlotRow | None, dbname: str) -> None:
    """Refuse a slot of the relay's name that is not a pgoutput slot of this database:
    it is nobody's gap to close (never dropped by a recovery)."""
    if slot is None:
        return
    if slot.plugin != "pgoutput":
        raise DatabaseSetupError(
            f"slot {slot.name} uses plugin {slot.plugin!r}, not 'pgoutput': drop it "
            f"(outbox-cdc slot drop) or set CDC_SLOT to another name"
        )
    if slot.database != dbname:
        raise DatabaseSetupError(
            f"slot {slot.name} belongs to database {slot.database}, not {dbname}"
        )


def inspect(
    settings: Settings, *, slot_survives_failover: bool = False, standby: bool = False
) -> Inspection:
    """Read the slot, the server, the history and Kafka; decide (reads only).

    ``standby``: a slot another process streams raises :class:`SlotInUseError`
    before Kafka is read (the relay then waits as a standby)."""
    dsn = settings.pg_dsn.get_secret_value()
    with connect(settings) as conn:
        slot = read_slot(conn, settings.slot)
        check_slot_kind(slot, conn.info.dbname)
        if standby and slot is not None and slot.active:
            raise SlotInUseError(f"slot {settings.slot} is active: another process streams it")
        history = gaps.latest(conn, settings.slot)
        maker = gaps.maker(conn, settings.slot)
        server = identify_system(dsn)
        try:
            topics, recorded = relay_topics(conn, settings, list_topics(settings))
            tails = read_tails(settings, gap_rule(server, settings.slot), topics)
        except KafkaException as exc:
            raise KafkaUnavailableError(f"cannot read the outbox topics' tails: {exc}") from exc
        last = tails.last
        empty = outbox_is_empty(conn, settings) if history is None and last is None else None
    evidence = Evidence(
        slot_name=settings.slot,
        slot=slot,
        server=server,
        last=last,
        history=history,
        maker=maker,
        outbox_empty=empty,
    )
    verdict = decide(
        evidence, margin_s=settings.gap_margin_s, slot_survives_failover=slot_survives_failover
    )
    return Inspection(evidence, verdict, tails, recorded)


def outbox_is_empty(conn: Conn, settings: Settings) -> bool:
    """The outbox table (the publication's share of it) holds no row."""
    schema, name = resolve_table(conn, settings.outbox_table)
    row_filter = publication_row_filter(conn, settings.publication, schema, name)
    where = (
        sql.SQL(" WHERE ") + row_filter_sql(row_filter) if row_filter is not None else sql.SQL("")
    )
    row = conn.execute(  # (no parameters: the row filter's text goes verbatim)
        sql.SQL("SELECT NOT EXISTS (SELECT 1 FROM {}{})").format(
            sql.Identifier(schema, name), where
        )
    ).fetchone()
    return bool(row and row[0])


def open_gap(settings: Settings, found: Inspection) -> gaps.HistoryRow:
    """The gap's history row: the open one found, or a new one written now (unless
    another relay wrote one first: that one is returned)."""
    verdict = found.verdict
    assert verdict.action is Action.GAP and verdict.cause is not None
    with connect(settings) as conn:
        if verdict.gap_id is not None:
            row = gaps.latest(conn, settings.slot)
            if row is None or row.id != verdict.gap_id or not row.is_open:
                # (recovered or accepted by another process since the check read it)
                raise StreamError(f"gap {verdict.gap_id} was closed meanwhile: checking again")
            return row
        reason = why_unrecoverable(conn, settings, found.last, found.evidence.server)
        last = found.last
        ghosts = taken_back(last.newest_rows if last else (), found.evidence.server)
        if ghosts:
            note = taken_back_note(ghosts, found.evidence.server)
            log.warning("slot %s: %s", settings.slot, note)
        return gaps.record_gap(
            conn,
            gaps.NewGap(
                slot=settings.slot,
                cause=verdict.cause.value,
                detail=verdict.detail
                + (f"; {reason}" if reason else "")
                + (f"; {taken_back_note(ghosts, found.evidence.server)}" if ghosts else ""),
                last_published_ts=last.commit_ts if last else None,
                last_published_origin=str(last.origin) if last and last.origin else None,
                window_start=verdict.window_start,
                unrecoverable=reason is not None,
            ),
            seen_latest=found.history.id if found.history is not None else None,
        )


def open_first_start(settings: Settings) -> gaps.HistoryRow:
    """A gap of cause ``first_start`` over the whole table (``slot init --from table``):
    the relay, or the command, recovers it; it resumes like any gap."""
    with connect(settings) as conn:
        return gaps.record_gap(
            conn,
            gaps.NewGap(
                slot=settings.slot,
                cause=GapCause.FIRST_START.value,
                detail="first start: the table's rows are published (`slot init --from table`)",
                last_published_ts=None,
                last_published_origin=None,
                window_start=None,
                unrecoverable=False,
            ),
            seen_latest=None,
        )


def why_unrecoverable(
    conn: Conn, settings: Settings, last: LastRecord | None, server: ServerIdentity
) -> str | None:
    """Which kinds of events a gap after ``last`` may hold that the table cannot give
    back (None: it can give back every one), from the relay's own evidence and its
    settings: ``CDC_MESSAGES=on`` (logical messages decoded) holds every gap open - an
    application may have written table-less events while the slot was gone, which no
    evidence shows; ``off``: the relay decodes none, so none can be missing.

    Rows a failover took back (:func:`cdc.relay.gaps.gap.taken_back`) are not counted as
    deleted: the new primary never had them."""
    messages = settings.messages == "on"
    horizon_us = (datetime.now(UTC) - timedelta(seconds=settings.recovery_horizon_s)).timestamp()
    newest = last.newest_rows if last else ()
    rows = tuple(r for r in newest if r.commit_ts_us >= horizon_us * 1_000_000)
    ghosts = {r.id for r in taken_back(rows, server)}
    ids = sorted({r.id for r in rows} - ghosts)
    gone = 0
    if ids and settings.outbox_keeps_rows:
        row = conn.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE id::text = ANY(%s)").format(
                table_identifier(settings.outbox_table)
            ),
            (ids,),
        ).fetchone()
        gone = len(ids) - (int(row[0]) if row else 0)
    return unrecoverable_reason(
        keeps_rows=settings.outbox_keeps_rows,
        published_messages=messages,
        newest_rows=len(ids),
        rows_gone=gone,
    )


def _window_query(conn: Conn, settings: Settings, start: datetime | None) -> sql.Composed:
    """The window's rows in commit order: those of the publication's row filter only
    (a shard of the outbox, ``CDC_PUBLICATION_FILTERED``): the other shares are the
    other relays' to recover. Executed without parameters (``start`` is a literal): the
    filter's text goes verbatim, ``%`` and all (:func:`cdc.wal.stream.row_filter_sql`)."""
    when = order_column(conn)
    schema, name = resolve_table(conn, settings.outbox_table)
    conditions: list[sql.Composable] = []
    if start is not None:
        conditions.append(sql.SQL("{} >= {}").format(when, sql.Literal(start)))
    row_filter = publication_row_filter(conn, settings.publication, schema, name)
    if row_filter is not None:  # the server's own text of the filter (pg_publication_tables)
        conditions.append(row_filter_sql(row_filter))
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
        row = conn.execute(query).fetchone()
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


def recover(
    settings: Settings,
    gap: gaps.HistoryRow,
    *,
    topics: TopicManager | None = None,
    lock: RecoveryLock | None = None,
) -> gaps.Recovered:
    """Close ``gap`` from the outbox table (see the module docstring). ``lock``: the
    recovery lock the caller holds (else it is taken here: one recovery of a slot at a
    time, two relays or a relay and the CLI); it is checked before every step that
    depends on it (:meth:`RecoveryLock.ensure`)."""
    if gap.unrecoverable:
        raise GapUnrecoverableError(
            f"gap {gap.id} cannot be recovered ({gap.detail}): `outbox-cdc slot accept-gap`"
        )
    started = time.monotonic()
    held = lock or RecoveryLock(settings).take()
    try:
        done = _recover(settings, gap, topics, started, held)
        _check_still_ours(held.checked(), settings, gap, done)
        gaps.mark_recovered(held.conn, gap.id, done)
    finally:
        if lock is None:
            held.close()
    return done


def _check_still_ours(
    conn: Conn, settings: Settings, gap: gaps.HistoryRow, done: gaps.Recovered
) -> None:
    """Before the gap is marked: it is still open, and the slot is still the one this
    recovery made (not streamed, not replaced) - whatever happened while the lock's
    connection was away. Else :class:`SlotInUseError`: the next session checks again."""
    latest = gaps.latest(conn, settings.slot)
    slot = read_slot(conn, settings.slot)
    if latest is None or latest.id != gap.id or not latest.is_open:
        why = f"gap {gap.id} was closed by another process meanwhile"
    elif slot is None or slot.active or lsn_to_str(slot.confirmed_flush_lsn) != done.consistent_lsn:
        why = f"slot {settings.slot} is no longer the one this recovery made"
    else:
        return
    raise SlotInUseError(f"recovery of gap {gap.id} not marked: {why}")


@dataclass
class _Progress:
    """Records how far a recovery got (:func:`cdc.gaps.record_progress`), now and then.

    ``floor``: this attempt's start (the server's clock, before its slot was made)
    minus the margin - rows committed after the snapshot were created (or
    committed) after it, so the next attempt never starts later than this."""

    lock: RecoveryLock
    gap_id: int
    floor: datetime
    #: rows re-published by earlier attempts
    base_rows: int
    publisher: Publisher
    rows_then: int = 0
    at: float = field(default_factory=time.monotonic)

    def before(self, ts: datetime) -> None:
        """Every row sent so far is older than ``ts`` (the next one's): when due, wait
        for their acks and record that the window is done up to ``ts``."""
        sent = self.publisher.sent
        if sent - self.rows_then < PROGRESS_EVERY_ROWS and (
            time.monotonic() - self.at < PROGRESS_EVERY_S or sent == self.rows_then
        ):
            return
        self.publisher.wait_acked()
        gaps.record_progress(
            self.lock.checked(),  # (its connection may have been taken again)
            self.gap_id,
            resume_from=min(ts, self.floor),
            rows=self.base_rows + self.publisher.sent,
        )
        self.rows_then, self.at = self.publisher.sent, time.monotonic()


def _db_now(conn: Conn) -> datetime:
    row = conn.execute("SELECT statement_timestamp()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def _recover(
    settings: Settings,
    gap: gaps.HistoryRow,
    topics: TopicManager | None,
    started: float,
    lock: RecoveryLock,
) -> gaps.Recovered:
    dsn = settings.pg_dsn.get_secret_value()
    lock.ensure()  # (the slot is dropped and made again under it)
    _clear_slot(settings)
    server = identify_system(dsn)
    origin = origin_value(server, settings.slot)
    since = gap.resume_from or gap.window_start  # (the recorded progress of earlier attempts)
    if since is not None and gap.resume_from is not None:
        log.info("gap %d: resuming its recovery from %s", gap.id, since.isoformat())
    floor = _db_now(lock.checked()) - timedelta(seconds=settings.gap_margin_s)
    acks = Acks()
    producer, txs = publishing_producer(settings, system_id=server.system_id, purpose="recovery")
    if txs is not None:  # exactly-once: what read_committed consumers hold already is skipped
        owner = recovery_rule(server, settings.slot)  # (only the relay's own records count)
        txs.present = present_ids(settings, epoch_us(since) // 1000 if since else 0, owner)
    origin_header = (c.HEADER_ORIGIN, origin.encode())
    publisher = Publisher(
        settings, producer, topics or topic_manager(settings), acks, tx=txs, origin=origin_header
    )
    progress = _Progress(lock, gap.id, floor, gap.rows_recovered or 0, publisher)
    mark = str(gap.id).encode()
    try:
        lock.ensure()
        with (
            exported_slot(dsn, settings.slot, failover=settings.failover_slot) as made,
            connect(settings) as conn,
        ):
            in_snapshot(conn, made.snapshot)
            if settings.standby_safe:  # every row of the snapshot on the standby first
                wait_standby_flushed(settings, made.consistent_lsn)
            window_end = datetime.now(UTC)
            lsn = lsn_to_str(made.consistent_lsn)
            query = _window_query(conn, settings, since)
            # (a redone transaction's rows, and a record refused with its batch: read in
            # the slot's snapshot)
            publisher.again = rows_again(
                settings,
                made.snapshot,
                tracked=commit_time_tracked(conn),
                lsn=lsn,
                origin=origin_header,
                mark=mark,
            )
            # Streamed (chunks of FETCH_ROWS as the server sends them): the server
            # keeps sending while the rows are published; a server-side cursor waited
            # for a round trip per FETCH (half the loop's time, docs/performance.md).
            with conn.cursor() as cur:
                tx, tx_ts = None, None
                for row in cur.stream(query, size=FETCH_ROWS):
                    if row[6] != tx_ts:  # rows of one transaction share its commit time
                        tx_ts = row[6]
                        progress.before(tx_ts)
                        tx = TxContext(lsn, epoch_us(tx_ts), origin_header)
                    assert tx is not None
                    publisher.send(outbox_record(row, tx, settings, mark))
            publisher.wait_acked()  # (while the snapshot lives: a redo reads in it)
            conn.execute("COMMIT")
    finally:
        publisher.producer.flush(0)  # (a redo may have renewed it)
    if txs is not None:
        log.info(
            "gap %d: exactly-once: %d rows of the window already in Kafka (read_committed)"
            " skipped, %d published in %d transactions of at most %d records (%d redone)",
            gap.id,
            txs.skipped,
            publisher.sent,
            txs.committed,
            txs.max_records,
            publisher.redone,
        )
    with connect(settings) as conn:
        slot = read_slot(conn, settings.slot)
    return gaps.Recovered(
        window_start=gap.window_start,
        window_end=window_end,
        origin=origin,
        consistent_lsn=lsn,
        rows=(gap.rows_recovered or 0) + publisher.sent,
        seconds=time.monotonic() - started,
        catalog_xmin=slot.catalog_xmin if slot is not None else None,
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
        slot = read_slot(conn, settings.slot)
        gaps.mark_accepted(
            conn,
            gap.id,
            by=by,
            origin=origin,
            consistent_lsn=lsn_to_str(made.consistent_lsn),
            catalog_xmin=slot.catalog_xmin if slot is not None else None,
        )
    return origin


def make_slot(settings: Settings, found: Inspection, *, cause: str, detail: str) -> gaps.SlotMade:
    """Make the slot (missing) or adopt it (there, with no recorded identity) and record
    its identity: the row that vouches for it from now on."""
    origin = origin_value(found.server, settings.slot)
    with connect(settings) as conn:
        event = gaps.EVENT_ADOPTED if found.slot is not None else gaps.EVENT_CREATED
        if found.slot is None:
            ensure_slot(conn, settings.slot, failover=settings.failover_slot)
        slot = read_slot(conn, settings.slot)
        assert slot is not None
        check_slot_kind(slot, conn.info.dbname)
        if slot.active:
            raise SlotInUseError(f"slot {settings.slot} is active: another process streams it")
        made = gaps.SlotMade(
            slot=settings.slot,
            origin=origin,
            lsn=lsn_to_str(slot.confirmed_flush_lsn),
            catalog_xmin=slot.catalog_xmin,
            cause=cause,
            detail=detail,
        )
        gaps.record_created(conn, made, event=event)
    return made
