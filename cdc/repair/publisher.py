"""The publisher of a republishing run: every record acknowledged, bounded transactions.

:func:`cdc.repair.republish.republish` (the start-up check, the audit's repair) and
the gap recovery (:func:`cdc.relay.gaps.recovery.recover`) hand it the records
their rows make (:func:`cdc.repair.republish.outbox_record`), in the order read.

Guarantees:

* every record is acknowledged by Kafka before the run returns:
  :meth:`Publisher.wait_acked` waits for the last delivery report (at most
  :data:`ACK_TIMEOUT_S`); any Kafka error other than a refused record raises
  :class:`~cdc.errors.KafkaUnavailableError` (a gap stays open; a second repair
  publishes again, harmless: consumers dedupe on ``id``);
* a record refused for itself - by Kafka (too large, invalid) - is dead-lettered
  with the reason, never dropped; a dead letter Kafka refuses is sent again in its
  minimal form (every field cut to :data:`DLQ_MINIMAL_FIELD_BYTES`), and one
  refused in that form raises. Kafka judges a batch, not a record (a topic's
  ``max.message.bytes`` against the whole batch; librdkafka fails each of its
  records): a record refused with its batch is made again from its row and
  produced alone, and only a refusal of it alone makes its dead letter - its
  batch-mates reach their topic;
* in exactly-once mode (:func:`cdc.repair.transactional.exactly_once`) the run
  publishes in Kafka transactions (:class:`cdc.repair.transactional.Transactions`),
  skipping every id ``read_committed`` consumers already hold; each transaction is
  committed once every record of it is acknowledged, and **bounded**: once it holds
  ``CDC_REPUBLISH_TX_MAX_RECORDS`` records or has been open a share of ``CDC_TX_TIMEOUT_MS``
  (:meth:`Transactions.full`) it is committed and the next one opened - a window of
  ten million rows is hundreds of transactions, none near the timeout, none
  holding a partition's last stable offset (what read_committed consumers of the
  streamed records can see) longer than one of them. A transaction is cut anywhere,
  inside the rows of one WAL transaction too: a row is known by its id, not its
  position, and a run that starts again skips the ids already committed;
* the end of a full transaction - its records' acknowledgements, then
  ``commit_transaction`` - runs on a thread of its own (:class:`_Commit`) while the
  run goes on reading rows and making their records, held (at most
  ``CDC_REPUBLISH_TX_MAX_RECORDS``) and produced into the next transaction once the commit
  returned (librdkafka takes no record into a new transaction before) - up to
  its bound, whose commit then starts on its thread in turn: one producer, the
  records in the order read; a transaction opens at its first record (a window
  Kafka holds whole opens none);
* **an aborted transaction is redone, not the window**: a transaction whose record
  Kafka refused (dead-lettered in the redo), whose record failed otherwise or whose
  commit failed is aborted and its records are produced again in a new transaction,
  at most :data:`TX_ATTEMPTS` times; then the run fails (the next run skips what was
  committed). What is kept for a redo is the event ids of the open transaction's
  records (at most ``CDC_REPUBLISH_TX_MAX_RECORDS``), not the records: the redo makes
  them again from their rows (``again``: the run's rows as the run read them - the
  outbox table is the truth). Kept whole, a copy of every record cost the reading a
  sixth of its time (at 10,000,000 rows: a ``marshal`` copy per record, 17% of the
  main thread's samples; as objects, before that, more).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from cdc import constants as c
from cdc.errors import KafkaUnavailableError
from cdc.kafka.producer import PURGED, IdsInFlight, TopicManager, is_record_error, make_producer
from cdc.repair.transactional import TX_CALL_TIMEOUT_S, Transactions, exactly_once
from cdc.router import KafkaRecord, TxContext, dead_letter
from cdc.settings import Settings

log = logging.getLogger("cdc.relay")

#: Records produced between two polls of the delivery reports (the queue's room is
#: polled for as well whenever it is full).
POLL_EVERY = 100
#: Longest wait for Kafka to acknowledge the recovered records.
ACK_TIMEOUT_S = 120.0
#: A dead letter's value above this is replaced by a note (as the streaming path does).
DLQ_MAX_VALUE_BYTES = 512 * 1024
#: Exactly-once: a republishing transaction that aborts is redone (its records only)
#: at most this many times; then the run fails.
TX_ATTEMPTS = 5
#: Exactly-once: the longest wait for a transaction's end on its thread - its flush
#: (ACK_TIMEOUT_S) and commit_transaction (TX_CALL_TIMEOUT_S) are bounded, and a margin.
COMMIT_JOB_MAX_S = ACK_TIMEOUT_S + TX_CALL_TIMEOUT_S + 10.0


class Acks:
    """Failed delivery reports of the recovery's records: records Kafka refused for
    themselves (to dead-letter), the first other error. The producer runs with
    ``delivery.report.only.error``: a delivered record calls nothing, and
    ``flush()`` returning 0 means every report was served."""

    def __init__(self) -> None:
        self.refused: list[tuple[KafkaError, KafkaRecord]] = []
        self.error: KafkaError | None = None

    def failed(self, err: KafkaError, msg: Message, event_id: bytes | None) -> None:
        if err.code() in PURGED:  # (an aborted transaction's records: redone)
            return
        if is_record_error(err):
            self.refused.append((err, _refused_record(msg, event_id)))
        else:
            self.error = self.error or err


class _Run(IdsInFlight):
    """The delivery-report callback of up to :data:`RUN_RECORDS` recovered records:
    a failed report finds its record's event id (reports carry no headers)."""

    __slots__ = ("acks",)

    acks: Acks

    def __call__(self, err: KafkaError | None, msg: Message) -> None:
        if err is None:
            return
        if not is_record_error(err):
            self.acks.failed(err, msg, None)
            return
        claimed = self.event_id_of(msg)
        self.acks.failed(err, msg, claimed)
        # (records alike in key and value: the report cannot say which one was refused,
        # so each is judged again - else one could be taken for delivered, and be lost)
        for event_id in self.alike(msg):
            if event_id != claimed:
                self.acks.failed(err, msg, event_id)


#: librdkafka's "erroneous state": produce() into a transaction that failed already.
_STATE = KafkaError._STATE

#: Records that share one :class:`_Run` (it is freed once all their reports are served).
RUN_RECORDS = 1_000


#: A dead letter Kafka refused for its size is sent again with every field cut to this.
DLQ_MINIMAL_FIELD_BYTES = 1024


def _refused_record(msg: Message, event_id: bytes | None) -> KafkaRecord:
    """A refused record back from its delivery report, with the event id its run
    found (the report itself carries no headers)."""
    headers = [(c.HEADER_ID, event_id)] if event_id else []
    return KafkaRecord(
        str(msg.topic()),
        msg.key() or b"",
        msg.value() or b"",
        headers,
        int(msg.timestamp()[1]),
        (event_id or b"").decode(errors="replace"),
    )


def _dead_letter_of(
    err: KafkaError, record: KafkaRecord, settings: Settings, origin: tuple[str, bytes] | None
) -> KafkaRecord:
    """The dead letter of a recovered record Kafka refused (as the streaming path writes
    it, ``origin`` the republisher's); the minimal form when the refused record is itself
    a dead letter."""
    minimal = record.topic == settings.dlq_topic
    if minimal and b'"original_key_size"' in record.value:  # already the minimal form
        raise KafkaUnavailableError(f"recovery: Kafka refused a dead letter: {err.str()}")
    return dead_letter(
        reason=f"Kafka refused the record: {err.str()}",
        event_id=record.event_id,
        original_topic=record.topic,
        key=record.key,
        raw=record.value,
        headers=record.headers,
        tx=TxContext("", record.timestamp_ms * 1000, origin),
        dlq_topic=settings.dlq_topic,
        max_value_bytes=0 if minimal else DLQ_MAX_VALUE_BYTES,
        max_field_bytes=DLQ_MINIMAL_FIELD_BYTES if minimal else None,
    )


#: The records of the given event ids made again from their rows, in the order given (a
#: row gone from the table is passed by): what a redo produces, and a record refused with
#: its batch, produced alone. The run's own reader
#: (:func:`cdc.repair.republish.rows_again`: its rows as the run read them).
Again = Callable[[list[str]], Iterable[KafkaRecord]]


@dataclass
class Publisher:
    """Sends the records of one run (:meth:`send`) and waits until Kafka acknowledged
    every one (:meth:`wait_acked`): ``sent`` counts them, a dead letter in place of a
    refused record. With ``tx`` (exactly-once) every record goes into a bounded Kafka
    transaction, committed at its bound or at :meth:`wait_acked`, redone if it aborts."""

    settings: Settings
    producer: Producer
    topics: TopicManager
    acks: Acks
    sent: int = 0
    run: _Run | None = None
    #: exactly-once mode: the ids to skip and the transactions (cdc.repair.transactional)
    tx: Transactions | None = None
    #: the ``origin`` header of the run's records: its dead letters carry it too
    origin: tuple[str, bytes] | None = None
    #: the records of a redone transaction, or of ones refused with their batch, made
    #: again from their rows
    again: Again | None = None
    #: exactly-once: the event ids of the open transaction's records, in order - what is
    #: kept for its redo (its records are made again from their rows: see the module)
    kept: list[str] = field(default_factory=list)
    #: exactly-once: aborts of the open transaction so far (reset at its commit)
    attempts: int = 0
    #: exactly-once: transactions redone after an abort
    redone: int = 0
    #: exactly-once: the full transaction's acknowledgements and commit, under way on a
    #: thread of its own while the next records are read and built
    job: _Commit | None = None
    #: exactly-once: records built meanwhile, produced into the next transaction
    held: list[KafkaRecord] = field(default_factory=list)
    #: the event ids produced alone (:meth:`_produce_alone`): a refusal judges the record
    alone: set[str] = field(default_factory=set)
    #: exactly-once: records kept for a redo but not produced (their transaction had failed)
    unproduced: int = 0

    def send(self, record: KafkaRecord) -> None:
        tx = self.tx
        if tx is None:
            self._produce(record)
            return
        if tx.skip(record.event_id):
            return
        job = self.job
        if job is not None:  # (a commit under way: held for the next transaction)
            held = self.held
            held.append(record)
            if len(held) >= tx.max_records or job.done.is_set():
                self._next_transaction()
            return
        self._add(record, tx)

    def _add(self, record: KafkaRecord, tx: Transactions) -> None:
        """Produce ``record`` into the open transaction (opened for it if none is); a
        transaction at its bound ends on a thread (:class:`_Commit`: its acknowledgements
        and commit) while the reading and the records' making go on, into ``held``."""
        kept = self.kept
        if not kept:
            tx.begin()
        kept.append(self._produce(record).event_id)
        if tx.full(len(kept)):
            self.run = None
            self.job = _Commit(self.producer, tx, self.acks)

    def _next_transaction(self) -> None:
        """The commit under way ends (a failed one is redone), then the records held
        meanwhile go into the next transaction - up to its bound: the rest stay held
        while that one's commit is under way."""
        job, self.job = self.job, None
        if job is not None:
            self._end(job)
        held, self.held = self.held, []
        tx = self.tx
        assert tx is not None
        for at, record in enumerate(held):
            if self.job is not None:
                self.held = held[at:]
                return
            self._add(record, tx)

    def _end(self, job: _Commit) -> None:
        """Wait for ``job`` (its calls are bounded: so is the wait); a transaction it did
        not commit is redone here."""
        if not job.done.wait(COMMIT_JOB_MAX_S):
            raise KafkaUnavailableError(
                f"republishing: a transaction's commit did not end within {COMMIT_JOB_MAX_S:g}s"
            )
        if job.failed is not None or self.acks.error is not None or self.acks.refused:
            self._settle(redo=job.failed or "a record failed")  # (redone, committed)
        else:
            self.kept, self.attempts = [], 0

    def _produce(self, record: KafkaRecord) -> KafkaRecord:
        """Produce ``record`` (its dead letter when the producer refuses it); what was
        produced."""
        if record.topic not in self.topics.known:
            self.topics.ensure([record.topic])
        run = self.run
        if run is None or len(run) >= RUN_RECORDS:
            run = self.run = _Run()
            run.acks = self.acks
        while True:
            try:
                # Positional (topic, value, key, partition, callback, on_delivery,
                # timestamp, headers), as the streaming path: keywords cost a tenth.
                self.producer.produce(
                    record.topic,
                    record.value,
                    record.key,
                    -1,
                    run,
                    None,
                    record.timestamp_ms,
                    record.headers,  # type: ignore[arg-type]  # (list is invariant)
                )
                break
            except BufferError:
                self.producer.poll(0.1)
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if isinstance(err, KafkaError) and is_record_error(err):
                    record = _dead_letter_of(err, record, self.settings, self.origin)
                    continue
                if self.tx is not None and isinstance(err, KafkaError) and err.code() == _STATE:
                    # The open transaction failed already (a record of it refused: librdkafka
                    # takes no record into it after that): this one is kept, not produced -
                    # the transaction cannot commit, and its redo produces every kept id.
                    self.unproduced += 1
                    self.sent += 1
                    return record
                raise KafkaUnavailableError(f"recovery produce failed: {exc}") from exc
        run.append((hash((record.key, record.value)), record.event_id.encode()))
        self.sent += 1
        if not self.sent % POLL_EVERY:  # delivery reports: served in batches, not per row
            self.producer.poll(0)
        return record

    def wait_acked(self) -> None:
        """Until Kafka acknowledged every record; refused ones are dead-lettered (and
        acknowledged) first; any other error raises (the gap stays open). Exactly-once:
        the commit under way ends first, the records held meanwhile are produced, and
        the open transaction is committed; one that cannot be (a record of it failed,
        or the commit) is aborted and redone."""
        while self.job is not None or self.held:
            self._next_transaction()
        self._settle()

    def _settle(self, redo: str | None = None) -> None:
        """:meth:`wait_acked`'s wait (``redo``: abort and redo the open transaction first)."""
        self.run = None  # (its reports can free it)
        deadline = time.monotonic() + ACK_TIMEOUT_S
        if redo is not None:
            self._redo(redo)
        while True:
            left = self.producer.flush(1.0)  # (serves the reports)
            tx = self.tx
            if tx is not None and (self.acks.error is not None or self.acks.refused):
                self._redo(f"a record failed: {self.acks.error or self.acks.refused[0][0]}")
                deadline = time.monotonic() + ACK_TIMEOUT_S
                continue
            if self.acks.error is not None:
                raise KafkaUnavailableError(f"recovery: Kafka error: {self.acks.error}")
            if self.acks.refused:
                self._dead_letter_refused()
                self.run = None
                continue
            if not left:
                if tx is not None:
                    try:
                        tx.commit()
                    except KafkaUnavailableError as exc:
                        self._redo(str(exc))
                        deadline = time.monotonic() + ACK_TIMEOUT_S
                        continue
                    self.kept, self.attempts = [], 0
                return
            if time.monotonic() > deadline:
                raise KafkaUnavailableError(f"recovery: {left} records not acknowledged")

    def _redo(self, why: str) -> None:
        """Exactly-once: abort the open transaction and produce its records again in a
        new one (a refused record replaced by its dead letter); the run fails after
        :data:`TX_ATTEMPTS` aborts of one transaction, or when the abort fails."""
        tx, again = self.tx, self.again
        assert tx is not None and again is not None, "exactly-once publishes with a redo source"
        self.attempts += 1
        if self.attempts > TX_ATTEMPTS:
            raise KafkaUnavailableError(
                f"republishing: a Kafka transaction of {len(self.kept)} records aborted"
                f" {TX_ATTEMPTS} times: {why}"
            )
        log.warning(
            "republishing: aborting a Kafka transaction of %d records (%s): redoing it",
            len(self.kept),
            why,
        )
        refused = {record.event_id: err for err, record in self.acks.refused}
        self.producer = tx.renew()  # (the failed transaction aborted, a new producer)
        self.acks.refused, self.acks.error, self.run = [], None, None
        kept, self.kept = self.kept, []
        self.sent -= len(kept)
        suspects = sum(1 for i in refused if i and i not in self.alone)
        if suspects:
            _refused_with_batch(suspects)
        tx.begin()
        for record in again(kept):
            err = refused.get(record.event_id)
            if err is None:
                self.kept.append(self._produce(record).event_id)
            elif record.event_id in self.alone:  # refused alone: its dead letter
                dead = _dead_letter_of(err, record, self.settings, self.origin)
                self.kept.append(self._produce(dead).event_id)
            else:  # refused with its batch: judged alone (refused again, redone again)
                self.kept.append(self._produce_alone(record).event_id)
        self.redone += 1

    def _dead_letter_refused(self) -> None:
        """At-least-once: the refused records' dead letters - of those refused alone
        (:meth:`_produce_alone`); the others, refused with their batch (Kafka judges a
        batch: they may be innocent batch-mates), are made again from their rows and
        produced alone, their reports served before the next record goes."""
        refused, self.acks.refused = self.acks.refused, []
        suspects: dict[str, None] = {}  # (an id once: alike records name each other)
        for err, record in refused:
            event_id = record.event_id
            if event_id and event_id not in self.alone and self.again:
                suspects[event_id] = None
            elif event_id not in suspects:
                self.sent -= 1  # the refused record is replaced by its dead letter
                self.send(_dead_letter_of(err, record, self.settings, self.origin))
        self.sent -= len(suspects)  # (each is produced again)
        if suspects and self.again is not None:
            _refused_with_batch(len(suspects))
            for record in self.again(list(suspects)):
                self._produce_alone(record)

    def _produce_alone(self, record: KafkaRecord) -> KafkaRecord:
        """Produce ``record`` with no other in its batch: every report before it served,
        then it, then its own report (each wait bounded by :data:`ACK_TIMEOUT_S`); a
        refusal then judges the record itself (dead-lettered: :meth:`_dead_letter_refused`,
        or the redo). Exactly-once, in a transaction failed already, it is only kept
        (judged in the redo)."""
        self._flush_all()
        if self.tx is not None and (self.acks.refused or self.acks.error is not None):
            self.sent += 1
            return record
        unproduced = self.unproduced
        produced = self._produce(record)
        if produced is record and self.unproduced == unproduced:  # (not its dead letter)
            self.alone.add(record.event_id)
        self._flush_all()
        return produced

    def _flush_all(self) -> None:
        self.run = None  # (its reports can free it)
        left = self.producer.flush(ACK_TIMEOUT_S)
        if left:
            raise KafkaUnavailableError(
                f"republishing: {left} records not acknowledged within {ACK_TIMEOUT_S:g}s"
            )


def _refused_with_batch(count: int) -> None:
    log.warning(
        "republishing: Kafka refused %d records with their batch (it judges a batch):"
        " each is produced alone, and only one refused alone is dead-lettered",
        count,
    )


class _Commit:
    """Exactly-once: one full transaction's end on a thread of its own (daemon; every
    call bounded): every record acknowledged (``flush``: a refused record's report is
    served here, into :class:`Acks`), then - when none failed - ``commit_transaction``.
    ``failed``: why the commit did not happen (the publisher then redoes the
    transaction on its own thread)."""

    __slots__ = ("done", "failed")

    def __init__(self, producer: Producer, tx: Transactions, acks: Acks) -> None:
        self.done = threading.Event()
        self.failed: str | None = None
        threading.Thread(
            target=self._run, args=(producer, tx, acks), name="republish-commit", daemon=True
        ).start()

    def _run(self, producer: Producer, tx: Transactions, acks: Acks) -> None:
        try:
            left = producer.flush(ACK_TIMEOUT_S)
            if left:
                self.failed = f"{left} records not acknowledged within {ACK_TIMEOUT_S:g}s"
            elif acks.error is None and not acks.refused:
                tx.commit()
        except BaseException as exc:  # (handed to the publisher's thread, never lost)
            self.failed = str(exc)
        finally:
            self.done.set()


def publishing_producer(
    settings: Settings, *, system_id: str, purpose: str
) -> tuple[Producer, Transactions | None]:
    """The producer of a republishing run: transactional in exactly-once mode (with the
    ids to skip filled in by the caller), else the relay's at-least-once producer."""
    if exactly_once(settings):
        tx = Transactions(settings, system_id=system_id, purpose=purpose)
        return tx.producer, tx
    # Delivered records call nothing (a _Run per RUN_RECORDS finds a refused one's id).
    producer = make_producer(
        settings.kafka_bootstrap_servers, settings.kafka_config, failed_reports_only=True
    )
    return producer, None
