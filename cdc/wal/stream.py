"""The replication connection: a thin psycopg 3 shell around the COPY_BOTH stream.

Guarantees:

* :func:`ensure_slot` / :func:`ensure_publication` leave the database ready for
  the relay or raise :class:`DatabaseSetupError` naming the fix (``wal_level``,
  the REPLICATION privilege, a slot created with another plugin, a publication
  this role may not create);
* :class:`ReplicationStream` starts ``pgoutput`` (proto 1, ``messages 'true'``)
  at the slot's confirmed position, hands out raw CopyData payloads without
  blocking longer than asked, and sends standby status updates;
* a slot held by another walsender raises :class:`SlotInUseError` (the caller
  waits as a hot standby); a lost connection raises :class:`StreamError`.

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

from cdc.errors import DatabaseSetupError, SlotInUseError, StreamError
from cdc.migrate import check_wal_level
from cdc.wal.replproto import lsn_to_str, pg_now_us, standby_status_update, str_to_lsn

log = logging.getLogger("cdc.stream")

Conn = psycopg.Connection[Any]


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


def ensure_publication(conn: Conn, publication: str, table: str) -> None:
    """Create ``publication`` for inserts into ``table`` when it is missing."""
    exists = conn.execute(
        "SELECT 1 FROM pg_publication WHERE pubname = %s", (publication,)
    ).fetchone()
    if exists:
        return
    try:
        conn.execute(
            sql.SQL("CREATE PUBLICATION {} FOR TABLE {} WITH (publish = 'insert')").format(
                sql.Identifier(publication), sql.Identifier(table)
            )
        )
        log.info("publication %s created for table %s", publication, table)
    except pgerrors.InsufficientPrivilege as exc:
        raise DatabaseSetupError(
            f"publication {publication} is missing and this role may not create it: "
            "run `outbox-cdc migrate` as the owner of the outbox table"
        ) from exc
    except pgerrors.UndefinedTable as exc:
        raise DatabaseSetupError(
            f"table {table} does not exist: run `outbox-cdc migrate` first"
        ) from exc


def server_is_utf8(conn: Conn) -> bool:
    """True when the database stores text as UTF-8 (then every text value
    pgoutput sends is valid UTF-8, and the relay may pass it on unchecked)."""
    row = conn.execute("SHOW server_encoding").fetchone()
    return row is not None and str(row[0]).upper() in ("UTF8", "UTF-8")


def ensure_slot(conn: Conn, slot: str, *, create: bool = True) -> SlotInfo:
    """Create the logical slot (``pgoutput``) when missing; refuse another plugin.

    ``create=False`` (the relay after its gap check, :mod:`cdc.relay.gap`): a
    missing slot raises :class:`StreamError` instead - it disappeared since the
    check, and the next session's check decides what that means.
    """
    check_wal_level(conn)
    check_replication_privilege(conn)
    info = slot_info(conn, slot)
    if info is None and not create:
        raise StreamError(f"slot {slot} disappeared after the gap check")
    if info is None:
        try:
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
            log.info("slot %s created (pgoutput)", slot)
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


class ReplicationStream:
    """One streaming session of a slot. Not thread-safe; close() when done."""

    def __init__(self, dsn: str, *, slot: str, publication: str) -> None:
        self.slot = slot
        self.publication = publication
        try:
            self._conn: Conn = psycopg.connect(dsn, replication="database", autocommit=True)
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
