"""The relay's producer: records handed to Kafka, delivery reports, librdkafka's errors.

Guarantees: a record is acknowledged to the LSN tracker only from its delivery
report; a record Kafka refuses for itself (e.g. too large) is remembered in
:class:`~cdc.relay.state.PoisonIds` and dead-lettered; any other error ends the
session, a librdkafka fatal error with :class:`cdc.errors.ProducerFatalError`
(the producer is then purged, closed and rebuilt: its records were never
acknowledged, so they are read again - duplicates, never loss). While the
local queue is full the relay keeps serving callbacks and answering the
server. librdkafka's own errors and log lines reach the process's logging and
``outbox_relay_kafka_errors_total{code}`` through
:class:`cdc.kafkalog.KafkaClientEvents`; failed delivery reports count there too.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial
from typing import TYPE_CHECKING, NoReturn

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from cdc import constants as c
from cdc.errors import (
    KafkaUnavailableError,
    ProducerFatalError,
)
from cdc.health import Liveness
from cdc.kafkalog import KafkaClientEvents, fatal_error
from cdc.producer import (
    PURGED,
    TopicManager,
    is_record_error,
    record_error_code,
)
from cdc.relay.metrics import RelayMetrics
from cdc.relay.state import PoisonIds, QueueStep, RelayState, Session
from cdc.router import (
    KafkaRecord,
)
from cdc.tracing import DeliveryCallback, RelayTracing

log = logging.getLogger("cdc.relay")


class Producing:
    """The relay's part that owns the producer (a mixin of :class:`~cdc.relay.loop.Relay`)."""

    if TYPE_CHECKING:
        metrics: RelayMetrics
        liveness: Liveness
        poison: PoisonIds
        _stop: threading.Event
        _producer: Producer | None
        _events: KafkaClientEvents
        _topics: TopicManager
        _tracing: RelayTracing | None

        def _set_state(self, state: RelayState, reason: str = "") -> None: ...

        def _send_status(self, sess: Session) -> None: ...

        _queue_dlq: QueueStep

    def _poll(self, timeout_s: float) -> None:
        """Serve the producer's callbacks; a fatal error it raises ends the session
        with :class:`ProducerFatalError` (the producer is then rebuilt)."""
        producer = self._producer
        assert producer is not None
        try:
            producer.poll(timeout_s)
        except KafkaException as exc:
            self._raise_kafka(exc, "producer poll failed")

    def _raise_kafka(self, exc: KafkaException, what: str) -> NoReturn:
        """End the session for ``exc``: ProducerFatalError when it is fatal."""
        err = fatal_error(exc)
        if err is None:
            raise KafkaUnavailableError(f"{what}: {exc}") from exc
        if not err.fatal():  # produce()'s "_FATAL": the error itself comes from the next poll
            exc = self._underlying_fatal(exc)
            err = fatal_error(exc) or err
        self._events.raised(exc)
        raise ProducerFatalError(f"producer fatal error {err.name()}: {err.str()}") from exc

    def _underlying_fatal(self, exc: KafkaException) -> KafkaException:
        """The fatal error behind a ``_FATAL`` from produce(), when poll() raises it."""
        producer = self._producer
        assert producer is not None
        try:
            producer.poll(0)
        except KafkaException as raised:
            err = fatal_error(raised)
            if err is not None and err.fatal():
                return raised
        return exc

    def _produce(self, sess: Session, tx_id: int, record: KafkaRecord) -> None:
        """Hand ``record`` to Kafka (or to the dead-letter queue when it is known poison)."""
        event_id = record.event_id.encode()
        refused = self.poison.recall(event_id) if self.poison else None
        if refused is not None:
            sess.tracker.add(tx_id)
            self._queue_dlq(
                sess,
                tx_id,
                refused[0],
                refused[1],
                record.topic,
                record.key,
                record.value,
                record.headers,
                record.timestamp_ms,
            )
            return
        if record.topic not in self._topics.known:
            self._topics.ensure([record.topic])
        sess.tracker.add(tx_id)
        r = record
        try:
            self._send(sess, tx_id, r.topic, r.value, r.key, r.headers, r.timestamp_ms, event_id)
        except KafkaException as exc:
            self._refused(sess, tx_id, exc, r.topic, r.key, r.value, r.headers, r.timestamp_ms)

    def _refused(
        self,
        sess: Session,
        tx_id: int,
        exc: KafkaException,
        topic: str,
        key: bytes,
        value: bytes,
        headers: list[tuple[str, bytes]],
        timestamp_ms: int,
    ) -> None:
        """``produce`` of an added record raised: dead-letter a record Kafka refuses
        for itself (e.g. too large); any other error ends the session (a fatal one
        with :class:`ProducerFatalError`)."""
        err = exc.args[0] if exc.args else None
        if not (isinstance(err, KafkaError) and is_record_error(err)):
            self._raise_kafka(exc, "produce failed")
        code = record_error_code(err)
        self._queue_dlq(sess, tx_id, code, err.str(), topic, key, value, headers, timestamp_ms)

    def _send(
        self,
        sess: Session,
        tx_id: int,
        topic: str,
        value: bytes,
        key: bytes,
        headers: list[tuple[str, bytes]],
        timestamp_ms: int,
        event_id: bytes,
    ) -> None:
        """``produce`` one added record of ``tx_id``, waiting while the local queue is full.

        Positional arguments (topic, value, key, partition, callback, on_delivery,
        timestamp, headers): keyword parsing cost a tenth of ``produce``. The
        callback goes in the ``callback`` slot; a None there would not fall back
        to ``on_delivery``, and the record would never be acknowledged.
        librdkafka hands no headers to delivery callbacks: the event id rides along.
        """
        producer = self._producer
        assert producer is not None
        callback: DeliveryCallback = partial(self._on_delivery, sess, tx_id, topic, event_id)
        if self._tracing is not None:
            callback = self._tracing.produce(topic, key, headers, event_id, callback)
        while True:
            try:
                # (the stubs want list[tuple[str, str | bytes | None]]; list is invariant)
                producer.produce(topic, value, key, -1, callback, None, timestamp_ms, headers)  # type: ignore[arg-type]
                return
            except BufferError:
                # Local queue full: Kafka is slow. Serve callbacks and keep the
                # walsender happy while waiting for room.
                self._poll(c.BACKPRESSURE_POLL_S)
                self._set_state(RelayState.BACKPRESSURE)
                self.liveness.tick()
                self._send_status(sess)
                if self._stop.is_set() or sess.fatal is not None:
                    raise KafkaUnavailableError("stopped while Kafka's queue was full") from None

    def _on_delivery(
        self,
        sess: Session,
        tx_id: int,
        topic: str,
        event_id: bytes,
        err: KafkaError | None,
        msg: Message,
    ) -> None:
        """Delivery report of one record: ack it, or dead-letter a record Kafka refused."""
        if err is None:
            acked = sess.acked
            acked[topic] = acked.get(topic, 0) + 1
            if not sess.tracker.ack(tx_id):  # the transaction's last outstanding record
                _, ts_ms = msg.timestamp()
                self.metrics.latency.observe(max(time.time() - ts_ms / 1000.0, 0.0))
            return
        self.metrics.kafka_errors.labels(err.name()).inc()
        if is_record_error(err):
            code = record_error_code(err)
            self.poison.remember(event_id, code, err.str())
            self.metrics.poison_ids.set(len(self.poison))
            self._queue_dlq(
                sess,
                tx_id,
                code,
                err.str(),
                topic,
                msg.key() or b"",
                msg.value() or b"",
                [(c.HEADER_ID, event_id)],
                msg.timestamp()[1],
            )
            return
        if sess.fatal is None and err.code() not in PURGED:  # once a session: reports come in bulk
            log.error(
                "kafka delivery to %s failed: %s",
                topic,
                err,
                extra={"topic": topic, "event_id": event_id.decode(errors="replace")},
            )
        sess.fatal = err
