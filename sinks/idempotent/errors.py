"""The idempotent consumer's errors; the retry policy is an attribute of each.

::

    SinkError
     └── IdempotencyError            (spends_attempt = False)
          ├── ConsumerUsageError     set up or called so that a guarantee would break
          ├── BadEvent               no usable event id / unreadable record: parked at once
          ├── LedgerUnavailable      the PostgreSQL connection broke (retriable)
          └── DeadLetterError        Kafka did not acknowledge a dead letter (retriable)
"""

from __future__ import annotations

from sinks.core.errors import SinkError


class IdempotencyError(SinkError):
    """Root of this package's errors (a :class:`SinkError`)."""

    spends_attempt = False


class ConsumerUsageError(IdempotencyError):
    """The helper was set up or called in a way that would break its guarantees."""


class BadEvent(IdempotencyError):  # noqa: N818 - it names the input, like Unroutable
    """The record has no usable event id (or cannot be read): parked or dead-lettered at once."""


class LedgerUnavailable(IdempotencyError):  # noqa: N818 - the name says what happened
    """The consumer's PostgreSQL connection broke; no attempt was spent."""

    retriable = True


class DeadLetterError(IdempotencyError):
    """Kafka did not acknowledge a dead letter; the record is polled again later."""

    retriable = True
