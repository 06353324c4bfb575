"""The replication connection: a thin psycopg 3 shell around the COPY_BOTH stream.

Guarantees:

* :func:`ensure_slot` / :func:`ensure_publication` leave the database ready for
  the relay or raise :class:`DatabaseSetupError` naming the fix (``wal_level``,
  the REPLICATION privilege, a slot created with another plugin, a publication
  this role may not create, an outbox table that does not exist or lacks a
  routed column, an existing publication that does not publish every insert of
  the schema-qualified outbox table with every routed column);
* :class:`ReplicationStream` starts ``pgoutput`` (proto 1; ``messages 'true'`` only
  with ``messages=True``, ``CDC_MESSAGES=on``: else logical messages are not decoded)
  at the slot's confirmed position, hands out raw CopyData payloads without
  blocking longer than asked, and sends standby status updates;
* **the confirm limit is the stream's own**: a stream is constructed with its
  :class:`ConfirmLimit` (the relay's: the slot's confirm limit,
  :class:`cdc.relay.gaps.ledger.SlotLedger`; a tool's stream that no relay vouches
  for says so with :data:`UNLIMITED`), and :meth:`ReplicationStream.send_status`
  passes every position through it: no status past the limit is ever sent,
  whichever caller sends it;
* a slot held by another walsender raises :class:`SlotInUseError` (the caller
  waits as a hot standby); a lost connection raises :class:`StreamError`;
* every connection is opened by :func:`cdc.pgconn.connect` (connect timeout,
  TCP keepalives and ``tcp_user_timeout`` on both ends, bounded waits, unless
  its DSN says otherwise);
* a stream knows, from the moment it connected, the server's
  ``wal_sender_timeout`` for its walsender (:attr:`ReplicationStream.wal_sender_timeout_ms`)
  and the walsender as the server sees it (:attr:`ReplicationStream.walsender`:
  its pid, and the client address and port of the stream's own socket), so
  the relay can look at that walsender (:func:`cdc.wal.looks.look_at_walsender`),
  end it (:func:`cdc.wal.looks.end_walsender`) when the path to it is dead, and
  later recognise it as its own orphan (:func:`slot_holder`, :meth:`Walsender.holds`).

No protocol parsing happens here (see :mod:`cdc.wal.replproto`, :mod:`cdc.wal.pgoutput`).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import psycopg
from psycopg import errors as pgerrors
from psycopg import pq, sql
from psycopg.conninfo import make_conninfo

from cdc.errors import DatabaseSetupError, SlotInUseError, StreamError
from cdc.migrate import check_wal_level
from cdc.pgconn import Use, connect, conninfo, describe_holder, failure_text
from cdc.router import ROUTED_COLUMNS, BrokenOutbox, outbox_layout
from cdc.wal.replproto import lsn_to_str, pg_now_us, standby_status_update, str_to_lsn
from cdc.wal.slots import failover_wanted

log = logging.getLogger("cdc.stream")

Conn = psycopg.Connection[Any]


class ConfirmLimit(Protocol):
    """How far a slot may confirm now: a stream sends no status past it."""

    def cap(self, lsn: int, now: float) -> int:
        """``lsn`` as far as the slot may confirm it now, asking the limit to be raised
        when due (may raise :class:`StreamError`: the limit cannot be raised)."""
        ...

    def bound(self, lsn: int) -> int:
        """``lsn`` as far as the slot may confirm it now (asks for nothing, never raises)."""
        ...


class _Unlimited:
    """The limit of a stream no relay vouches for (an operator's tool, a test)."""

    def cap(self, lsn: int, now: float) -> int:
        return lsn

    def bound(self, lsn: int) -> int:
        return lsn


#: No limit: for a stream whose slot no relay's ledger guards (never the relay's own).
UNLIMITED: ConfirmLimit = _Unlimited()

#: pgoutput's option that decodes logical messages (only with ``CDC_MESSAGES=on``).
MESSAGES_OPTION = ", messages 'true'"


def with_connection_defaults(dsn: str) -> str:
    """``dsn`` with the defaults of an operator's connection (:data:`cdc.pgconn.Use.CLI`)."""
    return conninfo(dsn, Use.CLI)


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


def row_filter_sql(row_filter: str) -> sql.Composable:
    """A publication's row filter (as :func:`publication_row_filter` read it) as a
    condition of a query: the server's own text, in parentheses.

    The text is data: whatever it holds (``%`` of a modulo or a ``LIKE``, quotes,
    ``%%``) reaches the server as the server printed it - as long as the query that
    carries it is executed *without client-side parameters* (psycopg reads ``%`` as
    a placeholder only when parameters are passed): the recovery's window, the
    audit's reads and the outbox's emptiness check put their values in as
    :class:`psycopg.sql.Literal` and pass none.
    """
    return sql.SQL("({})").format(sql.SQL(row_filter))


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

    ``create=False`` (the relay after its gap check, :mod:`cdc.relay.gaps.gap`): a
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


#: After ending its own orphaned walsender, the relay waits this long at most for the
#: server to release the slot (a backend ends within milliseconds of the signal; one
#: blocked writing to a dead client notices at its next wait, well inside this).
TAKE_BACK_WAIT_S = 10.0


@dataclass(frozen=True)
class Walsender:
    """A walsender as the server sees it (``pg_stat_activity``): its pid, its client's address
    and port (None and -1 over a Unix socket), who it serves (a relay's PID and host)."""

    pid: int
    client_addr: str | None
    client_port: int
    application_name: str | None = field(default=None, compare=False)
    client_hostname: str | None = field(default=None, compare=False)

    def same_as(self, other: Walsender) -> bool:
        """True when ``other`` is this very walsender: same pid, same client address
        and port (so a pid the server reused for another connection never matches)."""
        return (
            self.pid == other.pid
            and self.client_port == other.client_port
            and _address(self.client_addr) == _address(other.client_addr)
        )

    def __str__(self) -> str:
        unix = self.client_addr is None
        where = "a Unix socket" if unix else f"{self.client_addr}:{self.client_port}"
        holder = describe_holder(self.application_name, self.client_hostname)
        return f"walsender {self.pid} (client {where}{'; ' + holder if holder else ''})"


def _address(text: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | str | None:
    """An address in one form (an IPv4-mapped IPv6 address as the IPv4 one)."""
    if text is None:
        return None
    try:
        addr = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return text
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


@dataclass(frozen=True)
class SlotHolder:
    """A slot and who holds it."""

    exists: bool
    #: the walsender streaming it (None: inactive or missing)
    walsender: Walsender | None


#: The slot and its active walsender's client address (host() drops the /32).
_HOLDER_SQL = (
    "SELECT s.active_pid, host(a.client_addr), coalesce(a.client_port, -1), a.application_name,"
    " a.client_hostname FROM pg_replication_slots s LEFT JOIN pg_stat_activity a"
    " ON a.pid = s.active_pid WHERE s.slot_name = %s"
)


def slot_holder(conn: Conn, slot: str) -> SlotHolder:
    """Who holds ``slot`` now (one cheap catalog query)."""
    row = conn.execute(_HOLDER_SQL, (slot,)).fetchone()
    if row is None:
        return SlotHolder(exists=False, walsender=None)
    pid, addr, port, app, hostname = row
    walsender = Walsender(int(pid), addr, int(port), app or None, hostname) if pid else None
    return SlotHolder(exists=True, walsender=walsender)


def take_back(conn: Conn, slot: str, orphan: Walsender) -> bool:
    """End ``orphan`` (the relay's own previous walsender, still holding ``slot``) and
    wait until the slot is free; whether it is (False: someone else holds it now, or
    it was not released within :data:`TAKE_BACK_WAIT_S`)."""
    holder = slot_holder(conn, slot)
    if holder.walsender is None:
        return True
    if not holder.walsender.same_as(orphan):
        return False
    conn.execute(
        "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots"
        " WHERE slot_name = %s AND active_pid = %s",
        (slot, orphan.pid),
    )
    deadline = time.monotonic() + TAKE_BACK_WAIT_S
    while time.monotonic() < deadline:
        holder = slot_holder(conn, slot)
        if holder.walsender is None:
            return True
        if not holder.walsender.same_as(orphan):
            return False
        time.sleep(0.1)
    return False


def _client_address(fd: int) -> tuple[str | None, int]:
    """The local address and port of socket ``fd``: the client address and port the
    server shows for this connection (None and -1 for a Unix socket)."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        if sock.family == socket.AF_UNIX:
            return None, -1
        name = sock.getsockname()
        return str(name[0]), int(name[1])
    finally:
        sock.close()


def _wal_sender_timeout_ms(pgconn: pq.abc.PGconn) -> int | None:
    """This walsender's ``wal_sender_timeout`` (0: off), None when it cannot be read."""
    result = pgconn.exec_(b"SELECT setting FROM pg_settings WHERE name = 'wal_sender_timeout'")
    if result.status != pq.ExecStatus.TUPLES_OK or result.ntuples != 1:
        return None
    value = result.get_value(0, 0)
    return int(value) if value is not None and value.isdigit() else None


class ReplicationStream:
    """One streaming session of a slot. Not thread-safe; close() when done."""

    def __init__(
        self,
        dsn: str,
        *,
        slot: str,
        publication: str,
        limit: ConfirmLimit,
        messages: bool = False,
    ) -> None:
        self.slot = slot
        self.publication = publication
        #: every status sent passes through it (see the module docstring)
        self.limit = limit
        #: logical messages decoded (``CDC_MESSAGES=on``)
        self.messages = messages
        try:
            self._conn: Conn = connect(dsn, Use.REPLICATION, replication="database")
        except psycopg.OperationalError as exc:
            raise StreamError(f"replication connection failed: {failure_text(exc)}") from exc
        self._pg = self._conn.pgconn
        try:
            #: this stream's walsender as the server shows it (pid, our socket's address)
            self.walsender = Walsender(self._pg.backend_pid, *_client_address(self._pg.socket))
            #: the server's wal_sender_timeout for this walsender (0: off; None: unknown)
            self.wal_sender_timeout_ms = _wal_sender_timeout_ms(self._pg)
        except (OSError, psycopg.Error) as exc:
            self._conn.close()
            raise StreamError(f"replication connection failed: {failure_text(exc)}") from exc
        #: ``() -> (size, payload)`` of a CopyData message already received: size 0
        #: when none is buffered, negative when the stream ended (then :meth:`read`
        #: raises). The relay's hot path; a bound C call, no Python frame.
        self.get_nowait: Callable[[], tuple[int, memoryview]] = partial(self._pg.get_copy_data, 1)

    def start(self, start_lsn: int = 0, *, confirmed_lsn: int | None = None) -> None:
        """``START_REPLICATION`` (0: at ``confirmed_lsn``); SlotInUseError if another holds it."""
        command = (
            f"START_REPLICATION SLOT {sql.Identifier(self.slot).as_string(self._conn)} "
            f"LOGICAL {lsn_to_str(start_lsn)} (proto_version '1', "
            f"publication_names {sql.Literal(self.publication).as_string(self._conn)}"
            f"{MESSAGES_OPTION if self.messages else ''})"
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
        known = f"{lsn_to_str(confirmed_lsn)} " if confirmed_lsn is not None else ""
        where = lsn_to_str(start_lsn) if start_lsn else f"{known}(its confirmed position)"
        log.info("slot %s streaming from %s", self.slot, where)

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

    def wait_readable(self, timeout_s: float) -> bool:
        """True when bytes arrive within ``timeout_s`` (nothing is consumed: the next
        :meth:`read` hands them out). For a caller that drained what was buffered."""
        ready, _, _ = select.select([self._pg.socket], [], [], timeout_s)
        return bool(ready)

    def _consume(self) -> None:
        try:
            self._pg.consume_input()
        except psycopg.OperationalError as exc:
            raise StreamError(f"replication connection lost: {exc}") from exc

    def _raise_end(self) -> None:
        result = self._pg.get_result()
        message = (result.error_message if result else b"").decode(errors="replace").strip()
        raise StreamError(f"replication stream ended: {message or 'server closed the stream'}")

    def send_status(
        self, confirmable: int, *, reply_requested: bool = False, ask_raise: bool = True
    ) -> int:
        """Report ``confirmable`` as written, flushed and applied - as far as the stream's
        limit lets it (:meth:`ConfirmLimit.cap`; :meth:`ConfirmLimit.bound` without
        ``ask_raise``: a status sent from an error path asks for nothing): the position
        sent, which is never past the limit."""
        limit = self.limit
        lsn = limit.cap(confirmable, time.monotonic()) if ask_raise else limit.bound(confirmable)
        msg = standby_status_update(lsn, lsn, lsn, pg_now_us(), reply_requested)
        try:
            self._pg.put_copy_data(msg)
            while self._pg.flush() == 1:
                select.select([], [self._pg.socket], [], 1.0)
        except psycopg.OperationalError as exc:
            raise StreamError(f"replication connection lost: {exc}") from exc
        return lsn

    @property
    def backend_pid(self) -> int:
        return self._pg.backend_pid

    @property
    def server(self) -> tuple[str, str, int]:
        """Host, address and port of the server this stream reads (one of a multi-host DSN)."""
        info = self._conn.info
        return info.host, info.hostaddr, info.port

    def server_dsn(self, dsn: str) -> str:
        """``dsn`` narrowed to the server this stream reads (for looking at its walsender)."""
        host, hostaddr, port = self.server
        return make_conninfo(
            dsn, host=host, hostaddr=hostaddr, port=port, target_session_attrs="any"
        )

    def close(self) -> None:
        self._conn.close()
