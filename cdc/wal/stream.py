"""The replication connection: a thin psycopg 3 shell around the COPY_BOTH stream.

Guarantees:

* :func:`ensure_slot` / :func:`ensure_publication` leave the database ready for
  the relay or raise :class:`DatabaseSetupError` naming the fix (``wal_level``,
  the REPLICATION privilege, a slot created with another plugin, a publication
  this role may not create, an outbox table that does not exist or lacks a
  routed column, an existing publication that does not publish every insert of
  the schema-qualified outbox table with every routed column);
* :class:`ReplicationStream` starts ``pgoutput`` (proto 1, ``messages 'true'``)
  at the slot's confirmed position, hands out raw CopyData payloads without
  blocking longer than asked, and sends standby status updates;
* a slot held by another walsender raises :class:`SlotInUseError` (the caller
  waits as a hot standby); a lost connection raises :class:`StreamError`;
* every connection gets :data:`CONNECTION_DEFAULTS` (connect timeout, TCP
  keepalives, ``tcp_user_timeout``) unless its DSN sets them
  (:func:`with_connection_defaults`); :func:`end_walsender` ends the walsender
  of a replication connection the caller gave up as silent (half-open).

No protocol parsing happens here (see :mod:`cdc.wal.replproto`, :mod:`cdc.wal.pgoutput`).
"""

from __future__ import annotations

import logging
import select
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import psycopg
from psycopg import errors as pgerrors
from psycopg import pq, sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from cdc.errors import DatabaseSetupError, SlotInUseError, StreamError
from cdc.migrate import check_wal_level
from cdc.router import ROUTED_COLUMNS, BrokenOutbox, outbox_layout
from cdc.wal.replproto import lsn_to_str, pg_now_us, standby_status_update, str_to_lsn
from cdc.wal.slots import failover_wanted

log = logging.getLogger("cdc.stream")

Conn = psycopg.Connection[Any]


#: libpq settings of every relay connection unless its DSN sets them: a connect
#: that hangs fails after 10 s; an idle path is probed after 10 s, every 5 s, and
#: given up after 3 lost probes; unacknowledged sent data fails it after 30 s.
CONNECTION_DEFAULTS = {
    "connect_timeout": "10",
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
    "tcp_user_timeout": "30000",
}


def with_connection_defaults(dsn: str) -> str:
    """``dsn`` with :data:`CONNECTION_DEFAULTS` merged in (what it sets wins)."""
    params = conninfo_to_dict(dsn)
    for name, value in CONNECTION_DEFAULTS.items():
        params.setdefault(name, value)
    return make_conninfo("", **params)


@dataclass(frozen=True)
class SlotInfo:
    """A replication slot as ``pg_replication_slots`` shows it."""

    name: str
    plugin: str
    database: str
    active: bool
    active_pid: int | None
    confirmed_flush_lsn: int
    lag_bytes: int | None


def slot_info(conn: Conn, slot: str) -> SlotInfo | None:
    """The slot's row, or None when it does not exist."""
    row = conn.execute(
        "SELECT slot_name, plugin, database, active, active_pid,"
        " confirmed_flush_lsn::text,"
        " pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint"
        " FROM pg_replication_slots WHERE slot_name = %s",
        (slot,),
    ).fetchone()
    if row is None:
        return None
    return SlotInfo(
        name=row[0],
        plugin=row[1] or "",
        database=row[2] or "",
        active=bool(row[3]),
        active_pid=row[4],
        confirmed_flush_lsn=str_to_lsn(row[5]) if row[5] else 0,
        lag_bytes=row[6],
    )


def check_replication_privilege(conn: Conn) -> None:
    row = conn.execute(
        "SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user"
    ).fetchone()
    if not row or not row[0]:
        raise DatabaseSetupError(
            "the relay's role lacks the REPLICATION privilege: "
            "ALTER ROLE <role> WITH REPLICATION (see sql/roles/relay_role.sql)"
        )


def ensure_publication(
    conn: Conn, publication: str, table: str, *, filtered: bool = False
) -> tuple[str, str]:
    """Make ``publication`` publish inserts of the outbox ``table``; return it as (schema, name).

    ``table`` (``CDC_OUTBOX_TABLE``, ``name`` or ``schema.name``) is resolved in
    the catalog - a bare name by the role's ``search_path`` - and every lookup
    after that uses the qualified name. The table must have the routed
    columns with usable types. A missing publication is created for exactly
    that table; an existing one must publish its inserts, all of its rows (no
    row filter, unless ``filtered``: a shard of the outbox on purpose) and every
    routed column (no column list leaving one out): otherwise
    :class:`DatabaseSetupError` names the publication, the table and the fix,
    because the relay would silently publish nothing.
    """
    schema, name = resolve_table(conn, table)
    qualified = f"{schema}.{name}"
    check_outbox_columns(conn, schema, name)
    exists = conn.execute(
        "SELECT 1 FROM pg_publication WHERE pubname = %s", (publication,)
    ).fetchone()
    if exists:
        check_publication_covers(conn, publication, schema, name, filtered=filtered)
        return schema, name
    try:
        conn.execute(
            sql.SQL("CREATE PUBLICATION {} FOR TABLE {} WITH (publish = 'insert')").format(
                sql.Identifier(publication), sql.Identifier(schema, name)
            )
        )
        log.info("publication %s created for table %s", publication, qualified)
    except pgerrors.InsufficientPrivilege as exc:
        raise DatabaseSetupError(
            f"publication {publication} is missing and this role may not create it: "
            "run `outbox-cdc migrate` as the owner of the outbox table"
        ) from exc
    return schema, name


def resolve_table(conn: Conn, table: str) -> tuple[str, str]:
    """``table`` (``name`` or ``schema.name``) as the catalog's (schema, name)."""
    ident = sql.Identifier(*table.split(".", 1)).as_string(conn)
    row = conn.execute(
        "SELECT n.nspname, c.relname FROM pg_class c"
        " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass(%s)",
        (ident,),
    ).fetchone()
    if row is None:
        raise DatabaseSetupError(
            f"outbox table {table} does not exist: run `outbox-cdc migrate` first"
            " or set CDC_OUTBOX_TABLE (schema.name)"
        )
    return str(row[0]), str(row[1])


def check_outbox_columns(conn: Conn, schema: str, name: str) -> None:
    """The outbox table has every required column with a usable type (domains by base type)."""
    rows = conn.execute(
        "SELECT a.attname, COALESCE(NULLIF(t.typbasetype, 0), a.atttypid)::int"
        " FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid"
        " WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped"
        " ORDER BY a.attnum",
        (sql.Identifier(schema, name).as_string(conn),),
    ).fetchall()
    layout = outbox_layout(f"{schema}.{name}", [(str(n), int(oid)) for n, oid in rows])
    if isinstance(layout, BrokenOutbox):
        raise DatabaseSetupError(f"{layout.problem}: fix the table or CDC_OUTBOX_TABLE")


def check_publication_covers(
    conn: Conn, publication: str, schema: str, name: str, *, filtered: bool = False
) -> None:
    """``publication`` publishes every insert of schema.name (or, ``filtered``, those of
    its row filter) with every routed column."""
    pg15 = conn.info.server_version >= 150000
    extra = "pt.rowfilter, pt.attnames" if pg15 else "NULL::text, NULL::name[]"
    row = conn.execute(
        f"SELECT p.pubinsert, pt.tablename IS NOT NULL, {extra} FROM pg_publication p"  # noqa: S608
        " LEFT JOIN pg_publication_tables pt ON pt.pubname = p.pubname"
        " AND pt.schemaname = %s AND pt.tablename = %s WHERE p.pubname = %s",
        (schema, name, publication),
    ).fetchone()
    assert row is not None
    pubinsert, covered, rowfilter, attnames = row
    qualified = f"{schema}.{name}"
    fix = f"ALTER PUBLICATION {publication} SET TABLE {qualified} (or set CDC_PUBLICATION)"
    if not covered:
        tables = [
            str(r[0])
            for r in conn.execute(
                "SELECT schemaname || '.' || tablename FROM pg_publication_tables"
                " WHERE pubname = %s ORDER BY 1 LIMIT 5",
                (publication,),
            )
        ]
        raise DatabaseSetupError(
            f"publication {publication} does not publish the outbox table {qualified}"
            f" (it publishes: {', '.join(tables) or 'no table'}): {fix}"
        )
    if not pubinsert:
        raise DatabaseSetupError(
            f"publication {publication} does not publish inserts of {qualified}:"
            f" ALTER PUBLICATION {publication} SET (publish = 'insert')"
        )
    if rowfilter is not None and not filtered:
        raise DatabaseSetupError(
            f"publication {publication} publishes {qualified} with a row filter"
            f" (WHERE {rowfilter}), whose rows would never reach Kafka: {fix};"
            " set CDC_PUBLICATION_FILTERED=true if it shards the outbox on purpose"
        )
    left_out = [c for c in ROUTED_COLUMNS if attnames is not None and c not in attnames]
    if left_out and _has_columns(conn, schema, name, left_out):
        raise DatabaseSetupError(
            f"publication {publication} publishes {qualified} with a column list leaving out"
            f" {', '.join(left_out)}: {fix}"
        )


def publication_row_filter(conn: Conn, publication: str, schema: str, name: str) -> str | None:
    """The row filter ``publication`` applies to schema.name, as the server prints it."""
    if conn.info.server_version < 150000:
        return None
    row = conn.execute(
        "SELECT rowfilter FROM pg_publication_tables"
        " WHERE pubname = %s AND schemaname = %s AND tablename = %s",
        (publication, schema, name),
    ).fetchone()
    return str(row[0]) if row and row[0] is not None else None


def _has_columns(conn: Conn, schema: str, name: str, columns: list[str]) -> bool:
    row = conn.execute(
        "SELECT count(*) FROM pg_attribute WHERE attrelid = %s::regclass"
        " AND attname = ANY(%s) AND NOT attisdropped",
        (sql.Identifier(schema, name).as_string(conn), columns),
    ).fetchone()
    return bool(row and row[0])


def server_is_utf8(conn: Conn) -> bool:
    """True when the database stores text as UTF-8 (then every text value
    pgoutput sends is valid UTF-8, and the relay may pass it on unchecked)."""
    row = conn.execute("SHOW server_encoding").fetchone()
    return row is not None and str(row[0]).upper() in ("UTF8", "UTF-8")


def ensure_slot(conn: Conn, slot: str, *, create: bool = True, failover: str = "off") -> SlotInfo:
    """Create the logical slot (``pgoutput``) when missing; refuse another plugin.

    ``create=False`` (the relay after its gap check, :mod:`cdc.relay.gap`): a
    missing slot raises :class:`StreamError` instead - it disappeared since the
    check, and the next session's check decides what that means. ``failover``
    (``CDC_FAILOVER_SLOT``): a slot created here is a failover slot when
    :func:`cdc.wal.slots.failover_wanted` says so for this server.
    """
    check_wal_level(conn)
    check_replication_privilege(conn)
    info = slot_info(conn, slot)
    if info is None and not create:
        raise StreamError(f"slot {slot} disappeared after the gap check")
    if info is None:
        as_failover = failover_wanted(failover, conn.info.server_version)
        try:
            if as_failover:  # (temporary, two_phase, failover): PostgreSQL 17+
                conn.execute(
                    "SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, false, true)",
                    (slot,),
                )
            else:
                conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
            log.info("slot %s created (pgoutput%s)", slot, ", failover" if as_failover else "")
        except pgerrors.DuplicateObject:
            log.info("slot %s was created concurrently", slot)
        info = slot_info(conn, slot)
        assert info is not None
    if info.plugin != "pgoutput":
        raise DatabaseSetupError(
            f"slot {slot} uses plugin {info.plugin!r}, not 'pgoutput': drop it "
            f"(outbox-cdc slot drop) or set CDC_SLOT to another name"
        )
    dbname = conn.info.dbname
    if info.database != dbname:
        raise DatabaseSetupError(f"slot {slot} belongs to database {info.database}, not {dbname}")
    return info


def end_walsender(dsn: str, slot: str, pid: int) -> bool:
    """End the walsender ``pid`` if it still holds ``slot``; whether one was ended.

    For a replication connection the relay gave up as silent: behind a half-open
    path (and with ``wal_sender_timeout`` off) the server keeps that walsender,
    and so the slot, until it hears of the end; a new session would find the
    slot busy. Only our own abandoned walsender is ended (slot and pid must match).
    """
    try:
        with psycopg.connect(with_connection_defaults(dsn), autocommit=True) as conn:
            row = conn.execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots"
                " WHERE slot_name = %s AND active_pid = %s",
                (slot, pid),
            ).fetchone()
    except psycopg.Error as exc:
        log.warning("could not end the silent walsender %d of slot %s: %s", pid, slot, exc)
        return False
    return bool(row and row[0])


class ReplicationStream:
    """One streaming session of a slot. Not thread-safe; close() when done."""

    def __init__(self, dsn: str, *, slot: str, publication: str) -> None:
        self.slot = slot
        self.publication = publication
        try:
            self._conn: Conn = psycopg.connect(
                with_connection_defaults(dsn), replication="database", autocommit=True
            )
        except psycopg.OperationalError as exc:
            raise StreamError(f"replication connection failed: {exc}") from exc
        self._pg = self._conn.pgconn
        #: ``() -> (size, payload)`` of a CopyData message already received: size 0
        #: when none is buffered, negative when the stream ended (then :meth:`read`
        #: raises). The relay's hot path; a bound C call, no Python frame.
        self.get_nowait: Callable[[], tuple[int, memoryview]] = partial(self._pg.get_copy_data, 1)

    def start(self, start_lsn: int = 0) -> None:
        """``START_REPLICATION``; raises SlotInUseError when another relay holds the slot."""
        command = (
            f"START_REPLICATION SLOT {sql.Identifier(self.slot).as_string(self._conn)} "
            f"LOGICAL {lsn_to_str(start_lsn)} (proto_version '1', "
            f"publication_names {sql.Literal(self.publication).as_string(self._conn)}, "
            "messages 'true')"
        )
        self._pg.send_query(command.encode())
        result = self._pg.get_result()
        if result is None or result.status != pq.ExecStatus.COPY_BOTH:
            message = (result.error_message if result else b"").decode(errors="replace").strip()
            state = result.error_field(pq.DiagnosticField.SQLSTATE) if result else None
            while self._pg.get_result() is not None:
                pass
            if state == b"55006":  # object_in_use: "slot ... is active for PID n"
                raise SlotInUseError(message)
            raise StreamError(f"START_REPLICATION failed: {message}")
        self._pg.nonblocking = 1
        log.info("slot %s streaming from %s", self.slot, lsn_to_str(start_lsn))

    def read(self, timeout_s: float) -> memoryview | bytes | None:
        """The next CopyData payload, or None when none arrived within ``timeout_s``."""
        nbytes, data = self._pg.get_copy_data(1)
        if nbytes == 0:
            ready, _, _ = select.select([self._pg.socket], [], [], timeout_s)
            if not ready:
                return None
            self._consume()
            nbytes, data = self._pg.get_copy_data(1)
            if nbytes == 0:
                return None
        if nbytes < 0:
            self._raise_end()
        return data

    def _consume(self) -> None:
        try:
            self._pg.consume_input()
        except psycopg.OperationalError as exc:
            raise StreamError(f"replication connection lost: {exc}") from exc

    def _raise_end(self) -> None:
        result = self._pg.get_result()
        message = (result.error_message if result else b"").decode(errors="replace").strip()
        raise StreamError(f"replication stream ended: {message or 'server closed the stream'}")

    def send_status(self, flushed_lsn: int, *, reply_requested: bool = False) -> None:
        """Report ``flushed_lsn`` as written, flushed and applied."""
        msg = standby_status_update(
            flushed_lsn, flushed_lsn, flushed_lsn, pg_now_us(), reply_requested
        )
        try:
            self._pg.put_copy_data(msg)
            while self._pg.flush() == 1:
                select.select([], [self._pg.socket], [], 1.0)
        except psycopg.OperationalError as exc:
            raise StreamError(f"replication connection lost: {exc}") from exc

    @property
    def backend_pid(self) -> int:
        return self._pg.backend_pid

    @property
    def server(self) -> tuple[str, str, int]:
        """Host, address and port of the server this stream reads (one of a multi-host DSN)."""
        info = self._conn.info
        return info.host, info.hostaddr, info.port

    def close(self) -> None:
        self._conn.close()
