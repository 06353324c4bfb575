"""The relay's dead letters: records that cannot be published, written to the dead-letter topic.

Guarantees: a dead letter holds its record's place in the LSN tracker until
Kafka acknowledges it, so its transaction is confirmed only then. One that
cannot be written (``produce`` raising ``BufferError`` or ``KafkaException``, a
failed delivery report, e.g. the topic deleted while auto-creation is off)
stays first in line, unacknowledged: the stream is HELD (no WAL read, the
server still answered), retried after a back-off, and ``/readyz`` names the
cause until one is written. A dead letter carries the event's id, key and
original topic whenever the row or message holds them (a routing error
included). A dead letter Kafka refuses for its own size is
written again in a minimal form (key and headers cut, the value a note). The
reason's full text goes to the ``dlq.reason`` header; the log line cuts it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaError, KafkaException, Message

from cdc import constants as c
from cdc.kafka.log import fatal_error
from cdc.kafka.producer import (
    PURGED,
    is_record_error,
)
from cdc.relay.health.metrics import RelayMetrics
from cdc.relay.health.state import Session, _PendingDlq
from cdc.router import (
    DeadLetterCode,
    KafkaRecord,
    RouteError,
    TxContext,
    dead_letter,
)
from cdc.settings import Settings
from cdc.wal.replproto import lsn_to_str

if TYPE_CHECKING:
    from cdc.relay.stream.mode import DeliveryMode
    from cdc.relay.stream.producing import Producing

log = logging.getLogger("cdc.relay")


#: Cap of each field of a minimal dead letter (written after Kafka refused the
#: full one for its size): key and header values, the value's prefix.
DLQ_MINIMAL_FIELD_BYTES = 1024


#: A dead-letter reason longer than this is cut in the log line (the record's
#: dlq.reason header keeps it whole); reasons quote the event's own values.
LOG_REASON_MAX_CHARS = 2_000


#: A dead-letter value larger than this is replaced by a note (see router.dead_letter).
DLQ_MAX_VALUE_BYTES = 512 * 1024


class DeadLetters:
    """The relay's dead letters (a collaborator of :class:`~cdc.relay.stream.loop.Relay`):
    queued with their record's place in the tracker, written through the producer
    :class:`~cdc.relay.stream.producing.Producing` owns. The delivery mode admits each
    (:meth:`DeliveryMode.dead_letter`) and hears of a failed one
    (:meth:`DeliveryMode.dead_letter_failed`)."""

    #: the delivery mode (set by the loop once both exist)
    mode: DeliveryMode

    def __init__(self, settings: Settings, metrics: RelayMetrics, producing: Producing) -> None:
        self.settings = settings
        self.metrics = metrics
        self._producing = producing

    def route(self, sess: Session, tx_id: int, tx: TxContext, exc: RouteError) -> None:
        """The dead letter of a row or message that does not route (``exc`` says why)."""
        sess.tracker.add(tx_id)
        self.queue(
            sess,
            tx_id,
            exc.code,
            exc.reason,
            exc.topic,
            exc.key,
            exc.raw,
            [(c.HEADER_ID, exc.event_id.encode())],
            tx.timestamp_ms,
        )

    def queue(
        self,
        sess: Session,
        tx_id: int,
        code: DeadLetterCode,
        reason: str,
        topic: str,
        key: bytes,
        value: bytes,
        headers: list[tuple[str, bytes]],
        timestamp_ms: int,
    ) -> None:
        """Queue the dead letter of a record whose add to ``tx_id`` it takes over (unless
        the delivery mode does not admit it: it acknowledged the record then)."""
        if not self.mode.dead_letter(sess, tx_id):
            return
        event_id = dict(headers).get(c.HEADER_ID, b"").decode(errors="replace")
        cut = (
            reason if len(reason) <= LOG_REASON_MAX_CHARS else reason[:LOG_REASON_MAX_CHARS] + "..."
        )
        log.warning(
            "event %s -> %s (%s): %s",
            event_id or "?",
            self.settings.dlq_topic,
            code.value,
            cut,
            extra={"event_id": event_id, "topic": topic, "lsn": lsn_to_str(tx_id)},
        )
        sess.pending_dlq.append(
            _PendingDlq(tx_id, code, reason, topic, key, value, headers, timestamp_ms, event_id)
        )

    def drain(self, sess: Session) -> None:
        """Hand the pending dead letters to Kafka, oldest first.

        One that cannot be handed over stays first in line, unacknowledged (so
        its transaction stays unconfirmed); the stream is HELD until a retry
        after a back-off writes one. Kafka refusing it for its size makes it
        minimal (see :data:`DLQ_MINIMAL_FIELD_BYTES`) and it is tried again at once.
        """
        pending = sess.pending_dlq
        if not pending or time.monotonic() < sess.dlq_retry_at:
            return
        producer = self._producing.producer
        assert producer is not None
        while pending:
            item = pending[0]
            r = self._dlq_record(item, sess.origin)
            report = DlqReport(self, sess, item)
            headers: Any = r.headers  # (list is invariant; the stubs want str | bytes | None)
            try:
                producer.produce(r.topic, r.value, r.key, -1, report, None, r.timestamp_ms, headers)
                report.sent = True
                # (only its report may keep it now: this frame can outlive the call,
                # held by the traceback of an exception raised here earlier)
                del report
            except BufferError:
                self._dlq_failed(sess, item, "the producer's local queue is full")
                return
            except KafkaException as exc:
                if fatal_error(exc) is not None:
                    self._producing.raise_kafka(exc, "dead-letter produce failed")
                err = exc.args[0] if exc.args else None
                if isinstance(err, KafkaError) and is_record_error(err) and not item.minimal:
                    item.minimal = True
                    continue
                self._dlq_failed(sess, item, str(err.str() if isinstance(err, KafkaError) else exc))
                return
            pending.popleft()

    def _dlq_record(self, item: _PendingDlq, origin: tuple[str, bytes] | None) -> KafkaRecord:
        return dead_letter(
            reason=item.reason,
            event_id=item.event_id,
            original_topic=item.topic,
            key=item.key,
            raw=item.value,
            headers=item.headers,
            tx=TxContext(lsn_to_str(item.tx_id), item.timestamp_ms * 1000, origin),
            dlq_topic=self.settings.dlq_topic,
            max_value_bytes=0 if item.minimal else DLQ_MAX_VALUE_BYTES,
            max_field_bytes=DLQ_MINIMAL_FIELD_BYTES if item.minimal else None,
        )

    def _dlq_failed(self, sess: Session, item: _PendingDlq, cause: str) -> None:
        """A dead letter could not be written: hold the stream, retry after a back-off."""
        now = time.monotonic()
        delay_s = sess.dlq_backoff.failed(now)
        sess.dlq_retry_at = now + delay_s
        sess.held = f"dead letter to {self.settings.dlq_topic} not written: {cause}"
        self.metrics.dead_letter_retries.inc()
        log.warning(
            "event %s: %s; retrying in %.1fs",
            item.event_id or "?",
            sess.held,
            delay_s,
            extra={"event_id": item.event_id, "topic": self.settings.dlq_topic},
        )

    def delivered(self, sess: Session, item: _PendingDlq) -> None:
        """A dead letter is delivered: ack its record."""
        sess.tracker.ack(item.tx_id)
        self.metrics.dead_lettered.labels(item.code.value).inc()
        if sess.held is not None:
            log.info("dead letters are written again", extra={"topic": self.settings.dlq_topic})
            sess.held = None
        sess.dlq_backoff.reset()
        sess.dlq_retry_at = 0.0

    def report_failed(self, sess: Session, item: _PendingDlq, err: KafkaError) -> None:
        """A dead letter's delivery failed: put it back in line (unless the producer is
        being discarded: so is the session). The delivery mode may fail its
        transaction with it (:meth:`DeliveryMode.dead_letter_failed`: the session ends)."""
        fails = self.mode.dead_letter_failed(sess, err)
        self.metrics.kafka_errors.labels(err.name()).inc()
        if err.code() not in PURGED:
            sess.pending_dlq.appendleft(item)
            if is_record_error(err) and not item.minimal:
                item.minimal = True
            else:
                self._dlq_failed(sess, item, f"{err.name()}: {err.str()}")
        if fails:
            sess.fatal = sess.fatal or err


class DlqReport:
    """The delivery report of one dead letter, counted by reference like
    :class:`cdc.relay.stream.producing.Reports`: a failed report calls it; once the last
    reference is gone (the report served), a delivered dead letter is acknowledged."""

    __slots__ = ("failed", "item", "owner", "sent", "sess")

    def __init__(self, owner: DeadLetters, sess: Session, item: _PendingDlq) -> None:
        self.owner = owner
        self.sess = sess
        self.item = item
        self.sent = False
        self.failed = False

    def __call__(self, err: KafkaError | None, msg: Message) -> None:
        if err is None:  # (reports of delivered records come only while tracing)
            return
        self.failed = True
        self.owner.report_failed(self.sess, self.item, err)

    def __del__(self) -> None:
        if self.sent and not self.failed:
            try:
                self.owner.delivered(self.sess, self.item)
            except Exception as exc:  # (raised here it would only be printed)
                self.sess.fault = self.sess.fault or exc
