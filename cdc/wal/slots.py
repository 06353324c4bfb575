"""The server and the slot as the gap check sees them, and a slot made with an exported snapshot.

Guarantees:

* :func:`identify_system` asks ``IDENTIFY_SYSTEM`` on a replication connection:
  the system identifier and the *current* timeline (``pg_control_checkpoint()``
  lags a promotion until the next checkpoint; this does not), and the timeline's
  ancestors with the LSN where each ended (``TIMELINE_HISTORY``): the lineage
  whose records are the relay's own (:mod:`cdc.lineage`);
* :func:`read_slot` reads ``pg_replication_slots`` by the server's version (it
  only reads): ``wal_status`` and ``safe_wal_size`` everywhere (15+),
  ``conflicting`` from 16, ``invalidation_reason``, ``failover`` and ``synced``
  from 17 (``inactive_since``, 17+, is not needed); :attr:`SlotRow.invalidated`
  is the one answer to "why is this slot unusable" on every version;
* :func:`failover_wanted` turns ``CDC_FAILOVER_SLOT`` and the server's version
  into the slot's ``failover`` property (``on`` before PostgreSQL 17 is one
  :class:`DatabaseSetupError`); every slot the relay creates - first start
  (:func:`cdc.wal.stream.ensure_slot`), gap recovery and accepted loss
  (:func:`exported_slot`) - is created with it, and :func:`alter_failover`
  makes an existing slot match;
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

from cdc.errors import DatabaseSetupError, StreamError
from cdc.pgconn import Use, connect, failure_text
from cdc.wal.replproto import str_to_lsn

Conn = psycopg.Connection[Any]

#: ``server_version_num`` from which a logical slot can be a failover slot (``failover``
#: of pg_create_logical_replication_slot and CREATE/ALTER_REPLICATION_SLOT), synchronized
#: to standbys with ``sync_replication_slots`` (PostgreSQL 17).
FAILOVER_SLOTS_MIN_VERSION = 170_000
#: From 16 ``pg_replication_slots.conflicting``; from 17 ``invalidation_reason``,
#: ``failover``, ``synced``, ``inactive_since``; 18 adds the ``idle_timeout`` reason
#: (``idle_replication_slot_timeout``).
CONFLICTING_MIN_VERSION = 160_000
#: What PostgreSQL 15 calls nothing: a slot with ``wal_status = 'lost'`` lost its WAL
#: (its only way of being invalidated there); 17+ names it the same way.
WAL_REMOVED = "wal_removed"
#: PostgreSQL 16 says only ``conflicting``: invalidated by recovery on a standby (rows
#: removed, or wal_level lowered on the primary); 17+ names which.
CONFLICT = "conflict"


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
    #: why the slot can no longer be used (None: it can): PostgreSQL 17+'s
    #: ``invalidation_reason`` (wal_removed, rows_removed, wal_level_insufficient,
    #: 18: idle_timeout), 16's ``conflicting`` (:data:`CONFLICT`), or 15's
    #: ``wal_status = 'lost'`` (:data:`WAL_REMOVED`)
    invalidated: str | None = None
    #: PostgreSQL 17+: a failover slot (synchronized to standbys set up for it)
    failover: bool = False
    #: PostgreSQL 17+: the slot was synchronized from a primary (on a standby, or left
    #: so on a promoted one: the slot a failover carried over)
    synced: bool = False


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
        raise StreamError(f"replication connection failed: {failure_text(exc)}") from exc


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


def slot_columns(server_version_num: int) -> str:
    """The select list of :func:`read_slot` for a server of that version."""
    base = (
        "slot_name, plugin, database, active, confirmed_flush_lsn::text, wal_status, safe_wal_size"
    )
    if server_version_num >= FAILOVER_SLOTS_MIN_VERSION:
        more = ", invalidation_reason, failover, synced"
    elif server_version_num >= CONFLICTING_MIN_VERSION:
        more = ", CASE WHEN conflicting THEN 'conflict' END, false, false"
    else:
        more = ", NULL::text, false, false"
    return base + more + ", catalog_xmin::text::bigint"


def invalidated(wal_status: str | None, reason: str | None) -> str | None:
    """Why a slot is unusable, on every version: the server's reason when it gives one,
    else :data:`WAL_REMOVED` for ``wal_status = 'lost'`` (PostgreSQL 15, or 16+ where
    every invalidated slot reads ``lost``)."""
    if reason:
        return reason
    return WAL_REMOVED if wal_status == "lost" else None


def read_slot(conn: Conn, slot: str) -> SlotRow | None:
    """The slot's row, or None when it does not exist."""
    columns = slot_columns(conn.info.server_version)
    row = conn.execute(
        f"SELECT {columns} FROM pg_replication_slots WHERE slot_name = %s",  # noqa: S608
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
        catalog_xmin=row[10],
        invalidated=invalidated(row[5], row[7]),
        failover=bool(row[8]),
        synced=bool(row[9]),
    )


def failover_wanted(setting: str, server_version_num: int) -> bool:
    """Whether the relay's slot is to be a failover slot (``CDC_FAILOVER_SLOT``):
    ``auto`` on PostgreSQL 17+, ``on`` always (a server before 17 raises
    :class:`DatabaseSetupError` naming the fix), ``off`` never."""
    supported = server_version_num >= FAILOVER_SLOTS_MIN_VERSION
    if setting == "on" and not supported:
        raise DatabaseSetupError(
            f"CDC_FAILOVER_SLOT=on but the server is PostgreSQL {server_version_num // 10_000}:"
            " failover slots need PostgreSQL 17 or later; set CDC_FAILOVER_SLOT=auto or off"
        )
    return setting != "off" and supported


def alter_failover_command(slot: str, failover: bool = True) -> sql.Composed:
    """The replication command that sets ``slot``'s failover property (PostgreSQL 17+)."""
    return sql.SQL("ALTER_REPLICATION_SLOT {} (FAILOVER {})").format(
        sql.Identifier(slot), sql.SQL("true" if failover else "false")
    )


def alter_failover(dsn: str, slot: str, failover: bool) -> None:
    """Set ``slot``'s failover property (PostgreSQL 17+; the slot must not be in use)."""
    with _replication(dsn) as conn:
        _simple(conn.pgconn, alter_failover_command(slot, failover).as_string(conn))


def create_slot_command(slot: str, *, failover: bool) -> sql.Composed:
    """``CREATE_REPLICATION_SLOT`` of a pgoutput slot exporting its snapshot (``FAILOVER``
    only when asked: servers before 17 do not know the option)."""
    options = "SNAPSHOT 'export', FAILOVER true" if failover else "SNAPSHOT 'export'"
    return sql.SQL("CREATE_REPLICATION_SLOT {} LOGICAL pgoutput ({})").format(
        sql.Identifier(slot), sql.SQL(options)
    )


@contextmanager
def exported_slot(dsn: str, slot: str, *, failover: str = "off") -> Iterator[ExportedSlot]:
    """Create logical slot ``slot`` (pgoutput) exporting its snapshot - a failover slot
    when ``failover`` (``CDC_FAILOVER_SLOT``) asks for one on this server; the snapshot
    stays importable until the block ends (its connection is then closed, the slot stays)."""
    with _replication(dsn) as conn:
        wanted = failover_wanted(failover, conn.info.server_version)
        command = create_slot_command(slot, failover=wanted).as_string(conn)
        row = _simple(conn.pgconn, command)[0]
        yield ExportedSlot(
            name=slot,
            consistent_lsn=str_to_lsn((row[1] or b"0/0").decode()),
            snapshot=(row[2] or b"").decode(),
        )


def in_snapshot(conn: Conn, snapshot: str) -> None:
    """Begin a REPEATABLE READ transaction on ``conn`` that sees ``snapshot``."""
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)))


#: Each slot ``synchronized_standby_slots`` names, as the server shows it now: its type,
#: whether a walsender streams from it, whether it is invalidated, and whether its
#: position is behind the server's WAL (NULL: it never reserved WAL).
_STANDBY_SLOTS_SQL = """
SELECT n.name, s.slot_type, s.active, s.invalidation_reason IS NOT NULL,
       s.restart_lsn IS NULL OR s.restart_lsn < pg_current_wal_lsn()
FROM unnest(%s::text[]) AS n(name)
LEFT JOIN pg_replication_slots s ON s.slot_name = n.name
ORDER BY 1
"""


def standby_slot_names(setting: str) -> list[str]:
    """The slot names of a ``synchronized_standby_slots`` value (``*`` kept as is)."""
    return [part.strip().strip('"') for part in setting.split(",") if part.strip()]


def decoding_held_back(conn: Conn, slot: str, *, failover: bool | None = None) -> list[str]:
    """Why PostgreSQL holds the logical decoding of ``slot`` back, one line per cause
    (empty: nothing does). On 17+ a failover slot's walsender sends nothing until every
    physical slot of ``synchronized_standby_slots`` has confirmed the WAL: a name of a
    slot that does not exist (a promoted standby keeps its primary's setting), is not
    physical, is invalidated, or that no standby streams from while it is behind holds
    the decoding back (the server logs a WARNING a second, the relay receives nothing).
    ``failover``: whether the slot is (or will be) a failover slot; None: read it."""
    if conn.info.server_version < FAILOVER_SLOTS_MIN_VERSION:
        return []
    if failover is None:
        row = conn.execute(
            "SELECT failover FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
        failover = bool(row and row[0])
    if not failover:
        return []
    setting = conn.execute("SHOW synchronized_standby_slots").fetchone()
    names = standby_slot_names(str(setting[0] if setting else ""))
    if not names or names == ["*"]:
        return []
    return standby_slots_holding_back(conn, slot, names)


def standby_slots_holding_back(conn: Conn, slot: str, names: list[str]) -> list[str]:
    """One line for each of ``names`` (slots ``synchronized_standby_slots`` names) that
    holds the failover slot ``slot``'s decoding back, as the server shows it now."""
    held = []
    for name, kind, active, invalid, behind in conn.execute(_STANDBY_SLOTS_SQL, (names,)):
        why = why_held_back(kind, active=bool(active), invalid=bool(invalid), behind=bool(behind))
        if why is not None:
            held.append(
                f"synchronized_standby_slots names {name}, which {why}: PostgreSQL sends the"
                f" failover slot {slot} nothing until that slot confirms the WAL - remove it"
                " from synchronized_standby_slots (and reload) or bring that standby back"
            )
    return held


def why_held_back(kind: str | None, *, active: bool, invalid: bool, behind: bool) -> str | None:
    """Why a slot named in ``synchronized_standby_slots`` holds logical decoding back
    (None: it does not): ``kind`` is its ``slot_type`` (None: no such slot)."""
    if kind is None:
        return "does not exist (a promoted standby keeps its primary's setting)"
    if kind != "physical":
        return f"is a {kind} slot, not a standby's physical slot"
    if invalid:
        return "is invalidated"
    if not active and behind:
        return "has no standby streaming from it and is behind the server's WAL"
    return None
