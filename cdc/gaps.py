"""The slot history (``outbox_cdc_slot_history``, migration 006): slots made, gaps, their ends.

Guarantees:

* a gap is written ``open`` *before* anything is done about it, and becomes
  ``recovered`` only after Kafka acknowledged every re-published row, or
  ``accepted`` by a named operator: a relay that dies half-way finds the gap
  still open at its next start and does it again (duplicates, never loss);
* a ``created`` row records the slot a relay made at its first start, with the
  origin (system identifier / timeline / slot) it streamed from;
* rows are never deleted by outbox-cdc; they are few (one per slot lifetime event).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg import errors as pgerrors
from psycopg.rows import dict_row

from cdc.errors import DatabaseSetupError

Conn = psycopg.Connection[Any]

TABLE = "outbox_cdc_slot_history"

#: Values of the ``state`` column.
OPEN, RECOVERED, ACCEPTED, CREATED = "open", "recovered", "accepted", "created"


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

    @property
    def is_open(self) -> bool:
        return self.state == OPEN

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
                HistoryRow(**{**row, "consistent_lsn": _text(row["consistent_lsn"])})
                for row in cur.fetchall()
            ]
    except pgerrors.UndefinedTable as exc:
        raise DatabaseSetupError(f"table {TABLE} is missing: run `outbox-cdc migrate`") from exc


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


def record_created(conn: Conn, slot: str, *, origin: str, consistent_lsn: str) -> int:
    """The relay created ``slot`` at its first start."""
    return _insert(
        conn,
        "INSERT INTO outbox_cdc_slot_history (slot, event, cause, detail, state, origin,"
        " consistent_lsn, resolved_at) VALUES (%s, 'created', 'first_start',"
        " 'no record of this slot in Kafka', 'created', %s, %s, now()) RETURNING id",
        (slot, origin, consistent_lsn),
    )


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


def record_gap(conn: Conn, gap: NewGap) -> int:
    """Write ``gap`` as ``open``; its id."""
    return _insert(
        conn,
        "INSERT INTO outbox_cdc_slot_history (slot, event, cause, detail, state,"
        " last_published_ts, last_published_origin, window_start, unrecoverable)"
        " VALUES (%s, 'gap', %s, %s, 'open', %s, %s, %s, %s) RETURNING id",
        (
            gap.slot,
            gap.cause,
            gap.detail,
            gap.last_published_ts,
            gap.last_published_origin,
            gap.window_start,
            gap.unrecoverable,
        ),
    )


def _insert(conn: Conn, query: str, params: tuple[Any, ...]) -> int:
    try:
        row = conn.execute(query, params).fetchone()
    except pgerrors.UndefinedTable as exc:
        raise DatabaseSetupError(f"table {TABLE} is missing: run `outbox-cdc migrate`") from exc
    assert row is not None
    return int(row[0])


@dataclass(frozen=True)
class Recovered:
    """What a recovery re-published."""

    window_start: datetime | None
    window_end: datetime
    origin: str
    consistent_lsn: str
    rows: int
    seconds: float


def mark_recovered(conn: Conn, gap_id: int, done: Recovered) -> None:
    """The gap is closed: every row of the window is acknowledged by Kafka."""
    conn.execute(
        "UPDATE outbox_cdc_slot_history SET state = 'recovered', window_start = %s,"
        " window_end = %s, origin = %s, consistent_lsn = %s, rows_recovered = %s,"
        " seconds = %s, resolved_at = now() WHERE id = %s AND state = 'open'",
        (
            done.window_start,
            done.window_end,
            done.origin,
            done.consistent_lsn,
            done.rows,
            done.seconds,
            gap_id,
        ),
    )


def mark_accepted(conn: Conn, gap_id: int, *, by: str, origin: str, consistent_lsn: str) -> bool:
    """``by`` accepted the loss of the gap's window; the new slot starts at ``consistent_lsn``."""
    cur = conn.execute(
        "UPDATE outbox_cdc_slot_history SET state = 'accepted', accepted_by = %s,"
        " window_end = now(), origin = %s, consistent_lsn = %s, rows_recovered = 0,"
        " resolved_at = now() WHERE id = %s AND state = 'open'",
        (by, origin, consistent_lsn, gap_id),
    )
    return cur.rowcount == 1
