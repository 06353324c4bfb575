"""The idempotent consumer's loop: poll a record, run its handler once per event id.

See :mod:`sinks.idempotent` for the guarantees; this module drives the pure
books (:mod:`sinks.idempotent.books`), the tables (:mod:`sinks.idempotent.ledger`)
and the dead letters (:mod:`sinks.idempotent.dead_letter`) from one thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from cdc.kafka.log import KafkaClientEvents
from sinks.core.delivery import Envelope
from sinks.idempotent.books import TP, AttemptBook, PauseActions, PauseBook, event_id_of
from sinks.idempotent.constants import RETRY_BACKOFF_CAP_S
from sinks.idempotent.dead_letter import DeadLetters
from sinks.idempotent.errors import (
    BadEvent,
    ConsumerUsageError,
    DeadLetterError,
    IdempotencyError,
    LedgerUnavailable,
)
from sinks.idempotent.ledger import Ledger, ensure_ledger, require_idle, safe_text
from sinks.idempotent.model import ConsumerOptions, FailurePolicy, Outcome, Processed, Stats

log = logging.getLogger(__name__)

Conn = psycopg.Connection[Any]
#: ``handler(conn, record)``: runs inside the transaction that writes the ledger row.
Handler = Callable[[Conn, Envelope], object]


class IdempotentConsumer:
    """See :mod:`sinks.idempotent`. Not thread-safe: one thread polls it.

    ``kafka_config`` is the confluent-kafka consumer configuration (``group.id``
    required); the helper sets ``enable.auto.offset.store=false`` and
    ``enable.auto.commit=true`` itself (auto commit then sends stored offsets
    only; ``auto.commit.interval.ms`` bounds what a crash redelivers - and the
    ledger skips). ``topics`` may hold regex subscriptions (``^...``).
    """

    def __init__(
        self,
        conn: Conn,
        handler: Handler,
        *,
        kafka_config: Mapping[str, Any],
        topics: Sequence[str],
        options: ConsumerOptions,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        options.check()
        if "group.id" not in kafka_config:
            raise ConsumerUsageError("kafka_config needs group.id")
        self.name = options.name
        self.conn = conn
        self.options = options
        self.stats = Stats()
        self._handler = handler
        self._ledger = Ledger(
            conn,
            name=options.name,
            ledger_table=options.ledger_table,
            parking_table=options.parking_table,
        )
        self._clock = clock
        self._book = AttemptBook(
            max_attempts=options.max_attempts, backoff_base_s=options.retry_backoff_s
        )
        #: partitions held paused after a failure, until when (kept across rebalances)
        self._pauses = PauseBook()
        #: why a record was given up, kept while its dead letter waits for Kafka
        self._given_up: dict[tuple[str, int, int], str] = {}
        self._stop = False
        if options.create_tables:
            ensure_ledger(
                conn, ledger_table=options.ledger_table, parking_table=options.parking_table
            )
        self._kafka_config = dict(kafka_config)
        self._dead_letters = DeadLetters(
            self._kafka_config, name=options.name, topic=options.dead_letter_topic
        )
        self._events = KafkaClientEvents(f"idempotent.{options.name}")
        self.consumer = Consumer(
            {
                "auto.offset.reset": "earliest",
                # librdkafka's default, stated: records of aborted relay transactions
                # (CDC_DELIVERY=exactly-once) are never handled; the ledger still dedupes
                "isolation.level": "read_committed",
                **self._kafka_config,
                **self._events.config(),
                "enable.auto.offset.store": False,
                "enable.auto.commit": True,
            }
        )
        self.consumer.subscribe(
            list(topics),
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_revoke,
        )

    # -- lifecycle ---------------------------------------------------------------------
    def __enter__(self) -> IdempotentConsumer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def stop(self) -> None:
        """Ask :meth:`run` to return after the record in hand (signal-safe)."""
        self._stop = True

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` was called."""
        return self._stop

    @property
    def held_partitions(self) -> set[TP]:
        """Partitions the helper holds paused after a failure (assigned ones)."""
        return {tp for tp in self._assigned() if self._pauses.holds(tp)}

    def run(self, *, poll_timeout_s: float = 1.0) -> None:
        """Poll and process records until :meth:`stop`."""
        while not self._stop:
            self.poll_once(poll_timeout_s)

    def close(self) -> None:
        """Leave the group; stored offsets are committed on the way out."""
        self._dead_letters.flush()
        self.consumer.close()

    # -- one record ------------------------------------------------------------------------
    def poll_once(self, timeout_s: float = 1.0) -> Processed | None:
        """Process at most one record; what became of it, or None when none came."""
        self._apply(self._pauses.due(self._clock()))
        msg = self.consumer.poll(timeout_s)
        if msg is None:
            return None
        err = msg.error()
        if err is not None:
            self._on_kafka_error(err, msg.topic(), msg.partition())
            return None
        record = Envelope.from_kafka(msg)  # the one read of the message's headers
        del msg  # never touched again (see sinks.core.delivery.read_headers)
        if self._pauses.holds(record.topic_partition):  # fetched before the seek back
            outcome = Outcome.STALE
        else:
            try:
                outcome = self._process(record)
            except BaseException:
                # Whatever escapes, nothing behind this record in its partition
                # may run (and store its offset) before this record is done.
                self._rewind(record, RETRY_BACKOFF_CAP_S)
                raise
        self.stats.count(outcome)
        try:
            event_id: str | None = event_id_of(record)
        except BadEvent:
            event_id = None
        return Processed(outcome=outcome, record=record, event_id=event_id)

    def _process(self, record: Envelope) -> Outcome:
        require_idle(self.conn)
        try:
            event_id = event_id_of(record)
        except BadEvent as exc:
            return self._give_up(record, None, exc.reason)
        reason = self._given_up.get(record.position)
        if reason is not None:  # given up; its dead letter was not acknowledged
            return self._give_up(record, event_id, reason)
        try:
            with self.conn.transaction():
                fresh = self._ledger.insert(event_id, record, "handled")
                if fresh:
                    self._handler(self.conn, record)
        except Exception as exc:
            return self._handler_failed(record, event_id, exc)
        self._done(record)
        if not fresh:
            log.info(
                "event %s already processed by %s: skipped",
                event_id,
                self.name,
                extra=_fields(record, event_id),
            )
            return Outcome.DUPLICATE
        return Outcome.HANDLED

    def _handler_failed(self, record: Envelope, event_id: str, exc: Exception) -> Outcome:
        if self.conn.closed or self.conn.broken:
            raise LedgerUnavailable(f"PostgreSQL connection lost: {exc}") from exc
        reason = safe_text(f"{type(exc).__name__}: {exc}")
        delay_s = self._book.failed(record.position)
        if delay_s is None:
            return self._give_up(record, event_id, reason)
        log.warning(
            "event %s failed in %s (attempt %d of %d), again in %.1fs: %s",
            event_id,
            self.name,
            self._book.failures(record.position),
            self._book.max_attempts,
            delay_s,
            reason,
            extra=_fields(record, event_id),
        )
        self._rewind(record, delay_s)
        return Outcome.RETRY

    def _give_up(self, record: Envelope, event_id: str | None, reason: str) -> Outcome:
        attempts = self._book.failures(record.position)
        if self.options.on_failure is FailurePolicy.DEAD_LETTER:
            try:
                self._dead_letters.send(record, reason)
            except DeadLetterError as exc:
                log.error("%s", exc.reason, extra=_fields(record, event_id))
                self._given_up[record.position] = reason
                self._rewind(record, RETRY_BACKOFF_CAP_S)
                return Outcome.RETRY
            with self.conn.transaction():
                if event_id is not None:
                    self._ledger.insert(event_id, record, "dead_lettered")
            outcome = Outcome.DEAD_LETTERED
        else:
            with self.conn.transaction():
                if event_id is not None:
                    self._ledger.insert(event_id, record, "parked")
                self._ledger.park(record, event_id, reason, attempts)
            outcome = Outcome.PARKED
        log.warning(
            "event %s %s by %s after %d attempt(s): %s",
            event_id or "?",
            outcome.value,
            self.name,
            attempts,
            reason,
            extra=_fields(record, event_id),
        )
        self._done(record)
        return outcome

    def _done(self, record: Envelope) -> None:
        """The transaction committed: only now may the offset move past the record."""
        self._book.settle(record.position)
        self._given_up.pop(record.position, None)
        self.consumer.store_offsets(
            offsets=[TopicPartition(record.topic, record.partition, record.offset + 1)]
        )

    def _rewind(self, record: Envelope, delay_s: float) -> None:
        """Pause the record's partition for ``delay_s`` and seek it back to the record."""
        self._apply(self._pauses.hold(record.topic_partition, until=self._clock() + delay_s))
        self.consumer.seek(TopicPartition(record.topic, record.partition, record.offset))

    def _apply(self, actions: PauseActions) -> None:
        """Carry out the pause book's answer on the client."""
        for method, tps in (
            (self.consumer.pause, actions.pause),
            (self.consumer.resume, actions.resume),
        ):
            if not tps:
                continue
            try:
                method([TopicPartition(t, p) for t, p in tps])
            except KafkaException as exc:  # e.g. a partition the client does not know yet
                log.warning(
                    "consumer %s: %s of %s failed: %s", self.name, method.__name__, tps, exc
                )

    def _assigned(self) -> set[TP]:
        return {(tp.topic, tp.partition) for tp in self.consumer.assignment()}

    # -- Kafka ---------------------------------------------------------------------------------
    def _on_kafka_error(self, err: KafkaError, topic: str | None, partition: int | None) -> None:
        if err.code() == KafkaError._PARTITION_EOF:
            return
        if err.fatal():
            raise IdempotencyError(f"consumer {self.name}: fatal Kafka error: {err.str()}")
        log.warning(
            "consumer %s: %s",
            self.name,
            err.str(),
            extra={"topic": topic, "partition": partition},
        )

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """(Re)assigned: start from the committed offset; a held partition stays paused
        until its deadline, every other one is resumed (librdkafka keeps a pause
        across revoke/assign)."""
        tps = [(tp.topic, tp.partition) for tp in partitions]
        self._forget(tps)
        self._apply(self._pauses.assigned(tps, now=self._clock()))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        tps = [(tp.topic, tp.partition) for tp in partitions]
        self._forget(tps)
        self._pauses.revoked(tps)

    def _forget(self, tps: list[TP]) -> None:
        """Partitions (re)assigned or taken away: their attempt counts start afresh."""
        gone = set(tps)
        for position in [p for p in self._given_up if (p[0], p[1]) in gone]:
            del self._given_up[position]
        self._book.forget_partitions(tps)


def _fields(record: Envelope, event_id: str | None) -> dict[str, object]:
    """Structured log fields of one record."""
    return {
        "event_id": event_id,
        "topic": record.topic,
        "partition": record.partition,
        "offset": record.offset,
    }
