"""The audit's PostgreSQL side: the window's rows, what the slot still holds, the parking lot.

Guarantees:

* :func:`read_window` is one plain read in a ``REPEATABLE READ READ ONLY``
  transaction: no lock that blocks a writer is taken (a ``SELECT``'s
  ``ACCESS SHARE`` only), nothing is written. Its first statement fixes the
  snapshot and reads the WAL insert position :attr:`TableRead.snapshot_lsn`:
  every transaction the snapshot sees has its commit record below it;
* it reads ids, not payloads: PostgreSQL groups the window's ids by routed
  topic, judged or context, and :func:`~cdc.audit.ids.bucket_of` bucket (in
  :data:`SUB_GROUPS` parts), and sends each group as one ``bytea`` of 16-byte ids;
  the groups are fetched through a server-side cursor :data:`GROUPS_PER_FETCH` at a
  time into :class:`~cdc.audit.ids.IdBuckets`, which spill to disk past their
  memory budget: the read's memory does not grow with the window;
* a row's time is its commit time where ``track_commit_timestamp`` is on, else
  its ``created_at`` (the transaction's start); rows from ``margin_s`` before the
  window are read as context (a record of the window may belong to one of them),
  never judged; only rows of the publication's row filter are read (another
  relay's share of a sharded outbox is not this relay's to audit), whatever the
  filter's text holds (``%``, quotes: :func:`cdc.wal.stream.row_filter_sql`);
* :func:`pending_in_slot` reads which events the slot still holds up to a WAL
  position (decoded from a temporary copy of the slot: the relay is not
  disturbed): committed, not yet confirmed, so in flight - not lost. It reports
  ``None`` with a reason when it cannot tell (no slot, no privilege, timeout);
* :func:`parked_by_status` counts the parking lot's rows of the window's events;
  ``None`` with a reason when the parking lot cannot be read.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg import IsolationLevel, sql
from psycopg import errors as pgerrors

from cdc.audit.compare import TableSide
from cdc.audit.ids import SQL_BUCKET, IdBuckets
from cdc.audit.window import Window
from cdc.errors import CdcError
from cdc.pgconn import failure_text
from cdc.records import uuid_bytes
from cdc.settings import Settings
from cdc.wal import pgoutput
from cdc.wal.replproto import str_to_lsn
from cdc.wal.slots import read_slot
from cdc.wal.stream import (
    publication_row_filter,
    resolve_table,
    row_filter_sql,
    with_connection_defaults,
)

Conn = psycopg.Connection[Any]

#: Groups (topic, judged, bucket) fetched per round trip of the window's cursor.
GROUPS_PER_FETCH = 64
#: Each bucket's ids come in this many groups (by a byte of the id the bucket does not
#: use), so one fetch holds GROUPS_PER_FETCH / (2 x BUCKETS x SUB_GROUPS) of a topic's
#: window - ~2.5 MB of a 10,000,000-row window - not 1/8 of it.
SUB_GROUPS = 16
#: Longest the window's read may take in the server (a window of tens of millions of
#: rows reads in minutes; past this the audit fails rather than wait without bound).
TABLE_READ_TIMEOUT_MS = 30 * 60 * 1000
#: Longest the slot peek may decode before the audit gives up on telling in-flight events.
PEEK_TIMEOUT_MS = 60_000
#: Name prefix of the temporary slot copies the audit peeks (at most 63 chars in all).
PEEK_SLOT_PREFIX = "outbox_audit_peek_"
#: Changes the peek reads per round trip.
PEEK_FETCH_ROWS = 5_000
#: Time basis names, as the report shows them.
COMMIT_TIME, CREATED_AT = "commit_timestamp", "created_at"


class AuditSetupError(CdcError):
    """The outbox table cannot be audited as configured (the message says why)."""


@dataclass
class TableRead:
    """What :func:`read_window` read."""

    snapshot_lsn: int
    time_basis: str
    topics: dict[str, TableSide] = field(default_factory=dict)
    judged_rows: int = 0
    context_rows: int = 0
    row_filter: str | None = None


def connect(settings: Settings, *, autocommit: bool = True) -> Conn:
    """A connection of the audit's own (timeouts and keepalives of the project's defaults)."""
    try:
        return psycopg.connect(
            with_connection_defaults(settings.pg_dsn.get_secret_value()),
            autocommit=autocommit,
            connect_timeout=10,
        )
    except psycopg.OperationalError as exc:
        raise CdcError(f"PostgreSQL connection failed: {failure_text(exc)}") from exc


def time_expression(conn: Conn, alias: str = "") -> tuple[sql.Composable, str]:
    """A row's time (commit time when tracked, else ``created_at``) and the basis's name."""
    prefix = f"{alias}." if alias else ""
    row = conn.execute("SHOW track_commit_timestamp").fetchone()
    if row is not None and str(row[0]).lower() == "on":
        expr = f"COALESCE(pg_xact_commit_timestamp({prefix}xmin), {prefix}created_at)"
        return sql.SQL(expr), COMMIT_TIME
    return sql.SQL(f"{prefix}created_at"), CREATED_AT


@dataclass(frozen=True)
class _Source:
    """The outbox relation of the audit and what selects this relay's rows of it."""

    table: sql.Composable
    when: sql.Composable
    basis: str
    row_filter: str | None

    def where(self, values: dict[str, sql.Literal]) -> sql.Composable:
        """Rows of the read: created from ``read_from``, before ``until``, of the row filter."""
        parts: list[sql.Composable] = [
            sql.SQL("created_at >= {read_from} AND created_at < {until}").format(**values)
        ]
        if self.row_filter is not None:  # the server's own text of the filter
            parts.append(row_filter_sql(self.row_filter))
        return sql.SQL(" AND ").join(parts)


def _source(conn: Conn, settings: Settings) -> _Source:
    schema, name = resolve_table(conn, settings.outbox_table)
    when, basis = time_expression(conn)
    row_filter = publication_row_filter(conn, settings.publication, schema, name)
    return _Source(sql.Identifier(schema, name), when, basis, row_filter)


def _values(window: Window, margin_s: float) -> dict[str, sql.Literal]:
    """The window's bounds as literals: a query carrying the row filter takes no
    client-side parameters (:func:`cdc.wal.stream.row_filter_sql`)."""
    return {
        "since": sql.Literal(window.since),
        "until": sql.Literal(window.until),
        "read_from": sql.Literal(window.since - timedelta(seconds=margin_s)),
    }


_WINDOW_SQL = """
SELECT aggregatetype, ts >= {since} AS judged,
       {bucket} AS bucket,
       string_agg(idb, ''::bytea), count(*)
FROM (SELECT uuid_send(id::uuid) AS idb, aggregatetype, {when} AS ts
      FROM {table} WHERE {where}) AS w
WHERE ts >= {read_from} AND ts < {until}
GROUP BY 1, 2, 3, get_byte(idb, 14) & {sub}
"""


@dataclass(frozen=True)
class Snapshot:
    """An open ``REPEATABLE READ READ ONLY`` transaction and the WAL position it was taken at."""

    conn: Conn
    lsn: int
    source: _Source


def open_snapshot(conn: Conn, settings: Settings) -> Snapshot:
    """Begin the read on ``conn`` (not autocommit): its first statement fixes the snapshot
    and reads the WAL insert position. :func:`read_ids` ends the transaction."""
    conn.isolation_level = IsolationLevel.REPEATABLE_READ
    conn.read_only = True
    row = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
    assert row is not None
    conn.execute(
        sql.SQL("SET LOCAL statement_timeout = {}").format(sql.Literal(TABLE_READ_TIMEOUT_MS))
    )
    return Snapshot(conn, str_to_lsn(row[0]), _source(conn, settings))


def read_ids(
    snapshot: Snapshot, settings: Settings, window: Window, *, margin_s: float
) -> TableRead:
    """The window's ids in ``snapshot`` (see the module docstring); ends its transaction.

    Only ``snapshot.conn`` is used: this may run on another thread while the caller
    reads Kafka (the snapshot's position is known already)."""
    conn, source = snapshot.conn, snapshot.source
    read = TableRead(snapshot.lsn, source.basis, row_filter=source.row_filter)
    values = _values(window, margin_s)
    query = sql.SQL(_WINDOW_SQL).format(
        when=source.when,
        table=source.table,
        where=source.where(values),
        bucket=sql.SQL(SQL_BUCKET),
        sub=sql.Literal(SUB_GROUPS - 1),
        **values,
    )
    try:
        with conn.cursor(name=f"outbox_audit_{uuid.uuid4().hex[:8]}") as cur:
            cur.itersize = GROUPS_PER_FETCH
            cur.execute(query)  # (no parameters: the row filter's text goes verbatim)
            for aggtype, judged, bucket, blob, count in cur:
                topic = settings.topic_prefix + (aggtype or "")
                side = read.topics.setdefault(topic, TableSide())
                (side.judged if judged else side.context).add_bucket_blob(int(bucket), blob)
                if judged:
                    read.judged_rows += int(count)
                else:
                    read.context_rows += int(count)
    finally:
        conn.rollback()  # (read only: nothing to keep)
    return read


def count_judged(snapshot: Snapshot, window: Window, *, margin_s: float) -> int:
    """Rows of the window (judged, not context) in ``snapshot``; leaves its transaction open."""
    source = snapshot.source
    values = _values(window, margin_s)
    query = sql.SQL(
        "SELECT count(*) FROM (SELECT {when} AS ts FROM {table} WHERE {where}) AS w"
        " WHERE ts >= {since} AND ts < {until}"
    ).format(when=source.when, table=source.table, where=source.where(values), **values)
    row = snapshot.conn.execute(query).fetchone()
    return int(row[0]) if row else 0


def read_window(conn: Conn, settings: Settings, window: Window, *, margin_s: float) -> TableRead:
    """:func:`open_snapshot` then :func:`read_ids` on one thread."""
    return read_ids(open_snapshot(conn, settings), settings, window, margin_s=margin_s)


@dataclass(frozen=True)
class Pending:
    """What the slot still holds (committed, not confirmed) up to the snapshot's position."""

    #: the events' ids; None when they could not be read (then ``note`` says why)
    ids: IdBuckets | None
    confirmed_lsn: int | None
    note: str = ""


def pending_in_slot(settings: Settings, upto_lsn: int) -> Pending:
    """The events the slot holds below ``upto_lsn`` (see the module docstring)."""
    with connect(settings) as conn:
        slot = read_slot(conn, settings.slot)
        if slot is None:
            return Pending(None, None, f"slot {settings.slot} does not exist")
        if slot.wal_status == "lost":
            return Pending(None, slot.confirmed_flush_lsn, f"slot {settings.slot} is lost")
        if slot.confirmed_flush_lsn >= upto_lsn:
            return Pending(IdBuckets(), slot.confirmed_flush_lsn)
        try:
            ids = _peek_ids(conn, settings, upto_lsn)
        except psycopg.Error as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return Pending(None, slot.confirmed_flush_lsn, f"cannot read the slot: {reason}")
        finally:
            _drop_copies(conn)
    return Pending(ids, slot.confirmed_flush_lsn)


def _peek_ids(conn: Conn, settings: Settings, upto_lsn: int) -> IdBuckets:
    copy = f"{PEEK_SLOT_PREFIX}{uuid.uuid4().hex[:16]}"
    conn.execute(sql.SQL("SET statement_timeout = {}").format(sql.Literal(PEEK_TIMEOUT_MS)))
    conn.execute("SELECT pg_copy_logical_replication_slot(%s, %s, true)", (settings.slot, copy))
    ids = IdBuckets()
    relations = pgoutput.RelationCache()
    upto = f"{upto_lsn >> 32:X}/{upto_lsn & 0xFFFFFFFF:X}"
    query = (
        "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, %s::pg_lsn, NULL,"
        " 'proto_version', '1', 'publication_names', %s)"
    )
    with conn.cursor() as cur:
        for (data,) in cur.stream(query, (copy, upto, settings.publication), size=PEEK_FETCH_ROWS):
            message = pgoutput.decode(bytes(data))
            if isinstance(message, pgoutput.Relation):
                relations.update(message)
            elif isinstance(message, pgoutput.Insert):
                id16 = uuid_bytes((relations.row_dict(message).get("id") or "").encode())
                if id16 is not None:
                    ids.add(id16)
    return ids


def _drop_copies(conn: Conn) -> None:
    if conn.closed or conn.broken:
        return
    conn.execute(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
        " WHERE temporary AND active_pid = pg_backend_pid() AND starts_with(slot_name, %s)",
        (PEEK_SLOT_PREFIX,),
    )


@dataclass(frozen=True)
class Parked:
    """The parking lot's rows of the window's events, by status (None: unreadable)."""

    by_status: dict[str, int] | None
    note: str = ""


def parked_by_status(settings: Settings, window: Window, *, margin_s: float) -> Parked:
    """Parked events of the window's judged rows, by status (FAILED, PENDING, DONE)."""
    with connect(settings) as conn:
        source = _source(conn, settings)
        values = _values(window, margin_s)
        query = sql.SQL(
            "SELECT f.status, count(*) FROM failed_sync_events f WHERE f.outbox_event_id IN"
            " (SELECT id::uuid FROM (SELECT id, {when} AS ts FROM {table} WHERE {where}) AS w"
            "  WHERE ts >= {since} AND ts < {until}) GROUP BY 1"
        ).format(when=source.when, table=source.table, where=source.where(values), **values)
        try:
            rows = conn.execute(query).fetchall()
        except (pgerrors.UndefinedTable, pgerrors.InsufficientPrivilege) as exc:
            return Parked(None, f"parking lot not read: {str(exc).strip().splitlines()[0]}")
    return Parked({str(status): int(count) for status, count in rows})


@dataclass(frozen=True)
class MissingRow:
    """A missing event as the report lists it."""

    id: str
    aggregatetype: str
    aggregateid: str
    created_at: datetime

    def as_json(self) -> dict[str, str]:
        return {
            "id": self.id,
            "aggregatetype": self.aggregatetype,
            "aggregateid": self.aggregateid,
            "created_at": self.created_at.isoformat(),
        }


def describe(settings: Settings, ids: list[bytes]) -> list[MissingRow]:
    """The rows of ``ids`` (the first missing ones), oldest first."""
    if not ids:
        return []
    with connect(settings) as conn:
        source = _source(conn, settings)
        rows = conn.execute(
            sql.SQL(
                "SELECT id::text, aggregatetype, aggregateid, created_at FROM {table}"
                " WHERE id::uuid = ANY(%s::uuid[]) ORDER BY created_at, id"
            ).format(table=source.table),
            ([uuid.UUID(bytes=i) for i in ids],),
        ).fetchall()
    return [MissingRow(str(r[0]), str(r[1]), str(r[2]), r[3]) for r in rows]
