"""Exactly-once transactions (cdc.relay.delivery.txbatch) against a model of PostgreSQL and Kafka.

The model is the world around the machine: a WAL of committed transactions (each
with 0-3 records), the slot's confirmed LSN, Kafka's read_committed log and
checkpoint, the open Kafka transaction, and one relay session reading the WAL
from the slot, driving :class:`TxBatch` as :mod:`cdc.relay.delivery.exactly_once` does.
Hypothesis interleaves reads (records and dead letters, which wait in the session
until drained into the transaction), commits, time, status updates and the faults: a
failed record (acted on at once, or - a delivery report served in a poll or in the
flush of a due commit - only at the shell's next step, the reading going on
meanwhile), a commit timeout (retriable) and a commit failure, a failing
abort, a broker restart between produce and commit (the open transaction is
lost: its commit fails), a fencing by a newer relay, kill -9 of the relay and
its restart reading the checkpoint. A commit is asynchronous, as in the shell:
it starts (COMMIT) and Kafka answers later (``commit_done``) while the relay
reads on, buffering the next transaction's records - so every fault above also
strikes while the next batch is buffering, and a commit given up on (its
budget spent, a fencing, a kill) may still complete in Kafka
(``late_commit_fault``). After every step:

* the read_committed log holds no record twice;
* a record (a dead letter too) enters only an OPEN transaction: never one that is
  aborting, failed or committing (the one admission rule);
* every WAL transaction at or below the slot's confirmed LSN, and at or below
  the committed checkpoint, has all its records in the read_committed log;
* a commit never happens inside a WAL transaction, and the checkpoint it writes
  never names a transaction whose records are not in that or an earlier one;
* an open Kafka transaction is never older than ``abort_after_ms``; a commit
  (its wait and its retries) lasts less than ``commit_budget_ms``;
* the records buffered during a commit stay within ``buffer_max_records`` and
  ``buffer_max_bytes``, and exist only while a commit is under way;
* a transaction that could commit (its last WAL transaction closed, nothing
  waiting) is never ``max_ms`` old while the relay has read all the WAL there is
  (caught up), nor ``backlog_max_ms`` old while more is there to read (a backlog:
  ``pg_commit`` adds to it, ``read`` takes from it), nor holds ``max_records``;
* and at the end, once the faults stop, every record of the WAL is in the log
  exactly once (nothing lost, nothing twice).

A second run (``OverlapModel``) starts every example with a commit under way and WAL
behind it, so the faults strike while the next batch is buffering far more often
(in 300 examples: ~150 records buffered, ~30 at the bound, ~10 commit failures and
~5 fencings while buffering, ~30 commits aborted at their budget).

Mutants at the bottom re-create the bugs the machine exists to prevent (confirming
what Kafka acknowledged rather than committed; splitting a WAL transaction; a skip
rule one transaction too wide; committing while dead letters wait; a caught-up
relay holding a transaction as long as a backlog's; a backlog's transaction
never committed by age; a record admitted while aborting), each with the
interleaving that shows it (``SCRIPTS``), run on every run against the mutant (the
model fails) and against the real machine (it passes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from cdc.relay.delivery.txbatch import Action, TxBatch, TxLimits, TxState

LIMITS = TxLimits(
    max_records=4,
    max_ms=50,
    backlog_max_ms=150,
    abort_after_ms=400,
    commit_budget_ms=100,
    buffer_max_records=3,
    buffer_max_bytes=60,
)


@dataclass
class WalTx:
    final_lsn: int
    end_lsn: int
    records: list[str]


@dataclass
class Session:
    batch: TxBatch
    #: next WAL transaction to read (index), and records read of the current one
    read_idx: int
    in_tx: bool = False
    read_records: int = 0
    tracker: int = 0
    covered: bool = False
    #: dead letters queued, not yet handed to Kafka (the shell's pending_dlq)
    pending_dlq: list[str] = field(default_factory=list)
    #: records routed while a commit is under way, held for the next transaction
    buffer: list[str] = field(default_factory=list)


@dataclass
class Kafka:
    log: list[str] = field(default_factory=list)
    checkpoint: int | None = None
    pending: list[str] | None = None
    #: the transaction being committed (its records, its checkpoint), while the
    #: relay reads on: the shell's flush and commit_transaction on its own thread
    committing: tuple[list[str], int] | None = None
    #: the broker lost the open transaction (restart between produce and commit)
    doomed: bool = False


class TxBatchModel(RuleBasedStateMachine):
    #: the machine under test (the mutants below replace it)
    batch_cls: type[TxBatch] = TxBatch

    def __init__(self) -> None:
        super().__init__()
        self.wal: list[WalTx] = []
        self.slot_confirmed = 0
        self.kafka = Kafka()
        self.now_ms = 0
        self.sess: Session | None = None
        self.commit_faults: list[bool] = []  # retriable? per coming commit
        self.abort_fails = False
        #: a commit given up on (budget, fenced, kill) completes in Kafka all the same
        self.late_commit = False
        self.next_id = 0
        self.wal_end = 0
        #: records handed to Kafka while the machine was not OPEN (must stay empty)
        self.entered_not_open: list[tuple[str, TxState]] = []
        #: records the machine refused (aborting, failed, fenced): read again later
        self.refused = 0
        self._start()

    # -- the world -------------------------------------------------------------
    def _start(self) -> None:
        """A relay session: the checkpoint read (read_committed), the slot read from its
        confirmed LSN (what an init_transactions aborted is gone)."""
        self.kafka.pending = None
        self.kafka.committing = None
        self.kafka.doomed = False
        batch = self.batch_cls(LIMITS, self.kafka.checkpoint or 0)
        idx = next(
            (i for i, t in enumerate(self.wal) if t.end_lsn > self.slot_confirmed), len(self.wal)
        )
        self.sess = Session(batch=batch, read_idx=idx, tracker=self.slot_confirmed)

    def _do(self, action: Action) -> None:
        """The shell: perform what the machine asked."""
        sess = self.sess
        assert sess is not None
        batch = sess.batch
        while action is not Action.NONE:
            if action is Action.BEGIN:
                assert self.kafka.pending is None and self.kafka.committing is None
                # (the records buffered during the commit go first)
                self.kafka.pending, sess.buffer = sess.buffer, []
                # (the shell asks the machine again at once: the buffered transaction
                # may be due already)
                action = batch.due(
                    self.now_ms, waiting=bool(sess.pending_dlq), behind=self._behind()
                )
            elif action is Action.COMMIT:
                action = self._commit(batch)
            elif action is Action.ABORT:
                self._give_up_commit()
                self.kafka.pending = None
                self.kafka.doomed = False
                sess.buffer.clear()
                action = batch.aborted()
            elif action in (Action.RESTART, Action.EXIT):
                self._end_session()
                return
            else:
                raise AssertionError(action)

    def _end_session(self) -> None:
        """The session ends (EXIT: the process too): its open transaction is lost."""
        self._give_up_commit()
        self.sess = None
        self.kafka.pending = None

    def _give_up_commit(self) -> None:
        """A commit under way is given up on: Kafka may still complete it (late_commit),
        else the next init_transactions aborts it."""
        committing, self.kafka.committing = self.kafka.committing, None
        if committing is not None and self.late_commit and not self.kafka.doomed:
            self.kafka.log.extend(committing[0])
            self.kafka.checkpoint = committing[1]

    def _commit(self, batch: TxBatch) -> Action:
        """COMMIT: the checkpoint produced, the commit starts (it completes in
        ``commit_done`` while the relay reads on); a retry calls commit_transaction
        again on the same transaction."""
        sess = self.sess
        assert sess is not None and batch.candidate is not None
        assert batch.state is TxState.COMMITTING
        if self.kafka.committing is not None:  # (a retry: the reading went on meanwhile)
            assert self.kafka.committing[1] == batch.candidate
            return Action.NONE
        assert not sess.in_tx, "a commit inside a WAL transaction"
        pending = self.kafka.pending
        assert pending is not None
        # the checkpoint never names a transaction whose records are not all in Kafka
        for tx in self.wal:
            if tx.end_lsn <= batch.candidate:
                for rid in tx.records:
                    assert rid in self.kafka.log or rid in pending, (rid, batch.candidate)
        self.kafka.committing = (pending, batch.candidate)
        self.kafka.pending = None
        return Action.NONE

    def _settle(self) -> None:
        """The commit under way ends: Kafka's answer to commit_transaction."""
        sess = self.sess
        assert sess is not None and self.kafka.committing is not None
        batch = sess.batch
        records, checkpoint = self.kafka.committing
        # (the broker lost the transaction, or a record of it failed: it never commits)
        if self.kafka.doomed or batch.state is TxState.ABORTING:
            self.kafka.doomed = False
            self.kafka.committing = None
            self._do(batch.commit_failed(retriable=False, now_ms=self.now_ms))
            return
        if self.commit_faults:
            retriable = self.commit_faults.pop(0)
            self.now_ms += 30  # (a commit timeout takes time)
            self._do(batch.commit_failed(retriable=retriable, now_ms=self.now_ms))
            return
        self.kafka.log.extend(records)
        self.kafka.checkpoint = checkpoint
        self.kafka.committing = None
        self._do(batch.commit_ok())

    def _behind(self) -> bool:
        """More WAL is there to read at once (the shell: the last read turn ended with
        more than it read; it asks the machine at the turn's end, as here)."""
        sess = self.sess
        return sess is not None and (sess.in_tx or sess.read_idx < len(self.wal))

    # -- rules -----------------------------------------------------------------
    @initialize(sizes=st.lists(st.integers(0, 3), min_size=1, max_size=8))
    def backlog(self, sizes: list[int]) -> None:
        """A WAL to read from the first step (most runs would read little otherwise)."""
        for n in sizes:
            self.pg_commit(n)

    @rule(n=st.integers(0, 3))
    def pg_commit(self, n: int) -> None:
        base = 100 * (len(self.wal) + 1)
        ids = [f"e{self.next_id + i}" for i in range(n)]
        self.next_id += n
        self.wal.append(WalTx(base, base + 10, ids))
        self.wal_end = base + 10

    @precondition(lambda self: self.sess is not None)
    @rule(dead=st.booleans(), nbytes=st.integers(0, 40), steps=st.integers(1, 6))
    def read_some(self, dead: bool, nbytes: int, steps: int) -> None:
        """A read turn: up to ``steps`` messages (the first record may be a dead letter)."""
        for i in range(steps):
            if self.sess is None:
                return
            self.read(dead=dead and i == 0, nbytes=nbytes)

    @precondition(lambda self: self.sess is not None and self.kafka.committing is not None)
    @rule(dead=st.booleans(), nbytes=st.integers(0, 40), steps=st.integers(1, 8))
    def read_while_committing(self, dead: bool, nbytes: int, steps: int) -> None:
        """The same while a commit is under way (the overlap: more such turns)."""
        self.read_some(dead, nbytes, steps)

    def read(self, dead: bool = False, nbytes: int = 10) -> None:
        """One message of the WAL: a Begin, a record or a Commit."""
        sess = self.sess
        assert sess is not None
        if sess.read_idx >= len(self.wal):
            return
        tx = self.wal[sess.read_idx]
        batch = sess.batch
        if not sess.in_tx:
            sess.in_tx, sess.read_records = True, 0
            # (the shell's Begin: wal_opened and covered in one call)
            sess.covered = batch.opened(tx.final_lsn)
            return
        if sess.read_records < len(tx.records):
            rid = tx.records[sess.read_records]
            sess.read_records += 1
            if not sess.covered:
                self._read_record(sess, rid, dead=dead, nbytes=nbytes)
            return
        sess.in_tx = False
        sess.read_idx += 1
        sess.tracker = max(sess.tracker, tx.end_lsn)  # (optimistic: delivered at once)
        # (the shell's Commit: wal_closed and due in one call)
        self._do(batch.closed(tx.end_lsn, self.now_ms, bool(sess.pending_dlq), self._behind()))

    def _read_record(self, sess: Session, rid: str, *, dead: bool, nbytes: int) -> None:
        """A record routed: into the open transaction, the buffer, or (dead) pending_dlq;
        refused (aborting, failed, fenced): into nothing, and what is due is done (the
        shell's one guard: the abort, the session's end)."""
        batch = sess.batch
        action = batch.record(self.now_ms, nbytes)
        while action is Action.WAIT:  # the buffer is full: the commit's outcome first
            self._settle()
            if self.sess is None:
                return  # (aborted: the session ends, the record is read again)
            action = batch.record(self.now_ms, nbytes)
        if action is Action.REFUSE:
            self.refused += 1
            self._do(batch.due(self.now_ms, waiting=bool(sess.pending_dlq), behind=self._behind()))
            return
        if dead:  # a dead letter: queued now, handed to Kafka later (never while a
            # commit is under way: the shell drains them into an open transaction)
            sess.pending_dlq.append(rid)
        elif action is Action.BUFFER:
            sess.buffer.append(rid)
            return
        if action is not Action.BUFFER:
            self._do(action)
        if not dead:
            self._enter(batch, rid)

    def _enter(self, batch: TxBatch, rid: str) -> None:
        """``rid`` handed to Kafka, into the open transaction; one handed over while the
        machine is not OPEN (aborting, failed, committing) is noted for the invariant."""
        if batch.state is not TxState.OPEN:
            self.entered_not_open.append((rid, batch.state))
        assert self.kafka.pending is not None
        self.kafka.pending.append(rid)

    @precondition(lambda self: self.sess is not None and self.sess.pending_dlq)
    @rule()
    def drain_dlq(self) -> None:
        sess = self.sess
        assert sess is not None
        if sess.batch.admits:  # (the shell's guard: into an OPEN transaction only)
            for rid in sess.pending_dlq:
                self._enter(sess.batch, rid)
            sess.pending_dlq.clear()
            # (the shell's next loop turn asks the machine first: _poll)
            self._do(sess.batch.due(self.now_ms, behind=self._behind()))

    @precondition(lambda self: self.sess is not None and self.kafka.committing is not None)
    @rule()
    def commit_done(self) -> None:
        """Kafka answers the commit under way (the shell's next loop turn sees it)."""
        self._settle()

    @rule()
    def late_commit_fault(self) -> None:
        self.late_commit = True

    @precondition(lambda self: self.sess is not None)
    @rule(ms=st.one_of(st.integers(1, 200), st.sampled_from([LIMITS.max_ms, 60, 120])))
    def tick(self, ms: int) -> None:
        self.now_ms += ms
        sess = self.sess
        assert sess is not None
        self._do(sess.batch.due(self.now_ms, waiting=bool(sess.pending_dlq), behind=self._behind()))

    @precondition(lambda self: self.sess is not None)
    @rule()
    def keepalive(self) -> None:
        """The server's WAL end, read once every transaction before it was read."""
        sess = self.sess
        assert sess is not None
        if sess.read_idx == len(self.wal) and not sess.in_tx:
            sess.tracker = max(sess.tracker, self.wal_end + 5)

    @precondition(lambda self: self.sess is not None)
    @rule()
    def status(self) -> None:
        sess = self.sess
        assert sess is not None
        self.slot_confirmed = max(self.slot_confirmed, sess.batch.confirm_bound(sess.tracker))

    @precondition(
        lambda self: (
            self.sess is not None and self.sess.batch.state in (TxState.OPEN, TxState.COMMITTING)
        )
    )
    @rule()
    def produce_error(self) -> None:
        assert self.sess is not None
        self._do(self.sess.batch.failed())

    @precondition(
        lambda self: (
            self.sess is not None and self.sess.batch.state in (TxState.OPEN, TxState.COMMITTING)
        )
    )
    @rule()
    def report_failure(self) -> None:
        """A record's delivery failure reported where the shell does not act on the
        machine's answer (a delivery report served in a poll, or in the flush of a
        caught-up relay's due commit): the transaction cannot commit; the reading goes
        on until the shell's next step asks the machine."""
        assert self.sess is not None
        self.sess.batch.failed()
        self.sess.buffer.clear()  # (thrown away with the transaction: never produced)
        if self.kafka.pending is not None or self.kafka.committing is not None:
            self.kafka.doomed = True

    @rule(retriable=st.booleans())
    def commit_fault(self, retriable: bool) -> None:
        self.commit_faults.append(retriable)

    @rule()
    def abort_fault(self) -> None:
        self.abort_fails = True  # (an abort that fails ends the session the same way)

    @rule()
    def broker_restart(self) -> None:
        if self.kafka.pending is not None or self.kafka.committing is not None:
            self.kafka.doomed = True

    @precondition(lambda self: self.sess is not None)
    @rule()
    def fenced(self) -> None:
        assert self.sess is not None
        self._do(self.sess.batch.fenced())

    @precondition(lambda self: self.sess is not None)
    @rule()
    def kill9(self) -> None:
        self._end_session()  # (the next init_transactions aborts it, or it committed)

    @precondition(lambda self: self.sess is None)
    @rule()
    def relay_restart(self) -> None:
        self._start()

    # -- invariants ------------------------------------------------------------
    @invariant()
    def nothing_twice(self) -> None:
        assert len(self.kafka.log) == len(set(self.kafka.log)), self.kafka.log

    @invariant()
    def confirmed_and_checkpointed_are_in_kafka(self) -> None:
        bound = max(self.slot_confirmed, self.kafka.checkpoint or 0)
        logged = set(self.kafka.log)
        for tx in self.wal:
            if tx.end_lsn <= bound:
                assert set(tx.records) <= logged, (tx, bound)

    @invariant()
    def no_record_enters_a_transaction_not_open(self) -> None:
        """The one admission rule: a record (a dead letter too) is handed to Kafka only
        into an OPEN transaction - never while it aborts, failed, or commits (there it
        is buffered)."""
        assert not self.entered_not_open, self.entered_not_open

    @invariant()
    def waits_are_bounded(self) -> None:
        sess = self.sess
        if sess is not None and sess.batch.state is TxState.OPEN:
            assert self.now_ms - sess.batch.opened_ms < LIMITS.abort_after_ms

    @invariant()
    def the_buffer_is_bounded(self) -> None:
        """Records held during a commit: within both bounds, and only while committing."""
        sess = self.sess
        if sess is None:
            return
        batch = sess.batch
        assert batch.buffered <= LIMITS.buffer_max_records
        assert batch.buffered_bytes <= LIMITS.buffer_max_bytes
        assert len(sess.buffer) <= batch.buffered  # (a buffered dead letter waits in pending_dlq)
        if batch.state is not TxState.COMMITTING:
            assert batch.buffered == 0 and batch.buffered_bytes == 0

    @invariant()
    def a_commit_is_bounded(self) -> None:
        """A commit (acknowledgements and commit_transaction, retries) ends within its budget."""
        sess = self.sess
        if sess is not None and sess.batch.state is TxState.COMMITTING:
            assert self.now_ms - sess.batch.commit_started_ms < LIMITS.commit_budget_ms

    @invariant()
    def commits_in_time(self) -> None:
        """A transaction that could commit is committed at its bounds: ``max_ms`` when
        caught up (the latency a read_committed consumer sees), ``backlog_max_ms``
        while behind, ``max_records`` always."""
        sess = self.sess
        if sess is None or sess.batch.state is not TxState.OPEN:
            return
        batch = sess.batch
        if batch.wal_open or sess.pending_dlq or batch.candidate is None:
            return
        bound_ms = LIMITS.backlog_max_ms if self._behind() else LIMITS.max_ms
        assert self.now_ms - batch.opened_ms < bound_ms, (self._behind(), batch.opened_ms)
        assert batch.records < LIMITS.max_records

    @invariant()
    def a_record_in_open_only_counts(self) -> None:
        """In OPEN, record() adds one to ``records`` and answers NONE - nothing else (the
        relay's record step writes that case out, without the call:
        cdc.relay.delivery.eos_steps.EosSteps.record)."""
        sess = self.sess
        if sess is None or sess.batch.state is not TxState.OPEN:
            return
        batch = sess.batch
        assert _record_on_a_twin(batch, self.now_ms + 1, 100) == (
            Action.NONE,
            _changes(batch, records=batch.records + 1),
        )

    @invariant()
    def a_record_buffered_behind_the_first_only_counts(self) -> None:
        """While a commit is under way with records buffered already, record() of one
        the buffer has room for adds one to ``buffered`` and its bytes to
        ``buffered_bytes`` and answers BUFFER - nothing else (the record step writes
        that case out too, without the call or the clock; the buffer's first record
        and one at a bound ask the machine)."""
        sess = self.sess
        if sess is None or sess.batch.state is not TxState.COMMITTING:
            return
        batch = sess.batch
        if not 0 < batch.buffered < LIMITS.buffer_max_records:
            return
        room = LIMITS.buffer_max_bytes - batch.buffered_bytes
        for nbytes in {0, min(7, room), room}:  # (no more than the room: that is WAIT)
            assert _record_on_a_twin(batch, self.now_ms + 1, nbytes) == (
                Action.BUFFER,
                _changes(
                    batch,
                    buffered=batch.buffered + 1,
                    buffered_bytes=batch.buffered_bytes + nbytes,
                ),
            )

    def teardown(self) -> None:
        """Faults stop; the relay runs until it has read everything: every record once."""
        self.commit_faults.clear()
        self.kafka.doomed = False
        for _ in range(10 * (len(self.wal) + 5)):
            if self.sess is None:
                self._start()
            sess = self.sess
            assert sess is not None
            if self.kafka.committing is not None:
                self._settle()
            elif sess.read_idx == len(self.wal) and not sess.in_tx:
                if sess.batch.state is TxState.IDLE:
                    break
                self.drain_dlq() if sess.pending_dlq else None
                self.now_ms += LIMITS.max_ms
                self._do(sess.batch.due(self.now_ms, waiting=bool(sess.pending_dlq)))
            else:
                self.read()
        all_ids = [rid for tx in self.wal for rid in tx.records]
        assert sorted(self.kafka.log) == sorted(all_ids)


def _record_on_a_twin(batch: TxBatch, now_ms: int, nbytes: int) -> tuple[Action, dict[str, object]]:
    """record() asked of a copy of ``batch``: its answer, and the slots it changed (with
    their new values; any slot, whether ``batch``'s value was set again or not)."""
    twin = TxBatch(batch.limits, 0)
    for slot in TxBatch.__slots__:
        setattr(twin, slot, getattr(batch, slot))
    action = twin.record(now_ms, nbytes)
    changed = {
        slot: getattr(twin, slot)
        for slot in TxBatch.__slots__
        if getattr(twin, slot) != getattr(batch, slot)
    }
    return action, changed


def _changes(batch: TxBatch, **after: object) -> dict[str, object]:
    """The slots of ``after`` whose values differ from ``batch``'s."""
    return {slot: value for slot, value in after.items() if getattr(batch, slot) != value}


TestTxBatchModel = TxBatchModel.TestCase
TestTxBatchModel.settings = settings(
    max_examples=500,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class OverlapModel(TxBatchModel):
    """The same world, every run starting with a commit under way and WAL to read
    behind it: the faults strike while the next batch is buffering far more often."""

    @initialize(sizes=st.lists(st.integers(0, 3), min_size=2, max_size=8))
    def backlog(self, sizes: list[int]) -> None:
        for n in [1, *sizes]:
            self.pg_commit(n)
        for _ in range(3):  # Begin, the record, Commit of the first
            self.read()
        self.tick(LIMITS.backlog_max_ms)  # (behind: WAL waits to be read)
        assert self.kafka.committing is not None


TestOverlapModel = OverlapModel.TestCase
TestOverlapModel.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_a_commit_is_never_due_inside_a_wal_transaction() -> None:
    batch = TxBatch(LIMITS, 0)
    batch.wal_opened()
    assert batch.record(0) is Action.BEGIN
    for _ in range(10):
        batch.record(0)
    assert batch.due(LIMITS.max_ms * 2) is Action.NONE  # (records past max: still whole)
    batch.wal_closed(110)
    assert batch.due(LIMITS.max_ms * 2) is Action.COMMIT


def test_an_open_transaction_past_abort_after_is_aborted_even_inside_a_wal_transaction() -> None:
    batch = TxBatch(LIMITS, 0)
    batch.wal_opened()
    batch.record(0)
    assert batch.due(LIMITS.abort_after_ms) is Action.ABORT
    assert batch.aborted() is Action.RESTART
    assert batch.due(LIMITS.abort_after_ms) is Action.RESTART


def test_the_confirm_bound_holds_at_the_committed_checkpoint_until_idle() -> None:
    batch = TxBatch(LIMITS, 50)
    batch.wal_opened()
    batch.record(0)
    batch.wal_closed(210)
    assert batch.confirm_bound(300) == 50
    assert batch.due(LIMITS.max_ms) is Action.COMMIT
    assert batch.confirm_bound(300) == 50
    batch.commit_ok()
    assert batch.committed == 210
    assert batch.confirm_bound(300) == 300  # (idle: the tracker's answer, e.g. a WAL end)


def test_a_retriable_commit_failure_is_retried_within_its_budget_then_aborted() -> None:
    batch = TxBatch(LIMITS, 0)
    batch.wal_opened()
    batch.record(0)
    batch.wal_closed(110)
    assert batch.due(LIMITS.max_ms) is Action.COMMIT
    assert batch.commit_failed(retriable=True, now_ms=LIMITS.max_ms + 1) is Action.COMMIT
    at = LIMITS.max_ms + LIMITS.commit_budget_ms
    assert batch.commit_failed(retriable=True, now_ms=at) is Action.ABORT


def test_covered_is_strictly_below_the_checkpoint() -> None:
    batch = TxBatch(LIMITS, 210)
    assert batch.covered(200)
    assert not batch.covered(210)  # (a transaction may commit right at the last one's end)


@pytest.mark.parametrize("bad", [0, -1])
def test_limits_must_be_positive(bad: int) -> None:
    with pytest.raises(ValueError):
        TxLimits(max_records=bad, max_ms=1, backlog_max_ms=1, abort_after_ms=1, commit_budget_ms=1)


def test_the_backlog_bound_is_at_least_max_ms() -> None:
    with pytest.raises(ValueError):
        TxLimits(max_records=1, max_ms=50, backlog_max_ms=49, abort_after_ms=1, commit_budget_ms=1)


def test_behind_a_transaction_grows_to_the_backlog_bound_caught_up_to_max_ms() -> None:
    batch = TxBatch(LIMITS, 0)
    batch.wal_opened()
    batch.record(0)
    batch.wal_closed(110)
    assert batch.due(LIMITS.max_ms, behind=True) is Action.NONE
    assert batch.due(LIMITS.backlog_max_ms - 1, behind=True) is Action.NONE
    assert batch.due(LIMITS.backlog_max_ms - 1) is Action.COMMIT  # (caught up: max_ms)
    batch.commit_ok()
    batch.wal_opened()
    batch.record(200)
    batch.wal_closed(310)
    assert batch.due(200 + LIMITS.backlog_max_ms, behind=True) is Action.COMMIT


@st.composite
def _steps(draw: st.DrawFn) -> list[tuple[str, int, bool, bool]]:
    """Events of a machine's life: (event, a time or an LSN, waiting, behind)."""
    names = ["open", "record", "close", "due", "ok", "failed", "commit_failed", "aborted"]
    return draw(
        st.lists(
            st.tuples(
                st.sampled_from(names),
                st.integers(0, 1_000),
                st.booleans(),
                st.booleans(),
            ),
            max_size=60,
        )
    )


def _play(batch: TxBatch, steps: list[tuple[str, int, bool, bool]], fused: bool) -> list[object]:
    """Drive ``batch`` (Begin and Commit through the fused calls, or their two steps);
    what each step answered, and the machine's state after each."""
    out: list[object] = []
    lsn = 1_000
    for name, n, waiting, behind in steps:
        try:
            if name == "open":
                lsn += 100
                if not fused:
                    batch.wal_opened()
                answer: object = batch.opened(n * 10) if fused else batch.covered(n * 10)
            elif name == "record":
                answer = batch.record(n, n % 50)
            elif name == "close":
                if not fused:
                    batch.wal_closed(lsn)
                answer = (
                    batch.closed(lsn, n, waiting, behind)
                    if fused
                    else batch.due(n, waiting, behind)
                )
            elif name == "due":
                answer = batch.due(n, waiting, behind)
            elif name == "ok":
                answer = batch.commit_ok()
            elif name == "failed":
                answer = batch.failed()
            elif name == "commit_failed":
                answer = batch.commit_failed(retriable=waiting, now_ms=n)
            else:
                answer = batch.aborted()
        except ValueError as exc:
            answer = str(exc)
        out.append((answer, *(getattr(batch, slot) for slot in TxBatch.__slots__)))
    return out


@settings(max_examples=400, deadline=None)
@given(steps=_steps(), checkpoint=st.integers(0, 5_000))
def test_the_fused_begin_and_commit_calls_are_their_two_steps(
    steps: list[tuple[str, int, bool, bool]], checkpoint: int
) -> None:
    """opened() is wal_opened() then covered(), closed() is wal_closed() then due(): the
    same answers and the same machine after any sequence of events."""
    fused = _play(TxBatch(LIMITS, checkpoint), steps, fused=True)
    assert fused == _play(TxBatch(LIMITS, checkpoint), steps, fused=False)


# -- mutants: the bugs this model exists for, each caught -----------------------------


class _Mutant(TxBatch):
    """A mutant's Begin and Commit are its two steps (the fused calls of the real
    machine are checked against them above): a mutant of ``due``, ``covered`` or
    ``wal_closed`` is met on every path."""

    __slots__ = ()

    def opened(self, final_lsn: int) -> bool:
        self.wal_opened()
        return self.covered(final_lsn)

    def closed(self, end_lsn: int, now_ms: int, waiting: bool, behind: bool) -> Action:
        self.wal_closed(end_lsn)
        return self.due(now_ms, waiting=waiting, behind=behind)


class _ConfirmsPastTheCheckpoint(_Mutant):
    """Confirms what Kafka acknowledged, not what it committed."""

    __slots__ = ()

    def confirm_bound(self, confirmable: int) -> int:
        return confirmable


class _CommitsInsideAWalTransaction(_Mutant):
    """Commits at the record bound even inside a WAL transaction (a split without a
    position inside it in the checkpoint)."""

    __slots__ = ()

    def due(self, now_ms: int, *, waiting: bool = False, behind: bool = False) -> Action:
        if self.state is TxState.OPEN and self.records >= self.limits.max_records:
            self.candidate = self.candidate or 1
            self.state = TxState.COMMITTING
            self.commit_started_ms = now_ms
            return Action.COMMIT
        return super().due(now_ms, waiting=waiting, behind=behind)


class _SkipsTheCheckpointsOwnSuccessor(_Mutant):
    """Skips a transaction committed right at the checkpoint (<= instead of <)."""

    __slots__ = ()

    def covered(self, final_lsn: int) -> bool:
        return final_lsn <= self.skip_below + 100


class _CommitsWhileDeadLettersWait(_Mutant):
    """Commits while dead letters of the transaction are not handed to Kafka yet."""

    __slots__ = ()

    def due(self, now_ms: int, *, waiting: bool = False, behind: bool = False) -> Action:
        return super().due(now_ms, behind=behind)


class _HoldsACaughtUpTransactionAsLongAsABacklogs(_Mutant):
    """Takes every read as a backlog: a caught-up relay's records wait backlog_max_ms."""

    __slots__ = ()

    def due(self, now_ms: int, *, waiting: bool = False, behind: bool = False) -> Action:
        return super().due(now_ms, waiting=waiting, behind=True)


class _NeverCommitsABacklogByAge(_Mutant):
    """Behind, commits only at max_records: a slow backlog's transaction waits for the
    abort."""

    __slots__ = ()

    def due(self, now_ms: int, *, waiting: bool = False, behind: bool = False) -> Action:
        if behind and self.state is TxState.OPEN:
            if now_ms - self.opened_ms >= self.limits.abort_after_ms:
                return super().due(now_ms, waiting=waiting, behind=behind)
            if self.records < self.limits.max_records:
                return Action.NONE
        return super().due(now_ms, waiting=waiting, behind=behind)


class _BuffersPastItsBound(_Mutant):
    """Buffers every record read during a commit: memory grows with the commit's wait."""

    __slots__ = ()

    def record(self, now_ms: int, nbytes: int = 0) -> Action:
        if self.state is TxState.COMMITTING:
            self.buffered += 1
            self.buffered_bytes += nbytes
            return Action.BUFFER
        return super().record(now_ms, nbytes)


class _MovesTheCommittingCheckpoint(_Mutant):
    """A WAL transaction closed while buffering moves the candidate of the transaction
    being committed (whose checkpoint record is already written): ``committed`` then
    names a position Kafka does not hold, and the slot is confirmed past it."""

    __slots__ = ()

    def wal_closed(self, end_lsn: int) -> None:
        self.wal_open = False
        if self.state in (TxState.OPEN, TxState.COMMITTING):
            self.candidate = end_lsn
        if self.state is TxState.COMMITTING and self.buffered:
            self.next_candidate = end_lsn


class _WaitsForACommitWithoutBound(_Mutant):
    """Waits for a commit as long as it takes (no budget while committing)."""

    __slots__ = ()

    def due(self, now_ms: int, *, waiting: bool = False, behind: bool = False) -> Action:
        if self.state is TxState.COMMITTING:
            return Action.NONE
        return super().due(now_ms, waiting=waiting, behind=behind)


class _AdmitsWhileAborting(_Mutant):
    """Takes a record into a transaction that is aborting (the relay's old crash:
    a delivery failure during the flush, then the next insert)."""

    __slots__ = ()

    def record(self, now_ms: int, nbytes: int = 0) -> Action:
        if self.state is TxState.ABORTING:
            self.records += 1
            return Action.NONE
        return super().record(now_ms, nbytes)


def _check(model: TxBatchModel) -> None:
    model.nothing_twice()
    model.no_record_enters_a_transaction_not_open()
    model.confirmed_and_checkpointed_are_in_kafka()
    model.waits_are_bounded()
    model.commits_in_time()
    model.the_buffer_is_bounded()
    model.a_commit_is_bounded()
    model.a_record_in_open_only_counts()
    model.a_record_buffered_behind_the_first_only_counts()


#: Per mutant, the interleaving that shows its bug (steps: rule name and arguments); the
#: model's invariants (or its teardown: every record once) must fail on it.
SCRIPTS: dict[type[TxBatch], list[tuple[str, dict[str, object]]]] = {
    _ConfirmsPastTheCheckpoint: [
        ("pg_commit", {"n": 2}),
        *[("read", {})] * 4,
        ("status", {}),
    ],
    _CommitsInsideAWalTransaction: [
        ("pg_commit", {"n": 6}),
        *[("read", {})] * 5,
        ("tick", {"ms": 1}),
    ],
    _SkipsTheCheckpointsOwnSuccessor: [
        ("pg_commit", {"n": 1}),
        ("pg_commit", {"n": 1}),
        *[("read", {})] * 3,
        ("tick", {"ms": 60}),
        ("kill9", {}),
        ("relay_restart", {}),
    ],
    _CommitsWhileDeadLettersWait: [
        ("pg_commit", {"n": 1}),
        ("read", {}),
        ("read", {"dead": True}),
        ("read", {}),
        ("tick", {"ms": 60}),
    ],
    _HoldsACaughtUpTransactionAsLongAsABacklogs: [
        ("pg_commit", {"n": 1}),
        *[("read", {})] * 3,
        ("tick", {"ms": 60}),
    ],
    _BuffersPastItsBound: [
        ("pg_commit", {"n": 1}),
        *[("read", {})] * 3,
        ("tick", {"ms": 60}),
        ("pg_commit", {"n": 3}),
        ("pg_commit", {"n": 1}),
        *[("read", {})] * 7,
    ],
    _MovesTheCommittingCheckpoint: [
        ("pg_commit", {"n": 1}),
        *[("read", {})] * 3,
        ("tick", {"ms": 60}),
        ("pg_commit", {"n": 1}),
        *[("read", {})] * 3,
        ("commit_done", {}),
        ("status", {}),
        ("kill9", {}),
        ("relay_restart", {}),
    ],
    _WaitsForACommitWithoutBound: [
        ("pg_commit", {"n": 1}),
        *[("read", {})] * 3,
        ("tick", {"ms": 60}),
        ("tick", {"ms": 200}),
    ],
    _AdmitsWhileAborting: [
        ("pg_commit", {"n": 3}),
        *[("read", {})] * 2,  # Begin, the first record: OPEN
        ("report_failure", {}),  # (served in a poll: the reading goes on)
        ("read", {}),  # the second record
    ],
    _NeverCommitsABacklogByAge: [
        ("pg_commit", {"n": 1}),
        ("pg_commit", {"n": 1}),
        *[("read", {})] * 3,
        ("tick", {"ms": 160}),
    ],
}


@pytest.mark.parametrize("mutant", list(SCRIPTS), ids=lambda m: m.__name__.strip("_"))
def test_the_model_catches_the_mutant(mutant: type[TxBatch]) -> None:
    class Mutated(TxBatchModel):
        batch_cls = mutant

    model = Mutated()
    with pytest.raises(AssertionError):
        for name, kwargs in SCRIPTS[mutant]:
            getattr(model, name)(**kwargs)
            _check(model)
        model.teardown()


@pytest.mark.parametrize("script", list(SCRIPTS.values()), ids=lambda _: "script")
def test_the_real_machine_passes_every_mutants_script(
    script: list[tuple[str, dict[str, object]]],
) -> None:
    model = TxBatchModel()
    for name, kwargs in script:
        getattr(model, name)(**kwargs)
        _check(model)
    model.teardown()


#: The overlap's faults, each while the next transaction's records are buffered
#: (the stateful run reaches them too, less often: a script per edge, checked after
#: every step and at teardown - every record once).
_BUFFERING = [
    ("pg_commit", {"n": 1}),
    *[("read", {})] * 3,
    ("tick", {"ms": 60}),  # COMMIT of the first: under way
    ("pg_commit", {"n": 2}),
    *[("read", {})] * 3,  # Begin and two records: buffered
]
OVERLAP_SCRIPTS: dict[str, list[tuple[str, dict[str, object]]]] = {
    "commit_ok_opens_the_buffered_transaction": [*_BUFFERING, ("commit_done", {})],
    "a_commit_failing_while_buffering_aborts_and_reads_again": [
        ("commit_fault", {"retriable": False}),
        *_BUFFERING,
        ("commit_done", {}),
        ("relay_restart", {}),
    ],
    "a_retriable_failure_retries_while_the_reading_goes_on": [
        ("commit_fault", {"retriable": True}),
        *_BUFFERING,
        ("commit_done", {}),
        ("read", {}),  # the buffered WAL transaction's Commit, during the retry
        ("commit_done", {}),
    ],
    "the_broker_losing_the_committing_transaction": [
        *_BUFFERING,
        ("broker_restart", {}),
        ("commit_done", {}),
        ("relay_restart", {}),
    ],
    "fenced_while_buffering": [*_BUFFERING, ("fenced", {}), ("relay_restart", {})],
    "fenced_while_buffering_after_kafka_committed": [
        ("late_commit_fault", {}),
        *_BUFFERING,
        ("fenced", {}),
        ("relay_restart", {}),
    ],
    "kill_9_while_buffering": [*_BUFFERING, ("kill9", {}), ("relay_restart", {})],
    "kill_9_while_buffering_after_kafka_committed": [
        ("late_commit_fault", {}),
        *_BUFFERING,
        ("status", {}),
        ("kill9", {}),
        ("relay_restart", {}),
    ],
    "a_commit_past_its_budget_is_given_up_with_its_buffer": [
        ("late_commit_fault", {}),
        *_BUFFERING,
        ("tick", {"ms": LIMITS.commit_budget_ms}),
        ("relay_restart", {}),
    ],
    "a_delivery_failure_during_the_flush_aborts_and_reads_again": [
        *_BUFFERING,
        ("report_failure", {}),  # (the flush at due: the commit cannot succeed)
        ("pg_commit", {"n": 1}),
        ("read_some", {"dead": False, "nbytes": 10, "steps": 4}),  # refused: aborted
        ("relay_restart", {}),
    ],
    "the_buffer_full_by_records_waits_for_the_commit": [
        *_BUFFERING,
        ("pg_commit", {"n": 3}),
        *[("read", {})] * 5,
    ],
    "the_buffer_full_by_bytes_waits_for_the_commit": [
        *_BUFFERING,
        ("pg_commit", {"n": 1}),
        ("read", {}),
        ("read", {"nbytes": 45}),
    ],
    "a_dead_letter_read_while_buffering_waits_for_the_next_transaction": [
        *_BUFFERING,
        ("pg_commit", {"n": 1}),
        ("read", {}),  # the Commit of the buffered WAL transaction
        ("read", {}),  # Begin
        ("read", {"dead": True}),  # the record: a dead letter, counted in the buffer
        ("read", {}),  # Commit
        ("drain_dlq", {}),  # (nothing open: it stays queued)
        ("commit_done", {}),
        ("drain_dlq", {}),
        ("tick", {"ms": 60}),
        ("commit_done", {}),
    ],
}


@pytest.mark.parametrize("name", list(OVERLAP_SCRIPTS))
def test_the_overlap_keeps_every_record_once(name: str) -> None:
    model = TxBatchModel()
    seen_buffer = False
    for step, kwargs in OVERLAP_SCRIPTS[name]:
        getattr(model, step)(**kwargs)
        _check(model)
        seen_buffer = seen_buffer or bool(model.sess and model.sess.batch.buffered)
    assert seen_buffer, "the script never buffered"
    model.teardown()


def test_a_record_past_the_buffers_bounds_waits_and_counts_nothing() -> None:
    batch = TxBatch(LIMITS, 0)
    batch.wal_opened()
    batch.record(0)
    batch.wal_closed(110)
    assert batch.due(LIMITS.max_ms) is Action.COMMIT
    batch.wal_opened()
    assert batch.record(60, 50) is Action.BUFFER
    assert batch.record(61, 11) is Action.WAIT  # (bytes: 50 + 11 > 60)
    assert batch.record(61, 10) is Action.BUFFER
    assert batch.record(62, 0) is Action.BUFFER
    assert batch.record(63, 0) is Action.WAIT  # (records: 3)
    assert (batch.buffered, batch.buffered_bytes) == (3, 60)
    assert batch.flush(63) is Action.WAIT  # (shutdown: the commit's outcome first)
    assert batch.confirm_bound(500) == 0
    assert batch.commit_ok() is Action.BEGIN
    assert batch.state is TxState.OPEN and batch.records == 3 and batch.opened_ms == 60
    assert batch.candidate is None  # (its WAL transaction is still open)
    assert batch.committed == 110 and batch.confirm_bound(500) == 110
    batch.wal_closed(210)
    assert batch.flush(64) is Action.COMMIT


def test_a_failure_the_shell_learnt_of_later_refuses_records_and_makes_the_abort_due() -> None:
    """A delivery failure reported in a poll or the commit's flush (failed(), its answer
    not acted on): every record is refused - counted nowhere - and the abort is what
    due(), closed() and a shutdown's flush() answer, until it is done."""
    batch = TxBatch(LIMITS, 0)
    batch.wal_opened()
    assert batch.record(0) is Action.BEGIN
    batch.failed()
    assert batch.state is TxState.ABORTING and not batch.admits
    records = batch.records
    assert batch.record(1, 10) is Action.REFUSE and batch.records == records
    assert batch.due(2) is Action.ABORT
    assert batch.closed(110, 3, False, False) is Action.ABORT
    assert batch.flush(4) is Action.ABORT
    assert batch.aborted() is Action.RESTART
    assert batch.record(5) is Action.REFUSE and batch.due(5) is Action.RESTART
    batch.fenced()
    assert batch.record(6) is Action.REFUSE and batch.due(6) is Action.EXIT
