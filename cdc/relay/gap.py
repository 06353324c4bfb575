"""The gap check: may the relay stream its slot, create it (first start), or is there a gap?

Guarantees:

* :func:`decide` is pure: a function of the slot's row, the server's identity,
  the newest record of this slot found in Kafka (:mod:`cdc.lineage`) and the
  slot's latest history row (:mod:`cdc.gaps`); its cases are a unit-tested table;
* a slot is created without a gap only at a **first start**: no record of the
  slot in Kafka and no history of it. A missing slot after that, an invalidated
  slot (``wal_status`` ``lost``; the server's reason decides the cause: WAL
  removed, PostgreSQL 18's ``idle_replication_slot_timeout``, a recovery
  conflict), or a server whose system identifier or timeline differs from the
  ``origin`` of the last record is a :class:`GapCause` - except a failover slot
  the promoted server holds as ``synced`` (PostgreSQL 17+ slot synchronization:
  the same slot, carried over; streamed on without a gap);
* a gap found earlier and not closed (``open`` in the history: waiting for an
  operator, or a recovery that died half-way) is the same gap again, with its
  window;
* the gap's window starts at the last record's commit time minus the margin
  (``CDC_GAP_MARGIN_S``), or - with no record in Kafka but a known history -
  at the history row's time minus the margin, or at the table's beginning;
* :func:`unrecoverable_reason` says when the table cannot hold the window's
  events (``CDC_OUTBOX_KEEPS_ROWS=false``, or none of the newest ids in Kafka
  is in the table while they are inside the recovery horizon): the gap then
  waits for ``outbox-cdc slot accept-gap``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime, timedelta

from cdc.gaps import OPEN, HistoryRow
from cdc.lineage import LastRecord, Origin
from cdc.wal.slots import WAL_REMOVED, ServerIdentity, SlotRow


class GapCause(enum.StrEnum):
    """Why the slot cannot be trusted to hold every event since the last record in Kafka."""

    SLOT_MISSING = "slot_missing"  # dropped, or not carried over by a failover
    SLOT_LOST = "slot_lost"  # invalidated: max_slot_wal_keep_size removed its WAL
    SLOT_IDLE_TIMEOUT = "slot_idle_timeout"  # PostgreSQL 18: idle_replication_slot_timeout
    SLOT_INVALIDATED = "slot_invalidated"  # another reason (rows_removed, wal_level, conflict)
    SYSTEM_CHANGED = "system_changed"  # another cluster (system identifier) under the name
    TIMELINE_CHANGED = "timeline_changed"  # the server was promoted since the last record


class Action(enum.Enum):
    STREAM = "stream"  # the slot holds everything since the last record
    CREATE = "create"  # first start: create the slot, nothing to recover
    GAP = "gap"  # recover from the outbox table (or accept the loss)


@dataclass(frozen=True)
class Verdict:
    action: Action
    cause: GapCause | None = None
    detail: str = ""
    #: the gap's window starts here; None: from the table's first row
    window_start: datetime | None = None
    #: the history row of a gap already recorded (open)
    gap_id: int | None = None

    @property
    def reason(self) -> str:
        """``<cause>: <detail>`` for /readyz and the log."""
        return f"{self.cause.value if self.cause else self.action.value}: {self.detail}"


def _window(
    last: LastRecord | None, history: HistoryRow | None, margin: timedelta
) -> datetime | None:
    if last is not None:
        return last.commit_ts - margin
    if history is not None:
        return history.detected_at - margin
    return None


def decide(
    *,
    slot_name: str,
    slot: SlotRow | None,
    server: ServerIdentity,
    last: LastRecord | None,
    history: HistoryRow | None,
    margin_s: float,
    slot_survives_failover: bool = False,
) -> Verdict:
    """What the relay does with its slot (see the module docstring).

    ``slot_survives_failover``: the slot is a failover slot (PostgreSQL 17+), so an
    existing slot under a new timeline is trusted; so is a slot the server says it
    synchronized (``failover`` and ``synced``: carried over by the failover).
    """
    margin = timedelta(seconds=margin_s)
    if history is not None and history.state == OPEN:
        return Verdict(
            Action.GAP,
            GapCause(history.cause),
            f"{history.detail} (gap {history.id}, found {history.detected_at:%Y-%m-%d %H:%M:%S}Z)",
            history.window_start,
            history.id,
        )
    if slot is None:
        if last is None and history is None:
            return Verdict(Action.CREATE, detail="first start: no record of this slot in Kafka")
        since = "its last record in Kafka" if last is not None else "the slot history"
        return Verdict(
            Action.GAP,
            GapCause.SLOT_MISSING,
            f"slot {slot_name} does not exist but {since} shows it published before",
            _window(last, history, margin),
        )
    if slot.invalidated is not None or slot.wal_status == "lost":
        cause, why = _invalidation(slot.invalidated or WAL_REMOVED)
        return Verdict(
            Action.GAP,
            cause,
            f"slot {slot_name} was invalidated ({why})",
            _window(last, history, margin),
        )
    # A failover slot the server synchronized to the promoted standby (PostgreSQL 17+:
    # ``synced`` stays true there) is the relay's slot carried over: its confirmed
    # position never passes what that standby had, so it holds every event since.
    carried_over = slot.failover and slot.synced
    return _check_origin(
        slot_name, server, last, history, margin, slot_survives_failover or carried_over
    )


def _invalidation(reason: str) -> tuple[GapCause, str]:
    """The cause and the words for a slot invalidated for ``reason`` (the server's)."""
    if reason == WAL_REMOVED:
        return GapCause.SLOT_LOST, "wal_status lost: max_slot_wal_keep_size removed its WAL"
    if reason == "idle_timeout":
        return (
            GapCause.SLOT_IDLE_TIMEOUT,
            "idle_timeout: inactive longer than idle_replication_slot_timeout",
        )
    return GapCause.SLOT_INVALIDATED, f"invalidation_reason {reason}"


def _check_origin(
    slot_name: str,
    server: ServerIdentity,
    last: LastRecord | None,
    history: HistoryRow | None,
    margin: timedelta,
    slot_survives_failover: bool,
) -> Verdict:
    origin = last.origin if last is not None else None
    if last is None or origin is None:
        return Verdict(Action.STREAM)  # nothing to compare (or records of a relay before `origin`)
    here = Origin(server.system_id, server.timeline, slot_name)
    if origin == here:
        return Verdict(Action.STREAM)
    if _made_here_after(history, here, last):
        return Verdict(Action.STREAM)
    if origin.system_id != server.system_id:
        return Verdict(
            Action.GAP,
            GapCause.SYSTEM_CHANGED,
            f"system identifier {server.system_id} is not {origin.system_id}"
            f" of the last record in Kafka ({last.topic}/{last.partition}@{last.offset})",
            _window(last, history, margin),
        )
    if slot_survives_failover:
        return Verdict(Action.STREAM)
    return Verdict(
        Action.GAP,
        GapCause.TIMELINE_CHANGED,
        f"timeline {server.timeline} is not {origin.timeline} of the last record in Kafka"
        f" (a promotion): slot {slot_name} was not made by this relay on this timeline",
        _window(last, history, margin),
    )


def _made_here_after(history: HistoryRow | None, here: Origin, last: LastRecord) -> bool:
    """The history shows this relay made the slot on this origin after the last record."""
    return (
        history is not None
        and history.state != OPEN
        and history.origin == str(here)
        and history.detected_at >= last.commit_ts
    )


def unrecoverable_reason(
    *,
    keeps_rows: bool,
    last: LastRecord | None,
    ids_in_table: int,
    horizon_start: datetime,
) -> str | None:
    """Why the outbox table cannot hold the gap's events, or None when it can."""
    if not keeps_rows:
        return (
            "CDC_OUTBOX_KEEPS_ROWS=false: events are deleted after insert or emitted as"
            " logical messages, so the table cannot replay the gap"
        )
    if (
        last is not None
        and last.newest_ids
        and ids_in_table == 0
        and last.commit_ts >= horizon_start
    ):
        return (
            f"none of the {len(last.newest_ids)} newest event ids in Kafka is in the outbox"
            " table (rows deleted after insert, or logical messages): the table cannot"
            " replay the gap"
        )
    return None
