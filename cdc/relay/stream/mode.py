"""The delivery mode: the one object the relay's loop hands over to at named points.

The loop (:class:`~cdc.relay.stream.loop.Relay`) holds its collaborators - the
decoder (:class:`~cdc.relay.stream.fast_path.FastPath`), the producer
(:class:`~cdc.relay.stream.producing.Producing`), the dead letters, the slot guard,
the standby's wait and standby-safe mode, the silence watch, Kafka's readiness, the
slot monitor - and one delivery mode. The mode is called at the points below, and
nowhere else; no collaborator overrides another's step. At-least-once
(:class:`cdc.relay.stream.at_least_once.AtLeastOnce`) and exactly-once
(:class:`cdc.relay.delivery.exactly_once.ExactlyOnce`) each implement every point;
``tests/unit/test_relay_layout.py`` holds this table to the code (a point of
:class:`DeliveryMode` not listed, or listed and gone, fails it).

==================  ===================  ==========================================
point               called by            at-least-once / exactly-once
==================  ===================  ==========================================
new_producer        Relay._session       a producer / a transactional one (fenced)
new_tracker         Relay._session       LsnTracker / capped at the checkpoint
session_begins      Relay._stream_loop   nothing / init_transactions, checkpoint
wal_begins          FastPath, read loop  read Begin / and TxBatch.opened
record              FastPath, Producing  Producing.send (or standby-safe's hold) /
                                         the admission rule, then Producing.send
dead_letter         DeadLetters.queue    admitted / the admission rule (covered,
                                         refused: acknowledged, not queued)
wal_ends            FastPath, read loop  read Commit / and TxBatch.closed (due)
serve               the loop's waits     Producing.poll / and the machine's due step
quiesce             Producing._settle    nothing / the commit under way awaited
drain_dead_letters  Relay (each turn)    DeadLetters.drain / only into an open
                                         transaction (TxBatch.admits)
read_wait_s         Relay._read_batch    READ_WAIT_S / no wait with a commit due
record_failed       Producing            no / the transaction fails (and fenced)
dead_letter_failed  DeadLetters          no / the transaction fails (and fenced)
kafka_raised        Producing            nothing / fenced: exit
session_ends        Relay._shutdown      nothing / the last commit
session_failed      Relay._stream_loop   nothing / abort the open transaction
session_closed      Relay._stream_loop   nothing / fenced: exit
producer_dropped    Relay (a rebuild)    nothing / the machine reset, no close()
==================  ===================  ==========================================

The hot points (``wal_begins``, ``record``, ``wal_ends``) are fetched once per read
turn (bound methods or plain functions: one call each, no lookup per message).
"""

from __future__ import annotations

from typing import Protocol

from confluent_kafka import KafkaError, KafkaException, Producer

from cdc.relay.health.state import Headers, Session
from cdc.wal.lsn import LsnTracker

#: A read turn waits this long for WAL when nothing is in flight.
READ_WAIT_S = 0.1


class DeliveryMode(Protocol):
    """The points where the loop hands over to the delivery mode (see the table above)."""

    def new_producer(self, origin: tuple[str, bytes]) -> Producer:
        """The session's producer (``origin``: the session's origin header)."""
        ...

    def new_tracker(self, start_lsn: int) -> LsnTracker:
        """The session's LSN tracker."""
        ...

    def session_begins(self, sess: Session) -> None:
        """The session holds the slot and its producer: before the first read."""
        ...

    def wal_begins(self, sess: Session, data: bytes | memoryview, at: int) -> None:
        """A WAL transaction begins: its Begin message at ``data[at]``."""
        ...

    def record(
        self,
        sess: Session,
        tx_id: int,
        topic: str,
        value: bytes,
        key: bytes,
        headers: Headers,
        timestamp_ms: int,
        event_id: bytes,
    ) -> None:
        """A record of ``tx_id`` (already added to the tracker) for Kafka."""
        ...

    def dead_letter(self, sess: Session, tx_id: int) -> bool:
        """A dead letter of ``tx_id`` (already added to the tracker) is about to be
        queued: whether it is (False: the mode acknowledged it instead)."""
        ...

    def wal_ends(self, sess: Session, data: bytes | memoryview, at: int) -> None:
        """A WAL transaction ends: its Commit message at ``data[at]``."""
        ...

    def serve(self, timeout_s: float) -> None:
        """Serve the producer (its callbacks), waiting at most ``timeout_s``."""
        ...

    def quiesce(self, sess: Session) -> None:
        """No commit under way once this returns (waited for, bounded by its budget): the
        next record step hands its record to Kafka at once (a record produced alone)."""
        ...

    def drain_dead_letters(self, sess: Session) -> None:
        """A turn of the loop: hand the pending dead letters to Kafka, if they may go."""
        ...

    def read_wait_s(self) -> float:
        """How long a read turn waits for WAL when nothing is in flight."""
        ...

    def record_failed(self, sess: Session, err: KafkaError) -> bool:
        """A record's delivery failed: whether the session's transaction fails with it
        (the session then ends, whatever the error)."""
        ...

    def dead_letter_failed(self, sess: Session, err: KafkaError) -> bool:
        """A dead letter's delivery failed: whether the session's transaction fails."""
        ...

    def kafka_raised(self, exc: KafkaException, what: str) -> None:
        """A Kafka call raised ``exc``; the session ends after this (which may raise)."""
        ...

    def session_ends(self, sess: Session) -> None:
        """SIGTERM: before the loop's own shutdown (the last flush and confirmation)."""
        ...

    def session_failed(self, sess: Session) -> None:
        """The session's loop raised (the exception goes on after this)."""
        ...

    def session_closed(self) -> None:
        """The session's loop returned or raised: the last word (it may raise)."""
        ...

    def producer_dropped(self) -> None:
        """A fatal error: the producer is about to be discarded and rebuilt."""
        ...
