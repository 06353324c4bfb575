"""The gap decision (cdc.relay.gaps.gap.decide) as a table: slot x server x the relay's last
record x history x the row that made the slot x an empty outbox; and the evidence behind it: whose
records count (cdc.evidence.Owner), which kinds of events a gap cannot give back."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from cdc.backlog import BacklogLimits, BacklogState, SlotMeasures, judge
from cdc.evidence import Origin, Owner, origin_value
from cdc.gaps import HistoryRow
from cdc.lineage import LastRecord, RowRef
from cdc.records import Record, RecordReader, Skip
from cdc.relay.gaps.gap import (
    Action,
    Evidence,
    GapCause,
    decide,
    taken_back,
    taken_back_note,
    unrecoverable_reason,
)
from cdc.router import TxContext, route_fields, route_message
from cdc.wal.replproto import str_to_lsn
from cdc.wal.slots import ServerIdentity, SlotRow, parse_timeline_history

SLOT = "outbox_slot"
SERVER = ServerIdentity("7301", 1)
#: the same cluster after a promotion: timeline 2, branched from 1 at 0/5000000
PROMOTED = ServerIdentity("7301", 2, ((1, str_to_lsn("0/5000000")),))
NOW = datetime(2026, 12, 1, 7, 0, tzinfo=UTC)
MARGIN_S = 300.0


def _slot(
    wal_status: str | None = "reserved", *, confirmed: str = "0/3000000", active: bool = False
) -> SlotRow:
    return SlotRow(SLOT, "pgoutput", "db", active, str_to_lsn(confirmed), wal_status, None, 7_700)


def _last(origin: str = "7301/1/outbox_slot", at: datetime = NOW) -> LastRecord:
    parsed = Origin.parse(origin)
    return LastRecord(
        commit_ts_us=int(at.timestamp() * 1_000_000),
        origin=parsed,
        topic="outbox.event.user",
        partition=0,
        offset=41,
        newest_rows=(RowRef("e1", int(at.timestamp() * 1_000_000)),),
    )


def _history(
    state: str,
    origin: str | None = "7301/1/outbox_slot",
    at: datetime = NOW - timedelta(days=1),
    *,
    limit: str | None = "0/4000000",
    cause: str | None = None,
) -> HistoryRow:
    made = state in ("created", "recovered", "accepted")
    return HistoryRow(
        id=7,
        slot=SLOT,
        event="created" if state == "created" else "gap",
        cause=cause or ("first_start" if state == "created" else "slot_lost"),
        detail="d",
        state=state,
        detected_at=at,
        last_published_ts=None,
        last_published_origin=None,
        window_start=NOW - timedelta(hours=1) if state == "open" else None,
        window_end=None,
        origin=origin if made else None,
        consistent_lsn="0/1000000" if made else None,
        rows_recovered=None,
        seconds=None,
        unrecoverable=False,
        accepted_by=None,
        resolved_at=None,
        slot_catalog_xmin=700 if made and limit else None,
        confirm_limit_lsn=limit if made else None,
    )


#: the row that made the slot (post-007: with its identity)
MADE = _history("created")
#: a 'created' row of a relay before migration 007 (no identity recorded)
MADE_BEFORE_007 = _history("created", limit=None)
WINDOW = NOW - timedelta(seconds=MARGIN_S)
MADE_WINDOW = MADE.detected_at - timedelta(seconds=MARGIN_S)


def _evidence(
    slot: SlotRow | None,
    server: ServerIdentity = SERVER,
    last: LastRecord | None = None,
    history: HistoryRow | None = None,
    *,
    maker: HistoryRow | None = None,
    empty: bool | None = None,
) -> Evidence:
    if maker is None and history is not None and history.made_slot:
        maker = history
    return Evidence(SLOT, slot, server, last, history, maker, empty)


CASES = [
    # (name, evidence, action, cause, window start)
    # -- first starts: silent only on an empty outbox
    (
        "first start: no slot, nothing anywhere, empty outbox",
        _evidence(None, empty=True),
        Action.CREATE,
        None,
        None,
    ),
    (
        "first start on a non-empty outbox refuses (slot init)",
        _evidence(None, empty=False),
        Action.REFUSE,
        None,
        None,
    ),
    (
        "first start, a slot made outside the relay, empty outbox: adopted",
        _evidence(_slot(), empty=True),
        Action.ADOPT,
        None,
        None,
    ),
    (
        "first start, a slot made outside the relay, rows in the outbox: refused",
        _evidence(_slot(), empty=False),
        Action.REFUSE,
        None,
        None,
    ),
    # -- the slot the relay made, as it made it
    ("slot made here, untouched", _evidence(_slot(), history=MADE), Action.STREAM, None, None),
    (
        "slot made here, records of ours in Kafka",
        _evidence(_slot(), last=_last(), history=MADE),
        Action.STREAM,
        None,
        None,
    ),
    (
        "slot confirmed exactly to its limit",
        _evidence(_slot(confirmed="0/4000000"), history=MADE),
        Action.STREAM,
        None,
        None,
    ),
    # -- a slot of the same name that is not the one made (issue 34, item 3)
    (
        "slot dropped and re-created under the same name (past the confirm limit)",
        _evidence(_slot(confirmed="0/4000001"), last=_last(), history=MADE),
        Action.GAP,
        GapCause.SLOT_REPLACED,
        WINDOW,
    ),
    (
        "slot re-created, topics expired: window from the slot's making",
        _evidence(_slot(confirmed="0/9000000"), history=MADE),
        Action.GAP,
        GapCause.SLOT_REPLACED,
        MADE_WINDOW,
    ),
    (
        "the maker row names another slot's origin",
        _evidence(_slot(), history=_history("created", "7301/1/other")),
        Action.GAP,
        GapCause.SLOT_REPLACED,
        MADE_WINDOW,
    ),
    # -- dropped, lost, moved
    (
        "slot dropped",
        _evidence(None, last=_last(), history=MADE),
        Action.GAP,
        GapCause.SLOT_MISSING,
        WINDOW,
    ),
    (
        "slot dropped, topics empty, history known",
        _evidence(None, history=MADE),
        Action.GAP,
        GapCause.SLOT_MISSING,
        MADE_WINDOW,
    ),
    (
        "slot dropped, empty history (before 006), records of ours: a gap, not a first start",
        _evidence(None, last=_last(), empty=False),
        Action.GAP,
        GapCause.SLOT_MISSING,
        WINDOW,
    ),
    (
        "slot invalidated",
        _evidence(_slot("lost"), last=_last(), history=MADE),
        Action.GAP,
        GapCause.SLOT_LOST,
        WINDOW,
    ),
    (
        "slot invalidated, topics empty, no history",
        _evidence(_slot("lost")),
        Action.GAP,
        GapCause.SLOT_LOST,
        None,
    ),
    (
        "unreserved is not lost yet",
        _evidence(_slot("unreserved"), last=_last(), history=MADE),
        Action.STREAM,
        None,
        None,
    ),
    # -- another system, another timeline
    (
        "another cluster's database under the slot name (the maker names another system)",
        _evidence(_slot(), ServerIdentity("9999", 1), history=MADE),
        Action.GAP,
        GapCause.SYSTEM_CHANGED,
        MADE_WINDOW,
    ),
    (
        "failover: promoted standby without the slot (records on the parent timeline count)",
        _evidence(None, PROMOTED, last=_last(), history=MADE),
        Action.GAP,
        GapCause.SLOT_MISSING,
        WINDOW,
    ),
    (
        "a slot of the same name after a promotion (not a failover slot)",
        _evidence(_slot(), PROMOTED, last=_last(), history=MADE),
        Action.GAP,
        GapCause.TIMELINE_CHANGED,
        WINDOW,
    ),
    (
        "slot made here by a recovery on the new timeline",
        _evidence(
            _slot(),
            PROMOTED,
            last=_last(),
            history=_history("recovered", "7301/2/outbox_slot", NOW + timedelta(minutes=5)),
        ),
        Action.STREAM,
        None,
        None,
    ),
    (
        "a maker of a timeline that is no ancestor (another branch)",
        _evidence(_slot(), PROMOTED, history=_history("created", "7301/3/outbox_slot")),
        Action.GAP,
        GapCause.TIMELINE_CHANGED,
        MADE_WINDOW,
    ),
    # -- databases migrated before 007 (no identity recorded): adopted when nothing disagrees
    (
        "before 007: a 'created' row without identity, the slot there",
        _evidence(_slot(), last=_last(), history=MADE_BEFORE_007),
        Action.ADOPT,
        None,
        None,
    ),
    (
        "before 006: records of ours, no history, the slot there",
        _evidence(_slot(), last=_last()),
        Action.ADOPT,
        None,
        None,
    ),
    (
        "before 007, a slot after a promotion: the old checks still hold",
        _evidence(_slot(), PROMOTED, last=_last(), history=MADE_BEFORE_007),
        Action.GAP,
        GapCause.TIMELINE_CHANGED,
        WINDOW,
    ),
    # -- open gaps
    (
        "an open gap is the same gap again, with its window",
        _evidence(_slot(), last=_last(), history=_history("open"), maker=MADE),
        Action.GAP,
        GapCause.SLOT_LOST,
        NOW - timedelta(hours=1),
    ),
    (
        "an open first start (`slot init --from table` died half-way) goes on",
        _evidence(_slot(), history=_history("open", cause="first_start")),
        Action.GAP,
        GapCause.FIRST_START,
        NOW - timedelta(hours=1),
    ),
]


@pytest.mark.parametrize(
    ("evidence", "action", "cause", "window"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_decide(
    evidence: Evidence, action: Action, cause: GapCause | None, window: datetime | None
) -> None:
    verdict = decide(evidence, margin_s=MARGIN_S)
    assert (verdict.action, verdict.cause, verdict.window_start) == (action, cause, window)
    if action in (Action.GAP, Action.REFUSE, Action.ADOPT):
        assert verdict.detail
    if action is Action.GAP:
        assert cause is not None and verdict.reason.startswith(cause.value)
    if action is Action.REFUSE:
        assert "slot init --from now" in verdict.detail and "CDC_SLOT_INIT" in verdict.detail
        assert ("takes it over" in verdict.detail) == (evidence.slot is not None)


def test_a_failover_slot_carried_to_the_promoted_server_is_trusted_up_to_the_switch() -> None:
    made_on_1 = _history("created", limit="0/4000000")
    synced = _evidence(_slot(confirmed="0/5000000"), PROMOTED, last=_last(), history=made_on_1)
    assert decide(synced, margin_s=MARGIN_S, slot_survives_failover=True).action is Action.STREAM
    past = replace(synced, slot=_slot(confirmed="0/5000001"))
    verdict = decide(past, margin_s=MARGIN_S, slot_survives_failover=True)
    assert verdict.cause is GapCause.SLOT_REPLACED
    assert decide(synced, margin_s=MARGIN_S).cause is GapCause.TIMELINE_CHANGED


def test_a_standby_slot_held_elsewhere_is_not_decided_here() -> None:
    """(recovery.inspect(standby=True) stops before reading Kafka; decide never sees it)"""
    verdict = decide(_evidence(_slot(active=True), history=MADE), margin_s=MARGIN_S)
    assert verdict.action is Action.STREAM


# -- whose records count ---------------------------------------------------------------


def _record(headers: dict[str, bytes]) -> Record:
    return Record("outbox.event.user", 0, 5, 1_000, headers)


@pytest.mark.parametrize(
    ("origin", "counts", "reason"),
    [
        (b"7301/1/outbox_slot", True, None),
        (b"7301/2/outbox_slot", True, None),  # the current timeline
        (None, False, Skip.NO_ORIGIN),  # Debezium, another team's producer, an old relay
        (b"garbage", False, Skip.BAD_ORIGIN),
        (b"7301//outbox_slot", False, Skip.BAD_ORIGIN),
        (b"9999/1/outbox_slot", False, Skip.FOREIGN_ORIGIN),  # another cluster, same slot name
        (b"7301/3/outbox_slot", False, Skip.FOREIGN_ORIGIN),  # a sibling branch of the history
        (b"7301/2/shard_b", False, Skip.FOREIGN_ORIGIN),  # another relay of this cluster
    ],
)
def test_only_records_of_this_system_lineage_and_slot_are_the_relays(
    origin: bytes | None, counts: bool, reason: Skip | None
) -> None:
    owner = Owner.of(PROMOTED, SLOT)
    reader = RecordReader()
    headers = {"id": b"e"} if origin is None else {"id": b"e", "origin": origin}
    judged = owner.judge(_record(headers), reader)
    assert (judged is not None) == counts
    assert dict(reader.skipped) == ({} if reason is None else {reason: 1})


def test_timeline_history_files_give_the_ancestors_and_where_each_ended() -> None:
    content = b"1\t0/3000060\tno recovery target specified\n\n2\t0/5000000\tbefore 2026\n"
    assert parse_timeline_history(content) == (
        (1, str_to_lsn("0/3000060")),
        (2, str_to_lsn("0/5000000")),
    )
    assert parse_timeline_history(b"\\x" + content.hex().encode()) == parse_timeline_history(
        content
    )
    server = ServerIdentity("7301", 3, parse_timeline_history(content))
    assert server.lineage == {1, 2, 3}
    assert server.switch_after(2) == str_to_lsn("0/5000000") and server.switch_after(3) is None


# -- which kinds a gap cannot give back ---------------------------------------------------


def test_rows_published_past_the_end_of_their_timeline_are_taken_back_not_deleted() -> None:
    """Edge: a failover without standby-safe mode - the relay, paused, still had in its
    socket rows the old primary committed after the standby's last replay; it published
    them on resuming. The new primary never had them: not "deleted after insert" (which
    would make the gap wait for an operator), but named as taken back."""
    history = b"1\t0/3000060\treason\n2\t0/5000000\treason\n"
    server = ServerIdentity("7301", 3, parse_timeline_history(history))
    end2 = str_to_lsn("0/5000000")
    rows = (
        RowRef("current", 9, 3, end2 + 4096),  # this timeline: never taken back
        RowRef("at-the-end", 8, 2, end2),  # starts where timeline 2 ended: not replayed
        RowRef("past", 7, 1, str_to_lsn("0/3000060") + 1),
        RowRef("before", 6, 2, end2 - 1),  # before the end: the new primary has it
        RowRef("no-lsn", 5, 2, 0),  # no evidence: never taken back
        RowRef("foreign-tli", 4, 9, end2 + 1),  # not an ancestor
    )
    assert [r.id for r in taken_back(rows, server)] == ["at-the-end", "past"]
    note = taken_back_note(taken_back(rows, server), server)
    assert "2 of the relay's newest records" in note and "timeline 1 ended at 0/3000060" in note
    assert "timeline 2 ended at 0/5000000" in note and "CDC_STANDBY_SAFE" in note
    assert taken_back_note((), server) == ""
    assert taken_back(rows, ServerIdentity("7301", 1, ())) == ()


def test_unrecoverable_kinds_come_from_the_relays_own_evidence() -> None:
    assert (
        unrecoverable_reason(keeps_rows=True, published_messages=False, newest_rows=20, rows_gone=0)
        is None
    )
    messages = unrecoverable_reason(
        keeps_rows=True, published_messages=True, newest_rows=20, rows_gone=0
    )
    assert messages and "logical messages" in messages and "deleted" not in messages
    assert "CDC_MESSAGES=on" in messages
    deleted = unrecoverable_reason(
        keeps_rows=True, published_messages=False, newest_rows=20, rows_gone=1
    )
    assert deleted and "1 of the relay's 20 newest row events" in deleted
    both = unrecoverable_reason(
        keeps_rows=True, published_messages=True, newest_rows=3, rows_gone=3
    )
    assert both and "logical messages" in both and "deleted after insert" in both
    configured = unrecoverable_reason(
        keeps_rows=False, published_messages=False, newest_rows=0, rows_gone=0
    )
    assert configured and "CDC_OUTBOX_KEEPS_ROWS=false" in configured


def test_records_made_from_logical_messages_say_so_and_rows_do_not() -> None:
    tx = TxContext("0/10", 1_796_036_361_123_456, ("origin", b"7301/1/outbox_slot"))
    row = route_fields("e1", "user", "k", "T", "{}", None, tx, "p.")
    doc = b'{"id":"e2","aggregatetype":"user","aggregateid":"k","type":"T","payload":{}}'
    message = route_message(doc, tx, topic_prefix="p.")
    assert "form" not in dict(row.headers)
    assert dict(message.headers)["form"] == b"message"


def test_origin_round_trips_and_rides_on_every_record_of_the_transaction() -> None:
    value = origin_value(SERVER, SLOT)
    assert value == "7301/1/outbox_slot"
    assert Origin.parse(value) == Origin("7301", 1, SLOT)
    assert Origin.parse("garbage") is None
    tx = TxContext("0/10", 1_796_036_361_123_456, ("origin", value.encode()))
    record = route_fields("e1", "user", "k", "T", "{}", None, tx, "p.")
    assert dict(record.headers)["origin"] == value.encode()


def test_the_backlog_guard_is_over_while_a_gap_is_unrecovered() -> None:
    limits = BacklogLimits(
        max_relay_age_s=60, max_slot_lag_bytes=1 << 30, max_group_age_s=300, retry_after_s=5
    )
    missing = SlotMeasures(relay_age_s=None, slot_lag_bytes=None, problems=("no slot",))
    assert judge(missing, None, limits).state is BacklogState.UNKNOWN
    gap = SlotMeasures(relay_age_s=None, slot_lag_bytes=None, gap="slot s gap 3 open (slot_lost)")
    verdict = judge(gap, None, limits)
    assert verdict.state is BacklogState.OVER
    assert verdict.exceeded == ("gap: slot s gap 3 open (slot_lost)",)
