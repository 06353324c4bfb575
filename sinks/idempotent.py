"""Idempotent consumer: a handler runs once per event id, inside the consumer's own
PostgreSQL transaction, for teams that consume the outbox topics with their own service.

:class:`IdempotentConsumer` wraps a confluent-kafka consumer. It reads records
of the relay (or of Debezium's outbox router: both carry the event id in the
``id`` header) and calls ``handler(conn, record)`` for each. Guarantees:

* the handler runs in a transaction on the consumer's connection that also
  inserts ``(consumer name, event id)`` into the ledger (``processed_events``):
  the handler's writes and the ledger row commit together or not at all;
* a duplicate delivery (a redelivery after a crash, an offset replay, the same
  event produced twice) finds its ledger row and is skipped: the handler is not
  called again;
* a record's offset is stored for commit only after its transaction committed
  (``enable.auto.offset.store=false``; auto commit sends stored offsets only).
  A crash between the transaction's commit and the offset commit redelivers
  the record, and the ledger skips it;
* a handler exception rolls back the handler's writes and the ledger row and
  leaves the offset where it was: the partition is paused for a growing backoff
  and sought back, so the same record is polled again; records behind it in
  that partition wait (per-partition order holds), other partitions go on;
* after ``max_attempts`` failures in a row the record is parked (table
  ``idempotent_parked_events``, in the same transaction as its ledger row) or
  dead-lettered (a topic; its ledger row is written once Kafka acknowledged the
  dead letter), and the partition moves on. Bad input (no usable ``id``
  header) is parked or dead-lettered at once with the reason: never dropped,
  never retried. A dead letter Kafka does not acknowledge spends no attempt:
  the record is polled again after a backoff;
* :func:`prune_ledger` deletes ledger rows older than an age, in batches. Keep
  rows longer than any replay you may run (at least the topics' retention): a
  replay past a pruned row runs its handler again.

One record's way (:class:`AttemptBook` holds the counts; pure)::

    polled --ledger row exists--------------------------> DUPLICATE (offset stored)
    polled --handler ok, commit-------------------------> HANDLED   (offset stored)
    polled --handler error, attempts < max--------------> RETRY     (paused, sought back)
    polled --handler error at max, or bad input---------> PARKED | DEAD_LETTERED (offset stored)

A PostgreSQL connection that breaks is not the handler's fault: the record is
sought back (no attempt spent) and :class:`LedgerUnavailable` is raised; the
caller reconnects and builds a new consumer, or lets the process restart.
"""

from __future__ import annotations

import enum
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from psycopg import sql
from psycopg.pq import TransactionStatus

from cdc.constants import HEADER_DLQ_REASON, HEADER_DLQ_TOPIC, HEADER_ID
from cdc.kafkalog import KafkaClientEvents
from cdc.outbox import table_identifier
from sinks.core.delivery import Envelope
from sinks.core.retry import retry_delay_s
from sinks.errors import SinkError

log = logging.getLogger(__name__)

Conn = psycopg.Connection[Any]
#: ``handler(conn, record)``: runs inside the transaction that writes the ledger row.
Handler = Callable[[Conn, Envelope], object]
#: (topic, partition)
TP = tuple[str, int]

DEFAULT_LEDGER_TABLE = "processed_events"
DEFAULT_PARKING_TABLE = "idempotent_parked_events"
#: Longest event id taken (a uuid is 36): anything longer is bad input, not a key.
MAX_EVENT_ID_CHARS = 200
#: Longest pause between two attempts at one record.
RETRY_BACKOFF_CAP_S = 30.0
#: How long a dead letter may take to be acknowledged before the record is retried.
DEAD_LETTER_TIMEOUT_S = 30.0
#: Ledger rows deleted per statement by :func:`prune_ledger`.
PRUNE_BATCH = 10_000
#: Advisory lock held while the tables are created (several instances may start at once).
_DDL_LOCK_KEY = 0x0B0C_DC00_0011
#: Dead-letter headers beyond the relay's (``dlq.reason``, ``dlq.original.topic``).
HEADER_DLQ_PARTITION = "dlq.original.partition"
HEADER_DLQ_OFFSET = "dlq.original.offset"
HEADER_DLQ_CONSUMER = "dlq.consumer"
#: Producer settings a dead-letter producer takes from the consumer's configuration.
_SHARED_PREFIXES = ("bootstrap.servers", "client.", "security.", "sasl.", "ssl.", "socket.")


class IdempotencyError(SinkError):
    """Root of this module's errors (a :class:`SinkError`)."""

    spends_attempt = False


class ConsumerUsageError(IdempotencyError):
    """The helper was set up or called in a way that would break its guarantees."""


class BadEvent(IdempotencyError):  # noqa: N818 - it names the input, like Unroutable
    """The record has no usable event id: parked or dead-lettered at once."""


class LedgerUnavailable(IdempotencyError):  # noqa: N818 - the name says what happened
    """The consumer's PostgreSQL connection broke; no attempt was spent."""

    retriable = True


class DeadLetterError(IdempotencyError):
    """Kafka did not acknowledge a dead letter; the record is polled again later."""

    retriable = True


class FailurePolicy(enum.Enum):
    PARK = "park"  # a row in the parking table, next to the ledger
    DEAD_LETTER = "dead_letter"  # a record on the dead-letter topic


class Outcome(enum.Enum):
    HANDLED = "handled"  # the handler ran and its transaction committed
    DUPLICATE = "duplicate"  # the ledger already had the event id: skipped
    RETRY = "retry"  # the handler failed; the record comes again after a backoff
    PARKED = "parked"  # given up (or bad input): a row in the parking table
    DEAD_LETTERED = "dead_lettered"  # given up (or bad input): a record on the DLQ topic
    STALE = "stale"  # fetched before its partition was sought back: ignored


@dataclass(frozen=True, slots=True, kw_only=True)
class Processed:
    """One polled record and what became of it."""

    outcome: Outcome
    record: Envelope
    #: None when the record has no usable id (bad input).
    event_id: str | None


@dataclass
class Stats:
    """Records per outcome since the consumer started."""

    handled: int = 0
    duplicate: int = 0
    retry: int = 0
    parked: int = 0
    dead_lettered: int = 0
    stale: int = 0

    def count(self, outcome: Outcome) -> None:
        setattr(self, outcome.value, getattr(self, outcome.value) + 1)


def event_id_of(record: Envelope) -> str:
    """The record's event id from its ``id`` header; raises :class:`BadEvent`.

    The relay and Debezium (default ``SimpleHeaderConverter``) send the id as
    plain UTF-8; a JSON string (Connect's ``JsonConverter`` as header converter)
    is unquoted. A uuid is written in its canonical lower-case form, so the
    spellings of one id share one ledger row.
    """
    raw = record.headers.get(HEADER_ID)
    if raw is None:
        raise BadEvent("no id header: the event id is the idempotency key")
    try:
        text = raw.decode("utf-8").strip()
        if len(text) >= 2 and text[0] == text[-1] == '"':
            text = str(json.loads(text)).strip()
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadEvent(f"id header is not UTF-8 text: {exc}") from exc
    if not text or len(text) > MAX_EVENT_ID_CHARS:
        raise BadEvent(f"id header must be 1-{MAX_EVENT_ID_CHARS} characters, not {len(text)}")
    try:
        return str(uuid.UUID(text))
    except ValueError:
        return text


class AttemptBook:
    """Failed attempts per record position and the backoff between them. Pure."""

    def __init__(self, *, max_attempts: int, backoff_base_s: float) -> None:
        if max_attempts < 1:
            raise ConsumerUsageError(f"max_attempts must be at least 1, not {max_attempts}")
        self.max_attempts = max_attempts
        self._base_s = backoff_base_s
        self._failures: dict[tuple[str, int, int], int] = {}

    def failures(self, position: tuple[str, int, int]) -> int:
        return self._failures.get(position, 0)

    def failed(self, position: tuple[str, int, int]) -> float | None:
        """Count a failure: the delay before the next attempt, or None to give up."""
        count = self._failures.get(position, 0) + 1
        self._failures[position] = count
        if count >= self.max_attempts:
            return None
        return retry_delay_s(count - 1, self._base_s, cap_s=RETRY_BACKOFF_CAP_S)

    def settle(self, position: tuple[str, int, int]) -> None:
        """The record is done (handled, skipped, parked or dead-lettered)."""
        self._failures.pop(position, None)

    def forget_partitions(self, tps: Iterable[TP]) -> None:
        """Partitions revoked: their next owner starts the counts afresh."""
        gone = set(tps)
        for position in [p for p in self._failures if (p[0], p[1]) in gone]:
            del self._failures[position]


# --- the tables ------------------------------------------------------------------------

_LEDGER_DDL = """
CREATE TABLE IF NOT EXISTS {ledger} (
    consumer_name text        NOT NULL,
    event_id      text        NOT NULL,
    outcome       text        NOT NULL CHECK (outcome IN ('handled', 'parked', 'dead_lettered')),
    topic         text        NOT NULL,
    "partition"   integer     NOT NULL,
    "offset"      bigint      NOT NULL,
    processed_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_name, event_id)
);
CREATE INDEX IF NOT EXISTS {ledger_idx} ON {ledger} (processed_at);
CREATE TABLE IF NOT EXISTS {parking} (
    id             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer_name  text        NOT NULL,
    event_id       text        NULL,
    topic          text        NOT NULL,
    "partition"    integer     NOT NULL,
    "offset"       bigint      NOT NULL,
    record_key     bytea       NULL,
    record_value   bytea       NULL,
    header_names   text[]      NOT NULL,
    header_values  bytea[]     NOT NULL,
    timestamp_ms   bigint      NULL,
    reason         text        NOT NULL,
    attempts       integer     NOT NULL,
    parked_at      timestamptz NOT NULL DEFAULT now(),
    UNIQUE (consumer_name, topic, "partition", "offset")
)
"""


def ensure_ledger(
    conn: Conn,
    *,
    ledger_table: str = DEFAULT_LEDGER_TABLE,
    parking_table: str = DEFAULT_PARKING_TABLE,
) -> None:
    """Create the ledger and the parking table in the consumer's database (idempotent)."""
    _require_idle(conn)
    ddl = sql.SQL(_LEDGER_DDL).format(
        ledger=table_identifier(ledger_table),
        ledger_idx=sql.Identifier(f"{ledger_table.rsplit('.', 1)[-1]}_processed_at_idx"),
        parking=table_identifier(parking_table),
    )
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_DDL_LOCK_KEY,))
        for statement in ddl.as_string(conn).split(";"):
            if statement.strip():
                conn.execute(statement.encode())


def prune_ledger(
    conn: Conn,
    *,
    older_than_s: float,
    consumer_name: str | None = None,
    ledger_table: str = DEFAULT_LEDGER_TABLE,
    batch_size: int = PRUNE_BATCH,
) -> int:
    """Delete ledger rows older than ``older_than_s`` (of one consumer, or all); return
    how many. Each batch is its own transaction."""
    _require_idle(conn)
    if older_than_s < 0 or batch_size < 1:
        raise ConsumerUsageError("older_than_s must be >= 0 and batch_size >= 1")
    mine = sql.SQL("AND consumer_name = %(name)s") if consumer_name else sql.SQL("")
    stmt = sql.SQL(
        "DELETE FROM {t} WHERE ctid IN (SELECT ctid FROM {t}"
        " WHERE processed_at < now() - make_interval(secs => %(age)s) {mine} LIMIT %(n)s)"
    ).format(t=table_identifier(ledger_table), mine=mine)
    params = {"age": older_than_s, "name": consumer_name, "n": batch_size}
    total = 0
    while True:
        with conn.transaction():
            deleted = max(conn.execute(stmt, params).rowcount, 0)
        total += deleted
        if deleted < batch_size:
            return total


def _require_idle(conn: Conn) -> None:
    """The helper's transactions must be real ones, not savepoints in the caller's."""
    status = conn.info.transaction_status
    if status != TransactionStatus.IDLE:
        raise ConsumerUsageError(
            f"the consumer's connection must be idle between records, not {status.name}: "
            "a transaction left open would turn the helper's commits into savepoints"
        )


# --- the consumer ----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ConsumerOptions:
    """How one idempotent consumer behaves (see the module docstring)."""

    #: Keys the ledger: one name per logical consumer, kept across deployments.
    name: str
    #: Attempts at a record whose handler keeps failing before it is given up.
    max_attempts: int = 5
    #: First pause after a failure; doubles per attempt, capped at RETRY_BACKOFF_CAP_S.
    retry_backoff_s: float = 0.5
    #: What happens to a record given up (or with no usable event id).
    on_failure: FailurePolicy = FailurePolicy.PARK
    #: The topic of FailurePolicy.DEAD_LETTER.
    dead_letter_topic: str = ""
    ledger_table: str = DEFAULT_LEDGER_TABLE
    parking_table: str = DEFAULT_PARKING_TABLE
    #: Create both tables on start (:func:`ensure_ledger`); off when a migration does.
    create_tables: bool = True

    def check(self) -> ConsumerOptions:
        if not self.name:
            raise ConsumerUsageError("name is required: it keys the processed-events ledger")
        if self.on_failure is FailurePolicy.DEAD_LETTER and not self.dead_letter_topic:
            raise ConsumerUsageError("on_failure=DEAD_LETTER needs dead_letter_topic")
        return self


class IdempotentConsumer:
    """See the module docstring. Not thread-safe: one thread polls it.

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
        self._ledger = table_identifier(options.ledger_table)
        self._parking = table_identifier(options.parking_table)
        self._clock = clock
        self._book = AttemptBook(
            max_attempts=options.max_attempts, backoff_base_s=options.retry_backoff_s
        )
        self._paused: dict[TP, float] = {}  # partition -> when to resume it
        #: why a record was given up, kept while its dead letter waits for Kafka
        self._given_up: dict[tuple[str, int, int], str] = {}
        self._stop = False
        if options.create_tables:
            ensure_ledger(
                conn, ledger_table=options.ledger_table, parking_table=options.parking_table
            )
        self._kafka_config = dict(kafka_config)
        self._events = KafkaClientEvents(f"idempotent.{options.name}")
        self.consumer = Consumer(
            {
                "auto.offset.reset": "earliest",
                **self._kafka_config,
                **self._events.config(),
                "enable.auto.offset.store": False,
                "enable.auto.commit": True,
            }
        )
        self._producer: Producer | None = None
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

    def run(self, *, poll_timeout_s: float = 1.0) -> None:
        """Poll and process records until :meth:`stop`."""
        while not self._stop:
            self.poll_once(poll_timeout_s)

    def close(self) -> None:
        """Leave the group; stored offsets are committed on the way out."""
        if self._producer is not None:
            self._producer.flush(DEAD_LETTER_TIMEOUT_S)
        self.consumer.close()

    # -- one record ------------------------------------------------------------------------
    def poll_once(self, timeout_s: float = 1.0) -> Processed | None:
        """Process at most one record; what became of it, or None when none came."""
        self._resume_due()
        msg = self.consumer.poll(timeout_s)
        if msg is None:
            return None
        err = msg.error()
        if err is not None:
            self._on_kafka_error(err, msg)
            return None
        record = Envelope.from_kafka(msg)
        if record.topic_partition in self._paused:  # fetched before the seek back
            outcome = Outcome.STALE
        else:
            try:
                outcome = self._process(record, msg)
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

    def _process(self, record: Envelope, msg: Message) -> Outcome:
        _require_idle(self.conn)
        try:
            event_id = event_id_of(record)
        except BadEvent as exc:
            return self._give_up(record, msg, None, exc.reason)
        reason = self._given_up.get(record.position)
        if reason is not None:  # given up; its dead letter was not acknowledged
            return self._give_up(record, msg, event_id, reason)
        try:
            with self.conn.transaction():
                fresh = self._ledger_insert(event_id, record, "handled")
                if fresh:
                    self._handler(self.conn, record)
        except Exception as exc:
            return self._handler_failed(record, msg, event_id, exc)
        self._done(record, msg)
        if not fresh:
            log.info(
                "event %s already processed by %s: skipped",
                event_id,
                self.name,
                extra=_fields(record, event_id),
            )
            return Outcome.DUPLICATE
        return Outcome.HANDLED

    def _handler_failed(
        self, record: Envelope, msg: Message, event_id: str, exc: Exception
    ) -> Outcome:
        if self.conn.closed or self.conn.broken:
            raise LedgerUnavailable(f"PostgreSQL connection lost: {exc}") from exc
        reason = f"{type(exc).__name__}: {exc}"
        delay_s = self._book.failed(record.position)
        if delay_s is None:
            return self._give_up(record, msg, event_id, reason)
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

    def _give_up(
        self, record: Envelope, msg: Message, event_id: str | None, reason: str
    ) -> Outcome:
        attempts = self._book.failures(record.position)
        if self.options.on_failure is FailurePolicy.DEAD_LETTER:
            try:
                self._dead_letter(msg, reason)
            except DeadLetterError as exc:
                log.error("%s", exc.reason, extra=_fields(record, event_id))
                self._given_up[record.position] = reason
                self._rewind(record, RETRY_BACKOFF_CAP_S)
                return Outcome.RETRY
            with self.conn.transaction():
                if event_id is not None:
                    self._ledger_insert(event_id, record, "dead_lettered")
            outcome = Outcome.DEAD_LETTERED
        else:
            with self.conn.transaction():
                if event_id is not None:
                    self._ledger_insert(event_id, record, "parked")
                self._park(record, msg, event_id, reason, attempts)
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
        self._done(record, msg)
        return outcome

    def _done(self, record: Envelope, msg: Message) -> None:
        """The transaction committed: only now may the offset move past the record."""
        self._book.settle(record.position)
        self._given_up.pop(record.position, None)
        self.consumer.store_offsets(message=msg)

    def _rewind(self, record: Envelope, delay_s: float) -> None:
        """Pause the record's partition for ``delay_s`` and seek it back to the record."""
        tp = TopicPartition(record.topic, record.partition)
        self.consumer.pause([tp])
        self.consumer.seek(TopicPartition(record.topic, record.partition, record.offset))
        self._paused[record.topic_partition] = self._clock() + delay_s

    def _resume_due(self) -> None:
        if not self._paused:
            return
        now = self._clock()
        due = [tp for tp, at in self._paused.items() if at <= now]
        if due:
            self.consumer.resume([TopicPartition(t, p) for t, p in due])
            for tp in due:
                del self._paused[tp]

    # -- SQL -----------------------------------------------------------------------------------
    def _ledger_insert(self, event_id: str, record: Envelope, outcome: str) -> bool:
        """The ledger row; False when the event id is already there (a duplicate)."""
        cur = self.conn.execute(
            sql.SQL(
                'INSERT INTO {} (consumer_name, event_id, outcome, topic, "partition", "offset")'
                " VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING"
            ).format(self._ledger),
            (self.name, event_id, outcome, record.topic, record.partition, record.offset),
        )
        return cur.rowcount == 1

    def _park(
        self, record: Envelope, msg: Message, event_id: str | None, reason: str, attempts: int
    ) -> None:
        headers = _header_list(msg)
        self.conn.execute(
            sql.SQL(
                'INSERT INTO {} (consumer_name, event_id, topic, "partition", "offset",'
                " record_key, record_value, header_names, header_values, timestamp_ms,"
                " reason, attempts) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
                ' ON CONFLICT (consumer_name, topic, "partition", "offset") DO NOTHING'
            ).format(self._parking),
            (
                self.name,
                event_id,
                record.topic,
                record.partition,
                record.offset,
                record.key,
                record.value,
                [name for name, _ in headers],
                [value for _, value in headers],
                record.timestamp_ms,
                reason,
                attempts,
            ),
        )

    # -- Kafka ---------------------------------------------------------------------------------
    def _dead_letter(self, msg: Message, reason: str) -> None:
        """Produce the record to the dead-letter topic and wait for Kafka's acknowledgement."""
        if self._producer is None:
            shared = {k: v for k, v in self._kafka_config.items() if k.startswith(_SHARED_PREFIXES)}
            self._producer = Producer(
                {
                    **shared,
                    **KafkaClientEvents(f"idempotent.{self.name}.dlq").config(),
                    "partitioner": "murmur2_random",
                    "enable.idempotence": True,
                    "acks": "all",
                }
            )
        topic = self.options.dead_letter_topic
        headers: list[tuple[str, str | bytes | None]] = [
            (k, v) for k, v in _header_list(msg) if not k.startswith("dlq.")
        ]
        headers += [
            (HEADER_DLQ_REASON, reason.encode()),
            (HEADER_DLQ_TOPIC, (msg.topic() or "").encode()),
            (HEADER_DLQ_PARTITION, str(msg.partition()).encode()),
            (HEADER_DLQ_OFFSET, str(msg.offset()).encode()),
            (HEADER_DLQ_CONSUMER, self.name.encode()),
        ]
        reports: list[KafkaError | None] = []
        try:
            self._producer.produce(
                topic,
                msg.value(),
                msg.key(),
                headers=headers,
                timestamp=max(msg.timestamp()[1], 0),  # 0: now, when the record had none
                on_delivery=lambda err, _msg: reports.append(err),
            )
        except (KafkaException, BufferError) as exc:
            raise DeadLetterError(f"dead letter to {topic} refused: {exc}") from exc
        self._producer.flush(DEAD_LETTER_TIMEOUT_S)
        if not reports:
            raise DeadLetterError(f"dead letter to {topic}: no acknowledgement in time")
        error = reports[0]  # (KafkaError's == with None raises inside C: test identity)
        if error is not None:
            raise DeadLetterError(f"dead letter to {topic} failed: {error.str()}")

    def _on_kafka_error(self, err: KafkaError, msg: Message) -> None:
        if err.code() == KafkaError._PARTITION_EOF:
            return
        if err.fatal():
            raise IdempotencyError(f"consumer {self.name}: fatal Kafka error: {err.str()}")
        log.warning(
            "consumer %s: %s",
            self.name,
            err.str(),
            extra={"topic": msg.topic(), "partition": msg.partition()},
        )

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._forget([(tp.topic, tp.partition) for tp in partitions])

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._forget([(tp.topic, tp.partition) for tp in partitions])

    def _forget(self, tps: list[TP]) -> None:
        """Partitions (re)assigned or taken away: they start from their committed offset."""
        for tp in tps:
            self._paused.pop(tp, None)
        gone = set(tps)
        for position in [p for p in self._given_up if (p[0], p[1]) in gone]:
            del self._given_up[position]
        self._book.forget_partitions(tps)


def _header_list(msg: Message) -> list[tuple[str, bytes]]:
    """Every header of the record, in order (a None value as b"")."""
    raw: Any = msg.headers() or []
    return [(str(name), value or b"") for name, value in raw]


def _fields(record: Envelope, event_id: str | None) -> dict[str, object]:
    """Structured log fields of one record."""
    return {
        "event_id": event_id,
        "topic": record.topic,
        "partition": record.partition,
        "offset": record.offset,
    }
