"""The slot history (``outbox_cdc_slot_history``, migrations 006-007): slots made, gaps, their ends.

Guarantees:

* a gap is written ``open`` *before* anything is done about it, and becomes
  ``recovered`` only after Kafka acknowledged every re-published row, or
  ``accepted`` by a named operator: a relay that dies half-way finds the gap
  still open at its next start and does it again (duplicates, never loss);
* a ``created`` row records the slot a relay made at its first start, with the
  origin (system identifier / timeline / slot) it streamed from;
* every row that made a slot (``created``, ``adopted``, a recovered or accepted
  gap) records its identity: ``slot_catalog_xmin`` and ``confirm_limit_lsn``, the
  furthest the relay ever let the slot confirm (:func:`maker`,
  :func:`raise_confirm_limit`: raised only ever, to the server's WAL insert
  position, *before* the relay confirms past it). A slot whose
  ``confirmed_flush_lsn`` is past it was moved by someone else;
* at most one gap of a slot is open (a unique partial index, migration 007):
  :func:`record_gap` of a second relay finds the first one's row instead of
  writing its own, and a gap found before the history moved on (another process
  closed it, or made the slot) is not written (:class:`HistoryChangedError`);
* a recovery's progress (:func:`record_progress`) only moves forward: every row
  of the window before ``resume_from`` is acknowledged by Kafka;
* :func:`note_output` records, once each, the topics the relay published to and
  the event forms it published (``message``) in ``outbox_cdc_slot_output``;
* rows are never deleted by outbox-cdc; they are few (one per slot lifetime event).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg import errors as pgerrors
from psycopg.rows import dict_row

from cdc.errors import CdcError, DatabaseSetupError

Conn = psycopg.Connection[Any]

TABLE = "outbox_cdc_slot_history"

#: Values of the ``state`` column ('superseded': a duplicate open gap closed by migration 007).
OPEN, RECOVERED, ACCEPTED, CREATED = "open", "recovered", "accepted", "created"

#: Values of the ``event`` column: the relay made the slot (a first start, `slot init`),
#: took over a slot it found without a recorded identity (made before migration 007),
#: or found a gap.
EVENT_CREATED, EVENT_ADOPTED, EVENT_GAP = "created", "adopted", "gap"

#: The output table (migration 007) and its kinds.
OUTPUT_TABLE = "outbox_cdc_slot_output"
OUTPUT_TOPIC, OUTPUT_FORM = "topic", "form"
#: The event form the outbox table cannot give back (pg_logical_emit_message).
FORM_MESSAGE = "message"


@dataclass(frozen=True)
class HistoryRow:
    """One row of the slot history."""

    id: int
    slot: str
    event: str
    cause: str
    detail: str
    state: str
    detected_at: datetime
    last_published_ts: datetime | None
    last_published_origin: str | None
    window_start: datetime | None
    window_end: datetime | None
    origin: str | None
    consistent_lsn: str | None
    rows_recovered: int | None
    seconds: float | None
    unrecoverable: bool
    accepted_by: str | None
    resolved_at: datetime | None
    #: the identity of the slot this row made (migration 007; None on older rows)
    slot_catalog_xmin: int | None = None
    confirm_limit_lsn: str | None = None
    #: a recovery's progress: every row of the window before it is in Kafka
    resume_from: datetime | None = None

    @property
    def is_open(self) -> bool:
        return self.state == OPEN

    @property
    def made_slot(self) -> bool:
        """This row made (or adopted) the slot and recorded its identity."""
        return self.confirm_limit_lsn is not None and self.state != OPEN

    def as_json(self) -> dict[str, object]:
        return {
            k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in asdict(self).items()
        }


_COLUMNS = ", ".join(HistoryRow.__dataclass_fields__)


def _rows(conn: Conn, query: str, params: tuple[Any, ...]) -> list[HistoryRow]:
    try:
        with conn.cursor(row_factory=dict_row) as cur:
            cur.execute(query, params)
            return [
                HistoryRow(
                    **{
                        **row,
                        "consistent_lsn": _text(row["consistent_lsn"]),
                        "confirm_limit_lsn": _text(row["confirm_limit_lsn"]),
                    }
                )
                for row in cur.fetchall()
            ]
    except (pgerrors.UndefinedTable, pgerrors.UndefinedColumn) as exc:
        raise _unmigrated(exc) from exc


def _unmigrated(exc: Exception) -> DatabaseSetupError:
    what = "table" if isinstance(exc, pgerrors.UndefinedTable) else "a column of table"
    return DatabaseSetupError(f"{what} {TABLE} is missing: run `outbox-cdc migrate`")


def _text(value: object) -> str | None:
    return None if value is None else str(value)


def latest(conn: Conn, slot: str) -> HistoryRow | None:
    """The newest history row of ``slot``."""
    rows = _rows(
        conn,
        f"SELECT {_COLUMNS} FROM {TABLE} WHERE slot = %s ORDER BY id DESC LIMIT 1",  # noqa: S608
        (slot,),
    )
    return rows[0] if rows else None


def open_gaps(conn: Conn, slot: str | None = None) -> list[HistoryRow]:
    """Gaps not yet recovered nor accepted (of ``slot``, or of every slot)."""
    where = "state = 'open'" + (" AND slot = %s" if slot is not None else "")
    return _rows(
        conn,
        f"SELECT {_COLUMNS} FROM {TABLE} WHERE {where} ORDER BY id",  # noqa: S608
        (slot,) if slot is not None else (),
    )


def maker(conn: Conn, slot: str) -> HistoryRow | None:
    """The newest row of ``slot`` that made (or adopted) a slot and recorded its identity."""
    rows = _rows(
        conn,
        f"SELECT {_COLUMNS} FROM {TABLE} WHERE slot = %s AND confirm_limit_lsn IS NOT NULL"  # noqa: S608
        " AND state <> 'open' ORDER BY id DESC LIMIT 1",
        (slot,),
    )
    return rows[0] if rows else None


def responsible_since(conn: Conn, slot: str) -> datetime | None:
    """When the relay's first start made (or took over) ``slot``, choosing not to publish
    the rows already in the table (``first_start``, ``init_now``); None otherwise (its
    history is older, or ``slot init --from table`` published them)."""
    rows = _rows(
        conn,
        f"SELECT {_COLUMNS} FROM {TABLE} WHERE slot = %s ORDER BY id LIMIT 1",  # noqa: S608
        (slot,),
    )
    first = rows[0] if rows else None
    if first is None or first.event == EVENT_GAP:
        return None
    return first.detected_at if first.cause in ("first_start", "init_now") else None


@dataclass(frozen=True)
class SlotMade:
    """A slot the relay just made (or adopted), as it is recorded."""

    slot: str
    #: ``origin`` of the records the relay publishes from it
    origin: str
    #: its consistent point (made) or its confirmed_flush_lsn (adopted): the first confirm limit
    lsn: str
    catalog_xmin: int | None
    #: 'first_start', 'init_now', 'upgrade', ...
    cause: str
    detail: str


def record_created(conn: Conn, made: SlotMade, *, event: str = EVENT_CREATED) -> int:
    """The relay made (``created``) or took over (``adopted``) ``made.slot``; its identity."""
    return _insert(
        conn,
        "INSERT INTO outbox_cdc_slot_history (slot, event, cause, detail, state, origin,"
        " consistent_lsn, slot_catalog_xmin, confirm_limit_lsn, resolved_at)"
        " VALUES (%s, %s, %s, %s, 'created', %s, %s, %s, %s, now()) RETURNING id",
        (
            made.slot,
            event,
            made.cause,
            made.detail,
            made.origin,
            made.lsn,
            made.catalog_xmin,
            made.lsn,
        ),
    )


def raise_confirm_limit(conn: Conn, row_id: int) -> tuple[str, str]:
    """Raise the confirm limit of the slot made by row ``row_id`` to the server's WAL
    insert position (never lower it); the new limit, and where the server's WAL
    ends after this write (the write itself adds WAL the slot may not confirm yet)."""
    row = conn.execute(
        "UPDATE outbox_cdc_slot_history SET confirm_limit_lsn ="
        " greatest(confirm_limit_lsn, pg_current_wal_insert_lsn())"
        " WHERE id = %s RETURNING confirm_limit_lsn::text",
        (row_id,),
    ).fetchone()
    if row is None:
        raise DatabaseSetupError(f"slot history row {row_id} is gone: the slot's identity is lost")
    end = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
    assert end is not None
    return str(row[0]), str(end[0])


def note_output(conn: Conn, slot: str, kind: str, names: list[str]) -> None:
    """Record that the relay of ``slot`` published to these topics / in these forms."""
    try:
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO outbox_cdc_slot_output (slot, kind, name) VALUES (%s, %s, %s)"
                " ON CONFLICT DO NOTHING",
                [(slot, kind, name) for name in names],
            )
    except pgerrors.UndefinedTable as exc:
        raise _unmigrated(exc) from exc


def outputs(conn: Conn, slot: str, kind: str) -> list[str]:
    """The topics (``kind`` 'topic') or forms ('form') recorded for ``slot``."""
    try:
        rows = conn.execute(
            "SELECT name FROM outbox_cdc_slot_output WHERE slot = %s AND kind = %s ORDER BY name",
            (slot, kind),
        ).fetchall()
    except pgerrors.UndefinedTable as exc:
        raise _unmigrated(exc) from exc
    return [str(r[0]) for r in rows]


@dataclass(frozen=True)
class NewGap:
    """What is known of a gap when it is found."""

    slot: str
    cause: str
    detail: str
    last_published_ts: datetime | None
    last_published_origin: str | None
    window_start: datetime | None
    unrecoverable: bool


class HistoryChangedError(CdcError):
    """The slot history moved on since the gap check read it (another relay or the CLI
    recovered, accepted or made the slot): the check is done again."""

    retriable = True


def record_gap(conn: Conn, gap: NewGap, *, seen_latest: int | None) -> HistoryRow:
    """Write ``gap`` as ``open``, unless the slot has an open gap already (another relay
    wrote it first: at most one is open) - its open row. ``seen_latest``: the slot's
    newest history row when the gap was found; if a newer one was written since, nothing
    is written and :class:`HistoryChangedError` raised (the finding is stale)."""
    try:
        conn.execute(
            "INSERT INTO outbox_cdc_slot_history (slot, event, cause, detail, state,"
            " last_published_ts, last_published_origin, window_start, unrecoverable)"
            " SELECT %s, 'gap', %s, %s, 'open', %s, %s, %s, %s"
            " WHERE NOT EXISTS (SELECT 1 FROM outbox_cdc_slot_history"
            " WHERE slot = %s AND id > %s)"
            " ON CONFLICT (slot) WHERE state = 'open' DO NOTHING",
            (
                gap.slot,
                gap.cause,
                gap.detail,
                gap.last_published_ts,
                gap.last_published_origin,
                gap.window_start,
                gap.unrecoverable,
                gap.slot,
                -1 if seen_latest is None else seen_latest,
            ),
        )
    except (pgerrors.UndefinedTable, pgerrors.InvalidColumnReference) as exc:
        # (no table, or no unique index to conflict on: migration 007 not applied)
        raise _unmigrated(exc) from exc
    opened = open_gaps(conn, gap.slot)
    if not opened:
        raise HistoryChangedError(
            f"the history of slot {gap.slot} changed since the gap check: checking again"
        )
    return opened[0]


def _insert(conn: Conn, query: str, params: tuple[Any, ...]) -> int:
    try:
        row = conn.execute(query, params).fetchone()
    except (pgerrors.UndefinedTable, pgerrors.UndefinedColumn) as exc:
        raise _unmigrated(exc) from exc
    assert row is not None
    return int(row[0])


@dataclass(frozen=True)
class Recovered:
    """What a recovery re-published (over all its attempts), and the slot it made."""

    window_start: datetime | None
    window_end: datetime
    origin: str
    consistent_lsn: str
    rows: int
    seconds: float
    #: the new slot's catalog_xmin (its identity, with consistent_lsn)
    catalog_xmin: int | None = None


def mark_recovered(conn: Conn, gap_id: int, done: Recovered) -> None:
    """The gap is closed: every row of the window is acknowledged by Kafka. The row
    now records the slot the recovery made (its first confirm limit: its consistent point)."""
    conn.execute(
        "UPDATE outbox_cdc_slot_history SET state = 'recovered', window_start = %s,"
        " window_end = %s, origin = %s, consistent_lsn = %s, rows_recovered = %s,"
        " seconds = %s, slot_catalog_xmin = %s, confirm_limit_lsn = %s, resolved_at = now()"
        " WHERE id = %s AND state = 'open'",
        (
            done.window_start,
            done.window_end,
            done.origin,
            done.consistent_lsn,
            done.rows,
            done.seconds,
            done.catalog_xmin,
            done.consistent_lsn,
            gap_id,
        ),
    )


def record_progress(conn: Conn, gap_id: int, *, resume_from: datetime, rows: int) -> None:
    """A recovery's progress: every row of the window before ``resume_from`` is in
    Kafka (``rows`` re-published so far, over every attempt). Only ever moves forward."""
    conn.execute(
        "UPDATE outbox_cdc_slot_history SET resume_from ="
        " greatest(resume_from, %s), rows_recovered = greatest(rows_recovered, %s)"
        " WHERE id = %s AND state = 'open'",
        (resume_from, rows, gap_id),
    )


def mark_accepted(
    conn: Conn,
    gap_id: int,
    *,
    by: str,
    origin: str,
    consistent_lsn: str,
    catalog_xmin: int | None = None,
) -> bool:
    """``by`` accepted the loss of the gap's window; the new slot starts at ``consistent_lsn``."""
    cur = conn.execute(
        "UPDATE outbox_cdc_slot_history SET state = 'accepted', accepted_by = %s,"
        " window_end = now(), origin = %s, consistent_lsn = %s, rows_recovered = 0,"
        " slot_catalog_xmin = %s, confirm_limit_lsn = %s, resolved_at = now()"
        " WHERE id = %s AND state = 'open'",
        (by, origin, consistent_lsn, catalog_xmin, consistent_lsn, gap_id),
    )
    return cur.rowcount == 1
