"""Does a standby carry the failover slot for good? The pure parts (issue 49, item 2).

The classification of a standby's row of the slot (for good / not yet / missing /
unknown), the row read as text, the DSN's hosts, the /readyz lines and the preflight's
wording of one answer, the watch's gauge and notes; /readyz keeps its status whatever
the notes say. The watch's memory (which series, which lines, what was logged) is
model-checked (:class:`WatchModel`, with two mutants it must catch). The real pair
(PostgreSQL 18) is tests/integration/test_failover_slots.py.
"""

from __future__ import annotations

import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from prometheus_client import CollectorRegistry, Gauge
from psycopg.conninfo import conninfo_to_dict
from pydantic import SecretStr

from cdc.check import Status, standby_copy_finding
from cdc.health import HealthServer, Liveness
from cdc.relay.standby import watch as standby_watch
from cdc.relay.standby.watch import StandbyWatch
from cdc.settings import Settings
from cdc.wal.standby_copy import (
    GAUGE_VALUE,
    MAX_STANDBY_HOSTS,
    NO_STANDBY_NOTE,
    ONE_HOST_NOTE,
    Carry,
    SlotCopyRow,
    StandbyCopy,
    _host_dsn,
    classify,
    copy_of,
    dsn_hosts,
    readiness_notes,
    standby_fixes,
)

SLOT = "outbox_slot"
#: A standby set up right: sync_replication_slots, hot_standby_feedback, a dbname.
SET_UP = ("on", "on", "host=a dbname=postgres")


@pytest.mark.parametrize(
    ("row", "carry"),
    [
        (None, Carry.MISSING),
        (SlotCopyRow(synced=True, temporary=False), Carry.FOR_GOOD),
        (SlotCopyRow(synced=True, temporary=True), Carry.NOT_YET),
        (SlotCopyRow(synced=False, temporary=False), Carry.MISSING),  # the standby's own slot
        (SlotCopyRow(synced=None, temporary=False), Carry.UNKNOWN),  # before 17: no column
        (SlotCopyRow(synced=True, temporary=None), Carry.UNKNOWN),
    ],
)
def test_a_standby_slot_row_is_classified(row: SlotCopyRow | None, carry: Carry) -> None:
    assert classify(row)[0] is carry


@given(st.none() | st.builds(SlotCopyRow, st.none() | st.booleans(), st.none() | st.booleans()))
def test_only_a_synced_persistent_copy_is_for_good(row: SlotCopyRow | None) -> None:
    carry, why = classify(row)
    assert (carry is Carry.FOR_GOOD) == (row == SlotCopyRow(synced=True, temporary=False))
    assert why  # every answer says why
    assert GAUGE_VALUE[carry] == {Carry.FOR_GOOD: 1, Carry.UNKNOWN: -1}.get(carry, 0)


def test_the_text_row_of_a_standby_reads_as_its_answer() -> None:
    temporary = copy_of("b:5433", ["t", *SET_UP, "t", "true", "true"])
    assert temporary == StandbyCopy("b:5433", Carry.NOT_YET, "temporary copy")
    persistent = copy_of("b:5433", ["t", *SET_UP, "t", "true", "false"])
    assert persistent is not None and persistent.carry is Carry.FOR_GOOD
    none = copy_of("b:5433", ["t", *SET_UP, "f", None, None])
    assert none is not None and none.carry is Carry.MISSING
    assert copy_of("a:5432", ["f", *SET_UP, "t", "false", "false"]) is None  # the primary


def test_the_standby_settings_that_keep_it_from_carrying_are_named() -> None:
    assert standby_fixes("on", "on", "dbname=x") == ()
    assert standby_fixes("off", None, "host=a") == (
        "sync_replication_slots = on",
        "hot_standby_feedback = on",
        "a dbname in primary_conninfo",
    )
    assert standby_fixes("on", "on", None) == ()  # primary_conninfo not readable: not judged


def test_the_readyz_phrase_of_each_answer() -> None:
    where = "10.0.0.2:5432"
    assert (
        StandbyCopy(where, Carry.NOT_YET, "temporary copy").phrase
        == "standby 10.0.0.2:5432: failover slot not yet carried for good (temporary copy)"
    )
    assert (
        StandbyCopy(where, Carry.FOR_GOOD, "synced, not temporary").phrase
        == "standby 10.0.0.2:5432: failover slot carried for good (synced, not temporary)"
    )
    missing = StandbyCopy(
        where, Carry.MISSING, "no synchronized copy", ("sync_replication_slots = on",)
    )
    assert missing.phrase == (
        "standby 10.0.0.2:5432: failover slot not carried (no synchronized copy);"
        " not set up to keep it: set sync_replication_slots = on"
    )
    unknown = StandbyCopy(where, Carry.UNKNOWN, "cannot look: Connection refused")
    assert unknown.phrase == (
        "standby 10.0.0.2:5432: failover slot unknown (cannot look: Connection refused)"
    )


def test_readyz_says_unknown_with_why_when_no_standby_can_be_read() -> None:
    assert readiness_notes([], hosts=1) == (ONE_HOST_NOTE,)
    assert "CDC_PG_DSN names one host" in ONE_HOST_NOTE and "unknown" in ONE_HOST_NOTE
    assert readiness_notes([], hosts=2) == (NO_STANDBY_NOTE,)
    copy = StandbyCopy("b:1", Carry.FOR_GOOD, "synced, not temporary")
    assert readiness_notes([copy], hosts=2) == (copy.phrase,)


def test_the_hosts_of_a_dsn_are_read_as_libpq_reads_them() -> None:
    assert dsn_hosts("host=a,b port=1,2 dbname=x") == [("a:1", "a", "1"), ("b:2", "b", "2")]
    assert dsn_hosts("host=a,b port=5 dbname=x") == [("a:5", "a", "5"), ("b:5", "b", "5")]
    assert dsn_hosts("postgresql://u@a:1,b:2/x") == [("a:1", "a", "1"), ("b:2", "b", "2")]
    assert len(dsn_hosts("host=a dbname=x")) == 1
    many = ",".join(f"h{i}" for i in range(20))
    assert len(dsn_hosts(f"host={many} dbname=x")) == MAX_STANDBY_HOSTS  # bounded


def test_one_host_of_a_dsn_is_looked_at_as_any_role() -> None:
    dsn = (
        "host=a,b hostaddr=10.0.0.1,10.0.0.2 port=1,2 dbname=x user=u"
        " target_session_attrs=read-write load_balance_hosts=random"
    )
    one = conninfo_to_dict(_host_dsn(dsn, 1, "2"))
    assert (one["host"], one["hostaddr"], one["port"]) == ("b", "10.0.0.2", "2")
    assert one["target_session_attrs"] == "any" and "load_balance_hosts" not in one
    assert (one["dbname"], one["user"]) == ("x", "u")


@pytest.mark.parametrize(
    ("copy", "status", "words"),
    [
        (StandbyCopy("b:2", Carry.FOR_GOOD, ""), Status.OK, "holds slot s for good (synced, not"),
        (StandbyCopy("b:2", Carry.NOT_YET, ""), Status.WARN, "temporary copy of slot s"),
        (StandbyCopy("b:2", Carry.MISSING, ""), Status.WARN, "holds no synchronized s yet"),
        (StandbyCopy("b:2", Carry.UNKNOWN, "cannot look: x"), Status.WARN, "cannot look: x"),
        (
            StandbyCopy("b:2", Carry.FOR_GOOD, "", ("hot_standby_feedback = on",)),
            Status.WARN,
            "will not carry the slot (a gap recovery would): set hot_standby_feedback = on",
        ),
    ],
)
def test_the_preflight_says_each_answer(copy: StandbyCopy, status: Status, words: str) -> None:
    finding = standby_copy_finding(copy, "s")
    assert (finding.item, finding.status) == ("standby b:2", status)
    assert words in finding.detail


def _watch(looking: bool, dsn: str = "host=a,b port=1,2") -> tuple[StandbyWatch, Gauge, Liveness]:
    gauge = Gauge("g", "g", ["standby"], registry=CollectorRegistry())
    liveness = Liveness()
    settings = Settings(pg_dsn=SecretStr(dsn), slot=SLOT)
    watch = StandbyWatch(
        settings, gauge=gauge, liveness=liveness, looking=lambda: looking, stop=threading.Event()
    )
    return watch, gauge, liveness


def _series(gauge: Gauge) -> dict[str, float]:
    return {s.labels["standby"]: s.value for m in gauge.collect() for s in m.samples}


def test_the_watch_shows_each_standby_and_drops_a_host_that_turned_primary(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watch, gauge, liveness = _watch(True)
    temporary = StandbyCopy("b:2", Carry.NOT_YET, "temporary copy")
    with caplog.at_level(logging.INFO, "cdc.relay"):
        watch.show([temporary], (temporary.phrase,))
        watch.show([temporary], (temporary.phrase,))  # the same answer: not logged again
    assert _series(gauge) == {"b:2": 0.0}
    assert liveness.notes == (temporary.phrase,)
    assert [r.getMessage() for r in caplog.records] == [temporary.phrase]
    persistent = StandbyCopy("b:2", Carry.FOR_GOOD, "synced, not temporary")
    watch.show([persistent], (persistent.phrase,))
    assert _series(gauge) == {"b:2": 1.0}
    watch.show([], (NO_STANDBY_NOTE,))  # b was promoted: no series left for it
    assert _series(gauge) == {}
    assert liveness.notes == (NO_STANDBY_NOTE,)


def test_the_watch_shows_nothing_while_the_relay_streams_no_failover_slot() -> None:
    watch, _, liveness = _watch(False)
    liveness.notes = ("stale",)
    watch.look_once()
    assert liveness.notes == ()


def test_a_look_that_raises_says_unknown_and_the_watch_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*_: object, **__: object) -> list[StandbyCopy]:
        raise ValueError("bad conninfo")

    monkeypatch.setattr(standby_watch, "look_at_standbys", broken)
    watch, _, liveness = _watch(True)
    watch.look_once()
    assert liveness.notes == ("standbys: failover slot unknown (the look failed: ValueError)",)


def test_a_single_host_dsn_is_unknown_without_a_connection() -> None:
    watch, gauge, liveness = _watch(True, dsn="host=a port=1 dbname=x")
    watch.look_once()  # one host: nothing to connect to
    assert liveness.notes == (ONE_HOST_NOTE,)
    assert _series(gauge) == {}


@pytest.mark.parametrize("ready", [True, False])
def test_readyz_notes_follow_the_state_and_never_change_the_status(ready: bool) -> None:
    liveness = Liveness()
    liveness.set("streaming" if ready else "stalled: x", ready=ready)
    liveness.notes = ("standby b:2: failover slot not yet carried for good (temporary copy)",)
    server = HealthServer(
        host="127.0.0.1", port=0, registry=CollectorRegistry(), liveness=liveness
    ).start()
    try:
        url = f"http://127.0.0.1:{server.port}/readyz"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                status, body = resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            status, body = exc.code, exc.read().decode()
    finally:
        server.stop()
    assert status == (200 if ready else 503)
    assert body.splitlines() == [liveness.state, *liveness.notes]


# --- the watch's memory, model-checked ------------------------------------------------------

#: Standby hosts a DSN may name (a few: the model's alphabet).
HOSTS = ("b:2", "c:3", "d:4")


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class WatchModel(RuleBasedStateMachine):
    """Any sequence of looks (hosts appear, change answer, turn primary, vanish): after
    every step the gauge has exactly one series per host of the last look, with that
    look's value; /readyz shows the last look's lines; a host's answer is logged once
    per change (the log grows by the changes only, never by a repeated look)."""

    watch_class: type[StandbyWatch] = StandbyWatch

    def __init__(self) -> None:
        super().__init__()
        self.gauge = Gauge("g", "g", ["standby"], registry=CollectorRegistry())
        self.liveness = Liveness()
        self.watch = self.watch_class(
            Settings(pg_dsn=SecretStr("host=a,b port=1,2"), slot=SLOT),
            gauge=self.gauge,
            liveness=self.liveness,
            looking=lambda: True,
            stop=threading.Event(),
        )
        self.handler = _Lines()
        logging.getLogger("cdc.relay").addHandler(self.handler)
        self.last: dict[str, Carry] = {}
        self.expected_lines: list[str] = []
        self.notes: tuple[str, ...] = ()

    def teardown(self) -> None:
        logging.getLogger("cdc.relay").removeHandler(self.handler)

    @rule(answers=st.dictionaries(st.sampled_from(HOSTS), st.sampled_from(list(Carry)), max_size=3))
    def look(self, answers: dict[str, Carry]) -> None:
        copies = [StandbyCopy(where, carry, "why") for where, carry in sorted(answers.items())]
        notes = readiness_notes(copies, hosts=2)
        previous = logging.getLogger("cdc.relay").level
        logging.getLogger("cdc.relay").setLevel(logging.INFO)
        try:
            self.watch.show(copies, notes)
        finally:
            logging.getLogger("cdc.relay").setLevel(previous)
        self.expected_lines += [c.phrase for c in copies if self.last.get(c.where) is not c.carry]
        self.last = dict(answers)
        self.notes = notes

    @invariant()
    def one_series_per_host_of_the_last_look(self) -> None:
        assert _series(self.gauge) == {w: GAUGE_VALUE[c] for w, c in self.last.items()}

    @invariant()
    def readyz_shows_the_last_look(self) -> None:
        assert self.liveness.notes == self.notes

    @invariant()
    def a_change_is_logged_once(self) -> None:
        assert self.handler.lines == self.expected_lines


TestWatchModel = WatchModel.TestCase
TestWatchModel.settings = settings(max_examples=60, stateful_step_count=20, deadline=None)


class _NeverForgets(StandbyWatch):
    """Mutant: a host that turned primary keeps its series (the gauge says a stale answer)."""

    def show(self, copies: Sequence[StandbyCopy], notes: tuple[str, ...]) -> None:
        shown = dict(self._shown)
        super().show(copies, notes)
        for where, carry in shown.items():
            if where not in self._shown:
                self._gauge.labels(where).set(GAUGE_VALUE[carry])


class _LogsEveryLook(StandbyWatch):
    """Mutant: every look logs every answer (a line every 15 s per standby)."""

    def show(self, copies: Sequence[StandbyCopy], notes: tuple[str, ...]) -> None:
        self._shown = {}
        super().show(copies, notes)


@pytest.mark.parametrize("mutant", [_NeverForgets, _LogsEveryLook])
def test_the_watch_model_catches_a_mutant(mutant: type[StandbyWatch]) -> None:
    class Mutated(WatchModel):
        watch_class = mutant

    with pytest.raises(AssertionError):
        run_state_machine_as_test(
            Mutated,
            settings=settings(
                max_examples=100,
                stateful_step_count=20,
                deadline=None,
                report_multiple_bugs=False,  # (one AssertionError, not a group of them)
            ),
        )
