"""The relay's producer: records handed to Kafka, delivery reports, librdkafka's errors.

Guarantees: a record is acknowledged to the LSN tracker only from its delivery
report (counted per run of a transaction's records by :class:`Reports`, not by a
Python call per record); a record Kafka refuses for itself (e.g. too large) is remembered in
:class:`~cdc.relay.health.state.PoisonIds` and dead-lettered - judged alone: Kafka refuses
a whole batch, so a refused record that shared its batch ends the session and is produced
alone when read again (its innocent batch-mates reach their topic); any other error ends the
session, a librdkafka fatal error with :class:`cdc.errors.ProducerFatalError`
(the producer is then purged, closed and rebuilt: its records were never
acknowledged, so they are read again - duplicates, never loss). While the
local queue is full the relay keeps serving callbacks and answering the
server. librdkafka's own errors and log lines reach the process's logging and
``outbox_relay_kafka_errors_total{code}`` through
:class:`cdc.kafka.log.KafkaClientEvents`; failed delivery reports count there too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from cdc import constants as c
from cdc.errors import (
    KafkaUnavailableError,
    ProducerFatalError,
)
from cdc.health import Liveness
from cdc.kafka.log import KafkaClientEvents, fatal_error
from cdc.kafka.producer import (
    PURGED,
    IdsInFlight,
    TopicManager,
    is_record_error,
    record_error_code,
)
from cdc.relay.health.metrics import RelayMetrics
from cdc.relay.health.state import PoisonIds, QueueStep, RelayState, Session
from cdc.router import KafkaRecord
from cdc.tracing import DeliveryCallback, RelayTracing
from cdc.wal.replproto import lsn_to_str

if TYPE_CHECKING:
    from cdc.relay.stream.mode import DeliveryMode

log = logging.getLogger("cdc.relay")


class Producing:
    """The relay's producer and its records (a collaborator of
    :class:`~cdc.relay.stream.loop.Relay`): it owns :attr:`producer` (made and dropped
    by the loop and the delivery mode), hands records to it (:meth:`send`, the
    at-least-once mode's record step) and reads their delivery reports. What the
    delivery mode adds - its own record step, its answer to a failed report or a
    raising Kafka call - is asked of :attr:`mode` (:mod:`cdc.relay.stream.mode`)."""

    #: the delivery mode (set by the loop once both exist)
    mode: DeliveryMode
    #: the dead letters' queue step (set by the loop: :meth:`DeadLetters.queue`)
    queue_dlq: QueueStep

    def __init__(
        self,
        metrics: RelayMetrics,
        liveness: Liveness,
        stop: threading.Event,
        *,
        events: KafkaClientEvents,
        topics: TopicManager,
        tracing: RelayTracing | None,
        poison: PoisonIds,
        set_state: Callable[[RelayState], None],
        creating_topic: Callable[[str | None], None],
        send_status: Callable[[Session], None],
    ) -> None:
        self.metrics = metrics
        self.liveness = liveness
        self.poison = poison
        self.producer: Producer | None = None
        self._stop = stop
        self.events = events
        self._topics = topics
        self.tracing = tracing
        self._set_state = set_state
        self._creating_topic = creating_topic
        self._send_status = send_status
        #: Kafka refused a record this session, and the session ends for it: a refused
        #: batch (its records are suspects, produced alone when read again), or exactly-once
        #: a record refused alone (dead-lettered when read again). Progress, not trouble:
        #: the next session reads them again at once, no back-off
        self.judged = False

    def poll(self, timeout_s: float) -> None:
        """Serve the producer's callbacks; a fatal error it raises ends the session
        with :class:`ProducerFatalError` (the producer is then rebuilt)."""
        producer = self.producer
        assert producer is not None
        try:
            producer.poll(timeout_s)
        except KafkaException as exc:
            self.raise_kafka(exc, "producer poll failed")

    def raise_kafka(self, exc: KafkaException, what: str) -> NoReturn:
        """End the session for ``exc``: ProducerFatalError when it is fatal (the delivery
        mode looks first: :meth:`DeliveryMode.kafka_raised`)."""
        self.mode.kafka_raised(exc, what)
        err = fatal_error(exc)
        if err is None:
            raise KafkaUnavailableError(f"{what}: {exc}") from exc
        if not err.fatal():  # produce()'s "_FATAL": the error itself comes from the next poll
            exc = self._underlying_fatal(exc)
            err = fatal_error(exc) or err
        self.events.raised(exc)
        raise ProducerFatalError(f"producer fatal error {err.name()}: {err.str()}") from exc

    def _underlying_fatal(self, exc: KafkaException) -> KafkaException:
        """The fatal error behind a ``_FATAL`` from produce(), when poll() raises it."""
        producer = self.producer
        assert producer is not None
        try:
            producer.poll(0)
        except KafkaException as raised:
            err = fatal_error(raised)
            if err is not None and err.fatal():
                return raised
        return exc

    def produce(self, sess: Session, tx_id: int, record: KafkaRecord) -> None:
        """Hand ``record`` to Kafka through the delivery mode's record step (or to the
        dead-letter queue when it is known poison)."""
        event_id = record.event_id.encode()
        refused = self.poison.recall(event_id) if self.poison else None
        if refused is not None and not refused[2]:  # refused with its batch: alone now
            self._alone(sess, tx_id, record, event_id)
            return
        if refused is not None:
            sess.tracker.add(tx_id)
            self.queue_dlq(
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
        self._record(sess, tx_id, record, event_id)

    def _record(self, sess: Session, tx_id: int, record: KafkaRecord, event_id: bytes) -> None:
        """The delivery mode's record step for ``record`` (its topic made first if new)."""
        if record.topic not in self._topics.known:
            self._creating_topic(record.topic)  # (/readyz names Kafka's answer meanwhile)
            try:
                self._topics.ensure([record.topic])
            finally:
                self._creating_topic(None)
        sess.tracker.add(tx_id)
        r = record
        try:
            step = self.mode.record
            step(sess, tx_id, r.topic, r.value, r.key, r.headers, r.timestamp_ms, event_id)
        except KafkaException as exc:
            self.refused(sess, tx_id, exc, r.topic, r.key, r.value, r.headers, r.timestamp_ms)

    def _alone(self, sess: Session, tx_id: int, record: KafkaRecord, event_id: bytes) -> None:
        """A suspect (Kafka refused the batch it was in: :class:`PoisonIds`) produced
        alone: every record before it reported, then it, then its own report waited
        for - its batch holds nothing else, so Kafka judges the record itself. Refused
        again, it is remembered as refused alone (:meth:`report_failed`); its dead letter
        is made there (at-least-once) or when it is read again (exactly-once: the
        refusal aborts the transaction). Delivered, it is forgotten. A record the mode
        holds instead (standby-safe) is judged when it is released (:meth:`send_held`)."""
        self._judged_alone(sess, event_id, lambda: self._record(sess, tx_id, record, event_id))

    def send_held(
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
        """:meth:`send` for a record standby-safe mode held and now releases: a suspect
        among them still goes alone."""
        found = self.poison.get(event_id) if self.poison else None
        if found is None or found[2]:
            self.send(sess, tx_id, topic, value, key, headers, timestamp_ms, event_id)
            return
        send = self.send
        self._judged_alone(
            sess,
            event_id,
            lambda: send(sess, tx_id, topic, value, key, headers, timestamp_ms, event_id),
        )

    def _judged_alone(self, sess: Session, event_id: bytes, produce: Callable[[], None]) -> None:
        """``produce`` (one record's step) with nothing else in the record's batch."""
        self._settle(sess)
        sess.reports = None
        produce()
        reports = sess.reports
        if reports is None:  # not produced: held (standby-safe), covered, refused locally
            return
        reports.alone = True
        sess.reports = None
        self._settle(sess)
        found = self.poison.get(event_id)
        if found is not None and not found[2]:  # delivered alone: innocent
            del self.poison[event_id]
            self.metrics.poison_ids.set(len(self.poison))

    def _settle(self, sess: Session) -> None:
        """Wait until no commit is under way and every record handed to Kafka has its
        delivery report, serving the producer and answering the server meanwhile. The
        wait is the back-pressure wait's (:meth:`send`): exactly-once, each record is
        bounded by ``message.timeout.ms`` (``CDC_TX_TIMEOUT_MS``) and a commit by its
        budget; at-least-once records never time out (``message.timeout.ms`` 0: they wait
        for Kafka) - a SIGTERM ends the wait, and a wait past its first step says
        ``backpressure`` (not ``streaming``) until the loop takes over again."""
        producer = self.producer
        assert producer is not None
        mode = self.mode
        first = True
        while True:
            mode.quiesce(sess)
            if not len(producer):
                return
            if not first:
                self._set_state(RelayState.BACKPRESSURE)
            first = False
            try:  # (flush, not poll: it sends what lingers at once, and returns when done)
                producer.flush(c.BACKPRESSURE_POLL_S)
            except KafkaException as exc:
                self.raise_kafka(exc, "producer flush failed")
            self.liveness.tick()
            self._send_status(sess)
            if self._stop.is_set() or sess.fatal is not None or sess.fault is not None:
                raise KafkaUnavailableError(
                    f"producing a record alone: {sess.fatal or sess.fault or 'stopping'}"
                )

    def refused(
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
            self.raise_kafka(exc, "produce failed")
        code = record_error_code(err)
        self.queue_dlq(sess, tx_id, code, err.str(), topic, key, value, headers, timestamp_ms)

    def send(
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
        to ``on_delivery``, and the record would never be acknowledged. The
        callback is the session's current :class:`Reports` of ``(tx_id, topic)``:
        one object counts the reports of a run of records, no callback per record.
        """
        producer = self.producer
        assert producer is not None
        reports = sess.reports
        if reports is None or reports.tx_id != tx_id or reports.topic != topic:
            # A new run of tx_id's records to topic (attributes set here: no call, no
            # __init__; a 1-event transaction's run is one per record).
            reports = sess.reports = Reports()
            reports.owner, reports.sess, reports.tx_id = self, sess, tx_id
            reports.topic, reports.timestamp_ms, reports.failed = topic, timestamp_ms, 0
        callback: DeliveryCallback = reports
        if self.tracing is not None:
            callback = self.tracing.produce(topic, key, headers, event_id, callback)
        while True:
            try:
                # (the stubs want list[tuple[str, str | bytes | None]]; list is invariant)
                producer.produce(topic, value, key, -1, callback, None, timestamp_ms, headers)  # type: ignore[arg-type]
                reports.append((hash((key, value)), event_id))
                return
            except BufferError:
                # Local queue full: Kafka is slow. Serve callbacks and keep the
                # walsender happy while waiting for room.
                sess.reports = None  # (what it counted may be acknowledged meanwhile)
                self.mode.serve(c.BACKPRESSURE_POLL_S)
                self._set_state(RelayState.BACKPRESSURE)
                self.liveness.tick()
                self._send_status(sess)
                if self._stop.is_set() or sess.fatal is not None or sess.fault is not None:
                    raise KafkaUnavailableError("stopped while Kafka's queue was full") from None

    def report_failed(self, reports: Reports, err: KafkaError, msg: Message) -> None:
        """A failed delivery report: dead-letter a record Kafka refused for itself,
        end the session for any other error (or whenever the delivery mode says the
        record's transaction fails with it: :meth:`DeliveryMode.record_failed`)."""
        sess, tx_id, topic = reports.sess, reports.tx_id, reports.topic
        fails = self.mode.record_failed(sess, err)
        self.metrics.kafka_errors.labels(err.name()).inc()
        event_id = reports.event_id_of(msg) if is_record_error(err) else None
        if event_id is not None and not getattr(reports, "alone", False):
            # Kafka judges a batch: the record may be an innocent batch-mate of the one
            # it refused. The session ends; read again, the record is produced alone.
            self.poison.suspect(event_id, record_error_code(err), err.str())
            self.metrics.poison_ids.set(len(self.poison))
            if sess.fatal is None:
                log.warning(
                    "kafka refused a batch of records to %s (%s): the session ends, and"
                    " each of its records is produced alone when read again",
                    topic,
                    err,
                    extra={"topic": topic, "lsn": lsn_to_str(tx_id)},
                )
            sess.fatal = sess.fatal or err
            self.judged = True
            return
        if event_id is not None:
            code = record_error_code(err)
            self.poison.remember(event_id, code, err.str())
            self.metrics.poison_ids.set(len(self.poison))
            self.queue_dlq(
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
            if fails:  # (exactly-once: read again, its dead letter is made)
                sess.fatal = sess.fatal or err
                self.judged = True
            return
        if sess.fatal is None and err.code() not in PURGED:  # once a session: they come in bulk
            log.error(
                "kafka delivery to %s failed: %s",
                topic,
                err,
                extra={"topic": topic, "lsn": lsn_to_str(tx_id)},
            )
        sess.fatal = err


class Reports(IdsInFlight):
    """The delivery reports of a run of one transaction's records to one topic,
    counted by reference: no Python call per delivered record.

    The relay's producer runs with ``delivery.report.only.error``: a delivered
    record's report calls nothing; confluent-kafka only releases the reference its
    ``produce`` took on the record's callback - this object - once the report is
    served (or at once when ``produce`` raised; the record was then not counted). A
    failed record's report calls it. The session holds the object while it may add
    records (it lets go at Commit, after each read batch, before waiting for room);
    when the last reference is gone every counted record has its report, and
    :meth:`__del__` acknowledges the delivered ones in one step. So a record is
    still acknowledged only from its delivery report, never before: an object kept
    alive longer only delays acknowledgements, and one never finalized (a discarded
    producer's records) acknowledges nothing, so its records are read again.

    The list holds each record's event id, with the hash of its key and value, in
    produce order, as long as it is in flight: librdkafka hands no headers to
    delivery reports, so a refused record's event id is found by its key and value
    (:meth:`event_id_of`; the hash, not the value, is kept: memory in flight).
    While tracing asks for every report (a span ends at each), the delivered ones
    call it too, with ``err`` None: ignored here. The attributes are set by
    :meth:`Producing.send` (a Python ``__init__`` was a measurable part of a
    1-event transaction).
    """

    __slots__ = ("alone", "failed", "owner", "sess", "timestamp_ms", "topic", "tx_id")

    owner: Producing
    sess: Session
    tx_id: int
    topic: str
    timestamp_ms: int
    #: failed reports so far (each dead-lettered, or the session ended)
    failed: int
    #: its one record was produced alone (:meth:`Producing._alone`): a refusal judges
    #: that record (never set on the hot path: read with a default)
    alone: bool

    def __call__(self, err: KafkaError | None, msg: Message) -> None:
        if err is None:
            return
        self.failed += 1
        self.owner.report_failed(self, err, msg)

    def __del__(self) -> None:
        """Every counted record has its report: acknowledge the delivered ones (the
        failed ones were dead-lettered, or ended the session)."""
        delivered = len(self) - self.failed
        if delivered <= 0:
            return
        sess = self.sess
        try:
            if not sess.tracker.ack(self.tx_id, delivered):  # its transaction's last one
                latency_s = time.time() - self.timestamp_ms / 1000.0
                self.owner.metrics.latency.observe(latency_s if latency_s > 0.0 else 0.0)
            acked = sess.acked
            acked[self.topic] = acked.get(self.topic, 0) + delivered
        except Exception as exc:  # (raised in a finalizer it would only be printed)
            sess.fault = sess.fault or exc
