"""Exactly-once publishing: a Kafka commit that overlaps the reading of the WAL.

A collaborator of :class:`cdc.relay.delivery.exactly_once.ExactlyOnce`, the delivery mode
(:class:`CommitOverlap`: it owns the commit under way; the decisions are
:class:`cdc.relay.delivery.txbatch.TxBatch`'s). Guarantees:

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

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from confluent_kafka import KafkaError, KafkaException, Producer
from prometheus_client import CollectorRegistry, Counter, Gauge

from cdc.errors import KafkaUnavailableError
from cdc.health import Liveness
from cdc.relay.delivery import checkpoint as ckpt
from cdc.relay.delivery.epoch import fatal_code, is_fenced
from cdc.relay.delivery.txbatch import Action, TxBatch, TxState
from cdc.relay.health.metrics import OneWriterHistogram
from cdc.relay.health.state import Headers, RefusedStep, SendStep, Session
from cdc.relay.stream.loop import ACK_WAIT_S, READ_WAIT_S, WAIT_TICK_S
from cdc.wal.replproto import lsn_to_str

if TYPE_CHECKING:
    from cdc.relay.stream.dead_letters import DeadLetters
    from cdc.relay.stream.producing import Producing

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
_OPEN, _COMMITTING = TxState.OPEN, TxState.COMMITTING


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


#: What :meth:`CommitOverlap.join_outcome` found of the commit under way.
JOINED_COMMITTED = "committed"  # it committed: no transaction is open
JOINED_STUCK = "stuck"  # still running, or only commit_transaction may follow
JOINED_OPEN = "open"  # none runs: the transaction may be aborted


def serve_reports(producer: Producer) -> None:
    """Serve the delivery reports already queued (failed ones are remembered)."""
    with contextlib.suppress(KafkaException):
        producer.poll(0)


class CommitOverlap:
    """The overlapped commit (see the module docstring): a collaborator of
    :class:`cdc.relay.delivery.exactly_once.ExactlyOnce`. It owns the commit under way -
    its thread, its flush, the buffer of records read meanwhile and their release, a
    retriable failure's "only commit_transaction may follow" - and asks the mode only
    what the mode decides: ``serve`` (a wait for the outcome), ``refuse`` (a record the
    machine refused) and ``kafka_failed`` (a transactional call failed)."""

    def __init__(
        self,
        *,
        producing: Producing,
        dead_letters: DeadLetters,
        liveness: Liveness,
        checkpoint_topic: str,
        transactions: Counter,
        batch: TxBatch,
        registry: CollectorRegistry,
        serve: Callable[[float], None],
        refuse: Callable[[Session], NoReturn],
        kafka_failed: Callable[[KafkaException, str], None],
    ) -> None:
        self._producing = producing
        self._dead_letters = dead_letters
        self._liveness = liveness
        self._checkpoint_topic = checkpoint_topic
        self._transactions = transactions
        self._serve = serve
        self._refuse = refuse
        self._kafka_failed = kafka_failed
        # (the producer's steps, bound once: the release calls them per record)
        self._send_record: SendStep = producing.send
        self._refused: RefusedStep = producing.refused
        #: the session's transactions and origin (:meth:`start`)
        self._batch = batch
        self._origin = ""
        #: records routed while a commit is under way, in the order read (one list
        #: for the mode's life: its record step holds :attr:`hold`, its append)
        self._buffer: list[_Held] = []
        #: hold a record for the next transaction (the record step's, per buffered record)
        self.hold = self._buffer.append
        #: the buffer is being produced into the next transaction: no commit meanwhile
        self.releasing = False
        #: a commit's checkpoint is produced; commit_transaction starts once the
        #: producer holds no record
        self._flushing = False
        #: commit_transaction under way on its own thread
        self._job: _CommitJob | None = None
        #: the producer a commit_transaction thread did not return from in time
        self._busy: Producer | None = None
        #: a commit_transaction failed retriably: only commit_transaction may follow
        self._unfinished = False
        self._overlapped = Counter(
            "outbox_relay_kafka_commit_overlap_records_total",
            "Exactly-once: records read while a Kafka commit was under way (buffered, then"
            " produced into the next transaction)",
            registry=registry,
        )
        self._checkpoint_lsn = Gauge(
            "outbox_relay_checkpoint_lsn",
            "Exactly-once: the last committed checkpoint (a commit end-LSN, as a number)",
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

    def start(self, batch: TxBatch, origin: str) -> None:
        """A session's transactions (``batch``, its checkpoint read) and its ``origin``
        (the checkpoint's key): no commit under way, nothing buffered."""
        self._batch = batch
        self._origin = origin
        self._buffer.clear()
        self._flushing = self.releasing = False
        self._checkpoint_lsn.set(batch.committed)

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

    def wait(self, timeout_s: float) -> bool:
        """While commit_transaction has the producer (on its thread): wait at most
        ``timeout_s`` for it to return, and True; else False (the producer is free)."""
        job = self._job
        if job is None:
            return False
        if timeout_s > 0:
            job.done.wait(timeout_s)
        return True

    def thread_running(self) -> bool:
        """Whether commit_transaction runs on its thread now (nothing to do meanwhile)."""
        job = self._job
        return job is not None and not job.done.is_set()

    def commit(self, sess: Session) -> Action:
        """Produce the checkpoint and start the commit (the reading goes on: the
        outcome is taken by :meth:`advance`); a retry only calls commit_transaction
        again."""
        producer = self._producing.producer
        batch = self._batch
        assert producer is not None and batch.candidate is not None
        if not self._unfinished:
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
                return self._failed(sess, exc)
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
            return self._failed(sess, exc)
        if batch.state is not _COMMITTING:
            # (a record's delivery failed during the flush: the machine says ABORT -
            # the transaction is aborted and the session reads again from the checkpoint)
            return batch.due(_now_ms())
        return self.advance(sess)

    def advance(self, sess: Session) -> Action:
        """The commit under way: commit_transaction started once the producer holds
        no record (its delivery reports all served), its outcome taken once it
        returned; what is due next (BEGIN: records were buffered meanwhile)."""
        producer = self._producing.producer
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
            return self._failed(sess, job.error)
        self._unfinished = False
        self._commit_seconds.observe(time.monotonic() - self._commit_due_at)
        batch = self._batch
        action = batch.commit_ok()
        self._transactions.labels("committed").inc()
        self._checkpoint_lsn.set(batch.committed)
        return action

    def _failed(self, sess: Session, exc: KafkaException) -> Action:
        """The checkpoint's produce or commit_transaction failed: fenced or fatal ends
        it (the mode's ``kafka_failed``); otherwise COMMIT again (retriable, within the
        budget) or ABORT."""
        producer = self._producing.producer
        assert producer is not None
        err = exc.args[0] if exc.args else None
        if is_fenced(exc) or fatal_code(exc) is not None:
            self._kafka_failed(exc, "commit_transaction")
        # A record that failed during the commit has its report queued: served now,
        # it is remembered (a refused one is dead-lettered when read again) and the
        # transaction marked failed - never a retry of a commit that cannot succeed.
        serve_reports(producer)
        retriable = isinstance(err, KafkaError) and err.retriable()
        # (after a retriable failure librdkafka takes only commit_transaction again)
        self._unfinished = self._unfinished or retriable
        log.warning("Kafka transaction commit failed: %s", exc)
        sess.stream.send_status(sess.tracker.confirmable, ask_raise=False)
        return self._batch.commit_failed(retriable=retriable, now_ms=_now_ms())

    def await_commit(self, sess: Session) -> None:
        """Wait for the commit under way to end (a full buffer, a shutdown), acting on
        its outcome; bounded: the machine aborts a commit at its budget."""
        while self._batch.state is _COMMITTING:
            self._liveness.tick()
            self._serve(COMMIT_WAIT_TICK_S)
            if sess.fatal is not None:  # (a record of the transaction failed)
                raise KafkaUnavailableError(f"producer error: {sess.fatal}")

    def release(self, sess: Session) -> None:
        """Produce the records buffered during the commit into the transaction just
        begun, in the order read (no commit is due before the last one is produced)."""
        buffer = self._buffer
        self._overlapped.inc(len(buffer))
        send = self._send_record  # (Producing.send: the mode's own record step would buffer)
        self.releasing = True
        batch = self._batch
        try:
            for tx_id, topic, value, key, headers, ts_ms, event_id in buffer:
                if batch.state is not _OPEN:  # (TxBatch.admits: a failure reported
                    self._refuse(sess)  # meanwhile - the abort is due)
                try:
                    send(sess, tx_id, topic, value, key, headers, ts_ms, event_id)
                except KafkaException as exc:  # (as Producing.produce: refused, or fatal)
                    self._refused(sess, tx_id, exc, topic, key, value, headers, ts_ms)
        finally:
            buffer.clear()  # (nothing is buffered meanwhile: the transaction is OPEN)
            self.releasing = False

    def join(self) -> bool:
        """Wait (bounded) for a commit_transaction thread to return; whether none runs
        now. The commit's state goes: its outcome no longer matters (the session ends)."""
        job, self._job = self._job, None
        self._flushing = False
        self._buffer.clear()
        if job is None:
            return True
        if not job.done.wait(COMMIT_TIMEOUT_S + WAIT_TICK_S):
            self._busy = self._producing.producer  # (never purged nor destroyed under it)
            log.warning(
                "commit_transaction did not return within %.0fs: its producer is left to it",
                COMMIT_TIMEOUT_S + WAIT_TICK_S,
            )
            return False
        return True

    def join_outcome(self) -> str:
        """Before an abort: :meth:`join`, and what the commit under way came to -
        :data:`JOINED_COMMITTED` (it committed after all: no transaction is open),
        :data:`JOINED_STUCK` (its thread did not return, or it failed retriably:
        abort_transaction would conflict - only a new producer ends it) or
        :data:`JOINED_OPEN` (the transaction may be aborted)."""
        job = self._job
        running = not self.join()
        if job is not None and not running:
            if job.error is None:
                self._unfinished = False
                return JOINED_COMMITTED
            err = job.error.args[0] if job.error.args else None
            if isinstance(err, KafkaError) and err.retriable():  # (only a commit may follow)
                self._unfinished = True
        return JOINED_STUCK if self._unfinished or running else JOINED_OPEN

    def forget(self) -> None:
        """The producer is let go: :meth:`join`, and no commit left unfinished."""
        self.join()
        self._unfinished = False

    def left_to_thread(self, producer: Producer) -> bool:
        """Whether ``producer`` was left to a commit_transaction thread that did not
        return in time (never purged nor destroyed under it)."""
        return producer is self._busy
