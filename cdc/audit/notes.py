"""The audit report's notes: what its reader must know to trust (or not) each number.

Pure text from a finished run (:mod:`cdc.audit.run`): the window moved to the relay's
first start, who could not be identified, what is in flight, which rows are placed by
``created_at``, what lies before the recovery horizon, what cannot be checked.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from cdc.audit import table as pg
from cdc.audit.window import Window, iso, to_ms
from cdc.settings import Settings


def first_start_notes(
    settings: Settings, requested: Window, judged: Window, boundary: datetime | None
) -> list[str]:
    """What the reader must know when the window asked for reaches before the first start."""
    if boundary is None or requested.since_ms >= to_ms(boundary):
        return []
    why = (
        "the rows committed before it were not published by choice (`slot init --from now`,"
        " or an empty outbox then)"
    )
    if judged != requested:
        return [
            f"the window starts at slot {settings.slot}'s first start ({iso(boundary)}), not"
            f" at {iso(requested.since)}: {why} and are not judged nor repaired"
            " (--before-first-start judges them)"
        ]
    return [
        f"the window reaches before slot {settings.slot}'s first start ({iso(boundary)}): {why}"
        " and are counted missing (--before-first-start)"
    ]


def report_notes(settings: Settings, report: Any, identity_note: str, horizon_ms: int) -> list[str]:
    """What the reader must know to trust (or not) each number (``report``: the run's
    :class:`cdc.audit.run.AuditReport`, not imported: that module imports this one)."""
    notes = [identity_note] if identity_note else []
    if report.in_flight:
        notes.append(
            f"{report.in_flight} rows of the window are still in slot {settings.slot}"
            " (committed, not yet in Kafka): in flight, not proven delivered - a relay"
            " behind or stopped; audit again once it caught up"
        )
    if report.pending.ids is None:
        notes.append(
            f"in-flight events cannot be told from missing ones ({report.pending.note}):"
            " rows the relay has not published yet are counted missing"
        )
    if report.time_basis == pg.CREATED_AT:
        notes.append(
            "track_commit_timestamp is off: rows are placed in the window by created_at"
            " (their transaction's start); rows of transactions open longer than"
            f" CDC_GAP_MARGIN_S ({settings.gap_margin_s:g}s) may be judged at the window's edge"
        )
    if report.window.since_ms < horizon_ms:
        notes.append(
            f"the window starts before the recovery horizon (CDC_RECOVERY_HORIZON_S): rows"
            f" older than {iso(datetime.fromtimestamp(horizon_ms / 1000, UTC))} may have been"
            " pruned; phantoms are judged only after it"
        )
    if not settings.outbox_keeps_rows:
        notes.append(
            f"CDC_OUTBOX_KEEPS_ROWS=false: {report.comparison.unchecked} records of this relay"
            " in the window have no row to be checked against (events not kept in the table)"
        )
    elif len(report.comparison.phantoms):
        notes.append(
            "phantoms are records of this relay with no row in the table: logical-message"
            " events (emit_event) and delete-after-insert writes are never in the table, so"
            " they are counted here and cannot be checked"
        )
    without_id = sum(report.kafka.without_id.values())
    if without_id:
        notes.append(f"{without_id} records had no readable id header (not checked)")
    for note in (report.group.note, report.parked.note):
        if note:
            notes.append(note)
    return notes
