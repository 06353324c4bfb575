"""The relay: committed outbox inserts from the WAL (pgoutput) into Kafka.

Invariants (DESIGN.md, "Relay invariants"):

1. The slot's confirmed LSN advances only past transactions all of whose
   records Kafka acknowledged (or that were dead-lettered and acknowledged):
   :class:`cdc.lsn.LsnTracker` decides, this loop only reports its answer.
2. With nothing in flight the keepalive WAL end is confirmed, so an idle
   outbox never pins WAL.
3. When Kafka is slow or away the in-flight count reaches its bound and the
   relay stops reading WAL, but keeps sending status updates, so the
   walsender does not time it out; it resumes where it stopped.
4. A second relay on the same slot waits as a hot standby and takes over when
   the first one's walsender goes away.
5. SIGTERM: stop reading, flush the producer, confirm, exit 0.
6. A record Kafka refuses for itself goes to the dead-letter topic with the
   reason in headers; the stream never stalls on one row, never drops one.

Its own error paths (none of them ends the process):

* A librdkafka fatal error (confluent-kafka raises it from ``poll``; e.g. an
  idempotent producer out of sequence, or ``enable.gapless.guarantee``): the
  session ends, the producer is purged, closed and dropped, and after a
  back-off (:data:`REBUILD_MIN_S` doubling to :data:`REBUILD_MAX_S`; back to
  the minimum only after :data:`REBUILD_CALM_S` without one, so a producer that
  dies at once every time is rebuilt at most once per back-off: no crash loop)
  a new session builds a new producer and reads from the slot's confirmed LSN.
  Purged records were never acknowledged, so they are read again: duplicates,
  never loss. ``outbox_relay_producer_rebuilds_total`` counts rebuilds and
  ``/readyz`` answers 503 ``rebuilding: <error>`` meanwhile.
* A dead letter that cannot be written (``produce`` raising ``BufferError`` or
  ``KafkaException``, a failed delivery report, e.g. the dead-letter topic
  deleted while broker auto-creation is off): the record stays pending and
  unacknowledged (so unconfirmed), the relay stops reading WAL (HELD) but
  keeps answering the server, retries after a back-off, and ``/readyz``
  answers 503 naming the cause until a dead letter is written. A dead letter
  Kafka refuses for its own size is written again in a minimal form (key and
  headers cut, the value a note).
* State stays bounded: :class:`PoisonIds` is an LRU, and the dead-letter
  metric is labelled with a :class:`cdc.router.DeadLetterCode` (a fixed set);
  the reason's full text goes to the record's ``dlq.reason`` header and the log.
* librdkafka's own errors and log lines (producer and admin client) reach the
  process's logging and ``outbox_relay_kafka_errors_total{code}`` through
  :class:`cdc.kafkalog.KafkaClientEvents`; that counter also counts failed
  delivery reports by their code.

States and transitions::

    STARTING --slot held elsewhere--> STANDBY --slot free--> STREAMING
    STREAMING <--in-flight at bound / below--> BACKPRESSURE
    STREAMING | BACKPRESSURE --a dead letter fails--> HELD --a dead letter written--> STREAMING
    STARTING | STREAMING | BACKPRESSURE | HELD --stream or Kafka error--> RECONNECTING --> STARTING
    STANDBY | STREAMING | BACKPRESSURE | HELD --producer fatal error--> REBUILDING --> STARTING
    any --SIGTERM--> STOPPING --> STOPPED

Ready (``/readyz`` 200) in STREAMING and BACKPRESSURE only; otherwise the body
names the state and its cause.
"""

from __future__ import annotations

import enum
import gc
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NoReturn

import orjson
import psycopg
from confluent_kafka import KafkaError, KafkaException, Message, Producer
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cdc import constants as c
from cdc import pgoutput as pgo
from cdc.backlog import BacklogGuard, backlog_route
from cdc.backoff import Backoff
from cdc.errors import (
    CdcError,
    DecodeError,
    KafkaUnavailableError,
    ProducerFatalError,
    SlotInUseError,
)
from cdc.health import HealthServer, Liveness
from cdc.kafkalog import KafkaClientEvents, fatal_error
from cdc.lsn import LsnTracker
from cdc.producer import (
    PURGED,
    TopicManager,
    discard_producer,
    is_record_error,
    make_producer,
    record_error_code,
)
from cdc.replproto import Keepalive, lsn_to_str, parse_copy_data, xlog_payload
from cdc.router import (
    ROUTED_COLUMNS,
    DeadLetterCode,
    KafkaRecord,
    RouteError,
    TxContext,
    dead_letter,
    route_fields,
    route_message,
)
from cdc.settings import Settings
from cdc.stream import (
    ReplicationStream,
    ensure_publication,
    ensure_slot,
    server_is_utf8,
    slot_info,
)
from cdc.tracing import DeliveryCallback, relay_tracing

log = logging.getLogger(__name__)

#: CopyData messages handled per loop turn before the producer is polled again.
READ_BATCH = 2_000
#: Longest a turn blocks waiting for WAL, so status and signals stay timely.
READ_WAIT_S = 0.1
#: The same while records are in flight: their delivery reports are served
#: between waits, so an ack (and the confirmation behind it) is not held back.
ACK_WAIT_S = 0.005
#: Confirm progress at most this often (fewer duplicates after a crash).
STATUS_MIN_INTERVAL_S = 0.02
#: Cyclic-GC thresholds for the relay process (see Relay.run).
GC_THRESHOLDS = (50_000, 20, 50)
#: Reconnect backoff after stream or Kafka trouble (back to the minimum after
#: a session that lasted the maximum).
RECONNECT_MIN_S = 0.5
RECONNECT_MAX_S = 30.0
#: Producer rebuilds after a fatal error: never closer than the minimum, doubling
#: while they follow each other, back to the minimum after the calm period.
REBUILD_MIN_S = 1.0
REBUILD_MAX_S = 60.0
REBUILD_CALM_S = 300.0
#: Retries of a dead letter that could not be written (reset once one is written).
DLQ_RETRY_MIN_S = 0.5
DLQ_RETRY_MAX_S = 30.0
#: Cap of each field of a minimal dead letter (written after Kafka refused the
#: full one for its size): key and header values, the value's prefix.
DLQ_MINIMAL_FIELD_BYTES = 1024
#: Event ids remembered as refused by Kafka (see PoisonIds): ~100 bytes each.
POISON_MAX = 10_000
#: A dead-letter reason longer than this is cut in the log line (the record's
#: dlq.reason header keeps it whole); reasons quote the event's own values.
LOG_REASON_MAX_CHARS = 2_000
#: Longest single wait between liveness ticks while backing off.
WAIT_TICK_S = 1.0
#: How long shutdown waits for Kafka to acknowledge what is in flight.
SHUTDOWN_FLUSH_S = 15.0
#: Slot lag and heartbeat period of the monitor thread.
MONITOR_INTERVAL_S = 5.0
#: A dead-letter value larger than this is replaced by a note (see router.dead_letter).
DLQ_MAX_VALUE_BYTES = 512 * 1024
_TAG_INSERT, _TAG_BEGIN, _TAG_COMMIT = ord("I"), ord("B"), ord("C")
_TAG_RELATION, _TAG_MESSAGE = ord("R"), ord("M")
_IGNORED_CHANGES = {ord("U"): "update", ord("D"): "delete", ord("T"): "truncate"}
_XLOG_PAYLOAD_AT = 25  # 'w', wal_start, wal_end, send_time
#: Bound of the aggregatetype -> topic cache of the fast path.
TOPIC_CACHE_MAX = 10_000
_loads, _dumps, _JSONDecodeError = orjson.loads, orjson.dumps, orjson.JSONDecodeError


class RelayState(enum.Enum):
    STARTING = "starting"  # connecting, ensuring slot and publication
    STANDBY = "standby"  # another relay streams the slot; we wait to take over
    STREAMING = "streaming"  # reading WAL and producing
    BACKPRESSURE = "backpressure"  # in-flight at its bound: not reading WAL
    HELD = "held"  # a dead letter could not be written: not reading WAL, retrying it
    RECONNECTING = "reconnecting"  # after an error, waiting before a new session
    REBUILDING = "rebuilding"  # producer fatal error: purged, closed; a new one after a back-off
    STOPPING = "stopping"  # SIGTERM received: flushing and confirming
    STOPPED = "stopped"  # done; the process exits 0


class RelayMetrics:
    """The relay's Prometheus metrics, in their own registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.relayed = Counter(
            "outbox_relay_events_total",
            "Events acknowledged by Kafka",
            ["topic"],
            registry=registry,
        )
        self.dead_lettered = Counter(
            "outbox_relay_dead_lettered_total",
            "Events written to the dead-letter topic, by reason code (cdc.router.DeadLetterCode)",
            ["reason"],
            registry=registry,
        )
        self.dead_letter_retries = Counter(
            "outbox_relay_dead_letter_retries_total",
            "Dead letters that could not be written and were scheduled again",
            registry=registry,
        )
        self.producer_rebuilds = Counter(
            "outbox_relay_producer_rebuilds_total",
            "Producers purged, closed and rebuilt after a librdkafka fatal error",
            registry=registry,
        )
        self.poison_ids = Gauge(
            "outbox_relay_poison_ids",
            "Event ids remembered as refused by Kafka (bounded LRU)",
            registry=registry,
        )
        self.ignored = Counter(
            "outbox_relay_ignored_changes_total",
            "Outbox updates/deletes/truncates seen and not published",
            ["kind"],
            registry=registry,
        )
        self.kafka_errors = Counter(
            "outbox_relay_kafka_errors_total",
            "librdkafka errors (producer and admin client) and failed delivery reports, by code",
            ["code"],
            registry=registry,
        )
        self.latency = Histogram(
            "outbox_relay_commit_to_ack_seconds",
            "Transaction commit to Kafka ack",
            buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=registry,
        )
        self.confirmed_lsn = Gauge(
            "outbox_relay_confirmed_lsn", "LSN last confirmed to the slot", registry=registry
        )
        self.slot_lag = Gauge(
            "outbox_relay_slot_lag_bytes",
            "pg_current_wal_lsn() - confirmed_flush_lsn",
            registry=registry,
        )
        self.in_flight = Gauge(
            "outbox_relay_in_flight", "Records produced, not yet acknowledged", registry=registry
        )
        self.state = Gauge(
            "outbox_relay_state", "1 for the current state", ["state"], registry=registry
        )
        self._relayed_children: dict[str, Any] = {}

    def relayed_in(self, topic: str) -> Any:
        """The per-topic child of ``relayed`` (cached: ``labels()`` is slow per record)."""
        child = self._relayed_children.get(topic)
        if child is None:
            child = self._relayed_children[topic] = self.relayed.labels(topic)
        return child


_UNKNOWN: Any = object()


def _decode(value: object) -> str | None:
    """A text value of an Insert tuple as str (None for NULL)."""
    if value is None:
        return None
    if value.__class__ is bytes:
        return value.decode()
    raise DecodeError("outbox row has a non-text value: the full row is not in the stream")


class PoisonIds(OrderedDict[bytes, tuple[DeadLetterCode, str]]):
    """Event ids Kafka refused for themselves -> (code, reason); least recently used first.

    Purpose: a record the broker refuses is dead-lettered from its failed
    delivery report, but its transaction is confirmed only once the dead letter
    is acknowledged; after a reconnect or a producer rebuild the same event is
    read again. Found here, it goes straight to the dead-letter topic instead of
    being offered to Kafka again (a second refusal - and, with
    ``enable.gapless.guarantee``, a second fatal error).

    Bounded: at most ``max_entries`` ids, the least recently used forgotten
    first. Forgetting loses nothing: an event read again after its id was
    forgotten is refused by Kafka again and dead-lettered by the same path.
    """

    def __init__(self, max_entries: int = POISON_MAX) -> None:
        super().__init__()
        self.max_entries = max_entries

    def remember(self, event_id: bytes, code: DeadLetterCode, reason: str) -> None:
        """Kafka refused ``event_id`` for ``reason``; forget the oldest beyond the bound."""
        self[event_id] = (code, reason)
        self.move_to_end(event_id)
        while len(self) > self.max_entries:
            self.popitem(last=False)

    def recall(self, event_id: bytes) -> tuple[DeadLetterCode, str] | None:
        """The refusal of ``event_id`` if remembered (it becomes the most recent)."""
        found = self.get(event_id)
        if found is not None:
            self.move_to_end(event_id)
        return found


@dataclass(eq=False)
class _PendingDlq:
    """A dead letter waiting to be written; it holds one add of ``tx_id`` in the tracker."""

    tx_id: int
    code: DeadLetterCode
    reason: str
    topic: str
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]
    timestamp_ms: int
    event_id: str
    #: Kafka refused the full dead letter for its size: write the minimal form.
    minimal: bool = False


@dataclass
class Session:
    """One streaming session: the stream, its LSN bookkeeping and relation cache."""

    stream: ReplicationStream
    tracker: LsnTracker
    relations: pgo.RelationCache = field(default_factory=pgo.RelationCache)
    tx_id: int | None = None
    tx: TxContext | None = None
    reply_requested: bool = False
    fatal: KafkaError | None = None
    #: dead letters not yet handed to Kafka, oldest first
    pending_dlq: deque[_PendingDlq] = field(default_factory=deque)
    #: why a dead letter failed (the stream is HELD), None while they flow
    held: str | None = None
    #: no dead letter is produced before this time (monotonic seconds)
    dlq_retry_at: float = 0.0
    dlq_backoff: Backoff = field(
        default_factory=lambda: Backoff(min_s=DLQ_RETRY_MIN_S, max_s=DLQ_RETRY_MAX_S)
    )
    last_confirmed: int = 0
    ignored_kinds: set[str] = field(default_factory=set)
    #: relation oid -> positions of the routed columns, None if not the outbox
    #: (cleared when a Relation message arrives)
    outbox_oids: dict[int, tuple[int, ...] | None] = field(default_factory=dict)
    #: acknowledged records per topic since the last status (metrics are
    #: updated in bulk: a Prometheus inc per record was a tenth of the CPU)
    acked: dict[str, int] = field(default_factory=dict)


class Relay:
    """Runs sessions until stopped; see the module docstring for the contract."""

    def __init__(
        self,
        settings: Settings,
        *,
        registry: CollectorRegistry | None = None,
        serve_http: bool = True,
    ) -> None:
        self.settings = settings.require("pg_dsn", "kafka_bootstrap_servers")
        self.registry = registry or CollectorRegistry()
        self.metrics = RelayMetrics(self.registry)
        self.liveness = Liveness()
        self._stop = threading.Event()
        self._state = RelayState.STARTING
        self._reason = ""
        self._serve_http = serve_http
        self._producer: Producer | None = None
        #: librdkafka's errors and logs of the producer (the same one across rebuilds)
        self._events = KafkaClientEvents("producer", count=self._count_kafka_error)
        self._rebuild_backoff = Backoff(
            min_s=REBUILD_MIN_S, max_s=REBUILD_MAX_S, calm_s=REBUILD_CALM_S
        )
        self._topics = TopicManager(
            bootstrap=settings.kafka_bootstrap_servers,
            overrides=settings.kafka_config,
            partitions=settings.topic_partitions,
            replication_factor=settings.topic_replication_factor,
            events=KafkaClientEvents("admin", count=self._count_kafka_error),
        )
        table = settings.outbox_table
        self._table = tuple(table.split(".", 1)) if "." in table else (None, table)
        self.poison = PoisonIds()
        #: aggregatetype as sent -> its topic, validated and created (fast path)
        self._topic_of: dict[bytes, str] = {}
        #: the database's text is UTF-8, so the fast path may use raw bytes
        self._utf8 = False
        #: OpenTelemetry produce spans; None (the default) costs one test per record
        self._tracing = relay_tracing()

    # -- lifecycle -----------------------------------------------------------
    def stop(self) -> None:
        """Ask the relay to stop (signal-safe)."""
        self._stop.set()

    @property
    def state(self) -> RelayState:
        return self._state

    def _set_state(self, state: RelayState, reason: str = "") -> None:
        """Enter ``state``; ``reason`` (the cause, for /readyz) is shown after it."""
        if state is self._state and reason == self._reason:
            return
        if state is not self._state:
            log.info("relay %s -> %s", self._state.value, state.value, extra={"state": state.value})
            self.metrics.state.labels(self._state.value).set(0)
            self.metrics.state.labels(state.value).set(1)
        self._state = state
        self._reason = reason
        self.liveness.set(
            f"{state.value}: {reason}" if reason else state.value,
            ready=state in (RelayState.STREAMING, RelayState.BACKPRESSURE),
        )

    def _count_kafka_error(self, code: str) -> None:
        self.metrics.kafka_errors.labels(code).inc()

    def _wait(self, delay_s: float) -> None:
        """Wait ``delay_s`` (less when stopped), ticking the liveness meanwhile."""
        deadline = time.monotonic() + delay_s
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.liveness.tick()
            self._stop.wait(min(left, WAIT_TICK_S))

    def run(self) -> int:
        """Stream until :meth:`stop`; return the process exit code."""
        # The hot path allocates ~30 short-lived, acyclic objects per event; the
        # default gen-0 threshold (700) ran the cyclic GC every ~25 events for
        # ~8% of the CPU. Collect less often; move start-up objects out of reach.
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        server = None
        guard = BacklogGuard(self.settings)  # GET /backlog: measured from PG and Kafka
        if self._serve_http:
            server = HealthServer(
                host=self.settings.http_host,
                port=self.settings.relay_http_port,
                registry=self.registry,
                liveness=self.liveness,
                routes={"/backlog": backlog_route(guard)},
            ).start()
        monitor = threading.Thread(target=self._monitor, name="slot-monitor", daemon=True)
        monitor.start()
        try:
            self._run_sessions()
        finally:
            if self._producer is not None:
                try:
                    self._producer.flush(SHUTDOWN_FLUSH_S)
                except KafkaException as exc:
                    self._events.raised(exc)
                    log.warning("final flush failed: %s", exc)
            self._set_state(RelayState.STOPPED)
            if server:
                server.stop()
            guard.close()
        return 0

    def _run_sessions(self) -> None:
        reconnect = Backoff(min_s=RECONNECT_MIN_S, max_s=RECONNECT_MAX_S, calm_s=RECONNECT_MAX_S)
        while not self._stop.is_set():
            self._set_state(RelayState.STARTING)
            try:
                self._session()
            except SlotInUseError as exc:
                self._standby(str(exc))
            except ProducerFatalError as exc:
                self._rebuild_producer(str(exc))
            except (CdcError, psycopg.OperationalError) as exc:
                if isinstance(exc, CdcError) and not exc.retriable:
                    raise
                delay_s = reconnect.failed(time.monotonic())
                log.warning("relay session ended: %s; reconnecting in %.1fs", exc, delay_s)
                self._set_state(RelayState.RECONNECTING, str(exc))
                self._wait(delay_s)

    def _rebuild_producer(self, reason: str) -> None:
        """Purge, close and drop the producer; the next session builds a new one.

        Called after a fatal error ended the session. The records the producer
        held were never acknowledged, so the next session - which starts at
        the slot's confirmed LSN - reads them again. The back-off comes first,
        so rebuilds are never closer than :data:`REBUILD_MIN_S`.
        """
        self.metrics.producer_rebuilds.inc()
        delay_s = self._rebuild_backoff.failed(time.monotonic())
        self._set_state(RelayState.REBUILDING, reason)
        log.error(
            "%s: purging and closing the producer; a new one in %.1fs",
            reason,
            delay_s,
            extra={"state": RelayState.REBUILDING.value},
        )
        producer, self._producer = self._producer, None
        if producer is not None:
            discard_producer(producer)
        self._wait(delay_s)
        self._events.clear_fatal()

    def _standby(self, reason: str) -> None:
        if self._state is not RelayState.STANDBY:
            log.info("slot %s busy (%s): waiting as hot standby", self.settings.slot, reason)
        self._set_state(RelayState.STANDBY)
        deadline = time.monotonic() + c.STANDBY_RETRY_S
        while not self._stop.is_set() and time.monotonic() < deadline:
            self.liveness.tick()
            if self._producer is not None:  # (kept from an earlier session)
                try:
                    self._poll(0)  # librdkafka queues log lines and errors until served
                except ProducerFatalError as exc:
                    self._rebuild_producer(str(exc))
                    return
                except KafkaUnavailableError as exc:
                    log.warning("standby: %s", exc)
            self._stop.wait(0.2)

    # -- one session -----------------------------------------------------------
    def _session(self) -> None:
        s = self.settings
        with psycopg.connect(
            s.pg_dsn.get_secret_value(), autocommit=True, connect_timeout=10
        ) as conn:
            ensure_publication(conn, s.publication, self._table[1])
            info = ensure_slot(conn, s.slot)
            self._utf8 = server_is_utf8(conn)
        self._topics.ensure([s.dlq_topic])
        stream = ReplicationStream(
            s.pg_dsn.get_secret_value(), slot=s.slot, publication=s.publication
        )
        try:
            stream.start(0)  # a standby stops here (SlotInUseError), without a producer
            if self._producer is None:
                self._producer = make_producer(
                    s.kafka_bootstrap_servers, s.kafka_config, events=self._events
                )
            sess = Session(
                stream=stream,
                tracker=LsnTracker(info.confirmed_flush_lsn),
                last_confirmed=info.confirmed_flush_lsn,
            )
            self._stream_loop(sess)
            if self._stop.is_set():
                self._shutdown(sess)
        finally:
            stream.close()

    def _stream_loop(self, sess: Session) -> None:
        next_status = 0.0
        while not self._stop.is_set():
            self.liveness.tick()
            self._poll(0)
            self._drain_dlq(sess)
            if sess.fatal is not None:
                raise KafkaUnavailableError(f"producer error: {sess.fatal}")
            if sess.held is not None:
                self._set_state(RelayState.HELD, sess.held)
                self._poll(c.BACKPRESSURE_POLL_S)
            elif sess.tracker.in_flight >= self.settings.relay_max_in_flight:
                self._set_state(RelayState.BACKPRESSURE)
                self._poll(c.BACKPRESSURE_POLL_S)
            else:
                self._set_state(RelayState.STREAMING)
                self._read_batch(sess)
            now = time.monotonic()
            advanced = sess.tracker.confirmable != sess.last_confirmed
            if (
                now >= next_status
                or sess.reply_requested
                or (advanced and now >= next_status - c.STATUS_INTERVAL_S + STATUS_MIN_INTERVAL_S)
            ):
                self._send_status(sess)
                next_status = now + c.STATUS_INTERVAL_S

    def _read_batch(self, sess: Session) -> None:
        stream, tracker = sess.stream, sess.tracker
        get_nowait = stream.get_nowait
        on_change, handle = self._on_change, self._handle
        limit = self.settings.relay_max_in_flight
        wait_s = ACK_WAIT_S if tracker.in_flight else READ_WAIT_S
        data: memoryview | bytes | None
        for _ in range(READ_BATCH):
            nbytes, data = get_nowait()
            if nbytes <= 0:  # nothing buffered (wait for it), or the stream ended (raises)
                data = stream.read(wait_s)
                if data is None:
                    return
            wait_s = 0.0
            if data[0] == 0x77 and len(data) > _XLOG_PAYLOAD_AT:  # XLogData: the hot path
                on_change(sess, bytes(data[_XLOG_PAYLOAD_AT:]))
            else:
                handle(sess, data)
            if sess.reply_requested or tracker.in_flight >= limit:
                return

    def _send_status(self, sess: Session) -> None:
        for topic, count in sess.acked.items():
            self.metrics.relayed_in(topic).inc(count)
        sess.acked.clear()
        lsn = sess.tracker.confirmable
        sess.stream.send_status(lsn)
        sess.reply_requested = False
        if lsn != sess.last_confirmed:
            log.debug("slot %s confirmed %s", self.settings.slot, lsn_to_str(lsn))
            sess.last_confirmed = lsn
        self.metrics.confirmed_lsn.set(lsn)
        self.metrics.in_flight.set(sess.tracker.in_flight)

    def _shutdown(self, sess: Session) -> None:
        self._set_state(RelayState.STOPPING)
        deadline = time.monotonic() + SHUTDOWN_FLUSH_S
        while time.monotonic() < deadline and (sess.tracker.in_flight or sess.pending_dlq):
            self._poll(0.05)
            self._drain_dlq(sess)
        self._send_status(sess)
        log.info(
            "relay stopped at %s with %d records unacknowledged",
            lsn_to_str(sess.tracker.confirmable),
            sess.tracker.in_flight,
        )

    # -- protocol --------------------------------------------------------------
    def _handle(self, sess: Session, data: memoryview | bytes) -> None:
        """One CopyData message of the replication stream."""
        payload = xlog_payload(data)
        if payload is None:
            msg = parse_copy_data(data)
            if isinstance(msg, Keepalive):
                sess.tracker.observe_wal_end(msg.wal_end)
                if msg.reply_requested:
                    sess.reply_requested = True
            return
        self._on_change(sess, payload)

    def _on_change(self, sess: Session, payload: bytes) -> None:
        """One pgoutput message (the payload of an XLogData message)."""
        if not payload:
            raise DecodeError("empty pgoutput message")
        tag = payload[0]
        if tag == _TAG_INSERT:
            self._on_insert(sess, payload)
        elif tag == _TAG_BEGIN:
            begin = pgo.decode(payload)
            assert isinstance(begin, pgo.Begin)
            sess.tx_id = begin.final_lsn
            sess.tx = TxContext(lsn_to_str(begin.final_lsn), begin.commit_ts_us)
            sess.tracker.open(begin.final_lsn)
        elif tag == _TAG_COMMIT:
            commit = pgo.decode(payload)
            assert isinstance(commit, pgo.Commit) and sess.tx_id is not None
            sess.tracker.close(sess.tx_id, commit.end_lsn)
            sess.tx_id = sess.tx = None
        elif tag == _TAG_RELATION:
            rel = pgo.decode(payload)
            assert isinstance(rel, pgo.Relation)
            sess.relations.update(rel)
            sess.outbox_oids.pop(rel.oid, None)
        elif tag == _TAG_MESSAGE:
            self._on_message(sess, pgo.decode(payload))
        elif tag in _IGNORED_CHANGES:
            self._on_ignored(sess, _IGNORED_CHANGES[tag])

    def _on_ignored(self, sess: Session, kind: str) -> None:
        """Outbox updates/deletes/truncates: counted, logged once a session, never published."""
        self.metrics.ignored.labels(kind).inc()
        if kind not in sess.ignored_kinds:
            sess.ignored_kinds.add(kind)
            log.info(
                "publication %s sends outbox %ss: counted, not published",
                self.settings.publication,
                kind,
            )

    def _is_outbox(self, rel: pgo.Relation) -> bool:
        schema, name = self._table
        return rel.name == name and (schema is None or rel.namespace == schema)

    def _on_insert(self, sess: Session, payload: bytes) -> None:
        """An Insert: the fast path routes straight from the message bytes.

        It handles the common case - an outbox row of text values, all
        required columns present, a JSON payload, a known topic, a UTF-8
        database - and yields the very record :func:`route_fields` would. Any
        other row goes to :meth:`_on_insert_decoded`, which decodes it fully
        and dead-letters or raises with the precise reason.
        """
        tx, tx_id = sess.tx, sess.tx_id
        found = pgo.insert_text_values(payload) if tx is not None else None
        if found is None:
            self._on_insert_decoded(sess, pgo.decode(payload))
            return
        oid, values = found
        index = sess.outbox_oids.get(oid, _UNKNOWN)
        if index is _UNKNOWN:
            index = self._outbox_index(sess, oid)
        if index is None:
            return
        ncols, i_id, i_aggtype, i_agg, i_type, i_payload, i_trace = index
        if len(values) != ncols or not self._utf8:
            self._on_insert_decoded(sess, pgo.decode(payload))
            return
        event_id = values[i_id]
        aggtype = values[i_aggtype]
        topic = self._topic_of.get(aggtype) if aggtype is not None else None
        key, event_type, doc = values[i_agg], values[i_type], values[i_payload]
        if topic is None or not (event_id and key and event_type and doc):
            self._on_insert_decoded(sess, pgo.decode(payload))
            return
        try:
            value = _dumps(_loads(doc))
        except _JSONDecodeError:
            self._on_insert_decoded(sess, pgo.decode(payload))
            return
        assert tx is not None and tx_id is not None
        headers = [
            (c.HEADER_ID, event_id),
            (c.HEADER_TYPE, event_type),
            (c.HEADER_AGGREGATE_TYPE, aggtype),
            tx.lsn_header,
            tx.ts_header,
        ]
        trace = values[i_trace] if i_trace >= 0 else None
        if trace:
            headers.append((c.HEADER_TRACEPARENT, trace))
        if self.poison and event_id in self.poison:  # (C-level checks: the hot path)
            self._produce(
                sess,
                tx_id,
                KafkaRecord(topic, key, value, headers, tx.timestamp_ms, event_id.decode()),
            )
            return
        sess.tracker.add(tx_id)
        try:
            self._send(sess, tx_id, topic, value, key, headers, tx.timestamp_ms, event_id)
        except KafkaException as exc:
            self._refused(sess, tx_id, exc, topic, key, value, headers, tx.timestamp_ms)

    def _on_insert_decoded(self, sess: Session, ins: Any) -> None:
        """An Insert the fast path did not take: decoded fully, routed or dead-lettered."""
        assert isinstance(ins, pgo.Insert)
        if sess.tx is None or sess.tx_id is None:
            raise DecodeError("pgoutput Insert outside a transaction")
        oid = ins.relation_oid
        index = sess.outbox_oids.get(oid, _UNKNOWN)
        if index is _UNKNOWN:
            index = self._outbox_index(sess, oid)
        if index is None:
            return
        ncols, i_id, i_aggtype, i_agg, i_type, i_payload, i_trace = index
        values = ins.new
        if len(values) != ncols:
            raise DecodeError(f"row of relation {oid} does not match its Relation message")
        try:
            # Insert tuples hold bytes or None (unchanged-TOAST exists only in updates).
            trace = values[i_trace] if i_trace >= 0 else None
            record = route_fields(
                _decode(values[i_id]),
                _decode(values[i_aggtype]),
                _decode(values[i_agg]),
                _decode(values[i_type]),
                _decode(values[i_payload]),
                _decode(trace),
                sess.tx,
                self.settings.topic_prefix,
            )
        except UnicodeDecodeError as exc:
            self._dead_letter_route(
                sess,
                sess.tx_id,
                sess.tx,
                RouteError(f"outbox row is not valid UTF-8: {exc}", code=DeadLetterCode.NOT_UTF8),
            )
            return
        except RouteError as exc:
            self._dead_letter_route(sess, sess.tx_id, sess.tx, exc)
            return
        self._produce(sess, sess.tx_id, record)
        aggtype = values[i_aggtype]
        if isinstance(aggtype, bytes) and record.topic in self._topics.known:
            if len(self._topic_of) >= TOPIC_CACHE_MAX:
                self._topic_of.clear()
            self._topic_of[aggtype] = record.topic

    def _outbox_index(self, sess: Session, oid: int) -> tuple[int, ...] | None:
        """Column count, then positions of :data:`ROUTED_COLUMNS` in relation ``oid``
        (-1: absent); None when it is not the outbox. Cached until its next Relation."""
        rel = sess.relations.get(oid)
        index: tuple[int, ...] | None = None
        if self._is_outbox(rel):
            names = [col.name for col in rel.columns]
            index = (len(names), *(names.index(n) if n in names else -1 for n in ROUTED_COLUMNS))
        sess.outbox_oids[oid] = index
        return index

    def _on_message(self, sess: Session, msg: Any) -> None:
        assert isinstance(msg, pgo.Message)
        if msg.prefix != c.OUTBOX_MESSAGE_PREFIX:
            return
        if sess.tx is None or sess.tx_id is None:
            # A non-transactional outbox message: never atomic with business
            # data, so it is dead-lettered rather than published.
            tx = TxContext(lsn_to_str(msg.lsn), int(time.time() * 1_000_000))
            # msg.lsn is the record's end; a following commit may start there,
            # so the pseudo-transaction's id sits just below it.
            sess.tracker.open(msg.lsn - 1)
            self._dead_letter_route(
                sess,
                msg.lsn - 1,
                tx,
                RouteError(
                    "non-transactional outbox message (use pg_logical_emit_message(true, ...))",
                    code=DeadLetterCode.NON_TRANSACTIONAL,
                    raw=bytes(msg.content),
                ),
            )
            sess.tracker.close(msg.lsn - 1, msg.lsn)
            return
        try:
            record = route_message(
                bytes(msg.content), sess.tx, topic_prefix=self.settings.topic_prefix
            )
        except RouteError as exc:
            self._dead_letter_route(sess, sess.tx_id, sess.tx, exc)
            return
        self._produce(sess, sess.tx_id, record)

    # -- Kafka -----------------------------------------------------------------
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

    def _dead_letter_route(self, sess: Session, tx_id: int, tx: TxContext, exc: RouteError) -> None:
        sess.tracker.add(tx_id)
        self._queue_dlq(
            sess,
            tx_id,
            exc.code,
            exc.reason,
            "",
            b"",
            exc.raw,
            [(c.HEADER_ID, exc.event_id.encode())],
            tx.timestamp_ms,
        )

    def _queue_dlq(
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
        """Queue the dead letter of a record whose add to ``tx_id`` it takes over."""
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

    def _drain_dlq(self, sess: Session) -> None:
        """Hand the pending dead letters to Kafka, oldest first.

        One that cannot be handed over stays first in line, unacknowledged (so
        its transaction stays unconfirmed); the stream is HELD until a retry
        after a back-off writes one. Kafka refusing it for its size makes it
        minimal (see :data:`DLQ_MINIMAL_FIELD_BYTES`) and it is tried again at once.
        """
        pending = sess.pending_dlq
        if not pending or time.monotonic() < sess.dlq_retry_at:
            return
        producer = self._producer
        assert producer is not None
        while pending:
            item = pending[0]
            r = self._dlq_record(item)
            callback = partial(self._on_dlq_delivery, sess, item)
            headers: Any = r.headers  # (list is invariant; the stubs want str | bytes | None)
            try:
                producer.produce(
                    r.topic, r.value, r.key, -1, callback, None, r.timestamp_ms, headers
                )
            except BufferError:
                self._dlq_failed(sess, item, "the producer's local queue is full")
                return
            except KafkaException as exc:
                if fatal_error(exc) is not None:
                    self._raise_kafka(exc, "dead-letter produce failed")
                err = exc.args[0] if exc.args else None
                if isinstance(err, KafkaError) and is_record_error(err) and not item.minimal:
                    item.minimal = True
                    continue
                self._dlq_failed(sess, item, str(err.str() if isinstance(err, KafkaError) else exc))
                return
            pending.popleft()

    def _dlq_record(self, item: _PendingDlq) -> KafkaRecord:
        return dead_letter(
            reason=item.reason,
            event_id=item.event_id,
            original_topic=item.topic,
            key=item.key,
            raw=item.value,
            headers=item.headers,
            tx=TxContext("", item.timestamp_ms * 1000),
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

    def _on_dlq_delivery(
        self, sess: Session, item: _PendingDlq, err: KafkaError | None, msg: Message
    ) -> None:
        """Delivery report of a dead letter: ack its record, or put it back in line."""
        if err is None:
            sess.tracker.ack(item.tx_id)
            self.metrics.dead_lettered.labels(item.code.value).inc()
            if sess.held is not None:
                log.info("dead letters are written again", extra={"topic": msg.topic()})
                sess.held = None
            sess.dlq_backoff.reset()
            sess.dlq_retry_at = 0.0
            return
        self.metrics.kafka_errors.labels(err.name()).inc()
        if err.code() in PURGED:  # the producer is being discarded: so is the session
            return
        sess.pending_dlq.appendleft(item)
        if is_record_error(err) and not item.minimal:
            item.minimal = True
            return
        self._dlq_failed(sess, item, f"{err.name()}: {err.str()}")

    # -- monitor thread ----------------------------------------------------------
    def _monitor(self) -> None:
        """Slot lag gauge and optional heartbeat, on a connection of its own; serves
        the admin client's log lines and errors (queued until served)."""
        s = self.settings
        last_beat = 0.0
        while not self._stop.wait(
            MONITOR_INTERVAL_S
            if s.heartbeat_interval_s <= 0
            else min(MONITOR_INTERVAL_S, s.heartbeat_interval_s)
        ):
            self._topics.serve()
            try:
                with psycopg.connect(
                    s.pg_dsn.get_secret_value(), autocommit=True, connect_timeout=5
                ) as conn:
                    info = slot_info(conn, s.slot)
                    if info is not None and info.lag_bytes is not None:
                        self.metrics.slot_lag.set(info.lag_bytes)
                    if (
                        s.heartbeat_interval_s > 0
                        and time.monotonic() - last_beat >= s.heartbeat_interval_s
                    ):
                        conn.execute(
                            "SELECT pg_logical_emit_message(false, %s, '')",
                            (c.OUTBOX_MESSAGE_PREFIX + "-heartbeat",),
                        )
                        last_beat = time.monotonic()
            except psycopg.Error as exc:
                log.debug("slot monitor: %s", exc)
