"""cdc.wal.lsn.LsnTracker: the relay confirms only what Kafka holds.

Examples pin the contract; a hypothesis state machine drives random
interleavings of open/add/ack/close/observe_wal_end, shaped like a real
replication stream (one transaction decoded at a time, ids and end LSNs
increasing, keepalive positions never ahead of an undecoded commit), and checks
the tracker against a brute-force reference after every step. It also ends
sessions the way the relay does after a producer fatal error or a reconnect:
records in flight are purged (never acknowledged), a new tracker starts at the
confirmed LSN and the server sends every unconfirmed transaction again; across
sessions, no transaction is ever confirmed before all its records were
acknowledged in one session (duplicates, never loss).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from cdc.wal.lsn import LsnTracker

# --- examples ------------------------------------------------------------------


def test_confirmable_starts_at_the_start_lsn() -> None:
    tracker = LsnTracker(100)
    assert (tracker.confirmable, tracker.in_flight, tracker.open_transactions) == (100, 0, 0)


def test_idle_stream_confirms_the_keepalive_wal_end() -> None:
    tracker = LsnTracker(100)
    tracker.observe_wal_end(500)
    assert tracker.confirmable == 500


def test_transaction_is_confirmed_only_after_close_and_every_ack() -> None:
    tracker = LsnTracker(100)
    tracker.open(200)
    tracker.add(200)
    tracker.add(200)
    tracker.ack(200)
    tracker.close(200, 260)
    assert tracker.confirmable == 100
    assert tracker.in_flight == 1
    tracker.ack(200)
    assert tracker.confirmable == 260
    assert tracker.in_flight == 0


def test_ack_returns_the_records_of_the_transaction_still_unacked() -> None:
    tracker = LsnTracker(100)
    tracker.open(200)
    tracker.add(200)
    tracker.add(200)
    assert tracker.ack(200) == 1
    tracker.add(200)
    assert tracker.ack(200) == 1
    tracker.close(200, 260)
    assert tracker.ack(200) == 0
    assert tracker.confirmable == 260


def test_acks_arriving_before_close_confirm_at_close() -> None:
    tracker = LsnTracker(100)
    tracker.open(200)
    tracker.add(200)
    tracker.ack(200)
    assert tracker.confirmable == 100
    tracker.close(200, 260)
    assert tracker.confirmable == 260


def test_transaction_without_records_is_confirmed_at_close() -> None:
    tracker = LsnTracker(100)
    tracker.open(200)
    tracker.close(200, 260)
    assert tracker.confirmable == 260


def test_later_transaction_acked_first_waits_for_the_earlier_one() -> None:
    tracker = LsnTracker(100)
    for tx_id, end in ((200, 260), (300, 360)):
        tracker.open(tx_id)
        tracker.add(tx_id)
        tracker.close(tx_id, end)
    tracker.ack(300)
    assert tracker.confirmable == 100
    tracker.ack(200)
    assert tracker.confirmable == 360


def test_wal_end_is_not_confirmed_while_a_transaction_is_open() -> None:
    tracker = LsnTracker(100)
    tracker.open(200)
    tracker.observe_wal_end(190)
    assert tracker.confirmable == 100
    tracker.close(200, 260)
    assert tracker.confirmable == 260


def test_wal_end_is_not_confirmed_while_records_are_unacked() -> None:
    tracker = LsnTracker(100)
    tracker.open(200)
    tracker.add(200)
    tracker.close(200, 260)
    tracker.observe_wal_end(900)
    assert tracker.confirmable == 100
    tracker.ack(200)
    assert tracker.confirmable == 900  # the remembered wal_end, once drained


def test_confirmable_never_decreases_on_a_stale_wal_end() -> None:
    tracker = LsnTracker(100)
    tracker.observe_wal_end(500)
    tracker.observe_wal_end(0)  # e.g. a Relation XLogData frame carries 0
    assert tracker.confirmable == 500
    assert tracker.wal_end == 500


def test_interleaved_open_transactions_confirm_in_id_order() -> None:
    tracker = LsnTracker(0)
    tracker.open(10)
    tracker.open(20)
    tracker.close(20, 30)
    assert (tracker.confirmable, tracker.open_transactions, tracker.pending_transactions) == (
        0,
        1,
        2,
    )
    tracker.close(10, 15)
    assert tracker.confirmable == 30
    assert tracker.pending_transactions == 0


def test_open_rejects_an_id_not_greater_than_the_previous_one() -> None:
    tracker = LsnTracker(0)
    tracker.open(10)
    with pytest.raises(ValueError, match="ids must increase"):
        tracker.open(10)
    with pytest.raises(ValueError, match="ids must increase"):
        tracker.open(5)


def test_ack_of_unknown_transaction_raises() -> None:
    tracker = LsnTracker(0)
    with pytest.raises(ValueError, match="unknown transaction 7"):
        tracker.ack(7)


def test_acks_in_bulk_count_as_many_acks() -> None:
    tracker = LsnTracker(0)
    tracker.open(10)
    for _ in range(3):
        tracker.add(10)
    tracker.close(10, 20)
    assert tracker.ack(10, 2) == 1
    assert tracker.confirmable == 0
    with pytest.raises(ValueError, match="beyond its added records"):
        tracker.ack(10, 2)
    with pytest.raises(ValueError, match="ack of 0 records"):
        tracker.ack(10, 0)
    assert tracker.ack(10, 1) == 0
    assert tracker.confirmable == 20
    assert tracker.in_flight == 0


def test_more_acks_than_adds_raise() -> None:
    tracker = LsnTracker(0)
    tracker.open(10)
    tracker.add(10)
    tracker.ack(10)
    with pytest.raises(ValueError, match="beyond its added records"):
        tracker.ack(10)


def test_ack_after_the_transaction_was_confirmed_raises() -> None:
    tracker = LsnTracker(0)
    tracker.open(10)
    tracker.add(10)
    tracker.close(10, 20)
    tracker.ack(10)
    with pytest.raises(ValueError, match="unknown transaction 10"):
        tracker.ack(10)


def test_add_to_a_closed_or_unknown_transaction_raises() -> None:
    tracker = LsnTracker(0)
    tracker.open(10)
    tracker.add(10)
    tracker.close(10, 20)
    with pytest.raises(ValueError, match="already closed"):
        tracker.add(10)
    with pytest.raises(ValueError, match="unknown"):
        tracker.add(99)


def test_close_twice_or_of_unknown_transaction_raises() -> None:
    tracker = LsnTracker(0)
    tracker.open(10)
    tracker.add(10)
    tracker.close(10, 20)
    with pytest.raises(ValueError, match="already closed"):
        tracker.close(10, 20)
    with pytest.raises(ValueError, match="unknown"):
        tracker.close(99, 120)


def test_close_with_end_lsn_below_the_id_raises() -> None:
    tracker = LsnTracker(0)
    tracker.open(10)
    with pytest.raises(ValueError, match="end LSN"):
        tracker.close(10, 9)


def test_single_position_pseudo_transaction_confirms_its_position_once_acked() -> None:
    tracker = LsnTracker(0)
    tracker.open(40)  # e.g. a non-transactional message at LSN 40, dead-lettered
    tracker.add(40)
    tracker.close(40, 40)
    assert tracker.confirmable == 0
    tracker.ack(40)
    assert tracker.confirmable == 40


def test_negative_start_lsn_raises() -> None:
    with pytest.raises(ValueError, match="negative"):
        LsnTracker(-1)


# --- random interleavings --------------------------------------------------------


@dataclass
class ModelTx:
    tx_id: int
    added: int = 0
    acked: int = 0
    end_lsn: int | None = None

    @property
    def done(self) -> bool:
        return self.end_lsn is not None and self.acked == self.added


class TrackerMachine(RuleBasedStateMachine):
    """A replication stream as the relay sees it, with Kafka acks in any order."""

    #: the tracker under test (the mutant tests below swap in broken ones)
    tracker_cls: type[LsnTracker] = LsnTracker

    def __init__(self) -> None:
        super().__init__()
        self.tracker = self.tracker_cls(0)
        self.txs: list[ModelTx] = []
        self.unacked: list[ModelTx] = []  # one entry per record Kafka still owes
        self.position = 0  # the server has sent everything that committed below this
        self.max_wal_end = 0
        self.expected = 0
        self.previous = 0
        #: every commit the server has sent, over all sessions: tx_id -> end LSN
        self.committed: dict[int, int] = {}
        #: transactions whose records were all acknowledged within one session
        self.delivered: set[int] = set()
        #: (tx_id, end LSN) the server sends again after a session restart, in order
        self.resend: list[tuple[int, int]] = []

    @initialize(start=st.integers(min_value=0, max_value=2**40))
    def start(self, start: int) -> None:
        self.tracker = self.tracker_cls(start)
        self.position = self.max_wal_end = self.expected = self.previous = start

    def open_tx(self) -> ModelTx | None:
        last = self.txs[-1] if self.txs else None
        return last if last is not None and last.end_lsn is None else None

    @precondition(lambda self: self.open_tx() is None)
    @rule(gap=st.integers(min_value=0, max_value=1000))
    def begin(self, gap: int) -> None:
        # After a restart the server sends the unconfirmed ones first; otherwise the
        # commit lies at or after the position.
        tx = ModelTx(self.resend[0][0] if self.resend else self.position + gap)
        self.txs.append(tx)
        self.tracker.open(tx.tx_id)

    @precondition(lambda self: self.open_tx() is not None)
    @rule(records=st.integers(min_value=1, max_value=3))
    def hand_records_to_kafka(self, records: int) -> None:
        tx = self.open_tx()
        assert tx is not None
        for _ in range(records):
            tx.added += 1
            self.unacked.append(tx)
            self.tracker.add(tx.tx_id)

    @precondition(lambda self: self.open_tx() is not None)
    @rule(record_size=st.integers(min_value=1, max_value=200))
    def commit(self, record_size: int) -> None:
        tx = self.open_tx()
        assert tx is not None
        if self.resend and self.resend[0][0] == tx.tx_id:
            tx.end_lsn = self.resend.pop(0)[1]
        else:
            tx.end_lsn = tx.tx_id + record_size
        self.committed[tx.tx_id] = tx.end_lsn
        self.position = max(self.position, tx.end_lsn)
        self.tracker.close(tx.tx_id, tx.end_lsn)
        self._note_delivered(tx)

    def _note_delivered(self, tx: ModelTx) -> None:
        if tx.done:
            self.delivered.add(tx.tx_id)

    @rule()
    def session_restarts(self) -> None:
        """The relay's session ends (producer fatal error, reconnect): the records
        in flight are purged - never acknowledged - and the new session's tracker
        starts at the LSN confirmed so far; the server sends again, with the same
        ids and end LSNs, every transaction it committed past that LSN (and the
        one it was sending)."""
        confirmed = self.tracker.confirmable
        self.resend = sorted(
            (tx_id, end) for tx_id, end in self.committed.items() if end > confirmed
        )
        self.tracker = self.tracker_cls(confirmed)
        self.txs = []
        self.unacked = []
        self.position = self.max_wal_end = self.expected = self.previous = confirmed

    @precondition(lambda self: bool(self.unacked))
    @rule(data=st.data())
    def kafka_acks_any_record(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(min_value=0, max_value=len(self.unacked) - 1))
        self.kafka_acks_any_record_at(index)

    @precondition(lambda self: bool(self.unacked))
    @rule(data=st.data())
    def kafka_acks_several_records_of_one_transaction_at_once(self, data: st.DataObject) -> None:
        """The relay counts delivery reports per transaction and acknowledges them
        together (``ack(tx_id, count)``), any number of the transaction's
        unacknowledged records."""
        tx = self.unacked[data.draw(st.integers(min_value=0, max_value=len(self.unacked) - 1))]
        mine = [i for i, other in enumerate(self.unacked) if other is tx]
        count = data.draw(st.integers(min_value=1, max_value=len(mine)))
        for i in reversed(mine[:count]):
            del self.unacked[i]
        tx.acked += count
        assert self.tracker.ack(tx.tx_id, count) == tx.added - tx.acked
        self._note_delivered(tx)

    @rule(data=st.data())
    def server_reports_wal_end(self, data: st.DataObject) -> None:
        tx = self.open_tx()
        # While a transaction is being sent, the server has not passed its commit
        # record; between transactions it may be anywhere ahead (but not past one
        # it is about to send again). 0 stands for the position-less Relation frames.
        if tx is not None:
            ceiling = tx.tx_id
        elif self.resend:
            ceiling = self.resend[0][0]
        else:
            ceiling = self.position + 1000
        near = st.integers(min_value=max(0, ceiling - 2000), max_value=ceiling)
        lsn = data.draw(st.one_of(st.just(0), near))
        if tx is None and not self.resend:
            self.position = max(self.position, lsn)
        self.max_wal_end = max(self.max_wal_end, lsn)
        self.tracker.observe_wal_end(lsn)

    @rule()
    def everything_settles(self) -> None:
        tx = self.open_tx()
        if tx is not None:
            self.commit(1)
        while self.unacked:
            self.kafka_acks_any_record_at(0)
        last_end = max((t.end_lsn or 0 for t in self.txs), default=0)
        assert self.tracker.confirmable == max(last_end, self.max_wal_end, self.previous)
        assert self.tracker.confirmable >= last_end

    def kafka_acks_any_record_at(self, index: int) -> None:
        tx = self.unacked.pop(index)
        tx.acked += 1
        assert self.tracker.ack(tx.tx_id) == tx.added - tx.acked
        self._note_delivered(tx)

    def reference(self) -> int:
        """Brute force: the end of the longest DONE prefix, or wal_end once all is DONE."""
        confirmable = self.expected
        for tx in self.txs:
            if not tx.done:
                return confirmable
            assert tx.end_lsn is not None
            confirmable = max(confirmable, tx.end_lsn)
        return max(confirmable, self.max_wal_end)

    @invariant()
    def confirmable_equals_the_reference_model(self) -> None:
        self.expected = self.reference()
        assert self.tracker.confirmable == self.expected

    @invariant()
    def confirmable_never_decreases(self) -> None:
        assert self.tracker.confirmable >= self.previous
        self.previous = self.tracker.confirmable

    @invariant()
    def confirmable_never_passes_an_open_or_unacked_transaction(self) -> None:
        for tx in self.txs:
            if not tx.done:
                assert self.tracker.confirmable <= tx.tx_id
                if tx.end_lsn is not None:
                    assert self.tracker.confirmable < tx.end_lsn

    @invariant()
    def no_transaction_is_confirmed_before_it_was_delivered_in_some_session(self) -> None:
        for tx_id, end in self.committed.items():
            if end <= self.tracker.confirmable:
                assert tx_id in self.delivered, f"transaction {tx_id} confirmed, never delivered"

    @invariant()
    def counters_match_the_model(self) -> None:
        assert self.tracker.in_flight == len(self.unacked)
        assert self.tracker.open_transactions == (0 if self.open_tx() is None else 1)


TrackerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
TestLsnTrackerConfirmsOnlyFullyAckedCommitsUnderRandomInterleavings = TrackerMachine.TestCase


# --- the bugs the model exists for ----------------------------------------------------------
# Each mutant is a tracker with one classic CDC confirmation bug; the state
# machine above must find it (a confirmed LSN past a record Kafka has not
# acknowledged is an event lost at the next restart).


class _ConfirmsTheHighestAckedCommit(LsnTracker):
    """Confirms a fully acked transaction at once, even behind an earlier unacked one."""

    def ack(self, tx_id: int, count: int = 1) -> int:
        tx = self._txs[tx_id]
        left = super().ack(tx_id, count)
        if left == 0 and tx[1] is not None:  # (its end_lsn: closed)
            self._confirmed = max(self._confirmed, tx[1])
        return left


class _ConfirmsAtCommit(LsnTracker):
    """Confirms a transaction when its commit arrives, before Kafka acked its records."""

    def close(self, tx_id: int, end_lsn: int) -> None:
        super().close(tx_id, end_lsn)
        self._confirmed = max(self._confirmed, end_lsn)


class _ConfirmsKeepalivesWhileInFlight(LsnTracker):
    """Confirms a keepalive's WAL end while records are still in flight."""

    def observe_wal_end(self, lsn: int) -> None:
        super().observe_wal_end(lsn)
        self._confirmed = max(self._confirmed, lsn)


def _machine_fails(tracker: type[LsnTracker]) -> None:
    machine = type(f"Mutant{tracker.__name__}", (TrackerMachine,), {"tracker_cls": tracker})
    with pytest.raises(AssertionError):
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=500,
                stateful_step_count=60,
                deadline=None,
                database=None,
                print_blob=False,
                report_multiple_bugs=False,
                derandomize=True,  # the same search every run: the finding is reproducible
                phases=[Phase.generate],  # detection is the point: no shrinking
            ),
        )


@pytest.mark.parametrize("tracker", [_ConfirmsAtCommit, _ConfirmsKeepalivesWhileInFlight])
def test_the_model_finds_a_tracker_that_confirms_past_an_unacked_record(
    tracker: type[LsnTracker],
) -> None:
    _machine_fails(tracker)


def _two_transactions_acked_out_of_order(tracker: type[LsnTracker]) -> None:
    """Commit A, commit B, Kafka acks B's record first: A's record is still owed."""

    class Scripted(TrackerMachine):
        tracker_cls = tracker

    machine = Scripted()
    checks = [
        machine.confirmable_equals_the_reference_model,
        machine.confirmable_never_decreases,
        machine.confirmable_never_passes_an_open_or_unacked_transaction,
        machine.no_transaction_is_confirmed_before_it_was_delivered_in_some_session,
        machine.counters_match_the_model,
    ]
    steps = [
        lambda: machine.start(100),
        lambda: machine.begin(0),  # A
        lambda: machine.hand_records_to_kafka(1),
        lambda: machine.commit(10),
        lambda: machine.begin(5),  # B
        lambda: machine.hand_records_to_kafka(1),
        lambda: machine.commit(10),
        lambda: machine.kafka_acks_any_record_at(1),  # B's record, before A's
        lambda: machine.kafka_acks_any_record_at(0),
    ]
    for step in steps:
        step()
        for check in checks:
            check()


def test_the_model_catches_the_highest_acked_commit_confirmed_behind_an_unacked_one() -> None:
    """The classic bug (confirm the highest acknowledged commit): the model's
    invariants reject it on the interleaving that exposes it, and accept the real
    tracker on the same one. (A random search finds it too, but only after
    hundreds of examples: this interleaving is the one it needs.)"""
    _two_transactions_acked_out_of_order(LsnTracker)
    with pytest.raises(AssertionError):
        _two_transactions_acked_out_of_order(_ConfirmsTheHighestAckedCommit)
