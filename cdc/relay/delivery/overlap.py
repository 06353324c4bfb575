"""Exactly-once publishing: a Kafka commit that overlaps the reading of the WAL.

A part of :class:`cdc.relay.delivery.exactly_once.ExactlyOnce`, the delivery mode (the decisions
are :class:`cdc.relay.delivery.txbatch.TxBatch`'s). Guarantees:

* a due commit produces the checkpoint and the relay reads on. Once every record
  of the transaction is acknowledged - the producer holds nothing, its delivery
  reports all served on the relay's thread - ``commit_transaction`` runs on a
  thread of its own (:class:`_CommitJob`): its flush has nothing left to do, so
  no callback runs there, and meanwhile the relay's thread does not touch the
  producer (its polls wait on the commit instead). A caught-up relay (its last
  read turn found no more WAL) waits for those acknowledgements in a flush
  first, bounded by :data:`FLUSH_AT_DUE_MAX_S`: what it would read meanwhile can
  only join the next transaction, and librdkafka sends at once while a flush
  runs (``linger.ms`` ignored) - a commit's latency, not its work;
* a record's delivery failure reported during that flush aborts the transaction
  at once (the session ends; the next one reads again from the checkpoint): the
  reading never goes on into a transaction that is aborting;
* the records routed meanwhile are *buffered* in the order read (librdkafka takes
  none into a new transaction before ``commit_transaction`` returns), within
  :data:`BUFFER_MAX_RECORDS` and :data:`BUFFER_MAX_BYTES`: at the bound the
  reading waits for the commit's outcome. No dead letter is produced during a
  commit (it would join the transaction being committed);
* a successful commit begins the next transaction and produces the buffer into
  it first; no commit is due before the buffer's last record is produced;
* a failed commit is retried or aborted as before; an abort, a fencing or the
  end of the session throws the buffer away: its records were never handed to
  Kafka, and the LSN confirmed to PostgreSQL never passed the committed
  checkpoint, so the next session reads them again;
* every wait is bounded: the machine aborts a commit at its budget; a thread
  still in ``commit_transaction`` is waited for at most :data:`COMMIT_TIMEOUT_S`
  more, then its producer is left to it (never purged or destroyed under it) and
  a new producer's ``init_transactions`` ends the transaction.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, NoReturn

from confluent_kafka import KafkaException, Producer
from prometheus_client import CollectorRegistry, Counter, Gauge

from cdc.errors import KafkaUnavailableError
from cdc.health import Liveness
from cdc.relay.delivery import checkpoint as ckpt
from cdc.relay.delivery.txbatch import Action, TxBatch, TxState
from cdc.relay.health.metrics import OneWriterHistogram
from cdc.relay.health.state import Headers, RefusedStep, SendStep, Session
from cdc.relay.stream.loop import ACK_WAIT_S, READ_WAIT_S, WAIT_TICK_S

if TYPE_CHECKING:
    from cdc.relay.stream.dead_letters import DeadLetters
from cdc.wal.replproto import lsn_to_str

log = logging.getLogger("cdc.relay")

#: One commit_transaction call waits at most this long; a retriable failure is retried
#: within ``cdc.relay.delivery.exactly_once.COMMIT_BUDGET_S``. Below the server's default
#: wal_sender_timeout (60 s): a wait for it answers no keepalive.
COMMIT_TIMEOUT_S = 5.0
#: Records routed while a commit is under way, held for the next transaction: a
#: commit takes a round trip or two (tens of ms) - a backlog read at 20,000 events/s
#: buffers a few hundred meanwhile; at the bound the reading waits for the commit.
BUFFER_MAX_RECORDS = 5_000
#: Their keys' and values' bytes: the memory a slow commit may hold.
BUFFER_MAX_BYTES = 16 << 20
#: Bounds of the commit-duration histogram, seconds: a commit on a quiet single broker
#: takes a few ms, one behind a backlog's 5,000 acknowledgements tens, the budget 10 s.
COMMIT_SECONDS_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: A caught-up relay's wait, at a due commit, for the transaction's acknowledgements
#: (a flush: sent at once, linger.ms ignored); the rest is awaited reading on. A few
#: round trips on a healthy broker; a wait that reads nothing answers no keepalive.
FLUSH_AT_DUE_MAX_S = 0.1
#: A wait for the commit's outcome (a full buffer, shutdown) looks again this often.
COMMIT_WAIT_TICK_S = 0.05
#: One record buffered during a commit: _send's arguments after the session.
_Held = tuple[int, str, bytes, bytes, Headers, int, bytes]
_COMMITTING = TxState.COMMITTING


def _now_ms() -> int:
    return int(time.monotonic() * 1000)


class _CommitJob:
    """``commit_transaction`` of one transaction, on a thread of its own (daemon: a
    process that exits does not wait for it; the call is bounded by ``timeout_s``).
    Started only once the producer holds no record and no event (every delivery report
    served on the relay's thread): its flush has nothing to do, no delivery report is
    served here. (A client error arriving meanwhile may be: its callbacks only log,
    count and set /readyz's text - safe from any thread.)"""

    __slots__ = ("done", "error", "thread")

    def __init__(self, producer: Producer, timeout_s: float) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(
            target=self._run, args=(producer, timeout_s), name="kafka-commit", daemon=True
        )
        self.thread.start()

    def _run(self, producer: Producer, timeout_s: float) -> None:
        try:
            producer.commit_transaction(timeout_s)
        except BaseException as exc:  # (handed to the relay's thread, never lost here)
            self.error = exc
        finally:
            self.done.set()


class CommitOverlap:
    """The overlapped commit's part of the exactly-once relay (see the module docstring)."""

    if TYPE_CHECKING:
        liveness: Liveness
        _producer: Producer | None
        _batch: TxBatch
        _commit_unfinished: bool
        _transactions: Counter
        _checkpoint_lsn: Gauge
        _checkpoint_topic: str
        _origin: str
        _dead_letters: DeadLetters
        _send_record: SendStep
        _refused: RefusedStep

        def serve(self, timeout_s: float) -> None: ...

        def _begin(self) -> None: ...

        def _refuse(self, sess: Session) -> NoReturn: ...

        def _commit_failed(self, sess: Session, exc: KafkaException) -> Action: ...

    def _init_overlap(self, registry: CollectorRegistry) -> None:
        #: records routed while a commit is under way, in the order read
        self._buffer: list[_Held] = []
        #: the buffer is being produced into the next transaction: no commit meanwhile
        self._releasing = False
        #: a commit's checkpoint is produced; commit_transaction starts once the
        #: producer holds no record
        self._flushing = False
        #: commit_transaction under way on its own thread
        self._job: _CommitJob | None = None
        #: the producer a commit_transaction thread did not return from in time
        self._busy: Producer | None = None
        self._overlapped = Counter(
            "outbox_relay_kafka_commit_overlap_records_total",
            "Exactly-once: records read while a Kafka commit was under way (buffered, then"
            " produced into the next transaction)",
            registry=registry,
        )
        #: when the commit under way was due (its first attempt)
        self._commit_due_at = 0.0
        self._commit_seconds = OneWriterHistogram(
            "outbox_relay_kafka_commit_seconds",
            "Exactly-once: a Kafka commit, from due (its checkpoint produced) to Kafka's"
            " answer - the transaction's last acknowledgements and EndTxn",
            COMMIT_SECONDS_BUCKETS,
            registry,
        )

    def read_wait_s(self) -> float:
        """While a Kafka transaction is open or committing, a read turn waits no longer
        than an ack would: its commit is due within CDC_TX_MAX_MS, or its outcome near."""
        state = self._batch.state
        return ACK_WAIT_S if state is TxState.OPEN or state is _COMMITTING else READ_WAIT_S

    def drain_dead_letters(self, sess: Session) -> None:
        """Dead letters go into an open transaction only (:attr:`TxBatch.admits`):
        while a commit is under way they wait (their transaction is the next one);
        while it aborts they are thrown away with it (read again, dead-lettered again)."""
        if self._batch.admits:
            self._dead_letters.drain(sess)

    def _commit(self, sess: Session) -> Action:
        """Produce the checkpoint and start the commit (the reading goes on: the
        outcome is taken by :meth:`_advance`); a retry only calls commit_transaction
        again."""
        producer = self._producer
        batch = self._batch
        assert producer is not None and batch.candidate is not None
        if not self._commit_unfinished:
            self._commit_due_at = time.monotonic()
            try:
                producer.produce(
                    self._checkpoint_topic,
                    lsn_to_str(batch.candidate).encode(),
                    self._origin.encode(),
                    0,
                    headers=ckpt.checkpoint_headers(self._origin),  # type: ignore[arg-type]
                )
            except KafkaException as exc:
                return self._commit_failed(sess, exc)
        self._flushing = True
        if not sess.caught_up:
            return Action.NONE
        # Caught up: the records read on meanwhile could only wait for this commit
        # (the next transaction begins after it), so the reading waits here instead,
        # in a flush - librdkafka sends at once while one runs (linger.ms ignored:
        # the transaction's last records and its checkpoint) - then the commit starts.
        try:
            producer.flush(FLUSH_AT_DUE_MAX_S)  # (reports served here, on the relay's thread)
        except KafkaException as exc:
            return self._commit_failed(sess, exc)
        if self._batch.state is not _COMMITTING:
            # (a record's delivery failed during the flush: the machine says ABORT -
            # the transaction is aborted and the session reads again from the checkpoint)
            return self._batch.due(_now_ms())
        return self._advance(sess)

    def _advance(self, sess: Session) -> Action:
        """The commit under way: commit_transaction started once the producer holds
        no record (its delivery reports all served), its outcome taken once it
        returned; what is due next (BEGIN: records were buffered meanwhile)."""
        producer = self._producer
        assert producer is not None
        if self._flushing:
            if len(producer):
                return Action.NONE
            self._flushing = False
            self._job = _CommitJob(producer, COMMIT_TIMEOUT_S)
            return Action.NONE
        job = self._job
        if job is None or not job.done.is_set():
            return Action.NONE
        self._job = None
        if job.error is not None:
            if not isinstance(job.error, KafkaException):
                raise KafkaUnavailableError(f"commit_transaction failed: {job.error}")
            return self._commit_failed(sess, job.error)
        self._commit_unfinished = False
        self._commit_seconds.observe(time.monotonic() - self._commit_due_at)
        batch = self._batch
        action = batch.commit_ok()
        self._transactions.labels("committed").inc()
        self._checkpoint_lsn.set(batch.committed)
        return action

    def _await_commit(self, sess: Session) -> None:
        """Wait for the commit under way to end (a full buffer, a shutdown), acting on
        its outcome; bounded: the machine aborts a commit at its budget."""
        while self._batch.state is _COMMITTING:
            self.liveness.tick()
            self.serve(COMMIT_WAIT_TICK_S)
            if sess.fatal is not None:  # (a record of the transaction failed)
                raise KafkaUnavailableError(f"producer error: {sess.fatal}")

    def _release(self, sess: Session) -> None:
        """Produce the records buffered during the commit into the transaction just
        begun, in the order read (no commit is due before the last one is produced)."""
        buffer, self._buffer = self._buffer, []
        self._overlapped.inc(len(buffer))
        send = self._send_record  # (Producing.send: the mode's own record step would buffer)
        self._releasing = True
        batch = self._batch
        try:
            for tx_id, topic, value, key, headers, ts_ms, event_id in buffer:
                if not batch.admits:  # (a failure reported meanwhile: the abort is due)
                    self._refuse(sess)
                try:
                    send(sess, tx_id, topic, value, key, headers, ts_ms, event_id)
                except KafkaException as exc:  # (as Producing.produce: refused, or fatal)
                    self._refused(sess, tx_id, exc, topic, key, value, headers, ts_ms)
        finally:
            self._releasing = False

    def _join_commit(self) -> bool:
        """Wait (bounded) for a commit_transaction thread to return; whether none runs
        now. The commit's state goes: its outcome no longer matters (the session ends)."""
        job, self._job = self._job, None
        self._flushing = False
        self._buffer = []
        if job is None:
            return True
        if not job.done.wait(COMMIT_TIMEOUT_S + WAIT_TICK_S):
            self._busy = self._producer  # (never purged nor destroyed under the thread)
            log.warning(
                "commit_transaction did not return within %.0fs: its producer is left to it",
                COMMIT_TIMEOUT_S + WAIT_TICK_S,
            )
            return False
        return True
