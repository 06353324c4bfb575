"""``CDC_DELIVERY=at-least-once``: the relay's default delivery mode.

Guarantees (DESIGN.md, relay invariants 1 and 6): a record goes to Kafka as it is
read (with ``CDC_STANDBY_SAFE``, once the standby has its commit:
:mod:`cdc.relay.standby.safe`); the slot is confirmed past a WAL transaction only
once Kafka acknowledged all its records and dead letters (the tracker decides);
a crash or a failed session reads again from the slot's confirmed position, so a
record may be published twice, never lost. Each point of
:class:`cdc.relay.stream.mode.DeliveryMode` (the table there) is implemented here,
most by the relay's collaborators' own steps, bound once (no wrapper on the hot path).
"""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException, Producer

from cdc.kafka.producer import make_producer
from cdc.relay.health.state import Session
from cdc.relay.standby.safe import StandbySafe
from cdc.relay.stream.dead_letters import DeadLetters
from cdc.relay.stream.fast_path import read_begin, read_commit
from cdc.relay.stream.mode import READ_WAIT_S
from cdc.relay.stream.producing import Producing
from cdc.settings import Settings
from cdc.wal.lsn import LsnTracker


class AtLeastOnce:
    """``CDC_DELIVERY=at-least-once``: records go to Kafka as they are read; the slot
    is confirmed past a transaction once all its records are acknowledged."""

    # (plain functions: the fast path calls them directly, no bound method)
    wal_begins = staticmethod(read_begin)
    wal_ends = staticmethod(read_commit)

    def __init__(
        self,
        settings: Settings,
        producing: Producing,
        dead_letters: DeadLetters,
        standby_safe: StandbySafe,
    ) -> None:
        self._settings = settings
        self._producing = producing
        self._dead_letters = dead_letters
        # (instance attributes: the hot path calls the step itself, no wrapper; with
        # CDC_STANDBY_SAFE records wait for the standby first)
        self.record = standby_safe.hold if standby_safe.on else producing.send
        self.serve = producing.poll
        self.drain_dead_letters = dead_letters.drain

    def new_producer(self, origin: tuple[str, bytes]) -> Producer:
        s, producing = self._settings, self._producing
        return make_producer(
            s.kafka_bootstrap_servers,
            s.kafka_config,
            events=producing.events,
            # delivered records call nothing (Reports counts them), unless
            # tracing ends a span at every report
            failed_reports_only=producing.tracing is None,
        )

    def new_tracker(self, start_lsn: int) -> LsnTracker:
        return LsnTracker(start_lsn)

    def session_begins(self, sess: Session) -> None:
        return None

    def dead_letter(self, sess: Session, tx_id: int) -> bool:
        return True

    def read_wait_s(self) -> float:
        return READ_WAIT_S

    def quiesce(self, sess: Session) -> None:
        return None

    def record_failed(self, sess: Session, err: KafkaError) -> bool:
        return False

    def dead_letter_failed(self, sess: Session, err: KafkaError) -> bool:
        return False

    def kafka_raised(self, exc: KafkaException, what: str) -> None:
        return None

    def session_ends(self, sess: Session) -> None:
        return None

    def session_failed(self, sess: Session) -> None:
        return None

    def session_closed(self) -> None:
        return None

    def producer_dropped(self) -> None:
        return None
