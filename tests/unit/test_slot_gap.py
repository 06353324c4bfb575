"""The gap decision (cdc.relay.gap.decide) as a table: slot x server x last record x history."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from cdc.backlog import BacklogLimits, BacklogState, SlotMeasures, judge
from cdc.gaps import HistoryRow
from cdc.lineage import LastRecord, Origin, origin_value
from cdc.relay.gap import Action, GapCause, decide, unrecoverable_reason
from cdc.router import TxContext, route_fields
from cdc.wal.slots import ServerIdentity, SlotRow

SLOT = "outbox_slot"
SERVER = ServerIdentity("7301", 1)
NOW = datetime(2026, 12, 1, 7, 0, tzinfo=UTC)
MARGIN_S = 300.0


def _slot(wal_status: str | None = "reserved") -> SlotRow:
    return SlotRow(SLOT, "pgoutput", "db", False, 100, wal_status, None)


def _last(origin: str | None = "7301/1/outbox_slot", at: datetime = NOW) -> LastRecord:
    return LastRecord(
        commit_ts_us=int(at.timestamp() * 1_000_000),
        origin=Origin.parse(origin) if origin else None,
        topic="outbox.event.user",
        partition=0,
        offset=41,
        newest_ids=("e1",),
    )


def _history(state: str, origin: str | None = None, at: datetime = NOW) -> HistoryRow:
    return HistoryRow(
        id=7,
        slot=SLOT,
        event="created" if state == "created" else "gap",
        cause="first_start" if state == "created" else "slot_lost",
        detail="d",
        state=state,
        detected_at=at,
        last_published_ts=None,
        last_published_origin=None,
        window_start=NOW - timedelta(hours=1) if state == "open" else None,
        window_end=None,
        origin=origin,
        consistent_lsn=None,
        rows_recovered=None,
        seconds=None,
        unrecoverable=False,
        accepted_by=None,
        resolved_at=None,
    )


LATER = NOW + timedelta(minutes=5)
WINDOW = NOW - timedelta(seconds=MARGIN_S)

CASES = [
    # (name, slot, server, last, history, action, cause, window start)
    ("first start: no slot, nothing in Kafka", None, SERVER, None, None, Action.CREATE, None, None),
    ("slot fine, same origin", _slot(), SERVER, _last(), None, Action.STREAM, None, None),
    ("slot fine, empty topics", _slot(), SERVER, None, None, Action.STREAM, None, None),
    (
        "records of a relay before `origin`",
        _slot(),
        SERVER,
        _last(None),
        None,
        Action.STREAM,
        None,
        None,
    ),
    ("slot dropped", None, SERVER, _last(), None, Action.GAP, GapCause.SLOT_MISSING, WINDOW),
    (
        "slot dropped, topics empty, history known",
        None,
        SERVER,
        None,
        _history("created"),
        Action.GAP,
        GapCause.SLOT_MISSING,
        WINDOW,
    ),
    (
        "slot invalidated",
        _slot("lost"),
        SERVER,
        _last(),
        None,
        Action.GAP,
        GapCause.SLOT_LOST,
        WINDOW,
    ),
    (
        "slot invalidated, topics empty",
        _slot("lost"),
        SERVER,
        None,
        None,
        Action.GAP,
        GapCause.SLOT_LOST,
        None,
    ),
    (
        "unreserved is not lost yet",
        _slot("unreserved"),
        SERVER,
        _last(),
        None,
        Action.STREAM,
        None,
        None,
    ),
    (
        "failover: promoted standby without the slot",
        None,
        ServerIdentity("7301", 2),
        _last(),
        None,
        Action.GAP,
        GapCause.SLOT_MISSING,
        WINDOW,
    ),
    (
        "a slot of the same name after a promotion",
        _slot(),
        ServerIdentity("7301", 2),
        _last(),
        None,
        Action.GAP,
        GapCause.TIMELINE_CHANGED,
        WINDOW,
    ),
    (
        "another cluster under the slot name",
        _slot(),
        ServerIdentity("9999", 1),
        _last(),
        None,
        Action.GAP,
        GapCause.SYSTEM_CHANGED,
        WINDOW,
    ),
    (
        "slot made here by a recovery after the last record",
        _slot(),
        ServerIdentity("7301", 2),
        _last(),
        _history("recovered", "7301/2/outbox_slot", LATER),
        Action.STREAM,
        None,
        None,
    ),
    (
        "history of another origin does not vouch",
        _slot(),
        ServerIdentity("7301", 2),
        _last(),
        _history("recovered", "7301/1/outbox_slot", LATER),
        Action.GAP,
        GapCause.TIMELINE_CHANGED,
        WINDOW,
    ),
    (
        "an open gap is the same gap again, with its window",
        _slot(),
        SERVER,
        _last(),
        _history("open"),
        Action.GAP,
        GapCause.SLOT_LOST,
        NOW - timedelta(hours=1),
    ),
]


@pytest.mark.parametrize(
    ("slot", "server", "last", "history", "action", "cause", "window"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_decide(slot, server, last, history, action, cause, window) -> None:  # type: ignore[no-untyped-def]
    verdict = decide(
        slot_name=SLOT, slot=slot, server=server, last=last, history=history, margin_s=MARGIN_S
    )
    assert (verdict.action, verdict.cause, verdict.window_start) == (action, cause, window)
    if action is Action.GAP:
        assert verdict.detail and verdict.reason.startswith(cause.value)


def test_a_failover_slot_under_a_new_timeline_is_trusted_when_the_mode_says_so() -> None:
    verdict = decide(
        slot_name=SLOT,
        slot=_slot(),
        server=ServerIdentity("7301", 2),
        last=_last(),
        history=None,
        margin_s=MARGIN_S,
        slot_survives_failover=True,
    )
    assert verdict.action is Action.STREAM


def test_unrecoverable_when_rows_are_not_kept_or_the_newest_ids_are_gone() -> None:
    horizon = NOW - timedelta(days=1)
    assert unrecoverable_reason(keeps_rows=False, last=None, ids_in_table=0, horizon_start=horizon)
    gone = unrecoverable_reason(
        keeps_rows=True, last=_last(), ids_in_table=0, horizon_start=horizon
    )
    assert gone and "newest event ids" in gone
    assert (
        unrecoverable_reason(keeps_rows=True, last=_last(), ids_in_table=1, horizon_start=horizon)
        is None
    )
    old_last = _last(at=NOW - timedelta(days=2))  # idle past the horizon: pruned, not deleted
    assert (
        unrecoverable_reason(keeps_rows=True, last=old_last, ids_in_table=0, horizon_start=horizon)
        is None
    )


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
