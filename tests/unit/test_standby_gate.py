"""Standby-safe mode: the gate's decisions (pure), the version gating, and the relay's use of it.

* a held transaction is released only once the standby flushed its commit end,
  whole, in commit order; an open transaction or an unknown position releases
  nothing (checked against a model over random histories);
* failover slots are chosen only on PostgreSQL 17+, else the relay's gate guards;
* the relay (a recording producer, no broker) holds records with the mode on,
  counts them in flight, confirms nothing past them, publishes them once the
  standby's flushed LSN passes their commit, and is HELD (not ready, no WAL read)
  while the standby does not catch up.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from confluent_kafka import Producer
from hypothesis import given
from hypothesis import strategies as st

from cdc.relay.health.state import RelayState, Session
from cdc.relay.standby.gate import (
    FAILOVER_SLOTS_MIN_VERSION,
    SafeMode,
    StandbyGate,
    choose_mode,
    listed_in_synchronized_standby_slots,
    releasable,
)
from cdc.relay.standby.safe import alter_failover_command
from cdc.relay.stream import loop as relay_mod
from cdc.relay.stream.loop import Relay
from cdc.settings import Settings
from cdc.wal.lsn import LsnTracker
from tests.unit.test_relay_routing import (
    FakeStream,
    FakeTopics,
    RecordingProducer,
    begin,
    commit,
    insert,
    relation,
    row,
)

# --- the decision ------------------------------------------------------------------


def test_nothing_is_releasable_while_the_standby_position_is_unknown() -> None:
    assert releasable(None, [10, 20]) == 0


def test_the_longest_flushed_prefix_of_commits_is_releasable() -> None:
    assert releasable(25, [10, 20, 30]) == 2
    assert releasable(30, [10, 20, 30]) == 3  # flushed exactly to the commit end
    assert releasable(29, [10, 20, 30]) == 2


def test_an_open_transaction_stops_the_release_even_when_later_ones_are_flushed() -> None:
    assert releasable(1_000, [10, None, 30]) == 1


@given(
    st.lists(st.tuples(st.integers(1, 5), st.booleans()), min_size=1, max_size=30),
    st.one_of(st.none(), st.integers(0, 200)),
)
def test_gate_releases_exactly_the_safe_prefix_in_commit_order(
    txs: list[tuple[int, bool]], flushed: int | None
) -> None:
    """Model: transactions at increasing LSNs, each committed or still open."""
    gate: StandbyGate[str] = StandbyGate()
    ends: dict[int, int | None] = {}
    lsn = 0
    for n, (records, committed) in enumerate(txs):
        lsn += 5
        for r in range(records):
            gate.hold(lsn, f"{n}:{r}", float(n))
        ends[lsn] = lsn + 3 if committed else None
    released = gate.release(flushed, ends.get)
    expect = 0
    for end in ends.values():
        if flushed is None or end is None or end > flushed:
            break
        expect += 1
    assert [tx.tx_id for tx in released] == list(ends)[:expect]
    assert [r for tx in released for r in tx.records] == [
        f"{n}:{r}" for n, (records, _) in enumerate(txs[:expect]) for r in range(records)
    ]
    assert gate.transactions == len(txs) - expect
    assert gate.records == sum(records for records, _ in txs[expect:])


def test_transactions_must_be_held_in_commit_order() -> None:
    gate: StandbyGate[str] = StandbyGate()
    gate.hold(20, "a", 0.0)
    with pytest.raises(ValueError, match="held after"):
        gate.hold(10, "b", 0.0)


def test_the_server_guard_releases_every_committed_transaction_at_the_head() -> None:
    gate: StandbyGate[str] = StandbyGate()
    for tx_id in (10, 20, 30):
        gate.hold(tx_id, str(tx_id), 0.0)
    ends = {10: 15, 20: 25, 30: None}
    assert [tx.tx_id for tx in gate.release_all_committed(ends.get)] == [10, 20]
    assert gate.newest_commit(ends.get) is None
    assert gate.oldest_held_at_s() == 0.0


# --- which mechanism guards ----------------------------------------------------------


def test_no_standby_named_is_off_whatever_the_server() -> None:
    assert choose_mode("", failover_slot="on", server_version_num=170_002).mode is SafeMode.OFF


@pytest.mark.parametrize("version", [150_010, 160_004, 169_999])
def test_failover_slots_on_before_postgresql_17_fall_back_to_the_relays_gate(version: int) -> None:
    choice = choose_mode("sb", failover_slot="on", server_version_num=version)
    assert choice.mode is SafeMode.RELAY
    assert "PostgreSQL 17" in choice.note and str(version) in choice.note


@pytest.mark.parametrize("version", [150_010, 160_004])
def test_auto_before_postgresql_17_is_the_relays_gate_without_a_note(version: int) -> None:
    assert choose_mode("sb", failover_slot="auto", server_version_num=version) == (
        choose_mode("sb", failover_slot="off", server_version_num=version)
    )


@pytest.mark.parametrize("setting", ["auto", "on"])
@pytest.mark.parametrize("version", [FAILOVER_SLOTS_MIN_VERSION, 170_002, 180_000])
def test_failover_slots_on_postgresql_17_or_later_let_the_server_guard(
    setting: str, version: int
) -> None:
    choice = choose_mode("sb", failover_slot=setting, server_version_num=version)
    assert choice == choice.__class__(SafeMode.SERVER)


def test_with_failover_slots_off_the_relay_guards_even_on_postgresql_18() -> None:
    assert choose_mode("sb", failover_slot="off", server_version_num=180_000).mode is (
        SafeMode.RELAY
    )


@pytest.mark.parametrize(
    ("setting", "listed"),
    [("sb", True), ("a, sb", True), ('"sb",x', True), ("*", True), ("", False), ("sbx", False)],
)
def test_synchronized_standby_slots_is_read_as_a_list(setting: str, listed: bool) -> None:
    assert listed_in_synchronized_standby_slots(setting, "sb") is listed


def test_the_failover_command_quotes_the_slot_name() -> None:
    command = alter_failover_command('a"b').as_string()
    assert command == 'ALTER_REPLICATION_SLOT "a""b" (FAILOVER true)'


# --- the relay holding and releasing -------------------------------------------------


@pytest.fixture
def relay(monkeypatch: pytest.MonkeyPatch) -> Iterator[Relay]:
    monkeypatch.setattr(relay_mod, "TopicManager", lambda **_: FakeTopics())
    r = Relay(
        Settings(
            pg_dsn="postgresql://x",
            kafka_bootstrap_servers="127.0.0.1:9",
            standby_safe="sb",
            standby_safe_max_wait_s=5.0,
        ),
        serve_http=False,
    )
    r._producer = RecordingProducer()  # type: ignore[assignment]
    r.decoder.utf8 = True
    r.decoder.topic_of[b"user"] = "outbox.event.user"
    safe = r.standby_safe._safe
    assert safe is not None
    safe.thread = threading.Thread()  # no poller: the test sets the standby's position
    yield r


def _tx(relay: Relay, sess: Session, final_lsn: int, n: int) -> None:
    relay.decoder.on_change(sess, begin(final_lsn))
    for i in range(n):
        relay.decoder.on_change(
            sess, insert(row(event_id=f"{final_lsn:08d}-0000-4000-8000-{i:012d}"))
        )
    relay.decoder.on_change(sess, commit(final_lsn))


class ServerStream(FakeStream):
    """A stream on one server of a multi-host DSN, read by a walsender of ``backend_pid``."""

    def __init__(self, port: int = 5432, backend_pid: int = 4242) -> None:
        self.server = ("127.0.0.1", "127.0.0.1", port)
        self.backend_pid = backend_pid


def _session(relay: Relay, stream: ServerStream | None = None) -> Session:
    sess = Session(stream=stream or ServerStream(), tracker=LsnTracker(0))  # type: ignore[arg-type]
    relay.decoder.on_change(sess, relation())
    return sess


def _flushed(relay: Relay, lsn: int | None, *, port: int = 5432, pid: int = 4242) -> None:
    """What the poller would set: the standby's flushed LSN read on that server."""
    safe = relay.standby_safe._safe
    assert safe is not None
    safe.reading = (("127.0.0.1", "127.0.0.1", port, pid), lsn)


def test_with_the_mode_on_records_wait_for_the_standby_and_count_in_flight(relay: Relay) -> None:
    producer = relay._producer
    assert isinstance(producer, RecordingProducer)
    safe = relay.standby_safe._safe
    assert safe is not None
    sess = _session(relay)
    _tx(relay, sess, 1_000, 2)
    _tx(relay, sess, 2_000, 1)
    relay.decoder.on_change(sess, begin(3_000))
    relay.decoder.on_change(sess, insert(row(event_id="00003000-0000-4000-8000-000000000000")))
    relay.standby_safe.release_held(sess)
    assert producer.produced == []
    assert sess.tracker.in_flight == 4  # held records count against CDC_MAX_IN_FLIGHT
    assert sess.tracker.confirmable == 0

    _flushed(relay, 1_000 + 40)  # commit end of the first transaction (commit() adds 40)
    relay.standby_safe.release_held(sess)
    assert [p.headers[0][1] for p in producer.produced] == [
        b"00001000-0000-4000-8000-000000000000",
        b"00001000-0000-4000-8000-000000000001",
    ]
    producer.poll()
    assert sess.tracker.confirmable == 1_040

    _flushed(relay, 10_000)  # past everything, but the third transaction is still open
    relay.standby_safe.release_held(sess)
    assert len(producer.produced) == 3
    relay.decoder.on_change(sess, commit(3_000))
    relay.standby_safe.release_held(sess)
    producer.poll()
    assert len(producer.produced) == 4
    assert sess.tracker.in_flight == 0 and sess.tracker.confirmable == 3_040
    assert relay.registry.get_sample_value("outbox_relay_standby_held_transactions") == 0


def test_a_standby_that_does_not_catch_up_holds_the_relay_until_it_does(
    relay: Relay, monkeypatch: pytest.MonkeyPatch
) -> None:
    safe = relay.standby_safe._safe
    assert safe is not None
    sess = _session(relay)
    now = [100.0]
    monkeypatch.setattr("cdc.relay.standby.safe.time.monotonic", lambda: now[0])
    _tx(relay, sess, 1_000, 1)
    relay.standby_safe.release_held(sess)
    assert sess.held is None
    now[0] += 6.0  # beyond standby_safe_max_wait_s
    relay.standby_safe.release_held(sess)
    assert sess.held is not None and "'sb'" in sess.held and "unknown" in sess.held
    relay._set_state(RelayState.HELD, sess.held)
    assert not relay.liveness.ready and "waiting" in relay.liveness.state
    _flushed(relay, 5_000)
    relay.standby_safe.release_held(sess)
    assert sess.held is None
    assert relay.registry.get_sample_value("outbox_relay_standby_held_records") == 0


def test_a_new_session_forgets_what_the_old_one_held(relay: Relay) -> None:
    safe = relay.standby_safe._safe
    assert safe is not None
    old = _session(relay)
    _tx(relay, old, 1_000, 3)
    new = _session(relay)
    _tx(relay, new, 2_000, 1)
    assert safe.gate.records == 1


def test_with_the_mode_off_the_send_step_is_the_producers_own() -> None:
    r = Relay(
        Settings(pg_dsn="postgresql://x", kafka_bootstrap_servers="127.0.0.1:9"),
        serve_http=False,
    )
    assert r.standby_safe._safe is None
    assert r.mode.record == r.producing.send  # (the delivery mode's record step: no hold)
    assert r.decoder._send == r.producing.send
    r.standby_safe.release_held(Session(stream=FakeStream(), tracker=LsnTracker(0)))  # type: ignore[arg-type]


def test_shutdown_does_not_wait_for_records_held_for_the_standby(
    relay: Relay, monkeypatch: pytest.MonkeyPatch
) -> None:
    sess = _session(relay)
    _tx(relay, sess, 1_000, 2)
    assert relay.standby_safe.held_records(sess) == 2 == sess.tracker.in_flight
    polls: list[float] = []
    monkeypatch.setattr(relay.mode, "serve", polls.append)
    relay._shutdown(sess)
    assert polls == []  # no turn of the flush wait
    assert sess.tracker.confirmable == 0  # held, never sent: read again after a restart


def test_a_reading_of_another_server_releases_nothing(relay: Relay) -> None:
    """After a failover the poller may read the promoted standby's positions (a new
    timeline, higher LSNs) while the session still holds the old primary's commits."""
    producer = relay._producer
    assert isinstance(producer, RecordingProducer)
    sess = _session(relay, ServerStream(port=5432, backend_pid=4242))
    _tx(relay, sess, 1_000, 1)
    relay.standby_safe.release_held(sess)
    _flushed(relay, 1 << 40, port=5433, pid=4242)  # another server
    relay.standby_safe.release_held(sess)
    _flushed(relay, 1 << 40, port=5432, pid=777)  # the same port, not our walsender
    relay.standby_safe.release_held(sess)
    assert producer.produced == []
    _flushed(relay, 1 << 40)
    relay.standby_safe.release_held(sess)
    assert len(producer.produced) == 1


def test_the_slot_guard_trusts_a_slot_after_promotion_only_while_the_server_guards(
    relay: Relay,
) -> None:
    safe = relay.standby_safe._safe
    assert safe is not None
    # (the slot guard asks the standby-safe mode: the relay's own gate - recover a gap)
    assert relay.guard._slot_survives_failover() is False
    safe.mode = SafeMode.SERVER
    assert relay.guard._slot_survives_failover() is True
    off = Relay(
        Settings(pg_dsn="postgresql://x", kafka_bootstrap_servers="127.0.0.1:9"),
        serve_http=False,
    )
    assert off.guard._slot_survives_failover() is False


def test_with_the_mode_on_a_real_producer_holds_too(relay: Relay) -> None:
    """With the mode on, every record reaches the gate with a real producer too:
    nothing goes to ``Producer.produce`` before the standby has it."""
    producer = Producer({"bootstrap.servers": "127.0.0.1:9", "log_level": 0})
    relay._producer = producer
    sess = _session(relay)
    _tx(relay, sess, 1_000, 3)
    relay.standby_safe.release_held(sess)
    assert relay.standby_safe.held_records(sess) == 3
    assert sess.reports is None  # no run of records was produced
