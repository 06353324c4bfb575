"""``CDC_DELIVERY=exactly-once``: Kafka transactions that carry their own checkpoint.

A thin shell around :class:`cdc.relay.delivery.txbatch.TxBatch` (the decisions) on top of the
at-least-once relay, whose hot path it leaves as it is: it only adds to the
record-handling steps (Begin, Commit and a record: :mod:`cdc.relay.delivery.eos_steps`;
a dead letter) and to the loop's poll. Guarantees (DESIGN.md, relay invariant 13):

* the producer is transactional; its ``transactional.id`` is
  ``CDC_TRANSACTIONAL_ID`` or ``outbox-cdc.<system identifier>.<slot>``: the
  relay that holds the slot is the one producer of that id. ``init_transactions``
  runs only once the session holds the slot (a standby never fences the active
  relay) and, before anything is read, fences the relay before it and aborts
  that relay's open transaction;
* the records of one or more whole WAL transactions, their dead letters and a
  **checkpoint record** (:mod:`cdc.relay.delivery.checkpoint`: the commit end-LSN of the
  last WAL transaction in it, keyed by ``origin``) are committed in one Kafka
  transaction; a transaction is committed once it holds ``CDC_TX_MAX_RECORDS``
  records or is ``CDC_TX_MAX_MS`` old, whichever first, and only between WAL
  transactions; while the relay reads a backlog (its last read turn left more WAL
  waiting: ``Session.caught_up`` false) the age bound is :data:`BACKLOG_TX_MAX_MS`
  instead - fewer commits, each a round trip and markers in every partition;
* the LSN confirmed to PostgreSQL never passes the last committed checkpoint
  while a Kafka transaction is open (the tracker is capped:
  :meth:`TxBatch.confirm_bound`), so it follows Kafka's commit (invariant 1);
* every start reads its checkpoint with ``read_committed`` and skips every WAL
  transaction whose commit LSN lies below it: nothing committed is published
  twice. The checkpoint is verified first (:func:`cdc.relay.delivery.checkpoint.judge`:
  its ``origin`` header, its value, not beyond the server's WAL position); one
  that is not trusted is warned about once and the session starts from the
  slot's confirmed position (duplicates possible, never a loss). On a new
  timeline without a checkpoint of its own (after a failover), the nearest
  ancestor timeline's checkpoint counts up to where that timeline ended
  (:func:`cdc.relay.delivery.checkpoint.read_checkpoint`). Records of an
  aborted transaction are invisible to a read_committed consumer and are read
  again from the slot;
* a failed record, a failed commit (after retries within the commit budget) or
  a transaction open for ``CDC_TX_TIMEOUT_MS`` less the commit budget is
  aborted and the session ends; the next one starts from the slot and the
  checkpoint. Every Kafka call of the transaction is bounded
  (:data:`cdc.relay.delivery.overlap.COMMIT_TIMEOUT_S`, :data:`ABORT_TIMEOUT_S`,
  :data:`INIT_TIMEOUT_S`);
* **fenced**: a relay whose producer a newer one fenced (a takeover while it was
  paused) publishes nothing more: it logs one line and the process exits 1. A
  producer whose epoch moved on is judged first
  (:func:`cdc.relay.delivery.epoch.is_takeover`): another
  session holds the slot, or no transaction of ours can have outlived
  ``CDC_TX_TIMEOUT_MS`` - fenced; otherwise the transaction coordinator aborted
  our transaction at its timeout (the relay was paused, with nobody to take
  over): one WARNING naming the timeout, a new producer, the session again from
  the checkpoint;
* a session whose start fails (``init_transactions``, the checkpoint read) lets
  its producer go: the next session makes and initialises a new one.
* **the commit overlaps the reading** (:mod:`cdc.relay.delivery.overlap`): records routed
  while a commit is under way are buffered, within bounds, for the next transaction.

How it is built: :class:`ExactlyOnceRelay` is the relay's loop
(:class:`cdc.relay.stream.loop.Relay`) with :class:`ExactlyOnce` as its delivery mode;
it overrides nothing of the loop. :class:`ExactlyOnce` implements every point of
:class:`cdc.relay.stream.mode.DeliveryMode` (the table of points and who calls
them is that module's). Its parts are collaborators it holds - composition, not
base classes - each a module of this folder owning its own state:
:class:`EosSteps` (the hot steps), :class:`CommitOverlap` (the commit under way and
its buffer), :class:`EpochMoved` (a moved epoch judged) and :class:`EosStart` (the
checkpoint read). The mode holds the session's machine (:class:`TxBatch`, a new
one at each session's start, handed to the parts that read it) and calls the parts;
they call back only the mode's steps named at their construction. A point a part
implements is that part's bound method, set on the mode (no call in between):

====================  ==========================  ===================================
point                 part                        what it does in exactly-once mode
====================  ==========================  ===================================
new_producer          ExactlyOnce                 transactional, fenced
new_tracker           ExactlyOnce                 capped at the checkpoint
session_begins        ExactlyOnce, EosStart       init_transactions, the checkpoint
wal_begins            EosSteps                    TxBatch.opened (covered: skipped)
record                EosSteps                    the admission rule (ExactlyOnce._admit)
dead_letter           ExactlyOnce                 the admission rule (ExactlyOnce._admit)
wal_ends              EosSteps                    TxBatch.closed (what is due)
serve                 ExactlyOnce                 the machine's due step; none while
                                                  commit_transaction has the producer
quiesce               ExactlyOnce                 the commit under way awaited (a
                                                  record produced alone goes in at once)
drain_dead_letters    CommitOverlap               only into an open transaction
read_wait_s           CommitOverlap               no wait with a commit due
record_failed         ExactlyOnce                 the transaction fails (fenced: noted)
dead_letter_failed    ExactlyOnce                 the transaction fails (fenced: noted)
kafka_raised          ExactlyOnce                 fenced: exit
session_ends          ExactlyOnce                 the last commit
session_failed        ExactlyOnce                 abort the open transaction
session_closed        ExactlyOnce, EpochMoved     fenced: exit (or the coordinator's
                                                  timeout: the session again)
producer_dropped      ExactlyOnce                 no close(), the commit joined
====================  ==========================  ===================================

The admission rule - no record or dead letter enters a Kafka transaction that is
aborting, failed or fenced, and none enters one being committed except through the
buffer - is :meth:`ExactlyOnce._admit`, asked by ``record`` and ``dead_letter`` with
the machine's answer (:meth:`TxBatch.record`, which they call themselves: a record
buffered during a commit costs one call, not three). ``record`` takes the machine's
OPEN case itself (no call), the model test checking it against :meth:`TxBatch.record`,
and hands a BUFFER answer to the commit's buffer (:attr:`CommitOverlap.hold`); the
buffer's release and the dead letters' drain ask the machine's :attr:`TxBatch.admits`
(the release reads it written out, per record).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, NoReturn

from confluent_kafka import KafkaError, KafkaException, Producer
from prometheus_client import CollectorRegistry, Counter

from cdc.errors import CdcError, ConfigError, KafkaUnavailableError, ProducerFatalError
from cdc.evidence import Origin
from cdc.health import Liveness
from cdc.kafka.producer import producer_config
from cdc.relay.delivery import checkpoint as ckpt
from cdc.relay.delivery.eos_start import EosStart
from cdc.relay.delivery.eos_steps import CheckpointTracker, EosSteps
from cdc.relay.delivery.epoch import FENCED_CODES, EpochMoved, fatal_code, is_fenced
from cdc.relay.delivery.overlap import (
    BUFFER_MAX_BYTES,
    BUFFER_MAX_RECORDS,
    JOINED_COMMITTED,
    JOINED_STUCK,
    CommitOverlap,
    serve_reports,
)
from cdc.relay.delivery.txbatch import Action, TxBatch, TxLimits, TxState
from cdc.relay.health.state import Session
from cdc.relay.stream.loop import Relay
from cdc.settings import Settings
from cdc.wal.lsn import LsnTracker
from cdc.wal.replproto import lsn_to_str

log = logging.getLogger("cdc.relay")

#: All attempts at one commit together; then the transaction is aborted.
COMMIT_BUDGET_S = 10.0
#: One abort_transaction call waits at most this long; a failed abort rebuilds the
#: producer (the new one's init_transactions aborts the transaction).
ABORT_TIMEOUT_S = 10.0
#: init_transactions waits at most this long (it waits for the previous producer
#: of the id: its open transaction is aborted first).
INIT_TIMEOUT_S = 30.0
#: While the relay reads a backlog (more WAL there than a read turn takes), a Kafka
#: transaction is committed at CDC_TX_MAX_RECORDS or this age, not at CDC_TX_MAX_MS:
#: its events are older than CDC_TX_MAX_MS already, and each commit costs a round trip
#: to the coordinator and markers in every partition leader. A second bounds the
#: work an abort throws away and the wait of the first events of a backlog.
BACKLOG_TX_MAX_MS = 1_000


class RelayFencedError(CdcError):
    """A newer relay took the transactional.id: this one publishes nothing more."""

    retriable = False


def transactional_id(configured: str, origin: Origin, slot: str) -> str:
    """``CDC_TRANSACTIONAL_ID``, or ``outbox-cdc.<system identifier>.<slot>``."""
    return configured or f"outbox-cdc.{origin.system_id}.{slot}"


_monotonic_ns = time.monotonic_ns
_NONE, _BEGIN, _WAIT, _REFUSE = Action.NONE, Action.BEGIN, Action.WAIT, Action.REFUSE
_COMMITTING = TxState.COMMITTING


def _now_ms() -> int:
    return _monotonic_ns() // 1_000_000  # (integers only: no float made)


class _ModeLiveness(Liveness):
    """``/readyz`` names the delivery mode after the state."""

    def set(self, state: str, *, ready: bool) -> None:
        super().set(f"{state} (exactly-once)", ready=ready)


class ExactlyOnceRelay(Relay):
    """The relay of ``CDC_DELIVERY=exactly-once``: the loop with :class:`ExactlyOnce`
    as its delivery mode (nothing of the loop overridden)."""

    def __init__(
        self,
        settings: Settings,
        *,
        registry: CollectorRegistry | None = None,
        serve_http: bool = True,
    ) -> None:
        super().__init__(
            settings,
            registry=registry,
            serve_http=serve_http,
            mode=ExactlyOnce,
            liveness=_ModeLiveness(),
        )


class ExactlyOnce:
    """The delivery mode of ``CDC_DELIVERY=exactly-once`` (see the module docstring),
    made of the relay's parts - its producer, dead letters, slot guard and standby wait -
    and its own collaborators, each owning its state: :class:`EosSteps` (the hot steps:
    the points ``wal_begins``, ``record`` and ``wal_ends`` are its bound methods),
    :class:`CommitOverlap` (the commit under way, the buffer; ``drain_dead_letters`` and
    ``read_wait_s`` are its) and :class:`EpochMoved` (a moved epoch judged). This object
    holds the session's machine (:class:`TxBatch`, told to each at the session's start),
    the admission rule (:meth:`_admit`) and what the machine asks done (:meth:`_act`)."""

    def __init__(self, relay: Relay) -> None:
        self.settings = s = relay.settings
        self.liveness = relay.liveness
        self._producing = relay.producing
        self._dead_letters = relay.dead_letters
        self._guard = relay.guard
        budget_ms = int(COMMIT_BUDGET_S * 1000)
        if s.standby_safe:
            # (held records are produced after their WAL transaction ended: a commit
            # could carry a checkpoint past records not yet in its transaction)
            raise ConfigError(
                "CDC_STANDBY_SAFE does not combine with CDC_DELIVERY=exactly-once: unset one"
            )
        if s.tx_timeout_ms <= budget_ms:
            raise ConfigError(
                f"CDC_TX_TIMEOUT_MS={s.tx_timeout_ms} must exceed the commit budget"
                f" ({budget_ms} ms)"
            )
        self._limits = TxLimits(
            max_records=s.tx_max_records,
            max_ms=s.tx_max_ms,
            backlog_max_ms=max(s.tx_max_ms, BACKLOG_TX_MAX_MS),
            abort_after_ms=s.tx_timeout_ms - budget_ms,
            commit_budget_ms=budget_ms,
            # (a buffer no larger than a transaction: the next one stays within its bound)
            buffer_max_records=min(BUFFER_MAX_RECORDS, s.tx_max_records),
            buffer_max_bytes=BUFFER_MAX_BYTES,
        )
        self._checkpoint_topic = ckpt.checkpoint_topic(s)
        self._start = EosStart(s)
        self._transactions = Counter(
            "outbox_relay_kafka_transactions_total",
            "Exactly-once: Kafka transactions ended, by outcome (committed, aborted)",
            ["outcome"],
            registry=relay.registry,
        )
        #: the producer whose init_transactions succeeded (None: call it first)
        self._initialised: Producer | None = None
        #: the session's transactions (a new machine at each session's start)
        self._batch = TxBatch(self._limits, 0)
        self._sess: Session | None = None
        self._fenced: str | None = None
        self._fenced_producer: Producer | None = None
        self._overlap = overlap = CommitOverlap(
            producing=relay.producing,
            dead_letters=relay.dead_letters,
            liveness=relay.liveness,
            checkpoint_topic=self._checkpoint_topic,
            transactions=self._transactions,
            batch=self._batch,
            registry=relay.registry,
            serve=self.serve,
            refuse=self._refuse,
            kafka_failed=self._kafka_failed,
        )
        self._steps = steps = EosSteps(
            batch=self._batch,
            send_record=relay.producing.send,
            hold=overlap.hold,
            commit_thread_running=overlap.thread_running,
            serve=self.serve,
            act=self._act,
            admit=self._admit,
            refuse=self._refuse,
        )
        self._epoch = EpochMoved(s, relay.standby)
        # The points its collaborators implement, bound here: the loop's call goes
        # straight to theirs (the hot ones once per message: no call in between).
        self.wal_begins = steps.wal_begins
        self.record = steps.record
        self.wal_ends = steps.wal_ends
        self.drain_dead_letters = overlap.drain_dead_letters
        self.read_wait_s = overlap.read_wait_s

    @property
    def _producer(self) -> Producer | None:
        """The session's producer (the relay's :attr:`Producing.producer`)."""
        return self._producing.producer

    @_producer.setter
    def _producer(self, producer: Producer | None) -> None:
        self._producing.producer = producer

    # -- the session -------------------------------------------------------------
    def new_producer(self, origin: tuple[str, bytes]) -> Producer:
        s = self.settings
        parsed = Origin.parse(origin[1])
        if parsed is None:
            raise KafkaUnavailableError(f"origin {origin[1]!r} does not parse")
        tid = transactional_id(s.transactional_id, parsed, s.slot)
        config: dict[str, Any] = dict(producer_config(s.kafka_bootstrap_servers, s.kafka_config))
        config.update(self._producing.events.config())
        config["delivery.report.only.error"] = self._producing.tracing is None
        config["transactional.id"] = tid
        config["transaction.timeout.ms"] = s.tx_timeout_ms
        # (records never outlive their transaction: at most the transaction timeout)
        config["message.timeout.ms"] = s.tx_timeout_ms
        log.info(
            "delivery exactly-once: transactional.id %s, checkpoint topic %s",
            tid,
            self._checkpoint_topic,
            extra={"topic": self._checkpoint_topic},
        )
        return Producer(config)

    def new_tracker(self, start_lsn: int) -> LsnTracker:
        return CheckpointTracker(start_lsn, self._batch)

    def session_closed(self) -> None:
        if self._fenced is not None:
            self._exit_fenced()

    def session_begins(self, sess: Session) -> None:
        """Fence the relay before (init_transactions), read the checkpoint, set the
        session's transactions up (the tracker then answers from them). A failed start
        abandons its producer too (``session_failed``: one whose init_transactions
        succeeded is never kept for a later session)."""
        producer = self._producer
        assert producer is not None and sess.origin is not None
        if self._initialised is not producer:
            try:
                producer.init_transactions(INIT_TIMEOUT_S)
            except KafkaException as exc:
                self._kafka_failed(exc, "init_transactions")
            self._initialised = producer
        origin = sess.origin[1].decode()
        start = sess.tracker._confirmed  # (the slot's confirmed position: the session's start)
        found = self._start.checkpoint(start, origin, self._guard.last_record)
        checkpoint = found if found is not None else 0
        self._batch = batch = TxBatch(self._limits, checkpoint)
        self._steps.start(batch)
        self._overlap.start(batch, origin)
        assert isinstance(sess.tracker, CheckpointTracker)
        sess.tracker.batch = batch
        self._sess = sess
        log.info(
            "checkpoint %s of %s; slot confirmed %s: WAL transactions below the checkpoint"
            " are skipped",
            lsn_to_str(checkpoint) if found is not None else "none",
            origin,
            lsn_to_str(start),
            extra={"lsn": lsn_to_str(checkpoint)},
        )

    def serve(self, timeout_s: float) -> None:
        """The producer served (not while commit_transaction has it: its end awaited
        instead), then what the machine says is due (the commit under way advanced)."""
        overlap = self._overlap
        if not overlap.wait(timeout_s):  # (commit_transaction has the producer: waited for)
            self._producing.poll(timeout_s)
        if self._fenced is not None:
            self._exit_fenced()
        sess = self._sess
        if sess is not None:
            if self._batch.state is _COMMITTING:
                self._act(sess, overlap.advance(sess))
            self._act(sess, self._due(sess))

    def quiesce(self, sess: Session) -> None:
        """The commit under way ended (:meth:`CommitOverlap.await_commit`): the records
        buffered meanwhile are in the next transaction, the next record goes in at once."""
        self._overlap.await_commit(sess)

    def session_ends(self, sess: Session) -> None:
        """Finish the commit under way, commit what can be (an open WAL transaction's
        records are aborted: the slot sends it again), before the relay's own shutdown:
        the last confirmation goes no further than the committed checkpoint."""
        overlap = self._overlap
        try:
            overlap.await_commit(sess)
            overlap.drain_dead_letters(sess)
            self._act(sess, self._batch.flush(_now_ms(), waiting=bool(sess.pending_dlq)))
            overlap.await_commit(sess)
        except KafkaUnavailableError as exc:  # (an abort, or a producer let go; fenced raises)
            log.warning("at shutdown: %s", exc)
        self._sess = None  # (the loop's polls act on transactions no more)

    # -- admission (records: EosSteps.record asks it) ---------------------------
    def dead_letter(self, sess: Session, tx_id: int) -> bool:
        """A dead letter (its record already added to the tracker) of ``tx_id``: not
        queued (acknowledged at once) when the checkpoint covers its WAL transaction, or
        when the admission rule refuses it - called from a delivery report too, so
        nothing is raised here: the abort is the machine's next answer to the loop
        (its transaction is lost anyway and the record read again, a refused one
        remembered). Buffered during a commit, it waits in pending_dlq meanwhile,
        counted in the next transaction."""
        batch = self._batch
        if batch.covered(tx_id) or self._admit(sess, 0, batch.record(_now_ms(), 0)) is _REFUSE:
            sess.tracker.ack(tx_id)
            return False
        return True

    def _admit(self, sess: Session, nbytes: int, action: Action) -> Action:
        """The admission rule, for a record of ``nbytes`` (key and value) or a dead
        letter (0) not in a covered WAL transaction: ``action``, the machine's answer
        (:meth:`TxBatch.record`, asked by the caller: one call less on the buffered
        path), acted on. NONE: into the open transaction (begun here when none was);
        BUFFER: a commit is under way, held for the next one (at the buffer's bound -
        WAIT - the reading waits for the commit's outcome and asks again); REFUSE: the
        transaction is aborting, failed or fenced - it enters none."""
        while action is _WAIT:
            self._overlap.await_commit(sess)
            action = self._batch.record(_now_ms(), nbytes)
        if action is _BEGIN:
            self._begin()
            return _NONE
        return action

    def _refuse(self, sess: Session) -> NoReturn:
        """A record the machine refused (the transaction is aborting, failed or fenced)
        is not produced: what is due is done - the abort, the session's end, the
        exit - and the session ends (its records are read again from the checkpoint)."""
        self._act(sess, self._batch.due(_now_ms()))
        raise KafkaUnavailableError("Kafka transaction aborted: reading again from the checkpoint")

    def _begin(self) -> None:
        """Begin the Kafka transaction the machine opened for a record."""
        producer = self._producer
        assert producer is not None
        try:
            producer.begin_transaction()
        except KafkaException as exc:
            self._kafka_failed(exc, "begin_transaction")

    def record_failed(self, sess: Session, err: KafkaError) -> bool:
        """A failed delivery report: the transaction cannot commit (aborted, the session
        ends); fenced: the relay stops. A record Kafka refused for itself is remembered
        (dead-lettered when it is read again). The machine is told first: no dead
        letter joins a transaction that must abort."""
        if is_fenced(err):
            self._fenced = self._fenced or f"{err.name()}: {err.str()}"
        self._batch.failed()
        return True

    def dead_letter_failed(self, sess: Session, err: KafkaError) -> bool:
        """A dead letter's delivery failed: its transaction cannot commit either (aborted,
        the session ends; the dead letter is made again when its record is read again)."""
        return self.record_failed(sess, err)

    def kafka_raised(self, exc: KafkaException, what: str) -> None:
        if is_fenced(exc) or fatal_code(exc) in FENCED_CODES:
            self._fenced = self._fenced or f"{what}: {exc}"
            self._exit_fenced()

    # -- transactions ------------------------------------------------------------
    def _due(self, sess: Session) -> Action:
        """What the transactions' machine says is due now (a backlog - the last read
        turn found more WAL than it read - lets the transaction grow longer; records of
        the buffer not yet produced wait like dead letters)."""
        return self._batch.due(
            _now_ms(), bool(sess.pending_dlq) or self._overlap.releasing, not sess.caught_up
        )

    def _act(self, sess: Session, action: Action) -> None:
        """Do what the transactions' machine asked (COMMIT, ABORT, RESTART, EXIT)."""
        while action is not Action.NONE:
            if action is Action.COMMIT:
                action = self._overlap.commit(sess)
            elif action is Action.ABORT:
                action = self._abort(sess, "a record of it failed, or it grew too old")
            elif action is Action.RESTART:
                raise KafkaUnavailableError(
                    "Kafka transaction aborted: reading again from the checkpoint"
                )
            elif action is Action.EXIT:
                self._exit_fenced()
            elif action is _BEGIN:  # (commit_ok: records were buffered during the commit)
                self._begin()
                self._overlap.release(sess)
                action = self._due(sess)
            else:  # BUFFER, WAIT and REFUSE come only from record(), WAIT from flush() too
                raise AssertionError(action)

    def _abort(self, sess: Session, why: str) -> Action:
        producer = self._producer
        assert producer is not None
        outcome = self._overlap.join_outcome()
        if outcome == JOINED_COMMITTED:  # (no transaction is open, the buffer in none)
            self._transactions.labels("committed").inc()
            return self._batch.aborted()
        if outcome == JOINED_STUCK:  # (abort_transaction would conflict with it)
            self._transactions.labels("aborted").inc()
            self._batch.aborted()
            self._drop_producer()
            raise ProducerFatalError(
                f"Kafka transaction commit not finished within {COMMIT_BUDGET_S:g}s: a new"
                " producer (its init_transactions aborts the transaction)"
            )
        log.warning("aborting the Kafka transaction (%s)", why)
        self._transactions.labels("aborted").inc()
        try:
            producer.abort_transaction(ABORT_TIMEOUT_S)
        except KafkaException as exc:
            if is_fenced(exc) or fatal_code(exc) in FENCED_CODES:
                self._fenced = self._fenced or f"abort_transaction: {exc}"
                self._exit_fenced()
            self._batch.aborted()
            self._drop_producer()
            raise ProducerFatalError(
                f"Kafka transaction abort failed ({exc}): a new producer (its"
                " init_transactions aborts the transaction)"
            ) from exc
        return self._batch.aborted()

    def session_failed(self, sess: Session) -> None:
        """The session ends with an exception: abort a Kafka transaction left open
        (fenced: the relay stops; a failed abort: the producer is rebuilt)."""
        self._sess = None
        open_states = (TxState.OPEN, TxState.COMMITTING, TxState.ABORTING)
        if self._batch.state in open_states and self._fenced is None and self._producer is not None:
            self._abort(sess, "the session ended")
        # A new session takes a new producer: init_transactions runs once per producer,
        # and the next session may come after another relay held the slot (and fenced
        # this producer) - a fresh one takes the id back.
        self._drop_producer()

    def producer_dropped(self) -> None:
        self._drop_producer()  # (close() would try to end the transaction once more)

    def _kafka_failed(self, exc: KafkaException, what: str) -> None:
        """A transactional call failed: fenced stops the relay; anything else ends the
        session (a fatal error rebuilds the producer)."""
        if is_fenced(exc) or fatal_code(exc) in FENCED_CODES:
            self._fenced = self._fenced or f"{what}: {exc}"
            self._exit_fenced()
        err = exc.args[0] if exc.args else None
        if isinstance(err, KafkaError) and err.txn_requires_abort():
            self._batch.failed()
            raise KafkaUnavailableError(f"{what} failed: {exc}") from exc
        if fatal_code(exc) is not None:
            self._drop_producer()
            raise ProducerFatalError(f"{what} failed: {exc}") from exc
        raise KafkaUnavailableError(f"{what} failed: {exc}") from exc

    def _drop_producer(self) -> None:
        """Serve the reports already there (a refused record is remembered), purge and
        let go of the producer without close() (which would try to end the transaction
        once more); the next session makes a new one."""
        overlap = self._overlap
        overlap.forget()
        producer, self._producer = self._producer, None
        self._initialised = None
        if producer is not None and not overlap.left_to_thread(producer):
            serve_reports(producer)
            with contextlib.suppress(KafkaException):
                producer.purge(in_queue=True, in_flight=True)

    def _exit_fenced(self) -> NoReturn:
        """The producer's epoch moved on. A takeover
        (:func:`cdc.relay.delivery.epoch.is_takeover`): publish
        nothing more - purge the producer's records and raise (it is not closed: close()
        would try to abort the transaction the broker already ended). The coordinator's
        transaction timeout instead: one WARNING, a new producer, the session again
        (:class:`cdc.relay.delivery.epoch.TransactionTimedOutError`)."""
        if not self._epoch.taken_over(self._batch):  # (the coordinator's timeout)
            why, self._fenced = self._fenced, None
            timed_out = self._epoch.timed_out(self._batch, why)
            self._transactions.labels("aborted").inc()
            self._batch.aborted()
            self._drop_producer()
            raise timed_out  # (the session again, a new producer)
        self._batch.fenced()
        overlap = self._overlap
        overlap.join()
        producer, self._producer = self._producer, None
        if producer is not None and not overlap.left_to_thread(producer):
            with contextlib.suppress(KafkaException):
                producer.purge(in_queue=True, in_flight=True)
            self._fenced_producer = producer  # (destroyed with the process)
        raise RelayFencedError(
            f"fenced: another relay took transactional.id of slot {self.settings.slot}"
            f" ({self._fenced}); this one publishes nothing more and exits"
        )
