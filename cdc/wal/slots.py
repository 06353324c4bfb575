"""The server and the slot as the gap check sees them, and a slot made with an exported snapshot.

Guarantees:

* :func:`identify_system` asks ``IDENTIFY_SYSTEM`` on a replication connection:
  the system identifier and the *current* timeline (``pg_control_checkpoint()``
  lags a promotion until the next checkpoint; this does not), and the timeline's
  ancestors with the LSN where each ended (``TIMELINE_HISTORY``): the lineage
  whose records are the relay's own (:mod:`cdc.lineage`);
* :func:`read_slot` reads ``pg_replication_slots`` with ``wal_status`` and
  ``safe_wal_size`` (PostgreSQL 13+); it only reads;
* :func:`exported_slot` creates the logical slot with ``SNAPSHOT 'export'`` and
  keeps its replication connection open while the caller reads inside the
  snapshot (``SET TRANSACTION SNAPSHOT``): every transaction committed before the
  slot's consistent point is visible there, every later one is streamed by the
  slot - nothing falls between the two. The snapshot ends when the block does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import pq, sql

from cdc.errors import StreamError
from cdc.pgconn import Use, connect
from cdc.wal.replproto import str_to_lsn

Conn = psycopg.Connection[Any]


@dataclass(frozen=True)
class ServerIdentity:
    """Which cluster and which history of it a connection reached."""

    system_id: str
    timeline: int
    #: the current timeline's ancestors, oldest first: (timeline, LSN where it ended)
    ancestors: tuple[tuple[int, int], ...] = ()

    @property
    def lineage(self) -> frozenset[int]:
        """The current timeline and its ancestors."""
        return frozenset({self.timeline, *(tli for tli, _ in self.ancestors)})

    def switch_after(self, timeline: int) -> int | None:
        """The LSN where ``timeline`` (an ancestor) ended; None when it is not one."""
        return next((end for tli, end in self.ancestors if tli == timeline), None)


@dataclass(frozen=True)
class SlotRow:
    """A logical slot as ``pg_replication_slots`` shows it."""

    name: str
    plugin: str
    database: str
    active: bool
    confirmed_flush_lsn: int
    #: reserved / extended / unreserved / lost (None before PostgreSQL 13)
    wal_status: str | None
    #: bytes of WAL that may still be written before the slot is invalidated
    #: (None when max_slot_wal_keep_size is -1, i.e. never)
    safe_wal_size: int | None
    catalog_xmin: int | None = None


@dataclass(frozen=True)
class ExportedSlot:
    """A slot just created, and the snapshot it exported (valid inside the block)."""

    name: str
    consistent_lsn: int
    snapshot: str


def _simple(pgconn: pq.abc.PGconn, command: str) -> list[list[bytes | None]]:
    """One replication command by the simple query protocol; its rows as raw values."""
    result = pgconn.exec_(command.encode())
    if result.status not in (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK):
        message = result.error_message.decode(errors="replace").strip()
        raise StreamError(f"{command.split(' ', 1)[0]} failed: {message}")
    return [
        [result.get_value(row, col) for col in range(result.nfields)]
        for row in range(result.ntuples)
    ]


def _replication(dsn: str) -> Conn:
    try:
        return connect(dsn, Use.REPLICATION, replication="database")
    except psycopg.OperationalError as exc:
        raise StreamError(f"replication connection failed: {exc}") from exc


def identify_system(dsn: str) -> ServerIdentity:
    """The server's system identifier, current timeline and its ancestors
    (``IDENTIFY_SYSTEM``, ``TIMELINE_HISTORY``)."""
    with _replication(dsn) as conn:
        row = _simple(conn.pgconn, "IDENTIFY_SYSTEM")[0]
        timeline = int(row[1] or b"0")
        history = b""
        if timeline > 1:  # (timeline 1 has no history file)
            history = _simple(conn.pgconn, f"TIMELINE_HISTORY {timeline}")[0][1] or b""
    return ServerIdentity(
        system_id=(row[0] or b"").decode(),
        timeline=timeline,
        ancestors=parse_timeline_history(history),
    )


def parse_timeline_history(content: bytes) -> tuple[tuple[int, int], ...]:
    """A timeline history file's ``<parent tli> <switch LSN> <reason>`` lines as
    (timeline, LSN where it ended), oldest first; comments and blank lines skipped.
    (The replication protocol sends the file as ``bytea``: hex text ``\\x..`` is undone.)"""
    if content.startswith(b"\\x"):
        content = bytes.fromhex(content[2:].decode())
    out = []
    for line in content.decode(errors="replace").splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0].isdigit() and "/" in fields[1]:
            out.append((int(fields[0]), str_to_lsn(fields[1])))
    return tuple(out)


def read_slot(conn: Conn, slot: str) -> SlotRow | None:
    """The slot's row, or None when it does not exist."""
    row = conn.execute(
        "SELECT slot_name, plugin, database, active, confirmed_flush_lsn::text,"
        " wal_status, safe_wal_size, catalog_xmin::text::bigint"
        " FROM pg_replication_slots WHERE slot_name = %s",
        (slot,),
    ).fetchone()
    if row is None:
        return None
    return SlotRow(
        name=row[0],
        plugin=row[1] or "",
        database=row[2] or "",
        active=bool(row[3]),
        confirmed_flush_lsn=str_to_lsn(row[4]) if row[4] else 0,
        wal_status=row[5],
        safe_wal_size=row[6],
        catalog_xmin=row[7],
    )


@contextmanager
def exported_slot(dsn: str, slot: str) -> Iterator[ExportedSlot]:
    """Create logical slot ``slot`` (pgoutput) exporting its snapshot; the snapshot
    stays importable until the block ends (its connection is then closed, the slot stays)."""
    with _replication(dsn) as conn:
        name = sql.Identifier(slot).as_string(conn)
        row = _simple(
            conn.pgconn, f"CREATE_REPLICATION_SLOT {name} LOGICAL pgoutput (SNAPSHOT 'export')"
        )[0]
        yield ExportedSlot(
            name=slot,
            consistent_lsn=str_to_lsn((row[1] or b"0/0").decode()),
            snapshot=(row[2] or b"").decode(),
        )


def in_snapshot(conn: Conn, snapshot: str) -> None:
    """Begin a REPEATABLE READ transaction on ``conn`` that sees ``snapshot``."""
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)))
