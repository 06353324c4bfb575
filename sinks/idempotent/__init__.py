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
  that partition wait (per-partition order holds), other partitions go on. The
  pause survives a rebalance: a partition revoked and assigned again during its
  backoff stays paused until the backoff is over, then resumes (never stalls);
* **every record is data**: any bytes a producer can write (header names that
  are not UTF-8, null header values, duplicate names, huge header sets, null
  keys, tombstones) are read by the sink's one reader
  (:func:`sinks.core.delivery.read_headers`); a record without a usable ``id``
  header, or whose headers cannot be read, is bad input, parked or
  dead-lettered at once with the reason: never dropped, never retried, never a
  crash;
* after ``max_attempts`` failures in a row the record is parked (table
  ``idempotent_parked_events``, in the same transaction as its ledger row) or
  dead-lettered (a topic; its ledger row is written once Kafka acknowledged the
  dead letter), and the partition moves on. A dead letter Kafka does not
  acknowledge spends no attempt: the record is polled again after a backoff;
* :func:`prune_ledger` deletes ledger rows older than an age, in batches. Keep
  rows longer than any replay you may run (at least the topics' retention): a
  replay past a pruned row runs its handler again.

One record's way (:class:`AttemptBook` holds the counts, :class:`PauseBook` the
pauses; both pure)::

    polled --ledger row exists--------------------------> DUPLICATE (offset stored)
    polled --handler ok, commit-------------------------> HANDLED   (offset stored)
    polled --handler error, attempts < max--------------> RETRY     (paused, sought back)
    polled --handler error at max, or bad input---------> PARKED | DEAD_LETTERED (offset stored)

A PostgreSQL connection that breaks is not the handler's fault: the record is
sought back (no attempt spent) and :class:`LedgerUnavailable` is raised; the
caller reconnects and builds a new consumer, or lets the process restart.

Modules, by role: :mod:`~sinks.idempotent.consumer` (the loop),
:mod:`~sinks.idempotent.books` (event id, attempts, pauses - pure),
:mod:`~sinks.idempotent.ledger` (the tables), :mod:`~sinks.idempotent.dead_letter`,
:mod:`~sinks.idempotent.model` (options and outcomes), :mod:`~sinks.idempotent.errors`,
:mod:`~sinks.idempotent.constants`.
"""

from __future__ import annotations

from sinks.idempotent.books import AttemptBook, Hold, PauseActions, PauseBook, event_id_of
from sinks.idempotent.constants import (
    DEAD_LETTER_TIMEOUT_S,
    DEFAULT_LEDGER_TABLE,
    DEFAULT_PARKING_TABLE,
    HEADER_DLQ_CONSUMER,
    HEADER_DLQ_OFFSET,
    HEADER_DLQ_PARTITION,
    MAX_EVENT_ID_CHARS,
    PRUNE_BATCH,
    RETRY_BACKOFF_CAP_S,
)
from sinks.idempotent.consumer import Handler, IdempotentConsumer
from sinks.idempotent.errors import (
    BadEvent,
    ConsumerUsageError,
    DeadLetterError,
    IdempotencyError,
    LedgerUnavailable,
)
from sinks.idempotent.ledger import ensure_ledger, prune_ledger
from sinks.idempotent.model import ConsumerOptions, FailurePolicy, Outcome, Processed, Stats

__all__ = [
    "DEAD_LETTER_TIMEOUT_S",
    "DEFAULT_LEDGER_TABLE",
    "DEFAULT_PARKING_TABLE",
    "HEADER_DLQ_CONSUMER",
    "HEADER_DLQ_OFFSET",
    "HEADER_DLQ_PARTITION",
    "MAX_EVENT_ID_CHARS",
    "PRUNE_BATCH",
    "RETRY_BACKOFF_CAP_S",
    "AttemptBook",
    "BadEvent",
    "ConsumerOptions",
    "ConsumerUsageError",
    "DeadLetterError",
    "FailurePolicy",
    "Handler",
    "Hold",
    "IdempotencyError",
    "IdempotentConsumer",
    "LedgerUnavailable",
    "Outcome",
    "PauseActions",
    "PauseBook",
    "Processed",
    "Stats",
    "ensure_ledger",
    "event_id_of",
    "prune_ledger",
]
