"""Exactly-once publishing's hot steps: Begin, Commit and a record's hand-over.

A collaborator of :class:`cdc.relay.delivery.exactly_once.ExactlyOnce` (:class:`EosSteps`:
the delivery mode's ``wal_begins``, ``record`` and ``wal_ends``, :mod:`cdc.relay.stream.mode`;
the decisions are :class:`cdc.relay.delivery.txbatch.TxBatch`'s). Begin and Commit are
read as :func:`cdc.relay.stream.fast_path.read_begin` and ``read_commit`` read them
(the same checks, the same session fields, the tracker's own ``open``/``close``),
with the machine told in the same step: at Begin :meth:`TxBatch.opened` written out
(no call: a WAL transaction is open, and whether the checkpoint covers it), at Commit
one call (:meth:`TxBatch.closed`: what is due). They run once per WAL transaction:
with 1-event transactions, a large part of the relay's cost. A record meets the
machine's :meth:`TxBatch.record` written out in its two common cases - OPEN (counted)
and a commit under way with room in the buffer (buffered, counted) - and calls it
otherwise; the unit tests hold the written-out forms to the machine's.
Guarantees, beyond the fast path's:

* a record of a WAL transaction the checkpoint covers is acknowledged at once and
  never produced (the machine's answer at its Begin, kept for its records);
* a record goes into the open Kafka transaction (counted there as
  :meth:`TxBatch.record` counts it, without the call; begun for it when none is open), or
  is buffered while a commit is under way (at the buffer's bound the reading waits
  for the commit's outcome), as the machine says; a record the machine refuses
  (the transaction is aborting, failed or fenced) is never produced: what is due
  is done - the abort, the session's end - and the next session reads it again;
* between WAL transactions while a commit is under way, its delivery reports are
  served and its outcome taken; while ``commit_transaction`` runs on its thread
  (the producer is the thread's) nothing is called - the loop's turns look at the
  commit's age (its budget) and the fencing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from cdc.errors import DecodeError, KafkaUnavailableError
from cdc.relay.delivery.txbatch import Action, TxBatch, TxState
from cdc.relay.health.state import Headers, SendStep, Session
from cdc.relay.stream.fast_path import _begin_slowly, _malformed
from cdc.wal import pgoutput as pgo
from cdc.wal.lsn import LsnTracker

if TYPE_CHECKING:
    from cdc.relay.delivery.overlap import _Held

_monotonic_ns = time.monotonic_ns
_tracker_open, _tracker_close = LsnTracker.open, LsnTracker.close
_begin_context, _COMMIT_LEN, _commit_fields = pgo.begin_context, pgo.COMMIT_LEN, pgo.commit_fields
_NONE = Action.NONE
_BUFFER, _REFUSE = Action.BUFFER, Action.REFUSE
_OPEN, _COMMITTING = TxState.OPEN, TxState.COMMITTING


class CheckpointTracker(LsnTracker):
    """The session's LSN tracker, capped at the committed checkpoint and telling the
    Kafka transactions where WAL transactions begin and end."""

    __slots__ = ("batch",)

    def __init__(self, start_lsn: int, batch: TxBatch) -> None:
        super().__init__(start_lsn)
        self.batch = batch

    @property
    def confirmable(self) -> int:
        return self.batch.confirm_bound(self._confirmed)

    # (LsnTracker's methods called directly, not through super(): once per WAL
    # transaction, measurable in a 1-event transaction's cost)
    def open(self, tx_id: int) -> None:
        _tracker_open(self, tx_id)
        self.batch.wal_opened()

    def close(self, tx_id: int, end_lsn: int) -> None:
        _tracker_close(self, tx_id, end_lsn)
        self.batch.wal_closed(end_lsn)


class EosSteps:
    """The exactly-once mode's Begin, Commit and record steps (see the module docstring):
    a collaborator of :class:`cdc.relay.delivery.exactly_once.ExactlyOnce`, whose points
    ``wal_begins``, ``record`` and ``wal_ends`` are these methods (bound: no call between).
    It owns the session's skip answer; it is told the session's machine (:meth:`start`)
    and hands every decision but the OPEN case back to the mode: ``admit`` (the admission
    rule), ``refuse``, ``act`` (what the machine asked), ``serve``; a buffered record goes
    to the commit's buffer (``hold``)."""

    def __init__(
        self,
        *,
        batch: TxBatch,
        send_record: SendStep,
        hold: Callable[[_Held], None],
        commit_thread_running: Callable[[], bool],
        serve: Callable[[float], None],
        act: Callable[[Session, Action], None],
        admit: Callable[[Session, int, Action], Action],
        refuse: Callable[[Session], NoReturn],
    ) -> None:
        #: the session's transactions (:meth:`start`)
        self._batch = batch
        #: the WAL transaction being read, when the checkpoint covers it (else -1)
        self._skip_tx = -1
        #: the buffer's bounds (the machine's: its written-out BUFFER case reads them)
        self._buffer_max_records = batch.limits.buffer_max_records
        self._buffer_max_bytes = batch.limits.buffer_max_bytes
        # (the producer's step and the mode's, bound once: the first is called per record)
        self._send_record = send_record
        self._hold = hold
        self._commit_thread_running = commit_thread_running
        self._serve = serve
        self._act = act
        self._admit = admit
        self._refuse = refuse

    def start(self, batch: TxBatch) -> None:
        """A session's transactions (its checkpoint read): no WAL transaction skipped yet."""
        self._batch = batch
        self._skip_tx = -1
        self._buffer_max_records = batch.limits.buffer_max_records
        self._buffer_max_bytes = batch.limits.buffer_max_bytes

    def wal_begins(self, sess: Session, data: bytes | memoryview, at: int) -> None:
        """Begin, read as :func:`cdc.relay.stream.fast_path.read_begin` reads it, and
        :meth:`TxBatch.opened` asked (its answer kept for the transaction's records)."""
        begin = _begin_context(data, at)
        if begin is None:  # malformed (raises), or a commit time beyond the years 1000-9999
            begin = _begin_slowly(data, at)
        tx_id = sess.tx_id = begin[0]
        sess.begin = begin
        _tracker_open(sess.tracker, tx_id)
        # TxBatch.opened written out (no call: once a WAL transaction, a measurable part
        # of a 1-event one; the unit test holds it to the machine's): a WAL transaction
        # is open, and whether the checkpoint covers it - kept for its records, which
        # compare ids.
        batch = self._batch
        batch.wal_open = True
        self._skip_tx = tx_id if tx_id < batch.skip_below else -1

    def wal_ends(self, sess: Session, data: bytes | memoryview, at: int) -> None:
        """Commit, read as :func:`cdc.relay.stream.fast_path.read_commit` reads it, and
        :meth:`TxBatch.closed` asked what is due (acted on only when something is)."""
        if len(data) - at != _COMMIT_LEN:
            raise _malformed(data[at:])
        tx_id = sess.tx_id
        if tx_id is None:
            raise DecodeError("pgoutput Commit outside a transaction")
        end_lsn = _commit_fields(data, at + 1)[2]
        _tracker_close(sess.tracker, tx_id, end_lsn)
        sess.tx_id = sess.begin = sess.tx = sess.reports = None
        batch = self._batch
        if batch.state is _COMMITTING:  # (the commit under way: its progress, between
            batch.wal_closed(end_lsn)  # WAL transactions - its reports served, its outcome
            # taken; nothing to do while commit_transaction runs)
            running = self._commit_thread_running  # (instance attributes read first,
            if not running():  # then called: a specialized load - see record)
                serve = self._serve
                serve(0)
                if sess.fatal is not None:  # (a record of it failed: its abort is due)
                    raise KafkaUnavailableError(f"producer error: {sess.fatal}")
            return
        # (the machine asked inline, _act only when it says so)
        now_ms = _monotonic_ns() // 1_000_000
        action = batch.closed(end_lsn, now_ms, bool(sess.pending_dlq), not sess.caught_up)
        if action is not _NONE:
            self._act(sess, action)

    def record(
        self,
        sess: Session,
        tx_id: int,
        topic: str,
        value: bytes,
        key: bytes,
        headers: Headers,
        timestamp_ms: int,
        event_id: bytes,
    ) -> None:
        """A record: acknowledged at once in a covered WAL transaction; else admitted
        (:meth:`ExactlyOnce._admit`: into the open transaction, or buffered during a
        commit; refused: never produced - the abort is done and the session ends)."""
        if tx_id == self._skip_tx:  # (covered: its Begin asked the machine)
            sess.tracker.ack(tx_id)
            return
        batch = self._batch
        state = batch.state
        if state is _OPEN:  # (TxBatch.record's OPEN case, written out: no call, no clock;
            batch.records += 1  # the model test checks it against the machine)
            send = self._send_record  # (an attribute load, cached: see FastPath.on_insert)
            send(sess, tx_id, topic, value, key, headers, timestamp_ms, event_id)
            return
        nbytes = len(value) + len(key)
        buffered = batch.buffered
        # TxBatch.record's BUFFER case, written out as its OPEN case is (no call, no
        # clock: a backlog reads hundreds of records during each commit), but for the
        # buffer's first record (its clock and candidate are the machine's) and one at
        # a bound (WAIT); the model test and the unit test hold it to the machine's.
        if (
            state is _COMMITTING
            and buffered
            and buffered < self._buffer_max_records
            and batch.buffered_bytes + nbytes <= self._buffer_max_bytes
        ):
            batch.buffered = buffered + 1
            batch.buffered_bytes += nbytes
            hold = self._hold  # (the buffer's append, read first as send is)
            hold((tx_id, topic, value, key, headers, timestamp_ms, event_id))
            return
        # The machine asked here (the other cases: one call), its answer acted on by the
        # admission rule (ExactlyOnce._admit) unless it is BUFFER.
        action = batch.record(_monotonic_ns() // 1_000_000, nbytes)
        if action is not _BUFFER:
            action = self._admit(sess, nbytes, action)
        if action is _BUFFER:  # (a commit under way: held for the next transaction)
            hold = self._hold
            hold((tx_id, topic, value, key, headers, timestamp_ms, event_id))
            return
        if action is _REFUSE:  # (aborting, failed, fenced: it enters no transaction)
            self._refuse(sess)
        self._send_record(sess, tx_id, topic, value, key, headers, timestamp_ms, event_id)
