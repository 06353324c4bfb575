"""Exactly-once publishing's Kafka transactions, as a pure state machine (no I/O).

The relay in ``CDC_DELIVERY=exactly-once`` mode (:mod:`cdc.relay.delivery.exactly_once`)
tells this machine what happened - a WAL transaction opened or closed, a record
handed to Kafka, time passed, a commit or abort finished or failed, the producer
was fenced - and does what :meth:`TxBatch.due` and the events answer
(:class:`Action`). Guarantees, checked after every step by the model test
(``tests/unit/test_txbatch_model.py``):

* **a WAL transaction stays whole inside one Kafka transaction**: a commit is
  never due while a WAL transaction is open. (Splitting one would need the
  checkpoint to name a position inside it - an LSN plus a record index - and
  a restart to skip part of a transaction it reads again: possible, but a
  second skip rule for a rare case; a large WAL transaction makes one large
  Kafka transaction instead, bounded by ``transaction.timeout.ms``.)
* **the checkpoint never runs ahead of the records**: the checkpoint a commit
  writes (:attr:`TxBatch.candidate`) is the commit end-LSN of the last WAL
  transaction *closed* inside the open Kafka transaction; every record of it,
  and of every earlier WAL transaction, was handed to Kafka in this or an
  earlier transaction, and :attr:`committed` moves to it only on
  :meth:`commit_ok`.
* **the LSN confirmed to PostgreSQL never passes the last committed
  checkpoint** while a Kafka transaction is open, committing, aborting or
  failed (:meth:`confirm_bound`). Only with no Kafka transaction at all
  (IDLE: everything read so far was committed or skipped) may the tracker's
  own answer - an idle outbox's WAL end - be confirmed.
* **a restart skips what a committed transaction holds**: :meth:`covered` is
  true exactly for WAL transactions whose commit LSN lies below the
  checkpoint read at start (``final_lsn < checkpoint``: a later transaction's
  commit record starts at or after an earlier one's end).
* **a caught-up relay commits within** ``max_ms``: once a due commit is
  possible (its last WAL transaction closed, nothing waiting), a transaction
  ``max_ms`` old is committed at the next :meth:`due` that is not ``behind``;
  while the relay reads a backlog (``behind``: more WAL was already there to
  read) it grows until ``max_records`` or ``backlog_max_ms``, whichever first -
  its events are older than ``max_ms`` already, and fewer commits drain the
  backlog faster (each costs round trips and markers in every partition).
* **every wait is bounded**: a Kafka transaction open for
  ``abort_after_ms`` (the transaction timeout less the commit budget) is
  aborted - the broker would abort it anyway; a commit that keeps failing
  retriably is retried until ``commit_budget_ms`` after it started, then
  aborted; after an abort (done or failed) the session ends (FAILED) and the
  next one starts from the slot and the checkpoint.
* **fenced is final**: once fenced, nothing else is done; the relay exits.
* **one admission rule**: a record enters a Kafka transaction only when it is
  OPEN (:meth:`record` answers NONE, or BEGIN for a new one); while a commit is
  under way it is buffered for the next one (BUFFER, WAIT at the bound); while
  the transaction is aborting, failed or fenced it enters none
  (:data:`Action.REFUSE`: not produced, not counted - its WAL transaction is
  read again by the next session, from the slot and the checkpoint). A
  failure reported while the shell is not acting on the machine (a delivery
  report served during the commit's flush, a poll) makes it ABORTING; the
  abort is then due (:meth:`due` answers ABORT) at the shell's next step. Every
  path that hands a record to Kafka - the stream's records, the records
  buffered during a commit, dead letters - asks :meth:`record` when the record
  is read, and, for what was counted earlier and handed over later (the
  buffer's records, dead letters), :attr:`admits` right before.
* **the commit overlaps the reading, within a bound**: while a commit is under
  way (COMMITTING: the transaction's records are being acknowledged, then
  ``commit_transaction`` runs), the relay keeps reading; the records it routes
  meanwhile are *buffered* for the next transaction (:data:`Action.BUFFER`:
  librdkafka takes no record into a new transaction before the commit
  returns), at most ``buffer_max_records`` records and ``buffer_max_bytes``
  bytes - a record that would pass either bound is answered
  :data:`Action.WAIT` (the shell waits for the commit's outcome, bounded by
  the commit budget, and asks again). The buffer exists only while COMMITTING;
  a commit that succeeds opens the next transaction with it
  (:meth:`commit_ok` answers BEGIN: its age counts from its first buffered
  record, its checkpoint candidate is the last WAL transaction closed in it);
  an abort, a fencing or a kill throws it away - its records were never handed
  to Kafka, and the session that reads them again starts from the slot and the
  checkpoint. The commit's whole wait (acknowledgements and
  ``commit_transaction``, retries included) is bounded: :meth:`due` aborts a
  commit ``commit_budget_ms`` old.

States and transitions::

    IDLE --record (BEGIN)--> OPEN --due: closed WAL tx, nothing waiting, and
                                     (records >= max or age >= max_ms, or
                                     age >= backlog_max_ms while behind)
                                     (COMMIT)--> COMMITTING --ok--> IDLE
    OPEN --shutdown: flush (COMMIT when due-able, else ABORT)
    COMMITTING --record (BUFFER: held for the next transaction; WAIT at the bound)
    COMMITTING --ok, nothing buffered--> IDLE;  --ok, records buffered (BEGIN)--> OPEN
    COMMITTING --retriable failure, within budget (COMMIT)--> COMMITTING
    COMMITTING --commit_budget_ms since it started (ABORT)--> ABORTING
    COMMITTING --other failure, or budget spent (ABORT)--> ABORTING
    OPEN --age >= abort_after_ms, or a failed record (ABORT)--> ABORTING
    ABORTING / FAILED / FENCED --record (REFUSE: enters no transaction)
    ABORTING --due (ABORT: a failure the shell did not act on at once)
    ABORTING --aborted / abort failed--> FAILED   (the session ends: RESTART; the
                                                   buffer is thrown away)
    any --fenced--> FENCED   (the relay says so and exits non-zero)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class TxState(enum.Enum):
    IDLE = "idle"  # no Kafka transaction open: everything read is committed or skipped
    OPEN = "open"  # a Kafka transaction is open and takes records
    COMMITTING = "committing"  # the checkpoint is produced, the commit is under way
    ABORTING = "aborting"  # the Kafka transaction is being aborted
    FAILED = "failed"  # aborted (or the abort failed): the session must end
    FENCED = "fenced"  # a newer relay took the transactional.id: stop for good


class Action(enum.Enum):
    NONE = "none"  # nothing to do
    BEGIN = "begin"  # begin a Kafka transaction (before producing this record)
    COMMIT = "commit"  # produce the checkpoint (candidate) and commit the transaction
    ABORT = "abort"  # abort the Kafka transaction
    RESTART = "restart"  # end the session (its reads since the checkpoint are read again)
    EXIT = "exit"  # fenced: publish nothing more, exit non-zero
    BUFFER = "buffer"  # a commit is under way: hold the record for the next transaction
    WAIT = "wait"  # the buffer is full (or a shutdown flush): wait for the commit's outcome
    REFUSE = "refuse"  # aborting, failed or fenced: the record enters no transaction


#: What is due in a state that takes no more records (ABORTING: a failure the shell
#: learnt of outside its acting on the machine, e.g. in a delivery report).
_SETTLED = {
    TxState.FENCED: Action.EXIT,
    TxState.FAILED: Action.RESTART,
    TxState.ABORTING: Action.ABORT,
}


@dataclass(frozen=True)
class TxLimits:
    """The bounds of one Kafka transaction (milliseconds, records)."""

    #: a due commit once this many records are in the transaction (CDC_TX_MAX_RECORDS)
    max_records: int
    #: a due commit once the transaction is this old (CDC_TX_MAX_MS)
    max_ms: int
    #: the same while the relay reads a backlog (``behind``): at least ``max_ms``
    backlog_max_ms: int
    #: an open transaction this old is aborted (transaction.timeout.ms less the commit budget)
    abort_after_ms: int
    #: a commit - its records' acknowledgements and commit_transaction, retries
    #: included - is aborted this long after it started
    commit_budget_ms: int
    #: records routed while a commit is under way, held for the next transaction
    buffer_max_records: int = 5_000
    #: their bytes (key and value)
    buffer_max_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        if (
            min(
                self.max_records,
                self.max_ms,
                self.abort_after_ms,
                self.commit_budget_ms,
                self.buffer_max_records,
                self.buffer_max_bytes,
            )
            < 1
        ):
            raise ValueError(f"transaction limits must be positive: {self}")
        if self.backlog_max_ms < self.max_ms:
            raise ValueError(f"backlog_max_ms must be at least max_ms: {self}")


#: The members as module constants: an enum member read through its class
#: (``Action.NONE``) goes through EnumType.__getattr__'s hook - about 20 times a
#: global's cost, and the machine's hot steps (record, closed) read one or two per record.
_IDLE, _OPEN, _COMMITTING = TxState.IDLE, TxState.OPEN, TxState.COMMITTING
_ABORTING, _FAILED, _FENCED = TxState.ABORTING, TxState.FAILED, TxState.FENCED
_NONE, _BEGIN, _COMMIT, _ABORT = Action.NONE, Action.BEGIN, Action.COMMIT, Action.ABORT
_RESTART, _EXIT, _BUFFER, _WAIT = Action.RESTART, Action.EXIT, Action.BUFFER, Action.WAIT
_REFUSE = Action.REFUSE


class TxBatch:
    """One session's Kafka transactions; ``checkpoint`` is what the checkpoint topic held
    at the session's start (read_committed), or the slot's confirmed LSN when none."""

    __slots__ = (
        "buffered",
        "buffered_bytes",
        "candidate",
        "commit_started_ms",
        "committed",
        "limits",
        "next_candidate",
        "next_opened_ms",
        "opened_ms",
        "records",
        "skip_below",
        "state",
        "wal_open",
    )

    def __init__(self, limits: TxLimits, checkpoint: int) -> None:
        self.limits = limits
        self.state = _IDLE
        #: the last committed checkpoint (commit end-LSN)
        self.committed = checkpoint
        #: WAL transactions whose commit LSN is below this were committed before: skipped
        self.skip_below = checkpoint
        #: the checkpoint the next commit writes (None: no WAL transaction closed in it yet)
        self.candidate: int | None = None
        #: records handed to Kafka in the open transaction
        self.records = 0
        self.opened_ms = 0
        self.commit_started_ms = 0
        #: a WAL transaction is open (a commit must wait for its end)
        self.wal_open = False
        #: records (and their bytes) buffered for the next transaction while COMMITTING
        self.buffered = 0
        self.buffered_bytes = 0
        #: the buffered transaction's checkpoint candidate and first record's time
        self.next_candidate: int | None = None
        self.next_opened_ms = 0

    def covered(self, final_lsn: int) -> bool:
        """Whether the WAL transaction committed at ``final_lsn`` is in Kafka already."""
        return final_lsn < self.skip_below

    def wal_opened(self) -> None:
        """A WAL transaction began (Begin, or a pseudo-transaction around a message)."""
        self.wal_open = True

    def opened(self, final_lsn: int) -> bool:
        """:meth:`wal_opened` and :meth:`covered` in one step (the shell's Begin,
        :meth:`cdc.relay.delivery.eos_steps.EosSteps.wal_begins`, writes it out - no call
        a WAL transaction - and its unit test holds it to this): a WAL transaction
        committed at ``final_lsn`` began; whether it is in Kafka already (its records
        are skipped)."""
        self.wal_open = True
        return final_lsn < self.skip_below

    def wal_closed(self, end_lsn: int) -> None:
        """A WAL transaction ended at ``end_lsn``; all of its records were handed over
        (a covered one's were skipped)."""
        self.wal_open = False
        state = self.state
        if state is _OPEN:
            self.candidate = end_lsn
        elif state is _COMMITTING and self.buffered:
            self.next_candidate = end_lsn

    def closed(self, end_lsn: int, now_ms: int, waiting: bool, behind: bool) -> Action:
        """:meth:`wal_closed` then :meth:`due`, in one call (the shell's Commit, once a
        WAL transaction; the model test drives this one, and checks it against the two).
        The open transaction's case is :meth:`due`'s, written out: no second call."""
        self.wal_open = False
        if self.state is not _OPEN:
            if self.state is _COMMITTING and self.buffered:
                self.next_candidate = end_lsn
            return self.due(now_ms, waiting, behind)
        self.candidate = end_lsn
        age_ms = now_ms - self.opened_ms
        limits = self.limits
        if age_ms >= limits.abort_after_ms:
            self.state = _ABORTING
            return _ABORT
        if waiting:
            return _NONE
        if self.records >= limits.max_records or age_ms >= (
            limits.backlog_max_ms if behind else limits.max_ms
        ):
            self.state = _COMMITTING
            self.commit_started_ms = now_ms
            return _COMMIT
        return _NONE

    def record(self, now_ms: int, nbytes: int = 0) -> Action:
        """A record (of ``nbytes``) is about to be produced: BEGIN when no transaction is
        open; while a commit is under way BUFFER (hold it for the next transaction), or
        WAIT when it would pass the buffer's bounds (nothing counted: ask again once
        the commit's outcome is in); REFUSE while the transaction is aborting, failed
        or fenced (nothing counted: the record enters no transaction; :meth:`due`
        says what to do).

        In OPEN it only counts the record (``records += 1``, NONE), and while a commit
        is under way with records buffered already and room for this one it only
        counts it there (``buffered``, ``buffered_bytes``; BUFFER): the exactly-once
        record step (:meth:`cdc.relay.delivery.eos_steps.EosSteps.record`) writes these
        two cases out (no call per record: most records meet one); the model test
        checks after every step that they are all this does."""
        state = self.state
        if state is _OPEN:
            self.records += 1
            return _NONE
        if state is _IDLE:
            self.state = _OPEN
            self.opened_ms = now_ms
            self.records = 1
            self.candidate = None
            return _BEGIN
        if state is not _COMMITTING:
            return _REFUSE
        limits = self.limits
        if (
            self.buffered >= limits.buffer_max_records
            or self.buffered_bytes + nbytes > limits.buffer_max_bytes
        ):
            return _WAIT
        if not self.buffered:
            self.next_opened_ms = now_ms
            self.next_candidate = None
        self.buffered += 1
        self.buffered_bytes += nbytes
        return _BUFFER

    @property
    def admits(self) -> bool:
        """Whether a record counted earlier (buffered during a commit, a dead letter) may
        be handed to Kafka now: only into an OPEN transaction."""
        return self.state is _OPEN

    def due(self, now_ms: int, waiting: bool = False, behind: bool = False) -> Action:
        """What is due now: COMMIT, ABORT (too old, or a failure was reported),
        RESTART, EXIT or NONE. ``waiting``:
        records of the transaction are not handed to Kafka yet (dead letters not
        written): no commit before they are. ``behind``: more WAL is there to read
        at once (a backlog): the age bound is ``backlog_max_ms``, not ``max_ms``."""
        if self.state is not _OPEN:
            if (
                self.state is _COMMITTING
                and now_ms - self.commit_started_ms >= self.limits.commit_budget_ms
            ):
                self.state = _ABORTING
                self._drop_buffer()
                return _ABORT
            return _SETTLED.get(self.state, _NONE)
        age_ms = now_ms - self.opened_ms
        limits = self.limits
        if age_ms >= limits.abort_after_ms:
            self.state = _ABORTING
            return _ABORT
        if self.wal_open or waiting or self.candidate is None:
            return _NONE
        if self.records >= limits.max_records or age_ms >= (
            limits.backlog_max_ms if behind else limits.max_ms
        ):
            self.state = _COMMITTING
            self.commit_started_ms = now_ms
            return _COMMIT
        return _NONE

    def flush(self, now_ms: int, *, waiting: bool = False) -> Action:
        """Commit now if a transaction can be (shutdown): COMMIT, ABORT (a WAL
        transaction is open, or records wait: it would be read again anyway; or a
        failure was reported), WAIT (a
        commit is under way: its outcome first, then flush again) or NONE."""
        if self.state is _COMMITTING:
            return _WAIT
        if self.state is _ABORTING:  # (a failure reported: its abort is due)
            return _ABORT
        if self.state is not _OPEN:
            return _NONE
        if self.wal_open or waiting or self.candidate is None:
            self.state = _ABORTING
            return _ABORT
        self.state = _COMMITTING
        self.commit_started_ms = now_ms
        return _COMMIT

    def commit_ok(self) -> Action:
        """The Kafka commit succeeded: the checkpoint it carried is committed. BEGIN
        when records were buffered meanwhile (begin the next transaction and produce
        them: it is OPEN with them), else NONE (IDLE)."""
        if self.state is not _COMMITTING or self.candidate is None:
            raise ValueError(f"commit_ok while {self.state.value}")
        self.committed = self.candidate
        if not self.buffered:
            self.state = _IDLE
            self.candidate = None
            self.records = 0
            return _NONE
        self.state = _OPEN
        self.candidate = self.next_candidate
        self.records = self.buffered
        self.opened_ms = self.next_opened_ms
        self._drop_buffer()
        return _BEGIN

    def _drop_buffer(self) -> None:
        self.buffered = self.buffered_bytes = 0
        self.next_candidate = None

    def commit_failed(self, *, retriable: bool, now_ms: int) -> Action:
        """The commit failed: COMMIT again (retriable, within budget) or ABORT."""
        if self.state is _ABORTING:  # (a record failed meanwhile)
            return _ABORT
        if self.state is not _COMMITTING:
            raise ValueError(f"commit_failed while {self.state.value}")
        if retriable and now_ms - self.commit_started_ms < self.limits.commit_budget_ms:
            return _COMMIT
        self.state = _ABORTING
        self._drop_buffer()
        return _ABORT

    def failed(self) -> Action:
        """A record of the open transaction failed (a failed delivery report, a produce
        error): the transaction cannot commit. ABORT (or NONE when none is open)."""
        if self.state in (_OPEN, _COMMITTING):
            self.state = _ABORTING
            self._drop_buffer()
            return _ABORT
        return _NONE

    def aborted(self) -> Action:
        """The abort finished, or failed (the broker aborts at the transaction timeout,
        the next producer's init_transactions at once): the session ends."""
        self._drop_buffer()
        if self.state is _FENCED:
            return _EXIT
        self.state = _FAILED
        return _RESTART

    def fenced(self) -> Action:
        """A newer producer took the transactional.id: nothing more is published."""
        self.state = _FENCED
        self._drop_buffer()
        return _EXIT

    def confirm_bound(self, confirmable: int) -> int:
        """The LSN that may be confirmed to PostgreSQL, given the tracker's answer."""
        if self.state is _IDLE:
            return confirmable
        return confirmable if confirmable < self.committed else self.committed
