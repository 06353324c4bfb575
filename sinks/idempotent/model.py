"""What an idempotent consumer is told (:class:`ConsumerOptions`) and what it reports
(:class:`Outcome`, :class:`Processed`, :class:`Stats`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from sinks.core.delivery import Envelope
from sinks.idempotent.constants import DEFAULT_LEDGER_TABLE, DEFAULT_PARKING_TABLE
from sinks.idempotent.errors import ConsumerUsageError


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


@dataclass(frozen=True, kw_only=True)
class ConsumerOptions:
    """How one idempotent consumer behaves (see :mod:`sinks.idempotent`)."""

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
