"""The gap check: may the relay stream its slot, make it (first start), or is there a gap?

Guarantees (DESIGN "Relay invariants" 7 and 11):

* :func:`decide` is pure: a function of the slot's row, the server's identity
  (system identifier, timeline and its ancestors), the newest record of the
  relay's *own* in Kafka (:mod:`cdc.lineage`: only records whose ``origin``
  names this system, timeline lineage and slot), the slot history
  (:mod:`cdc.gaps`: its latest row, and the row that made the current slot with
  the slot's recorded identity) and whether the outbox table is empty; its
  cases are a unit-tested table;
* **a slot is trusted only when it is provably the one the relay made**: the
  row that made it names the same system identifier and timeline (or, for a
  failover slot, an ancestor timeline), and the slot's ``confirmed_flush_lsn``
  is not past the row's confirm limit - the furthest the relay ever let it
  confirm. A slot re-created, advanced or streamed by anyone else has moved past
  it: :attr:`GapCause.SLOT_REPLACED`;
* a slot with no recorded identity is *adopted* (its identity recorded now) only
  where nothing says the relay ever streamed another one - a first start on an
  empty outbox - or where the database predates the record (history rows or
  records of the relay without an identity row: migrated before 007), and then
  only when that evidence names this system and timeline;
* a first start (no slot history, no record of the relay in Kafka) is silent
  only on an empty outbox; otherwise :attr:`Action.REFUSE`: ``outbox-cdc slot
  init --from now|table`` (or ``CDC_SLOT_INIT``) makes the choice explicit;
* a missing slot after a start, an invalidated slot (``wal_status`` ``lost``;
  the server's reason decides the cause: WAL removed, PostgreSQL 18's
  ``idle_replication_slot_timeout``, a recovery conflict), another system
  identifier or timeline is a :class:`GapCause` - except a failover slot the
  promoted server holds as ``synced`` (PostgreSQL 17+ slot synchronization: the
  same slot, carried over from an ancestor timeline; streamed on without a gap);
  a gap found earlier and not closed (``open`` in the history) is the same gap
  again, with its window;
* the gap's window starts at the relay's last record's commit time minus the
  margin (``CDC_GAP_MARGIN_S``), or - with no record of its own in Kafka - at
  the time the current slot was made (else the history's last row) minus the
  margin, or at the table's beginning;
* :func:`unrecoverable_reason` says which kinds of events of the window the table
  cannot give back, from evidence the relay owns: ``CDC_OUTBOX_KEEPS_ROWS=false``,
  logical messages the relay published (recorded, or ``form: message`` records
  of its own), rows of its own newest records gone from the table inside the
  recovery horizon (deleted after insert). Such a gap waits for
  ``outbox-cdc slot accept-gap``;
* a row record published from WAL a failover took back (:func:`taken_back`: its
  ``origin`` names an ancestor timeline and its commit LSN is at or past the point
  where that timeline ended) is not in the new primary's table because it never
  happened there, not because it was deleted: it is left out of that count and
  named on its own (the hazard ``CDC_STANDBY_SAFE`` removes), never a reason to
  wait for an operator.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime, timedelta

from cdc.evidence import Origin
from cdc.gaps import OPEN, HistoryRow
from cdc.lineage import LastRecord, RowRef
from cdc.wal.replproto import lsn_to_str, str_to_lsn
from cdc.wal.slots import WAL_REMOVED, ServerIdentity, SlotRow


class GapCause(enum.StrEnum):
    """Why the slot cannot be trusted to hold every event since the last record in Kafka."""

    SLOT_MISSING = "slot_missing"  # dropped, or not carried over by a failover
    SLOT_LOST = "slot_lost"  # invalidated: max_slot_wal_keep_size removed its WAL
    SLOT_IDLE_TIMEOUT = "slot_idle_timeout"  # PostgreSQL 18: idle_replication_slot_timeout
    SLOT_INVALIDATED = "slot_invalidated"  # another reason (rows_removed, wal_level, conflict)
    SYSTEM_CHANGED = "system_changed"  # another cluster (system identifier) under the name
    TIMELINE_CHANGED = "timeline_changed"  # the server was promoted since the slot was made
    SLOT_REPLACED = "slot_replaced"  # the slot under the name is not the one the relay made
    FIRST_START = "first_start"  # `slot init --from table`: the table's rows are published


class Action(enum.Enum):
    STREAM = "stream"  # the slot holds everything since the last record
    CREATE = "create"  # first start on an empty outbox: make the slot, nothing to recover
    ADOPT = "adopt"  # a slot without a recorded identity, nothing against it: record it
    REFUSE = "refuse"  # first start on a non-empty outbox: `slot init` decides
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
        what = self.cause.value if self.cause else self.action.value
        return f"{what}: {self.detail}" if self.detail else what


#: What a first start on a non-empty outbox tells the operator.
REFUSE_DETAIL = (
    "first start of slot {slot} (no slot history, no record of it in Kafka) on an outbox"
    " table that holds rows: run `outbox-cdc slot init --from now` (they are not published)"
    " or `--from table` (they are), or set CDC_SLOT_INIT"
)


@dataclass(frozen=True)
class Evidence:
    """What the gap check read (all but the server's identity may be absent)."""

    slot_name: str
    slot: SlotRow | None
    server: ServerIdentity
    #: the relay's own newest record in Kafka
    last: LastRecord | None
    #: the slot's newest history row
    history: HistoryRow | None
    #: the history row that made the current slot and recorded its identity
    maker: HistoryRow | None
    #: the outbox table (the publication's share of it) holds no row; None: not read
    #: (only a first start needs it)
    outbox_empty: bool | None = None


def decide(evidence: Evidence, *, margin_s: float, slot_survives_failover: bool = False) -> Verdict:
    """What the relay does with its slot (see the module docstring).

    ``slot_survives_failover``: the slot is a failover slot (PostgreSQL 17+), so a
    slot carried over to a promoted standby (the made one, confirmed no further
    than the LSN where the maker's timeline ended) is trusted; so is a slot the
    server says it synchronized (``failover`` and ``synced``).
    """
    e = evidence
    margin = timedelta(seconds=margin_s)
    history = e.history
    if history is not None and history.state == OPEN:
        return Verdict(
            Action.GAP,
            GapCause(history.cause),
            f"{history.detail} (gap {history.id}, found {history.detected_at:%Y-%m-%d %H:%M:%S}Z)",
            history.window_start,
            history.id,
        )
    first_start = e.last is None and history is None
    if e.slot is None:
        return _no_slot(e, margin, first_start)
    if e.slot.invalidated is not None or e.slot.wal_status == "lost":
        cause, why = _invalidation(e.slot.invalidated or WAL_REMOVED)
        return Verdict(
            Action.GAP,
            cause,
            f"slot {e.slot_name} was invalidated ({why})",
            _window(e, margin),
        )
    # A failover slot the server synchronized to the promoted standby (PostgreSQL 17+:
    # ``synced`` stays true there) is the relay's slot carried over: its confirmed
    # position never passes what that standby had, so it holds every event since.
    survives = slot_survives_failover or (e.slot.failover and e.slot.synced)
    if e.maker is None:
        if first_start:
            return _first_start(e, Action.ADOPT, "first start (the slot made outside the relay")
        return _adopt_unrecorded(e, margin, survives)
    return _check_identity(e, e.maker, margin, survives)


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


def _no_slot(e: Evidence, margin: timedelta, first_start: bool) -> Verdict:
    if first_start:
        return _first_start(e, Action.CREATE, "first start (no slot")
    since = "its last record in Kafka" if e.last is not None else "the slot history"
    return Verdict(
        Action.GAP,
        GapCause.SLOT_MISSING,
        f"slot {e.slot_name} does not exist but {since} shows it published before",
        _window(e, margin),
    )


#: ... and when a slot of that name exists (made outside the relay, or by a relay from
#: before slot histories and the `origin` header).
REFUSE_EXISTING = "; slot {slot} exists: `--from now` takes it over (what it holds is published)"


def _first_start(e: Evidence, action: Action, detail: str) -> Verdict:
    if e.outbox_empty:
        return Verdict(
            action, detail=f"{detail}, no slot history, no record in Kafka, an empty outbox table)"
        )
    refusal = REFUSE_DETAIL + (REFUSE_EXISTING if e.slot is not None else "")
    return Verdict(Action.REFUSE, detail=refusal.format(slot=e.slot_name))


def _adopt_unrecorded(e: Evidence, margin: timedelta, survives: bool) -> Verdict:
    """A slot with history or records of the relay but no identity row: made before
    migration 007. Adopted when what there is names this system and timeline."""
    origin = e.last.origin if e.last is not None else None
    if origin is None and e.history is not None and e.history.origin:
        origin = Origin.parse(e.history.origin)
    if origin is not None:
        wrong = _origin_mismatch(e, origin, margin, survives, what="the relay's last record")
        if wrong is not None:
            return wrong
    return Verdict(
        Action.ADOPT,
        detail=(
            f"slot {e.slot_name} has no recorded identity (made before migration 007):"
            " taken as the relay's; from now on a slot the relay did not make is a gap"
        ),
    )


def _origin_mismatch(
    e: Evidence, origin: Origin, margin: timedelta, survives: bool, *, what: str
) -> Verdict | None:
    """A gap when ``origin`` (where the slot was made, or streamed from) is not this
    server's system and timeline; a failover slot may come from an ancestor timeline."""
    server = e.server
    if origin.system_id != server.system_id:
        return Verdict(
            Action.GAP,
            GapCause.SYSTEM_CHANGED,
            f"system identifier {server.system_id} is not {origin.system_id} of {what}",
            _window(e, margin),
        )
    if origin.timeline == server.timeline:
        return None
    if survives and server.switch_after(origin.timeline) is not None:
        return None
    return Verdict(
        Action.GAP,
        GapCause.TIMELINE_CHANGED,
        f"timeline {server.timeline} is not {origin.timeline} of {what} (a promotion):"
        f" slot {e.slot_name} was not made by this relay on this timeline",
        _window(e, margin),
    )


def _check_identity(e: Evidence, maker: HistoryRow, margin: timedelta, survives: bool) -> Verdict:
    assert e.slot is not None and maker.confirm_limit_lsn is not None
    origin = Origin.parse(maker.origin or "")
    if origin is None or origin.slot != e.slot_name:
        return _replaced(e, margin, f"history row {maker.id} names no origin of this slot")
    wrong = _origin_mismatch(
        e, origin, margin, survives, what=f"the slot made (gap row {maker.id})"
    )
    if wrong is not None:
        return wrong
    limit = str_to_lsn(maker.confirm_limit_lsn)
    if origin.timeline != e.server.timeline:  # a failover slot from an ancestor timeline
        limit = max(limit, e.server.switch_after(origin.timeline) or 0)
    confirmed = e.slot.confirmed_flush_lsn
    if confirmed > limit:
        return _replaced(
            e,
            margin,
            f"its confirmed_flush_lsn {lsn_to_str(confirmed)} is past {lsn_to_str(limit)}, the"
            f" furthest this relay let it confirm (history row {maker.id}): it was re-created,"
            " advanced or streamed by someone else",
        )
    return Verdict(
        Action.STREAM,
        detail=(
            f"slot {e.slot_name} is the one this relay made (history row {maker.id}) on this"
            f" system and timeline, confirmed at {lsn_to_str(confirmed)} within its limit"
            f" {lsn_to_str(limit)}: the relay streams on from there, nothing to recover"
        ),
    )


def _replaced(e: Evidence, margin: timedelta, why: str) -> Verdict:
    return Verdict(
        Action.GAP,
        GapCause.SLOT_REPLACED,
        f"slot {e.slot_name} is not the one this relay made: {why}",
        _window(e, margin),
    )


def _window(e: Evidence, margin: timedelta) -> datetime | None:
    if e.last is not None:
        return e.last.commit_ts - margin
    since = e.maker or e.history
    return since.detected_at - margin if since is not None else None


def taken_back(rows: tuple[RowRef, ...], server: ServerIdentity) -> tuple[RowRef, ...]:
    """The row records published from WAL this server does not have: their timeline is
    an ancestor of the server's and their commit LSN is at or past the LSN where it
    ended (a commit record the promoted standby never replayed starts there or later).
    A record without a commit LSN (0) is never taken for one."""
    out = []
    for row in rows:
        if row.timeline == server.timeline or row.commit_lsn == 0:
            continue
        end = server.switch_after(row.timeline)
        if end is not None and row.commit_lsn >= end:
            out.append(row)
    return tuple(out)


def taken_back_note(rows: tuple[RowRef, ...], server: ServerIdentity) -> str:
    """What a gap's detail says about records a failover took back ('' for none)."""
    if not rows:
        return ""
    timelines = sorted({r.timeline for r in rows})
    ends = ", ".join(
        f"timeline {t} ended at {lsn_to_str(server.switch_after(t) or 0)}" for t in timelines
    )
    return (
        f"{len(rows)} of the relay's newest records were published from WAL the failover"
        f" took back ({ends}; e.g. event {rows[0].id}): Kafka holds events this server never"
        " committed (CDC_STANDBY_SAFE=true publishes only what a standby has)"
    )


def unrecoverable_reason(
    *,
    keeps_rows: bool,
    published_messages: bool,
    newest_rows: int,
    rows_gone: int,
) -> str | None:
    """Which kinds of events the outbox table cannot give back, or None when it can.

    ``published_messages``: the relay publishes records made from logical messages
    (``CDC_MESSAGES=on``);
    ``rows_gone`` of its ``newest_rows`` newest row records inside the recovery
    horizon are no longer in the table (deleted after insert: ``prune`` keeps them).
    """
    kinds = []
    if not keeps_rows:
        kinds.append(
            "events deleted after insert or emitted as logical messages"
            " (CDC_OUTBOX_KEEPS_ROWS=false)"
        )
    if published_messages:
        kinds.append(
            "logical messages (CDC_MESSAGES=on: events written with pg_logical_emit_message"
            " while the slot was gone are in no table)"
        )
    if rows_gone:
        kinds.append(
            f"rows deleted after insert ({rows_gone} of the relay's {newest_rows} newest row"
            " events inside the recovery horizon are gone from the table)"
        )
    if not kinds:
        return None
    return "the outbox table cannot give back " + "; ".join(kinds)
