"""The silence detector's decision (issue 34, item 6), the seat decision and the orphan match
(item 7), and the connection parameters of every connection (item 5): pure parts.

* :func:`cdc.relay.health.silence.judge` as a table: every kind of look at a silent
  session's walsender, and what the relay does;
* :class:`cdc.relay.health.silence.SilenceWatch` model-checked: over random silences,
  messages and looks (the fault events: a walsender gone, idle, blocked writing,
  unseen, going from record to record without a word; and the busy ones: on the
  CPU, reading spill files, a lock), a session is never ended while its
  walsender is busy inside a record, never without two looks of a walsender
  waiting for its client (or a vanished / unseen / record-to-record one), never
  before CDC_REPLICATION_SILENCE_S; a walsender no look can see (a look fails,
  whatever the server's wal_sender_timeout, 0 included) is ended within the relay's
  own bound and said blind until then (invariants; the mutants that trust
  wal_sender_timeout or say nothing while blind are caught); a walsender left alone
  is reported at most once per interval;
* :func:`cdc.relay.standby.wait.seat_of` and :meth:`cdc.wal.stream.Walsender.same_as`;
* :func:`cdc.pgconn.conninfo`: the defaults, per use, and the DSN's word first.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from psycopg.conninfo import conninfo_to_dict

from cdc.pgconn import (
    CLIENT_DEFAULTS,
    LOCK_TIMEOUT_MS,
    STATEMENT_TIMEOUT_MS,
    TCP_USER_TIMEOUT_MS,
    Use,
    conninfo,
)
from cdc.relay.health.silence import (
    LOOK_EVERY_S,
    LOOK_TIMEOUT_S,
    Judgement,
    Silence,
    SilenceWatch,
    judge,
    silence_bound_s,
)
from cdc.relay.standby.wait import Seat, seat_of
from cdc.wal.looks import WalsenderSample
from cdc.wal.stream import SlotHolder, Walsender


def sample(
    at_s: float,
    wait: str | None = None,
    *,
    kind: str | None = None,
    sent: int | None = 1000,
    decoded: int | None = 50,
    found: bool = True,
    replied: int | None = None,
) -> WalsenderSample:
    return WalsenderSample(
        at_s=at_s,
        found=found,
        state="active" if found else None,
        wait_event_type=kind or ("Client" if wait else None),
        wait_event=wait,
        sent_lsn=sent if found else None,
        decoded_bytes=decoded if found else None,
        reply_time_us=replied,
    )


IDLE = "WalSenderWaitForWAL"
IDLE_17 = "WalSenderWaitForWal"  # (PostgreSQL 17's spelling)
WRITE = "WalSenderWriteData"


def row(
    name: str,
    before: WalsenderSample | None,
    now: WalsenderSample | None,
    action: Silence,
    *,
    silent_s: float = 40,
    bound_s: float = 60,
    unseen: str = "",
    asked: int | None = None,
) -> tuple[
    str, float, float, WalsenderSample | None, WalsenderSample | None, str, int | None, Silence
]:
    return (name, silent_s, bound_s, before, now, unseen, asked, action)


#: When the relay first asked for a reply (its clock, microseconds).
ASKED = 1_700_000_000_000_000


CPU = None  # no wait event: on the CPU
SPILL, WAL, LOCK = ("BufFileRead", "IO"), ("WALRead", "IO"), ("relation", "Lock")

TABLE = [
    # busy inside one record (the replay of a large transaction): left alone
    row("on the CPU, first look", None, sample(10), Silence.LEAVE),
    row("reading its spill files", None, sample(10, SPILL[0], kind=SPILL[1]), Silence.LEAVE),
    row("reading WAL", None, sample(10, WAL[0], kind=WAL[1]), Silence.LEAVE),
    row("waiting for a lock", None, sample(10, LOCK[0], kind=LOCK[1]), Silence.LEAVE),
    row("on the CPU far past the bound", sample(4), sample(10), Silence.LEAVE, silent_s=900),
    row("its statistics moving", sample(4, decoded=5), sample(10, decoded=9), Silence.LEAVE),
    # went on reading WAL: working, unless it had read a reply request before (then its
    # answer went out when that record was done, and never arrived: dead path)
    row("sent_lsn moved", sample(4, sent=1000), sample(10, sent=5000), Silence.LEAVE),
    row(
        "sent_lsn moved, idle now after working",
        sample(4, WAL[0], kind=WAL[1], sent=1),
        sample(10, IDLE, sent=9),
        Silence.WAIT,
    ),
    row(
        "idle twice, sent_lsn moving: it reads WAL into the void",
        sample(4, IDLE, sent=1),
        sample(10, IDLE, sent=9),
        Silence.END,
    ),
    row(
        "sent_lsn moved after it read our request",
        sample(4, sent=1000, replied=ASKED),
        sample(10, sent=5000, replied=ASKED),
        Silence.END,
        asked=ASKED,
    ),
    row(
        "it read a request of an earlier silence",
        sample(4, sent=1000, replied=ASKED - 1),
        sample(10, sent=5000, replied=ASKED - 1),
        Silence.LEAVE,
        asked=ASKED,
    ),
    row(
        "it read our request, still inside the record",
        sample(4, SPILL[0], kind=SPILL[1], replied=ASKED),
        sample(10, SPILL[0], kind=SPILL[1], replied=ASKED),
        Silence.LEAVE,
        asked=ASKED,
    ),
    row(
        "blocked writing after it read more WAL",
        sample(4, WRITE, sent=1, replied=ASKED),
        sample(10, WRITE, sent=9, replied=ASKED),
        Silence.END,
        asked=ASKED,
    ),
    # gone
    row("gone", None, sample(10, found=False), Silence.END),
    row("gone after a look", sample(4), sample(10, found=False), Silence.END),
    # waiting for its client: two looks LOOK_EVERY_S apart, the same way
    row("blocked writing, first look", None, sample(10, WRITE), Silence.WAIT),
    row("blocked writing, looks too close", sample(8, WRITE), sample(10, WRITE), Silence.WAIT),
    row("blocked writing twice", sample(4, WRITE), sample(10, WRITE), Silence.END),
    row("idle, first look", None, sample(10, IDLE), Silence.WAIT),
    row("idle twice", sample(4, IDLE), sample(10, IDLE), Silence.END),
    row("idle twice (PostgreSQL 17)", sample(4, IDLE_17), sample(10, IDLE_17), Silence.END),
    row("idle after the CPU: it may answer now", sample(4), sample(10, IDLE), Silence.WAIT),
    row("idle after blocked writing", sample(4, WRITE), sample(10, IDLE), Silence.WAIT),
    # cannot be seen: past the relay's own bound, whatever wal_sender_timeout says
    row("unseen within the bound", None, None, Silence.WAIT, unseen="timeout"),
    row("unseen past the bound", sample(4), None, Silence.END, silent_s=61, unseen="timeout"),
    row(
        "unseen, wal_sender_timeout 0: the relay's bound still",
        None,
        None,
        Silence.END,
        silent_s=46,
        bound_s=silence_bound_s(35),
        unseen="connection timeout expired",
    ),
]


@pytest.mark.parametrize(
    ("silent_s", "bound_s", "before", "now", "unseen", "asked", "action"),
    [row[1:] for row in TABLE],
    ids=[row[0] for row in TABLE],
)
def test_the_silence_decision_table(
    silent_s: float,
    bound_s: float,
    before: WalsenderSample | None,
    now: WalsenderSample | None,
    unseen: str,
    asked: int | None,
    action: Silence,
) -> None:
    verdict = judge(
        silent_s=silent_s, bound_s=bound_s, now=now, before=before, asked_at_us=asked, unseen=unseen
    )
    assert verdict.action is action, verdict.reason
    assert verdict.reason


def test_the_reasons_name_what_was_seen() -> None:
    assert (
        "read 4000 bytes of WAL in 6s"
        in judge(
            silent_s=40, bound_s=60, now=sample(10, sent=5000), before=sample(4, sent=1000)
        ).reason
    )
    assert (
        "BufFileRead"
        in judge(
            silent_s=40, bound_s=60, now=sample(10, "BufFileRead", kind="IO"), before=None
        ).reason
    )
    ended = judge(silent_s=40, bound_s=60, now=sample(10, WRITE), before=sample(4, WRITE))
    assert "blocked writing" in ended.reason and "at two looks 6s apart" in ended.reason


def test_the_bound_is_the_relays_own_look_after_plus_the_looks_timeout() -> None:
    """Not the server's wal_sender_timeout: 0 (off) gave an unseen walsender for ever."""
    assert silence_bound_s(35.0) == 35.0 + LOOK_TIMEOUT_S
    assert silence_bound_s(5.0) == 5.0 + LOOK_TIMEOUT_S


def test_an_unseen_walsender_is_counted_from_the_last_look_that_saw_it() -> None:
    watch = SilenceWatch(look_after_s=35.0, bound_s=silence_bound_s(35.0))
    assert watch.judge(36.0, 100.0, sample(100.0)).action is Silence.LEAVE
    assert watch.blind is None
    blind = watch.judge(46.0, 110.0, None, "connection timeout expired")
    assert blind.action is Silence.WAIT, "seen working 10 s ago: within the bound"
    assert watch.blind is not None and "cannot be seen (connection timeout expired)" in watch.blind
    assert "silent for 46s" in watch.blind
    ended = watch.judge(82.0, 146.0, None, "connection timeout expired")
    assert ended.action is Silence.END and "no look has seen it for 46s" in ended.reason
    watch.heard()
    assert watch.blind is None, "a message ends the blindness"


def test_a_look_that_sees_the_walsender_again_ends_the_blindness() -> None:
    watch = SilenceWatch(look_after_s=35.0, bound_s=silence_bound_s(35.0))
    watch.judge(36.0, 100.0, None, "refused")
    assert watch.blind is not None
    watch.judge(41.0, 105.0, sample(105.0))
    assert watch.blind is None


def test_a_working_walsender_is_reported_at_most_once_per_interval() -> None:
    watch = SilenceWatch(look_after_s=35.0, bound_s=60.0)
    assert not watch.due(35.0, 100.0) and watch.due(35.1, 100.0)
    first = watch.judge(36.0, 100.0, sample(100.0))
    assert first.action is Silence.LEAVE and first.log
    assert not watch.due(40.0, 104.0), "the next look waits LOOK_EVERY_S"
    again = watch.judge(41.0, 105.0, sample(105.0))
    assert again.action is Silence.LEAVE and not again.log
    later = watch.judge(71.0, 135.5, sample(135.5))
    assert later.action is Silence.LEAVE and later.log
    watch.heard()
    assert watch.due(36.0, 136.0), "a new silence looks again at once"


# --- the watch, model-checked -------------------------------------------------------

LOOK_AFTER_S = 35.0

#: What a look can show: a walsender waiting for its client (idle, blocked writing), busy
#: (on the CPU, spilling, a lock), gone, or not to be seen at all.
WALSENDER = {
    "idle": (IDLE, "Client"),
    "write": (WRITE, "Client"),
    "cpu": (None, None),
    "spill": ("ReorderBufferWrite", "IO"),
    "lock": ("relation", "Lock"),
}


#: The relay's own bound for a walsender no look sees (the model's, written out).
BOUND_S = LOOK_AFTER_S + LOOK_TIMEOUT_S


def real_watch(look_after_s: float, timeout_ms: int) -> SilenceWatch:
    """The relay's watch for a session whose server has ``wal_sender_timeout`` = timeout_ms
    (which it does not read: the bound is its own)."""
    return SilenceWatch(look_after_s=look_after_s, bound_s=silence_bound_s(look_after_s))


class SilenceModel(RuleBasedStateMachine):
    """Random silences, messages, reply requests, looks and walsender states (the fault
    events: it vanishes, cannot be seen, waits for a client that is gone, a look fails
    whatever it does; the server's wal_sender_timeout 0, 10 s, 60 s or 600 s; the busy
    ones: the CPU, spilling, a lock; it reads WAL; it reads our request); each answer of
    the watch checked against the guarantees of cdc.relay.health.silence, and the bounds after
    every step (invariants)."""

    #: how a session's watch is made (the mutants below replace it)
    make_watch = staticmethod(real_watch)

    def __init__(self) -> None:
        super().__init__()
        self.timeout_ms = 0
        self.watch = self.make_watch(LOOK_AFTER_S, 0)
        self.now_s = 1000.0
        self.heard_at_s = self.now_s
        self.doing = "idle"  # a WALSENDER key, "gone" or "unseen"
        self.sent = 0
        self.reply_time_us = 0
        self.asked_at_us: int | None = None
        self.seen: list[WalsenderSample] = []  # the found looks of the current silence
        self.look_times: list[float] = []
        self.reported_at: list[float] = []
        self.ended = False
        #: the last look of this silence failed (the relay is blind: 503)
        self.last_look_failed = False
        #: how long no look had seen the walsender, at the last failed look
        self.unseen_at_last_look_s = 0.0

    def _us(self) -> int:
        return int(self.now_s * 1_000_000)

    @rule(timeout_ms=st.sampled_from([0, 10_000, 60_000, 600_000]))
    def new_session(self, timeout_ms: int) -> None:
        self.timeout_ms = timeout_ms
        self.watch = self.make_watch(LOOK_AFTER_S, timeout_ms)
        self.doing, self.ended = "idle", False
        self.a_message_arrives()

    @rule(step_s=st.sampled_from([0.5, 1.0, 5.0, 6.0, 36.0, 120.0]))
    def time_passes(self, step_s: float) -> None:
        self.now_s += step_s

    @rule(doing=st.sampled_from([*WALSENDER, "gone", "unseen"]))
    def the_walsender_changes(self, doing: str) -> None:
        self.doing = doing

    @rule()
    def it_reads_wal(self) -> None:
        self.sent += 100

    @rule()
    def it_reads_our_status_update(self) -> None:
        self.reply_time_us = self._us()

    @rule()
    def a_message_arrives(self) -> None:
        self.heard_at_s = self.now_s
        self.seen, self.look_times, self.asked_at_us = [], [], None
        self.last_look_failed, self.unseen_at_last_look_s = False, 0.0
        self.watch.heard()

    @rule()
    def a_status_update_is_sent(self) -> None:
        if self.now_s - self.heard_at_s >= self.watch.ask_after_s(5.0):
            self.watch.asking(self._us())
            if self.asked_at_us is None:
                self.asked_at_us = self._us()

    def _sample(self) -> WalsenderSample | None:
        if self.doing == "unseen":
            return None
        if self.doing == "gone":
            return WalsenderSample(at_s=self.now_s, found=False)
        event, kind = WALSENDER[self.doing]
        return WalsenderSample(
            at_s=self.now_s,
            found=True,
            state="active",
            wait_event_type=kind,
            wait_event=event,
            sent_lsn=self.sent,
            reply_time_us=self.reply_time_us,
        )

    @precondition(lambda self: not self.ended)
    @rule()
    def look(self) -> None:
        self._look(failed=False)

    @precondition(lambda self: not self.ended)
    @rule()
    def a_look_fails(self) -> None:
        """The look cannot connect or answer (the same dead path, too many connections),
        whatever the walsender does."""
        self._look(failed=True)

    def _look(self, *, failed: bool) -> None:
        silent_s = self.now_s - self.heard_at_s
        if not self.watch.due(silent_s, self.now_s):
            assert silent_s <= LOOK_AFTER_S or (
                self.look_times and self.now_s - self.look_times[-1] < LOOK_EVERY_S
            ), "a look is due past the setting, LOOK_EVERY_S after the last one"
            return
        look = None if failed else self._sample()
        verdict = self.watch.judge(silent_s, self.now_s, look, "unseen")
        assert verdict.action is self._expected(look, silent_s), verdict.reason
        if verdict.action is Silence.LEAVE and verdict.log:
            assert not self.reported_at or self.now_s - self.reported_at[-1] >= LOOK_AFTER_S
            self.reported_at.append(self.now_s)
        if look is not None:
            self.seen.append(look)
        else:
            self.unseen_at_last_look_s = self._unseen_s(silent_s)
        self.last_look_failed = look is None
        self.look_times.append(self.now_s)
        self.ended = verdict.action is Silence.END

    def _unseen_s(self, silent_s: float) -> float:
        """How long no look has seen the walsender: since the silence began, or since the
        last look of it that found it (gone or not)."""
        if not self.seen:
            return silent_s
        return min(silent_s, self.now_s - self.seen[-1].at_s)

    def _expected(self, look: WalsenderSample | None, silent_s: float) -> Silence:
        """The guarantees, written out: what the watch must answer."""
        assert silent_s > LOOK_AFTER_S, "never a look (nor an end) before the setting"
        if look is None:
            # the relay's own bound, whatever the server's wal_sender_timeout (0 included)
            return Silence.END if self._unseen_s(silent_s) > BOUND_S else Silence.WAIT
        if not look.found:
            return Silence.END
        before = self.seen[-1] if self.seen else None
        moved = before is not None and (look.sent_lsn or 0) > (before.sent_lsn or 0)
        read_before = (
            before is not None
            and self.asked_at_us is not None
            and (before.reply_time_us or 0) >= self.asked_at_us
        )
        if moved and read_before:
            return Silence.END  # it read our request, went on, its answer never came
        event = (look.wait_event or "").lower()
        if event not in {IDLE.lower(), WRITE.lower()}:
            return Silence.LEAVE  # working: never ended
        same_before = before is not None and (before.wait_event or "").lower() == event
        if same_before and before is not None and look.at_s - before.at_s >= LOOK_EVERY_S:
            return Silence.END  # waiting for its client at two looks
        return Silence.WAIT

    @invariant()
    def a_walsender_no_look_sees_is_ended_within_the_bound(self) -> None:
        assert self.ended or self.unseen_at_last_look_s <= BOUND_S, (
            f"unseen for {self.unseen_at_last_look_s}s (bound {BOUND_S}s,"
            f" wal_sender_timeout {self.timeout_ms} ms) and the session kept"
        )

    @invariant()
    def a_failed_look_is_said_until_a_message_or_a_look_that_sees(self) -> None:
        blind = self.watch.blind
        if self.last_look_failed and not self.ended:
            assert blind is not None and "cannot be seen" in blind and "silent for" in blind
        elif not self.last_look_failed:
            assert blind is None, blind


TestSilenceModel = SilenceModel.TestCase


# -- mutants: the bugs this model exists for, each caught ------------------------------


def _trusts_wal_sender_timeout(look_after_s: float, timeout_ms: int) -> SilenceWatch:
    """The regression of issue 49: the bound from the server's wal_sender_timeout, so an
    unseen walsender is never ended when it is 0 (and kept for as long when it is large)."""
    bound_s = math.inf if not timeout_ms else max(look_after_s, timeout_ms / 1000)
    return SilenceWatch(look_after_s=look_after_s, bound_s=bound_s)


class _QuietWhenBlind(SilenceWatch):
    """Never says that it cannot see (/readyz stays 200 through a blind silence)."""

    def judge(
        self, silent_s: float, now_s: float, look: WalsenderSample | None, unseen: str = ""
    ) -> Judgement:
        verdict = super().judge(silent_s, now_s, look, unseen)
        self.blind = None
        return verdict


def _quiet_when_blind(look_after_s: float, timeout_ms: int) -> SilenceWatch:
    return _QuietWhenBlind(look_after_s=look_after_s, bound_s=silence_bound_s(look_after_s))


_BLIND_SILENCE: list[tuple[str, dict[str, object]]] = [
    ("new_session", {"timeout_ms": 0}),
    ("the_walsender_changes", {"doing": "unseen"}),
    ("time_passes", {"step_s": 36.0}),
    ("look", {}),  # 36 s: blind, within the bound
    ("time_passes", {"step_s": 36.0}),
    ("look", {}),  # 72 s: past the bound, ended
]
MUTANT_SCRIPTS: dict[object, list[tuple[str, dict[str, object]]]] = {
    _trusts_wal_sender_timeout: _BLIND_SILENCE,
    _quiet_when_blind: _BLIND_SILENCE,
}


def _checked(model: SilenceModel) -> None:
    model.a_walsender_no_look_sees_is_ended_within_the_bound()
    model.a_failed_look_is_said_until_a_message_or_a_look_that_sees()


@pytest.mark.parametrize("mutant", list(MUTANT_SCRIPTS), ids=lambda m: m.__name__.strip("_"))
def test_the_model_catches_the_mutant(mutant: object) -> None:
    class Mutated(SilenceModel):
        make_watch = staticmethod(mutant)  # type: ignore[arg-type]

    model = Mutated()
    with pytest.raises(AssertionError):
        for name, kwargs in MUTANT_SCRIPTS[mutant]:
            getattr(model, name)(**kwargs)
            _checked(model)


@pytest.mark.parametrize("script", list(MUTANT_SCRIPTS.values()), ids=lambda _: "script")
def test_the_real_watch_passes_every_mutants_script(
    script: list[tuple[str, dict[str, object]]],
) -> None:
    model = SilenceModel()
    for name, kwargs in script:
        getattr(model, name)(**kwargs)
        _checked(model)
    assert model.ended


# --- the seat and the orphan --------------------------------------------------------------

MINE = Walsender(4242, "127.0.0.1", 51000)


@pytest.mark.parametrize(
    ("holder", "own", "recovering", "seat"),
    [
        (SlotHolder(False, None), None, False, Seat.FREE),  # missing: the gap check decides
        (SlotHolder(True, None), MINE, False, Seat.FREE),
        (SlotHolder(True, None), None, True, Seat.TAKEN),  # another process recovers
        (SlotHolder(True, MINE), MINE, False, Seat.OWN_ORPHAN),
        (SlotHolder(True, MINE), MINE, True, Seat.OWN_ORPHAN),
        (SlotHolder(True, MINE), None, False, Seat.TAKEN),  # no previous connection here
        (SlotHolder(True, Walsender(4242, "127.0.0.1", 51001)), MINE, False, Seat.TAKEN),
        (SlotHolder(True, Walsender(4243, "127.0.0.1", 51000)), MINE, False, Seat.TAKEN),
        (SlotHolder(True, Walsender(4242, "10.0.0.7", 51000)), MINE, False, Seat.TAKEN),
    ],
    ids=[
        "missing",
        "inactive",
        "inactive, recovering",
        "own orphan",
        "own orphan, recovering",
        "no previous walsender",
        "same pid, another port",
        "another pid",
        "same pid and port, another address",
    ],
)
def test_the_seat_decision_table(
    holder: SlotHolder, own: Walsender | None, recovering: bool, seat: Seat
) -> None:
    found, why = seat_of("s", holder, own, recovering=recovering)
    assert found is seat
    assert bool(why) is (seat is not Seat.FREE)


def test_a_walsender_is_matched_by_pid_address_and_port_in_any_spelling() -> None:
    assert MINE.same_as(Walsender(4242, "::ffff:127.0.0.1", 51000))
    assert Walsender(7, "::1", 5).same_as(Walsender(7, "0:0:0:0:0:0:0:1", 5))
    assert Walsender(7, None, -1).same_as(Walsender(7, None, -1))  # a Unix socket: pid
    assert not Walsender(7, None, -1).same_as(Walsender(7, "127.0.0.1", 5))
    assert "client 127.0.0.1:51000" in str(MINE)


# --- connection parameters ----------------------------------------------------------------


def _options(dsn: str) -> list[str]:
    text = conninfo_to_dict(dsn).get("options") or ""
    return [part for part in text.split() if part != "-c"]


def test_every_use_gets_keepalives_and_tcp_user_timeout_on_both_ends() -> None:
    for use in Use:
        params = conninfo_to_dict(conninfo("host=db dbname=app", use))
        for name, value in CLIENT_DEFAULTS.items():
            assert params[name] == value, (use, name)
        if use is not Use.CLI:
            assert f"tcp_user_timeout={TCP_USER_TIMEOUT_MS}" in _options(conninfo("", use))
            assert "tcp_keepalives_idle=10" in _options(conninfo("", use))


def test_each_use_bounds_its_waits() -> None:
    query = _options(conninfo("", Use.QUERY))
    assert f"statement_timeout={STATEMENT_TIMEOUT_MS}" in query
    assert f"lock_timeout={LOCK_TIMEOUT_MS}" in query
    hold = _options(conninfo("", Use.HOLD))
    assert "idle_session_timeout=0" in hold and "idle_in_transaction_session_timeout=0" in hold
    work = _options(conninfo("", Use.WORK))
    assert not any(o.startswith("statement_timeout") for o in work)
    assert f"lock_timeout={LOCK_TIMEOUT_MS}" in work and "idle_session_timeout=0" in work
    assert "idle_session_timeout=0" in _options(conninfo("", Use.REPLICATION))
    assert "options" not in conninfo_to_dict(conninfo("host=db", Use.CLI)), "a pooler may refuse"


def test_what_the_dsn_says_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    dsn = "postgresql://u@db/app?options=-c%20idle_session_timeout%3D1500&tcp_user_timeout=9"
    params = conninfo_to_dict(conninfo(dsn, Use.HOLD))
    assert params["tcp_user_timeout"] == "9"
    options = _options(conninfo(dsn, Use.HOLD))
    assert options[-1] == "idle_session_timeout=1500", "the server applies the last -c"
    monkeypatch.setenv("PGOPTIONS", "-c lock_timeout=5")
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "3")
    params = conninfo_to_dict(conninfo("host=db", Use.QUERY))
    assert "connect_timeout" not in params, "libpq reads PGCONNECT_TIMEOUT itself"
    assert _options(conninfo("host=db", Use.QUERY))[-1] == "lock_timeout=5"
