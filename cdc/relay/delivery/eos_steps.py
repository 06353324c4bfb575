"""Exactly-once publishing's hot steps: Begin, Commit and a record's hand-over.

A part of :class:`cdc.relay.delivery.exactly_once.ExactlyOnceRelay` (a mixin; the decisions
are :class:`cdc.relay.delivery.txbatch.TxBatch`'s). Begin and Commit are read as
:class:`cdc.relay.stream.fast_path.FastPath` reads them (the same checks, the same session
fields, the tracker's own ``open``/``close``), with the machine told in the same
step: one call at Begin (:meth:`TxBatch.opened`: whether the checkpoint covers the
transaction) and one at Commit (:meth:`TxBatch.closed`: what is due). They run once
per WAL transaction: with 1-event transactions, a large part of the relay's cost.
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
from typing import TYPE_CHECKING, NoReturn

from cdc.errors import DecodeError, KafkaUnavailableError
from cdc.relay.delivery.txbatch import Action, TxBatch, TxState
from cdc.relay.health.state import Headers, Session
from cdc.relay.stream.fast_path import _begin_slowly, _malformed
from cdc.relay.stream.producing import Producing
from cdc.wal import pgoutput as pgo
from cdc.wal.lsn import LsnTracker

if TYPE_CHECKING:
    from cdc.relay.delivery.overlap import _CommitJob, _Held

_monotonic_ns = time.monotonic_ns
_tracker_open, _tracker_close = LsnTracker.open, LsnTracker.close
_send_record = Producing._send  # (the relay's own _send: cdc.relay.stream.producing)
_begin_context, _COMMIT_LEN, _commit_fields = pgo.begin_context, pgo.COMMIT_LEN, pgo.commit_fields
_NONE = Action.NONE
_BEGIN, _BUFFER, _REFUSE = Action.BEGIN, Action.BUFFER, Action.REFUSE
_OPEN, _COMMITTING = TxState.OPEN, TxState.COMMITTING


class EosSteps:
    """The exactly-once relay's Begin, Commit and ``_send`` (see the module docstring)."""

    if TYPE_CHECKING:
        _batch: TxBatch
        _skip_tx: int
        _job: _CommitJob | None
        _buffer: list[_Held]

        def _poll(self, timeout_s: float) -> None: ...

        def _act(self, sess: Session, action: Action) -> None: ...

        def _begin(self) -> None: ...

        def _held(self, sess: Session, action: Action, nbytes: int) -> Action: ...

        def _refuse(self, sess: Session) -> NoReturn: ...

    def _on_begin(self, sess: Session, data: bytes | memoryview, at: int) -> None:
        begin = _begin_context(data, at)
        if begin is None:  # malformed (raises), or a commit time beyond the years 1000-9999
            begin = _begin_slowly(data, at)
        tx_id = sess.tx_id = begin[0]
        sess.begin = begin
        _tracker_open(sess.tracker, tx_id)
        # (the machine's answer kept for the transaction's records: _send compares ids)
        self._skip_tx = tx_id if self._batch.opened(tx_id) else -1

    def _on_commit(self, sess: Session, data: bytes | memoryview, at: int) -> None:
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
            job = self._job  # taken; nothing to do while commit_transaction runs)
            if job is None or job.done.is_set():
                self._poll(0)
                if sess.fatal is not None:  # (a record of it failed: its abort is due)
                    raise KafkaUnavailableError(f"producer error: {sess.fatal}")
            return
        # (the machine asked inline, _act only when it says so)
        now_ms = _monotonic_ns() // 1_000_000
        action = batch.closed(end_lsn, now_ms, bool(sess.pending_dlq), not sess.caught_up)
        if action is not _NONE:
            self._act(sess, action)

    def _send(
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
        if tx_id == self._skip_tx:  # (covered: its Begin asked the machine)
            sess.tracker.ack(tx_id)
            return
        batch = self._batch
        if batch.state is _OPEN:  # (TxBatch.record's OPEN case, written out: no call, no clock)
            batch.records += 1
            _send_record(self, sess, tx_id, topic, value, key, headers, timestamp_ms, event_id)  # type: ignore[arg-type]
            return
        action = batch.record(_monotonic_ns() // 1_000_000, len(value) + len(key))
        if action is not _NONE:
            if action is _BUFFER:  # (a commit under way: held for the next transaction)
                self._buffer.append((tx_id, topic, value, key, headers, timestamp_ms, event_id))
                return
            if action is _BEGIN:
                self._begin()
            else:  # WAIT (the buffer full) or REFUSE (aborting, failed, fenced)
                action = self._held(sess, action, len(value) + len(key))
                if action is _BUFFER:
                    self._buffer.append((tx_id, topic, value, key, headers, timestamp_ms, event_id))
                    return
                if action is _REFUSE:
                    self._refuse(sess)
        _send_record(self, sess, tx_id, topic, value, key, headers, timestamp_ms, event_id)  # type: ignore[arg-type]
