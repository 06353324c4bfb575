"""What differs between PostgreSQL 15 and 18 in what the relay reads and asks, as pure units.

* ``CDC_FAILOVER_SLOT`` into the slot's failover property by server version
  (edge: ``on`` before 17 is one clear error, never a silent plain slot);
* the replication commands the relay sends with and without ``FAILOVER``
  (edge: a server before 17 never sees the option);
* ``pg_replication_slots`` columns read by version, and one answer to "why is
  this slot unusable" on every version (edge: 15 has only ``wal_status``,
  16 ``conflicting``, 17+ ``invalidation_reason``);
* the gap decision for each invalidation cause and for a slot a failover carried
  over (edge: a synced failover slot on a new timeline streams on; a plain slot
  there, or a synced one that is not a failover slot, is still a gap).
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from cdc.errors import DatabaseSetupError
from cdc.evidence import Origin
from cdc.gaps import HistoryRow
from cdc.lineage import LastRecord, RowRef
from cdc.relay.gaps.gap import Action, Evidence, GapCause, Verdict, decide
from cdc.wal.slots import (
    CONFLICT,
    WAL_REMOVED,
    ServerIdentity,
    SlotRow,
    alter_failover_command,
    create_slot_command,
    failover_wanted,
    invalidated,
    slot_columns,
)

PG15, PG16, PG17, PG18 = 150_014, 160_009, 170_005, 180_006
SLOT = "outbox_slot"
NOW = datetime(2026, 12, 1, 7, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("setting", "version", "wanted"),
    [
        ("auto", PG15, False),
        ("auto", PG16, False),
        ("auto", PG17, True),
        ("auto", PG18, True),
        ("on", PG17, True),
        ("on", PG18, True),
        ("off", PG15, False),
        ("off", PG18, False),
    ],
)
def test_the_failover_setting_by_server_version(setting: str, version: int, wanted: bool) -> None:
    assert failover_wanted(setting, version) is wanted


@pytest.mark.parametrize("version", [PG15, PG16, 169_999])
def test_failover_on_before_postgresql_17_is_one_clear_error(version: int) -> None:
    with pytest.raises(DatabaseSetupError) as err:
        failover_wanted("on", version)
    message = str(err.value)
    assert "CDC_FAILOVER_SLOT=on" in message and "PostgreSQL 17" in message
    assert f"PostgreSQL {version // 10_000}" in message and "\n" not in message


def test_the_snapshot_slot_command_names_failover_only_when_asked() -> None:
    plain = create_slot_command('a"b', failover=False).as_string()
    assert plain == """CREATE_REPLICATION_SLOT "a""b" LOGICAL pgoutput (SNAPSHOT 'export')"""
    failover = create_slot_command("s", failover=True).as_string()
    assert (
        failover
        == """CREATE_REPLICATION_SLOT "s" LOGICAL pgoutput (SNAPSHOT 'export', FAILOVER true)"""
    )


def test_the_alter_command_sets_either_value() -> None:
    assert alter_failover_command("s").as_string() == 'ALTER_REPLICATION_SLOT "s" (FAILOVER true)'
    assert alter_failover_command("s", False).as_string() == (
        'ALTER_REPLICATION_SLOT "s" (FAILOVER false)'
    )


def test_slot_columns_follow_the_server_version() -> None:
    assert "invalidation_reason" not in slot_columns(PG15)
    assert "conflicting" not in slot_columns(PG15)
    assert "conflicting" in slot_columns(PG16) and "invalidation_reason" not in slot_columns(PG16)
    for version in (PG17, PG18):
        columns = slot_columns(version)
        assert "invalidation_reason, failover, synced" in columns
    # every version yields the same eleven values
    for version in (PG15, PG16, PG17, PG18):
        assert slot_columns(version).count(",") == 10


@pytest.mark.parametrize(
    ("wal_status", "reason", "answer"),
    [
        ("reserved", None, None),
        ("extended", None, None),
        ("lost", None, WAL_REMOVED),  # PostgreSQL 15: lost is the only way
        ("lost", CONFLICT, CONFLICT),  # 16: conflicting
        ("lost", "wal_removed", "wal_removed"),  # 17+
        ("lost", "idle_timeout", "idle_timeout"),  # 18
        ("lost", "rows_removed", "rows_removed"),
    ],
)
def test_one_answer_to_why_a_slot_is_unusable(
    wal_status: str, reason: str | None, answer: str | None
) -> None:
    assert invalidated(wal_status, reason) == answer


def _slot(invalid: str | None = None, *, failover: bool = False, synced: bool = False) -> SlotRow:
    return SlotRow(
        SLOT,
        "pgoutput",
        "db",
        False,
        100,
        "lost" if invalid else "reserved",
        None,
        invalidated=invalid,
        failover=failover,
        synced=synced,
    )


def _last(timeline: int = 1) -> LastRecord:
    return LastRecord(
        commit_ts_us=int(NOW.timestamp() * 1_000_000),
        origin=Origin.parse(f"7301/{timeline}/{SLOT}"),
        topic="outbox.event.user",
        partition=0,
        offset=41,
        newest_rows=(RowRef("e1", int(NOW.timestamp() * 1_000_000)),),
    )


#: the row that made the slot on timeline 1, with the furthest it let the slot confirm
MADE = HistoryRow(
    id=7,
    slot=SLOT,
    event="created",
    cause="first_start",
    detail="d",
    state="created",
    detected_at=NOW,
    last_published_ts=None,
    last_published_origin=None,
    window_start=None,
    window_end=None,
    origin=f"7301/1/{SLOT}",
    consistent_lsn="0/1",
    rows_recovered=None,
    seconds=None,
    unrecoverable=False,
    accepted_by=None,
    resolved_at=None,
    slot_catalog_xmin=700,
    confirm_limit_lsn="0/FF",
)


def _server(system: str, timeline: int) -> ServerIdentity:
    """Timeline 2 is a promotion that branched from 1 (the slot's confirmed 100 before it)."""
    return ServerIdentity(system, timeline, ((1, 0x1000),) if timeline > 1 else ())


def _verdict(slot: SlotRow, timeline: int = 1, system: str = "7301") -> Verdict:
    evidence = Evidence(SLOT, slot, _server(system, timeline), _last(), MADE, MADE)
    return decide(evidence, margin_s=300)


def _decide(slot: SlotRow, timeline: int = 1, system: str = "7301") -> tuple[Action, object]:
    verdict = _verdict(slot, timeline, system)
    return verdict.action, verdict.cause


@pytest.mark.parametrize(
    ("reason", "cause", "words"),
    [
        (WAL_REMOVED, GapCause.SLOT_LOST, "max_slot_wal_keep_size"),
        ("idle_timeout", GapCause.SLOT_IDLE_TIMEOUT, "idle_replication_slot_timeout"),
        ("rows_removed", GapCause.SLOT_INVALIDATED, "rows_removed"),
        ("wal_level_insufficient", GapCause.SLOT_INVALIDATED, "wal_level_insufficient"),
        (CONFLICT, GapCause.SLOT_INVALIDATED, "conflict"),
    ],
)
def test_each_invalidation_is_a_gap_with_its_own_cause(
    reason: str, cause: GapCause, words: str
) -> None:
    verdict = _verdict(_slot(reason))
    assert (verdict.action, verdict.cause) == (Action.GAP, cause)
    assert words in verdict.detail


def test_an_invalidated_synced_failover_slot_is_still_a_gap() -> None:
    slot = _slot("rows_removed", failover=True, synced=True)
    assert _decide(slot, timeline=2) == (Action.GAP, GapCause.SLOT_INVALIDATED)


def test_a_failover_slot_the_server_synchronized_streams_on_after_a_promotion() -> None:
    assert _decide(_slot(failover=True, synced=True), timeline=2) == (Action.STREAM, None)


@pytest.mark.parametrize(
    ("failover", "synced"), [(False, False), (True, False), (False, True)]
)  # fmt: skip
def test_a_slot_not_carried_over_by_slot_sync_is_a_gap_after_a_promotion(
    failover: bool, synced: bool
) -> None:
    slot = _slot(failover=failover, synced=synced)
    assert _decide(slot, timeline=2) == (Action.GAP, GapCause.TIMELINE_CHANGED)


def test_a_synced_slot_of_another_cluster_is_still_a_gap() -> None:
    slot = _slot(failover=True, synced=True)
    assert _decide(slot, timeline=2, system="9999") == (Action.GAP, GapCause.SYSTEM_CHANGED)
