"""Ops over the PostgreSQL side: the replication slot and the users backfill.

Guarantees:

* :func:`slot_status` reads only. Its ``wal_lag_bytes`` is the WAL written
  since the slot's ``confirmed_flush_lsn`` - what the relay has not yet
  confirmed as safely in Kafka. Its ``lag_time_s`` is the age of the **oldest
  transaction the slot has not confirmed** that carries a published change or
  a transactional logical message, measured as ``clock_timestamp() - commit
  time`` on the server's clock (0 when nothing is unconfirmed). It is read by
  decoding, never consuming: the slot is copied into a *temporary* slot of
  this session (``pg_copy_logical_replication_slot``, so an active relay is
  neither stopped nor disturbed) and the copy is peeked for its first
  ``Begin``; the copy disappears with the session. Needs the REPLICATION
  privilege; without it ``lag_time_s`` is ``None`` and ``lag_time_note`` says why.
  (``pg_stat_replication``'s ``flush_lag`` is not used: it goes stale or NULL
  exactly when the relay stops confirming.)
* :func:`slot_drop` refuses while the slot is active (a relay streams it) and
  returns what was dropped; the events committed after its confirmed LSN and
  not yet produced are then never relayed (count them first with
  :func:`unconfirmed_event_count`; rebuild with :func:`resync_users`).
* :func:`resync_users` writes one ``UserRegistered`` outbox event per existing
  user through :func:`cdc.outbox.write_event`, in batches of ``batch_size``
  users, each batch its own transaction, paging by primary key (keyset), so a
  failure leaves whole batches written and a rerun is harmless (each event has
  a new id; ``users/sync`` of a known user changes nothing in the engine).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypedDict

import psycopg
from psycopg import errors as pgerrors
from psycopg import sql

from cdc import gaps
from cdc.constants import OUTBOX_MESSAGE_PREFIX
from cdc.errors import CdcError, DatabaseSetupError
from cdc.outbox import user_registered_event, write_event
from cdc.pgconn import Use, connect, failure_text
from cdc.settings import Settings
from cdc.wal import pgoutput
from cdc.wal.slots import FAILOVER_SLOTS_MIN_VERSION, read_slot
from cdc.wal.stream import slot_holder

Conn = psycopg.Connection[Any]
#: progress(done, total)
ProgressFn = Callable[[int, int], None]

#: Peeking decodes WAL from the slot's restart LSN; give up after this so a
#: status call never hangs on a huge backlog (the lag time is then unknown).
PEEK_TIMEOUT_MS = 15_000
#: Changes decoded at most while looking for the first unconfirmed transaction:
#: bounds the work when non-transactional messages (heartbeats) come first.
PEEK_MAX_CHANGES = 1_000
#: Name prefix of the temporary slot copies this module peeks (at most 63 chars in all).
_PEEK_SLOT_PREFIX = "outbox_ops_peek_"
#: First bytes of pgoutput messages (protocol 1).
_TAG_BEGIN = ord("B")
_TAG_INSERT = ord("I")
_TAG_MESSAGE = ord("M")
#: A pgoutput Message is 'M', flags (1 byte), LSN (8 bytes), then the prefix:
#: the prefix starts at byte 11 in SQL's 1-based ``substring``.
_MESSAGE_PREFIX_POS = 11


class SlotNotFoundError(CdcError):
    """The replication slot does not exist."""


class SlotActiveError(CdcError):
    """The slot is streamed by a relay right now: it must not be dropped."""


class SlotStatus(TypedDict):
    """The slot as ops sees it (a plain dict, fit for ``--json``)."""

    slot: str
    exists: bool
    plugin: str | None
    database: str | None
    active: bool
    #: The walsender streaming the slot (a postgres backend, not the relay).
    active_pid: int | None
    #: Who holds an active slot: the walsender, its client address and the relay's own
    #: PID and host (its replication connection's application_name), e.g. ``walsender
    #: 12233 (client 127.0.0.1:40112; relay pid 12053 on host h)``; None when inactive.
    holder: str | None
    confirmed_flush_lsn: str | None
    restart_lsn: str | None
    current_wal_lsn: str
    #: WAL since confirmed_flush_lsn: not yet confirmed by the relay.
    wal_lag_bytes: int | None
    #: WAL since restart_lsn: what the server keeps on disk for this slot.
    retained_wal_bytes: int | None
    #: pg_replication_slots.wal_status: reserved / extended / unreserved / lost.
    wal_status: str | None
    #: WAL that may still be written before the slot is invalidated (None: no limit).
    safe_wal_size_bytes: int | None
    #: The slot's latest history row (cdc.gaps: a gap open, recovered or accepted;
    #: the slot created at a first start), None when there is none.
    gap: dict[str, object] | None
    #: PostgreSQL 17+: a failover slot (synchronized to standbys set up for it); None before.
    failover: bool | None
    #: PostgreSQL 17+: synchronized from a primary (the slot a failover carried over).
    synced: bool | None
    #: Age of the oldest unconfirmed transaction with an event; 0 when none.
    lag_time_s: float | None
    oldest_unconfirmed_commit_ts: str | None
    lag_time_note: str


_STATUS_SQL = """
SELECT s.slot_name, s.plugin, s.database, s.active, s.active_pid,
       s.confirmed_flush_lsn::text, s.restart_lsn::text, pg_current_wal_lsn()::text,
       pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::bigint,
       pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::bigint,
       s.wal_status, s.safe_wal_size
FROM (SELECT 1) AS one
LEFT JOIN pg_replication_slots AS s ON s.slot_name = %s
"""

_PEEK_ARGS = "'proto_version', '1', 'publication_names', %s, 'messages', 'true'"

_FIRST_BEGIN_SQL = f"""
SELECT data, clock_timestamp()
FROM pg_logical_slot_peek_binary_changes(%s, NULL, %s, {_PEEK_ARGS})
WHERE get_byte(data, 0) = {_TAG_BEGIN}
LIMIT 1
"""  # noqa: S608 - constants only

_COUNT_EVENTS_SQL = f"""
SELECT count(*) FILTER (WHERE get_byte(data, 0) = {_TAG_INSERT})
     + count(*) FILTER (WHERE get_byte(data, 0) = {_TAG_MESSAGE}
                         AND get_byte(data, 1) & 1 = 1
                         AND substring(data FROM {_MESSAGE_PREFIX_POS} FOR %s) = %s)
FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, {_PEEK_ARGS})
"""  # noqa: S608 - constants only


def _connect(settings: Settings) -> Conn:
    try:
        return connect(settings.require("pg_dsn").pg_dsn.get_secret_value(), Use.CLI)
    except psycopg.OperationalError as exc:
        raise CdcError(f"PostgreSQL connection failed: {failure_text(exc)}") from exc


def slot_status(settings: Settings) -> SlotStatus:
    """The slot's row, WAL lag in bytes and the lag time (see the module docstring)."""
    with _connect(settings) as conn:
        return read_slot_status(conn, settings)


def read_slot_status(conn: Conn, settings: Settings) -> SlotStatus:
    """:func:`slot_status` on the caller's autocommit connection (kept open by
    callers that ask often, e.g. :mod:`cdc.backlog`)."""
    row = conn.execute(_STATUS_SQL, (settings.slot,)).fetchone()
    assert row is not None
    status = _status_from_row(settings.slot, row)
    status["gap"] = _latest_history(conn, settings.slot)
    if status["exists"] and conn.info.server_version >= FAILOVER_SLOTS_MIN_VERSION:
        row = read_slot(conn, settings.slot)
        if row is not None:
            status["failover"], status["synced"] = row.failover, row.synced
    if status["active"]:
        walsender = slot_holder(conn, settings.slot).walsender
        status["holder"] = str(walsender) if walsender is not None else None
    if status["exists"] and status["wal_status"] != "lost":
        _fill_lag_time(conn, settings, status)
    return status


def _latest_history(conn: Conn, slot: str) -> dict[str, object] | None:
    """The slot's latest history row as JSON (None without one, or before migration 006)."""
    try:
        row = gaps.latest(conn, slot)
    except DatabaseSetupError:
        return None
    return row.as_json() if row is not None else None


def _status_from_row(slot: str, row: tuple[Any, ...]) -> SlotStatus:
    exists = row[0] is not None
    return SlotStatus(
        slot=slot,
        exists=exists,
        plugin=row[1],
        database=row[2],
        active=bool(row[3]),
        active_pid=row[4],
        holder=None,
        confirmed_flush_lsn=row[5],
        restart_lsn=row[6],
        current_wal_lsn=row[7],
        wal_lag_bytes=row[8],
        retained_wal_bytes=row[9],
        wal_status=row[10],
        safe_wal_size_bytes=row[11],
        gap=None,
        failover=None,
        synced=None,
        lag_time_s=None,
        oldest_unconfirmed_commit_ts=None,
        lag_time_note="slot does not exist" if not exists else "",
    )


def _fill_lag_time(conn: Conn, settings: Settings, status: SlotStatus) -> None:
    if not status["wal_lag_bytes"]:
        status["lag_time_s"] = 0.0
        status["lag_time_note"] = "nothing unconfirmed"
        return
    try:
        copy = _temporary_copy(conn, settings.slot)
        row = conn.execute(
            _FIRST_BEGIN_SQL, (copy, PEEK_MAX_CHANGES, settings.publication)
        ).fetchone()
    except psycopg.Error as exc:  # no REPLICATION privilege, timeout, no publication ...
        status["lag_time_note"] = f"lag time unavailable: {_first_line(exc)}"
        return
    finally:
        _drop_temporary(conn)
    if row is None:
        status["lag_time_s"] = 0.0
        status["lag_time_note"] = (
            f"no unconfirmed transaction with an event (first {PEEK_MAX_CHANGES} changes decoded)"
        )
        return
    begin = pgoutput.decode(bytes(row[0]))
    assert isinstance(begin, pgoutput.Begin)
    now_us = int(row[1].timestamp() * 1_000_000)
    status["lag_time_s"] = max(0, now_us - begin.commit_ts_us) / 1_000_000
    status["oldest_unconfirmed_commit_ts"] = _iso_us(begin.commit_ts_us)
    status["lag_time_note"] = "age of the oldest unconfirmed transaction with an event"


def _temporary_copy(conn: Conn, slot: str) -> str:
    """A temporary copy of ``slot`` owned by this session; statements time out from now on."""
    name = f"{_PEEK_SLOT_PREFIX}{uuid.uuid4().hex[:16]}"
    conn.execute(sql.SQL("SET statement_timeout = {}").format(sql.Literal(PEEK_TIMEOUT_MS)))
    conn.execute("SELECT pg_copy_logical_replication_slot(%s, %s, true)", (slot, name))
    return name


def _drop_temporary(conn: Conn) -> None:
    """Drop this session's temporary copies now (they would go with the session anyway)."""
    if conn.closed or conn.broken:
        return
    conn.execute(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
        " WHERE temporary AND active_pid = pg_backend_pid() AND starts_with(slot_name, %s)",
        (_PEEK_SLOT_PREFIX,),
    )


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _iso_us(unix_us: int) -> str:
    return datetime.fromtimestamp(unix_us / 1_000_000, UTC).isoformat()


def unconfirmed_event_count(settings: Settings) -> int | None:
    """Outbox events (inserts and transactional ``outbox`` messages) committed after the
    slot's confirmed LSN - what dropping the slot would lose if not yet in Kafka.
    ``None`` when it cannot be counted (no privilege, timeout)."""
    prefix = OUTBOX_MESSAGE_PREFIX.encode() + b"\x00"
    with _connect(settings) as conn:
        try:
            copy = _temporary_copy(conn, settings.slot)
            row = conn.execute(
                _COUNT_EVENTS_SQL, (len(prefix), prefix, copy, settings.publication)
            ).fetchone()
        except pgerrors.UndefinedObject as exc:
            raise SlotNotFoundError(f"slot {settings.slot} does not exist") from exc
        except psycopg.Error:
            return None
        finally:
            _drop_temporary(conn)
    return int(row[0]) if row is not None else None


def active_slot_line(status: SlotStatus) -> str:
    """``slot S is held by walsender W (client A; relay pid P on host H)``: an active
    slot's holder, the relay's PID apart from its walsender's."""
    holder = status["holder"] or f"walsender {status['active_pid']}"
    return f"slot {status['slot']} is active, held by {holder}"


def slot_drop(settings: Settings) -> SlotStatus:
    """Drop the slot; refuse while it is active. Returns its status just before."""
    status = slot_status(settings)
    if not status["exists"]:
        raise SlotNotFoundError(f"slot {settings.slot} does not exist")
    if status["active"]:
        raise SlotActiveError(f"{active_slot_line(status)}: stop that relay first, then drop it")
    with _connect(settings) as conn:
        try:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (settings.slot,))
        except pgerrors.ObjectInUse as exc:
            raise SlotActiveError(
                f"slot {settings.slot} became active: stop the relay first"
            ) from exc
        except pgerrors.UndefinedObject as exc:
            raise SlotNotFoundError(f"slot {settings.slot} does not exist") from exc
    return status


_USERS_PAGE_SQL = (
    "SELECT id, email, display_name, registered_at FROM users WHERE id > %s ORDER BY id LIMIT %s"
)


def resync_users(
    settings: Settings,
    *,
    batch_size: int = 1000,
    delete_after: bool = False,
    progress: ProgressFn | None = None,
) -> int:
    """Emit one ``UserRegistered`` event per existing user (backfill); return how many.

    Each batch reads its page of users and writes their events in one
    transaction; pages follow the primary key, so concurrent registrations are
    either in a page or emit their own event anyway.
    """
    if batch_size < 1:
        raise CdcError(f"batch size must be at least 1, not {batch_size}")
    with _connect(settings) as conn:
        row = conn.execute("SELECT count(*) FROM users").fetchone()
        total = int(row[0]) if row else 0
        emitted = 0
        after = uuid.UUID(int=0)
        while True:
            written, last = _resync_batch(
                conn,
                after=after,
                batch_size=batch_size,
                settings=settings,
                delete_after=delete_after,
            )
            emitted += written
            if progress is not None:
                progress(emitted, max(total, emitted))
            if last is None or written < batch_size:
                return emitted
            after = last


def _resync_batch(
    conn: Conn, *, after: uuid.UUID, batch_size: int, settings: Settings, delete_after: bool
) -> tuple[int, uuid.UUID | None]:
    """One page of users and their events, in one transaction; (events, last id)."""
    with conn.transaction():
        users = conn.execute(_USERS_PAGE_SQL, (after, batch_size)).fetchall()
        with conn.pipeline():
            for user_id, email, display_name, registered_at in users:
                write_event(
                    conn,
                    user_registered_event(user_id, email, display_name, registered_at),
                    table=settings.outbox_table,
                    delete_after=delete_after,
                )
    return len(users), (users[-1][0] if users else None)
