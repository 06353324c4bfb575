"""The relay's loop: sessions on the replication slot, until SIGTERM.

Invariants (DESIGN.md, "Relay invariants"):

1. The slot's confirmed LSN advances only past transactions all of whose
   records Kafka acknowledged (or that were dead-lettered and acknowledged):
   :class:`cdc.wal.lsn.LsnTracker` decides, this loop only reports its answer.
2. With nothing in flight the keepalive WAL end is confirmed, so an idle
   outbox never pins WAL.
3. When Kafka is slow or away the in-flight count reaches its bound and the
   relay stops reading WAL, but keeps sending status updates, so the
   walsender does not time it out; it resumes where it stopped.
4. A second relay on the same slot waits as a hot standby - cheaply, reading
   nothing but the slot's holder (:mod:`cdc.relay.standby.wait`) - and takes over
   when the first one's walsender goes away; a slot held by this relay's own
   previous walsender (a dead path left it behind) is taken back at once.
5. SIGTERM: stop reading, flush the producer, confirm, exit 0.
6. A record Kafka refuses for itself goes to the dead-letter topic with the
   reason in headers; the stream never stalls on one row, never drops one.
12. A silent replication connection is ended only when its walsender is not
   working (:mod:`cdc.relay.health.silence`: the relay looks at it first); a working
   one is left alone, and the relay says so.

No error path ends the process: a stream or Kafka error reconnects after a
back-off; a librdkafka fatal error rebuilds the producer after a back-off
(:data:`REBUILD_MIN_S` doubling to :data:`REBUILD_MAX_S`; back to the minimum
only after :data:`REBUILD_CALM_S` without one, so a producer that dies at once
every time is rebuilt at most once per back-off: no crash loop), and the next
session reads from the slot's confirmed LSN. ``outbox_relay_producer_rebuilds_total``
counts rebuilds and ``/readyz`` answers 503 ``rebuilding: <error>`` meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import psycopg
from confluent_kafka import KafkaException, Producer
from prometheus_client import CollectorRegistry

from cdc import collector
from cdc import constants as c
from cdc.backlog import BacklogGuard, backlog_route
from cdc.backoff import Backoff
from cdc.errors import (
    CdcError,
    KafkaUnavailableError,
    ProducerFatalError,
    SlotInUseError,
)
from cdc.health import HealthServer, Liveness
from cdc.kafka.log import KafkaClientEvents
from cdc.kafka.producer import TopicManager, discard_producer
from cdc.migrate import check_wal_level
from cdc.pgconn import connect
from cdc.relay.gaps.guard import GAP_RECHECK_S, SlotGapError, SlotGuard
from cdc.relay.gaps.ledger import SlotLedger
from cdc.relay.gaps.periodic_audit import ACTIVE_STATES, PeriodicAudit
from cdc.relay.health.kafka_ready import KafkaReadiness
from cdc.relay.health.metrics import RelayMetrics
from cdc.relay.health.monitor import SlotMonitor
from cdc.relay.health.silent_session import SilentSession
from cdc.relay.health.stall import StallWatch
from cdc.relay.health.state import POISON_MAX, PoisonIds, RelayState, Session
from cdc.relay.standby.safe import StandbySafe
from cdc.relay.standby.wait import StandbyWait
from cdc.relay.standby.watch import StandbyWatch
from cdc.relay.stream.at_least_once import AtLeastOnce
from cdc.relay.stream.dead_letters import DeadLetters
from cdc.relay.stream.fast_path import ACK_WAIT_S, READ_BATCH, FastPath
from cdc.relay.stream.mode import READ_WAIT_S, DeliveryMode
from cdc.relay.stream.producing import Producing
from cdc.settings import Settings
from cdc.tracing import relay_tracing
from cdc.wal.replproto import lsn_to_str
from cdc.wal.stream import (
    ReplicationStream,
    check_replication_privilege,
    ensure_publication,
    ensure_slot,
    server_is_utf8,
)

log = logging.getLogger("cdc.relay")


#: Confirm progress at most this often (fewer duplicates after a crash).
STATUS_MIN_INTERVAL_S = 0.02


#: Reconnect backoff after stream or Kafka trouble (back to the minimum after
#: a session that lasted the maximum).
RECONNECT_MIN_S = 0.5


RECONNECT_MAX_S = 30.0


#: Producer rebuilds after a fatal error: never closer than the minimum, doubling
#: while they follow each other, back to the minimum after the calm period.
REBUILD_MIN_S = 1.0


REBUILD_MAX_S = 60.0


REBUILD_CALM_S = 300.0


#: Longest single wait between liveness ticks while backing off.
WAIT_TICK_S = 1.0


#: How long shutdown waits for Kafka to acknowledge what is in flight.
SHUTDOWN_FLUSH_S = 15.0


#: What the log line of a transition into these states adds (its cause): one line
#: when a relay becomes a standby, one when it stalls, each saying why.
_TRANSITION_NOTE = {
    RelayState.STALLED: " ({reason})",
    RelayState.STANDBY: ": waiting as hot standby ({reason})",
}

__all__ = ["ACK_WAIT_S", "READ_BATCH", "READ_WAIT_S", "Relay"]


def _at_least_once(relay: Relay) -> AtLeastOnce:
    """The default delivery mode, made of the relay's parts."""
    return AtLeastOnce(relay.settings, relay.producing, relay.dead_letters, relay.standby_safe)


class Relay:
    """The relay's loop: sessions on the slot, each a read loop over its collaborators
    (held, never inherited): the decoder :attr:`decoder`, the producer :attr:`producing`,
    :attr:`dead_letters`, the slot :attr:`guard`, the :attr:`standby` wait,
    :attr:`standby_safe` mode, the :attr:`silence` watch, Kafka's :attr:`readiness` and
    the slot :attr:`monitor`; and one delivery mode, :attr:`mode`, called at the points
    :mod:`cdc.relay.stream.mode` names (``mode``: its factory, given the relay's parts;
    at-least-once by default)."""

    def __init__(
        self,
        settings: Settings,
        *,
        registry: CollectorRegistry | None = None,
        serve_http: bool = True,
        mode: Callable[[Relay], DeliveryMode] | None = None,
        liveness: Liveness | None = None,
    ) -> None:
        self.settings = s = settings.require("pg_dsn", "kafka_bootstrap_servers")
        self.registry = registry or CollectorRegistry()
        self.metrics = RelayMetrics(self.registry)
        self.liveness = liveness or Liveness()
        self._stop = threading.Event()
        self._state = RelayState.STARTING
        self._reason = ""
        self._serve_http = serve_http
        self._rebuild_backoff = Backoff(
            min_s=REBUILD_MIN_S, max_s=REBUILD_MAX_S, calm_s=REBUILD_CALM_S
        )
        self.readiness = KafkaReadiness(
            self.liveness,
            state=lambda: (self._state, self._reason),
            held_records=lambda sess: self.standby_safe.held_records(sess),  # noqa: PLW0108 (made below)
        )
        #: librdkafka's errors and logs of the producer (the same one across rebuilds)
        self._events = self.readiness.events = KafkaClientEvents(
            "producer",
            count=self._count_kafka_error,
            on_error=self.readiness.on_kafka_error,
            reach=True,
        )
        #: the relay's records of its slot: topics, forms, the confirm limit
        self._ledger = self._new_ledger()
        self._topics = TopicManager(
            bootstrap=s.kafka_bootstrap_servers,
            overrides=s.kafka_config,
            partitions=s.topic_partitions,
            replication_factor=s.topic_replication_factor,
            events=KafkaClientEvents(
                "admin", count=self._count_kafka_error, on_error=self.readiness.on_kafka_error
            ),
            before_first_use=self._ledger.note_topics,
        )
        # (room for every record in flight besides: one session's refused batches never
        # push out its own suspects, so each new session judges its first one alone)
        self.poison = PoisonIds(POISON_MAX + settings.relay_max_in_flight)
        self.producing = Producing(
            self.metrics,
            self.liveness,
            self._stop,
            events=self._events,
            topics=self._topics,
            #: OpenTelemetry produce spans; None (the default) costs one test per record
            tracing=relay_tracing(),
            poison=self.poison,
            set_state=self._set_state,
            creating_topic=self.readiness.creating_topic,
            send_status=self._send_status,
        )
        self.dead_letters = DeadLetters(s, self.metrics, self.producing)
        self.producing.queue_dlq = self.dead_letters.queue
        # CDC_STANDBY_SAFE: records wait for the standby (off: it holds nothing)
        self.standby_safe = StandbySafe(
            s,
            self.registry,
            self._stop,
            publish=self.producing.send_held,  # (a suspect among them goes alone)
            refused=self.producing.refused,
        )
        self.guard = SlotGuard(
            s,
            self.metrics,
            self._stop,
            topics=self._topics,
            ledger=self._ledger,
            set_state=self._set_state,
            slot_survives_failover=self.standby_safe.slot_survives_failover,
        )
        self.standby = StandbyWait(
            s,
            self.metrics,
            self.liveness,
            self._stop,
            set_state=self._set_state,
            serve_kept_producer=self._serve_kept_producer,
        )
        self.silence = SilentSession(s, self.metrics)
        self.monitor = SlotMonitor(s, self.metrics, self._stop, self._topics)
        self.mode: DeliveryMode = (mode or _at_least_once)(self)
        self.producing.mode = self.dead_letters.mode = self.mode
        self.decoder = FastPath(
            s,
            self.metrics,
            poison=self.poison,
            topics=self._topics,
            ledger=self._ledger,
            mode=self.mode,
            produce=self.producing.produce,
            refused=self.producing.refused,
            dead_letter_route=self.dead_letters.route,
        )

    def _new_ledger(self) -> SlotLedger:
        """The slot ledger (a replay replaces it: tests/bench)."""
        return SlotLedger(self.settings)

    @property
    def _producer(self) -> Producer | None:
        """The session's producer (:attr:`Producing.producer`)."""
        return self.producing.producer

    @_producer.setter
    def _producer(self, producer: Producer | None) -> None:
        self.producing.producer = producer

    def stop(self) -> None:
        """Ask the relay to stop (from any thread; a signal handler must not call it:
        see :func:`cdc.cli.relay._on_signals`)."""
        self._stop.set()

    @property
    def state(self) -> RelayState:
        return self._state

    def _set_state(self, state: RelayState, reason: str = "") -> None:
        """Enter ``state``; ``reason`` (the cause, for /readyz) is shown after it."""
        if state is self._state and reason == self._reason:
            return
        if state is not self._state:
            log.info(
                "relay %s -> %s%s",
                self._state.value,
                state.value,
                _TRANSITION_NOTE.get(state, "").format(reason=reason) if reason else "",
                extra={"state": state.value},
            )
            self.metrics.state.labels(self._state.value).set(0)
            self.metrics.state.labels(state.value).set(1)
        self._state = state
        self._reason = reason
        self.liveness.set(
            f"{state.value}: {reason}" if reason else state.value,
            ready=state in (RelayState.STREAMING, RelayState.BACKPRESSURE),
        )
        if state is not RelayState.STALLED:
            self.metrics.stalled.set(0)

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
        collector.for_bulk_work()  # (~30 short-lived objects per event: cdc.collector)
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
        monitor = threading.Thread(target=self.monitor.run, name="slot-monitor", daemon=True)
        monitor.start()
        self._start_audit()
        StandbyWatch(  # /readyz: do the standbys carry the failover slot for good? (17+)
            self.settings,
            gauge=self.metrics.failover_slot_synced,
            liveness=self.liveness,
            looking=lambda: self.monitor.slot_failover and self._state in ACTIVE_STATES,
            stop=self._stop,
        ).start()
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
            self._ledger.close()
        return 0

    def _start_audit(self) -> None:
        """The periodic audit (cdc.relay.gaps.periodic_audit): its own thread, only while this relay
        streams the slot; CDC_AUDIT_INTERVAL_S=0 leaves it off."""
        PeriodicAudit(
            self.settings,
            registry=self.registry,
            active=lambda: self._state in ACTIVE_STATES,
            stop=self._stop,
        ).start()

    def _run_sessions(self) -> None:
        reconnect = Backoff(min_s=RECONNECT_MIN_S, max_s=RECONNECT_MAX_S, calm_s=RECONNECT_MAX_S)
        while not self._stop.is_set():
            # (a gap is re-checked quietly; a reconnect keeps naming its cause, and a
            # standby stays a standby, until the session streams or fails otherwise)
            if self._state not in (RelayState.GAP, RelayState.RECONNECTING, RelayState.STANDBY):
                self._set_state(RelayState.STARTING)
            try:
                self._session()
            except SlotGapError as exc:
                self._set_state(RelayState.GAP, str(exc))
                self._wait(GAP_RECHECK_S)
            except SlotInUseError as exc:
                self.standby.wait(str(exc))
            except ProducerFatalError as exc:
                self._rebuild_producer(str(exc))
            except (CdcError, psycopg.OperationalError) as exc:
                if isinstance(exc, CdcError) and not exc.retriable:
                    raise
                if self.producing.judged:  # (progress: Producing.judged)
                    self.producing.judged = False
                    log.info("relay session ended: %s; reading its records again at once", exc)
                    self._set_state(RelayState.RECONNECTING, str(exc))
                    continue
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
        self.mode.producer_dropped()  # (exactly-once: no close(), the machine reset)
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

    def _session(self) -> None:
        s = self.settings
        dsn = s.pg_dsn.get_secret_value()
        with connect(dsn) as conn:
            self.decoder.table = ensure_publication(
                conn, s.publication, s.outbox_table, filtered=s.publication_filtered
            )
            check_wal_level(conn)  # (set-up errors first: the gap check needs both)
            check_replication_privilege(conn)
            self.standby.claim_slot(conn)  # a standby stops here, before any tail read
        origin = self.guard.guard_slot()  # first start, a gap, or a slot that holds everything
        with connect(dsn) as conn:
            info = ensure_slot(conn, s.slot, create=False)
            self.decoder.utf8 = server_is_utf8(conn)
        self._topics.ensure([s.dlq_topic])
        stream = ReplicationStream(
            dsn,
            slot=s.slot,
            publication=s.publication,
            limit=self._ledger,  # (no status past the slot's confirm limit)
            messages=s.messages == "on",
        )
        self.standby.own_walsender = stream.walsender  # (recognised if a dead path orphans it)
        try:
            # (a standby stops here - SlotInUseError - without a producer)
            stream.start(0, confirmed_lsn=info.confirmed_flush_lsn)
            if self._producer is None:
                self._producer = self.mode.new_producer(origin)
            sess = Session(
                stream=stream,
                tracker=self.mode.new_tracker(info.confirmed_flush_lsn),
                last_confirmed=info.confirmed_flush_lsn,
                origin=origin,
            )
            try:
                self._stream_loop(sess)
                if self._stop.is_set():
                    self._shutdown(sess)
            finally:
                sess.reports = None  # (it holds the session: no cycle left for the GC)
        finally:
            stream.close()

    def _serve_kept_producer(self) -> bool:
        """While a standby: serve a producer kept from an earlier session (librdkafka
        queues log lines and errors until served); False after a fatal error (it was
        rebuilt: leave the wait)."""
        if self._producer is None:
            return True
        try:
            self._poll(0)
        except ProducerFatalError as exc:
            self._rebuild_producer(str(exc))
            return False
        except KafkaUnavailableError as exc:
            log.warning("standby: %s", exc)
        return True

    def _poll(self, timeout_s: float) -> None:
        """Serve the producer (the delivery mode's ``serve``)."""
        self.mode.serve(timeout_s)

    def _stream_loop(self, sess: Session) -> None:
        """The session's read loop, between the delivery mode's ``session_begins`` and
        ``session_closed`` (``session_failed`` when it raises)."""
        mode = self.mode
        try:
            mode.session_begins(sess)
            self._turns(sess)
        except BaseException:
            mode.session_failed(sess)
            raise
        finally:
            mode.session_closed()

    def _turns(self, sess: Session) -> None:
        next_status = 0.0
        stall = StallWatch(self.settings.relay_stall_after_s, time.monotonic())
        heard_at = time.monotonic()  # the server's last message (or: we were not listening)
        silence_watch = self.silence
        silence = silence_watch.watch(sess)
        mode, readiness = self.mode, self.readiness
        release_held, read_batch = self.standby_safe.release_held, self.decoder.read_batch
        while not self._stop.is_set():
            self.liveness.tick()
            sess.reports = None  # (what the last batch added may now be acknowledged)
            mode.serve(0)
            mode.drain_dead_letters(sess)
            release_held(sess)  # standby-safe mode: what the standby has flushed
            if sess.fatal is not None:
                raise KafkaUnavailableError(f"producer error: {sess.fatal}")
            if sess.fault is not None:
                raise sess.fault
            if sess.held is not None:
                state, reason = RelayState.HELD, sess.held
                mode.serve(c.BACKPRESSURE_POLL_S)
                heard = True  # not listening: the server's silence is ours
            elif sess.tracker.in_flight >= self.settings.relay_max_in_flight:
                state, reason = RelayState.BACKPRESSURE, ""
                mode.serve(c.BACKPRESSURE_POLL_S)
                heard = True
            else:
                state, reason = RelayState.STREAMING, ""
                heard = read_batch(sess)
            now = time.monotonic()
            if heard:
                heard_at = now
                silence.heard()
            stalled = self._stalled(sess, stall, now) or readiness.unreachable(sess, stall, now)
            held_back = self.monitor.held_back
            held = held_back and f"logical decoding held back: {held_back}"
            self._set_state(*_turn_state(state, reason, stalled, silence.blind or held))
            silent_s = now - heard_at
            if silence.due(silent_s, now):
                silence_watch.judge(sess, silence, silent_s)
            advanced = self._ledger.bound(sess.tracker.confirmable) != sess.last_confirmed
            if (
                now >= next_status
                or sess.reply_requested
                or (advanced and now >= next_status - c.STATUS_INTERVAL_S + STATUS_MIN_INTERVAL_S)
            ):
                self._send_status(sess, ask_reply=silence_watch.asking(silence, silent_s))
                next_status = now + c.STATUS_INTERVAL_S

    def _stalled(self, sess: Session, stall: StallWatch, now: float) -> str | None:
        """Why the session is stalled (work waits, nothing acknowledged), or None."""
        reason = stall.observe(
            now,
            in_flight=sess.tracker.in_flight,
            pending=len(sess.pending_dlq),
            acked=sum(sess.acked.values()),
            confirmable=sess.tracker.confirmable,
        )
        self.metrics.stalled.set(1 if reason else 0)
        return reason

    def _send_status(self, sess: Session, *, ask_reply: bool = False) -> None:
        for topic, count in sess.acked.items():
            self.metrics.relayed_in(topic).inc(count)
        sess.acked.clear()
        # (the stream sends no further than the slot's confirm limit: what it sent)
        lsn = sess.stream.send_status(sess.tracker.confirmable, reply_requested=ask_reply)
        sess.reply_requested = False
        if lsn != sess.last_confirmed:
            log.debug("slot %s confirmed %s", self.settings.slot, lsn_to_str(lsn))
            sess.last_confirmed = lsn
        self.metrics.confirmed_lsn.set(lsn)
        self.metrics.in_flight.set(sess.tracker.in_flight)

    def _shutdown(self, sess: Session) -> None:
        self._set_state(RelayState.STOPPING)
        self.mode.session_ends(sess)  # (exactly-once: the last commit)
        if self._producer is None:  # (let go by the mode: nothing more to flush)
            return
        sess.reports = None  # (so what it counted can be acknowledged)
        deadline = time.monotonic() + SHUTDOWN_FLUSH_S
        # (records held for the standby were never sent: nothing to wait for)
        while time.monotonic() < deadline and (
            sess.tracker.in_flight > self.standby_safe.held_records(sess) or sess.pending_dlq
        ):
            self.mode.serve(0.05)
            self.mode.drain_dead_letters(sess)
        self._ledger.settle()  # (the last confirmation goes as far as Kafka acknowledged)
        self._send_status(sess)
        log.info(
            "relay stopped at %s with %d records unacknowledged",
            lsn_to_str(sess.tracker.confirmable),
            sess.tracker.in_flight,
        )


def _turn_state(
    state: RelayState, reason: str, stalled: str | None, blind: str | None
) -> tuple[RelayState, str]:
    """A stream turn's state: stalled (HELD already names its cause), or - streaming, and
    ``blind``: silent past CDC_REPLICATION_SILENCE_S and the look at the walsender failed
    (the relay cannot tell a working walsender from a dead path), or the server holds the
    slot's decoding back (cdc.relay.health.monitor) - 503 naming it, until it is not."""
    if stalled and state is not RelayState.HELD:
        return RelayState.STALLED, stalled
    if blind is not None and state is RelayState.STREAMING:
        return RelayState.STALLED, blind
    return state, reason
