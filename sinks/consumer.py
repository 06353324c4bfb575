"""The sink's consumer loop: a thin asyncio shell around :class:`sinks.core.machine.SinkCore`.

Every decision - what to send, when to probe, what to park, what to commit,
what to pause - is the core's (see :mod:`sinks.core.machine` for the invariants and
the circuit's transitions). This shell only carries the core's actions out
and reports what came of them:

* Kafka lives on its own thread (:class:`sinks.kafka_worker.KafkaWorker`);
  records, assignments, revocations and commit results arrive here as calls
  on the event loop, and pause/resume/commit go back as commands - so no
  Kafka call ever blocks deliveries, the admin API or the scheduler;
* a :class:`~sinks.core.machine.Send` becomes one task that delivers through
  :func:`sinks.dispatch.deliver` and maps the outcome to a core
  :class:`~sinks.core.machine.Result` (the error classes say which);
* a :class:`~sinks.core.machine.Park` becomes one task writing its whole batch in
  one round-trip, on a connection of its own (the admin API and the scheduler
  never queue behind it), every wait bounded (:mod:`sinks.parking.lot`: a
  ``LOCK TABLE failed_sync_events`` or a hung server fails the batch in
  seconds); a parking lot that fails keeps the records unsettled (the core
  parks them again after a growing wait, and counts them and the records
  settled behind them toward its pause threshold) and makes ``/readyz`` say
  ``parking lot unavailable: <why>`` until a park succeeds;
* ``/readyz`` is ready only while every engine route's circuit is CLOSED
  (else it names the routes down and why), the parking lot answers
  (else ``parking lot unavailable: <why>``) and the
  sink is not stalled (nothing delivered, parked or committed for
  ``SINK_STALL_AFTER_S`` while work waits: ``stalled: ...``; a shorter blip
  never shows); a state change is logged once, with its reason;
* an engine answer is mapped to a core result by its meaning
  (:func:`route_result`), with the engine route of the request that failed
  (``SinkError.endpoint``): a 429 is ``THROTTLED``; a ``Retry-After`` on
  another status, and an expired request deadline, are ``UNAVAILABLE``
  marked ``shared``; another 5xx is ``SERVER_ERROR`` (blamed on the record
  only with per-route evidence, by the core); everything else that is not
  about the record - refused, reset, timeouts, 408, 401/403, 3xx, the sink's
  own errors - is ``UNAVAILABLE``: trouble of the route, never an attempt.

SIGTERM (:meth:`Sink.stop`): take and send nothing new, wait up to
:data:`SHUTDOWN_WAIT_S` for what is in flight, commit, leave the group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cdc.health import Liveness
from cdc.kafkalog import KafkaClientEvents
from cdc.settings import Settings
from sinks import http1
from sinks.core import machine as core
from sinks.core.delivery import Envelope
from sinks.core.machine import (
    Circuit,
    Commit,
    Park,
    ParkItem,
    Pause,
    Result,
    ResultKind,
    Resume,
    Route,
    Send,
    SinkCore,
    Verdict,
)
from sinks.core.retry import Backoff, retry_delay_s
from sinks.dispatch import deliver
from sinks.engine import EngineClient
from sinks.errors import EngineMisconfigured, EngineUnavailable, SinkError, Unroutable
from sinks.kafka_worker import KafkaWorker
from sinks.logs import BoundedLabels, RepeatLog
from sinks.parking.lot import ParkingLot, ParkingLotUnavailable, ParkRequest
from sinks.routes import Routing
from sinks.tracing import SinkTracing

log = logging.getLogger(__name__)

#: Records held in memory (per instance) above which partitions pause.
MAX_BUFFERED = 20_000
#: Committed offsets are sent at most this often (and on revoke and shutdown).
COMMIT_INTERVAL_S = 1.0
#: First wait before a rejected record is sent again (doubles per attempt).
INLINE_BACKOFF_S = 0.2
#: Floor of the probe backoff (SINK_BACKOFF_MAX_S=0 would mean a busy loop).
MIN_BACKOFF_S = 0.1
#: Shutdown waits this long for deliveries and parks in flight.
SHUTDOWN_WAIT_S = 10.0
#: Gauges refresh period; also the longest the loop sleeps (liveness ticks).
GAUGE_REFRESH_S = 1.0
#: The shortest sleep: a timer the core reports as due now never becomes a busy loop.
MIN_SLEEP_S = 0.001
#: Distinct event types named in the per-type metrics; the rest count as "other"
#: (types come from other teams' producers: their number is not ours to bound).
MAX_TYPE_LABELS = 50
#: The engine sheds load: slow down, whatever else succeeds (DESIGN "Sink invariants" 2).
RATE_LIMITED = 429
#: Statuses that blame a record only with per-route evidence (DESIGN "Sink invariants" 3).
SERVER_ERRORS = range(500, 600)
#: Results that are trouble of an engine route (counted per route; no attempt spent).
ROUTE_TROUBLE = frozenset({ResultKind.UNAVAILABLE, ResultKind.SERVER_ERROR, ResultKind.THROTTLED})
#: The parking lot's event_type of a record whose type has no route.
UNROUTABLE = "UNROUTABLE"


class SinkMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.delivered = Counter(
            "outbox_sink_delivered_total", "Events the engine accepted", ["type"], registry=registry
        )
        self.parked = Counter(
            "outbox_sink_parked_total",
            "Events parked in failed_sync_events",
            ["sync_type"],
            registry=registry,
        )
        self.retried = Counter(
            "outbox_sink_retried_total",
            "Deliveries retried: kind=record - attempts spent (answers that blamed the record);"
            " kind=engine - answers that were trouble of an engine route (spent nothing when"
            " they came; a 5xx later blamed on its record is counted under record too)",
            ["kind"],
            registry=registry,
        )
        self.engine_latency = Histogram(
            "outbox_sink_engine_seconds",
            "Engine request latency (delivered events)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=registry,
        )
        self.end_to_end = Histogram(
            "outbox_sink_commit_to_engine_seconds",
            "Outbox commit to engine 2xx",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=registry,
        )
        self.circuit = Gauge(
            "outbox_sink_circuit_open",
            "1 while the circuit of any engine route is not closed (open or probing)",
            registry=registry,
        )
        self.route_circuit = Gauge(
            "outbox_sink_route_circuit_open",
            "1 while this engine route's circuit is not closed (open or probing)",
            ["route"],
            registry=registry,
        )
        self.route_waiting = Gauge(
            "outbox_sink_route_waiting_records",
            "Records queued for this engine route (lane heads and the records behind them)",
            ["route"],
            registry=registry,
        )
        self.route_trouble = Counter(
            "outbox_sink_route_trouble_total",
            "Engine answers judged trouble of this route (refused, timeouts, 408, 429, 5xx,"
            " 401/403, the sink's own errors): no attempt spent",
            ["route"],
            registry=registry,
        )
        self.lag = Gauge(
            "outbox_sink_consumer_lag",
            "End offset - committed offset, summed over the assigned partitions",
            registry=registry,
        )
        self.oldest_age = Gauge(
            "outbox_sink_oldest_unprocessed_age_seconds",
            "Age of the oldest record not yet delivered or parked",
            registry=registry,
        )
        self.in_flight = Gauge(
            "outbox_sink_in_flight", "Engine requests in flight", registry=registry
        )
        self.held = Gauge(
            "outbox_sink_held_records",
            "Records held in memory (queued, in flight, waiting to retry or park)",
            registry=registry,
        )
        self.tracked = Gauge(
            "outbox_sink_tracked_entries",
            "Per-record entries the sink keeps (bounded by the assigned, unsettled records)",
            registry=registry,
        )
        self.paused = Gauge(
            "outbox_sink_paused_partitions", "Assigned partitions paused", registry=registry
        )
        self.skipped = Counter(
            "outbox_sink_skipped_total",
            "Events skipped on purpose (SINK_IGNORED_TYPES), by type",
            ["type"],
            registry=registry,
        )
        self.unrouted = Counter(
            "outbox_sink_unrouted_total",
            "Events parked because their type has no route, by type",
            ["type"],
            registry=registry,
        )
        self.kafka_errors = Counter(
            "outbox_sink_kafka_errors_total",
            "Errors librdkafka reported, by code",
            ["code"],
            registry=registry,
        )
        self.offsets_expired = Counter(
            "outbox_sink_offsets_expired_total",
            "Offsets removed (retention, DeleteRecords) before the group processed them:"
            " skipped, each logged as an ERROR with its range",
            registry=registry,
        )
        self.commit_failures = Counter(
            "outbox_sink_commit_failures_total",
            "Offset commits the broker refused (retried)",
            registry=registry,
        )
        self.park_batch = Histogram(
            "outbox_sink_park_batch_size",
            "Records written to the parking lot per round-trip",
            buckets=(1, 2, 5, 10, 25, 50, 100, 250, 500),
            registry=registry,
        )
        self.park_failures = Counter(
            "outbox_sink_park_failures_total",
            "Park batches the parking lot failed to write (retried)",
            registry=registry,
        )
        self.lot_available = Gauge(
            "outbox_sink_parking_lot_available",
            "0 from a failed park until a park succeeds (records wait to be parked), else 1",
            registry=registry,
        )
        self.lot_available.set(1)
        self.stalled = Gauge(
            "outbox_sink_stalled",
            "1 while nothing was delivered, parked or committed for SINK_STALL_AFTER_S"
            " with work waiting",
            registry=registry,
        )
        self.stalled_seconds = Gauge(
            "outbox_sink_stalled_seconds",
            "Seconds without progress (delivered, parked, committed) while work waits",
            registry=registry,
        )
        self.window = Gauge(
            "outbox_sink_engine_window",
            "Adaptive limit of this engine route's requests in flight (AIMD; slow start after"
            " an outage)",
            ["route"],
            registry=registry,
        )
        self.throttled = Counter(
            "outbox_sink_throttled_total",
            "Engine answers that shed load (429, or Retry-After with 503/5xx): nothing spent",
            registry=registry,
        )
        self.pauses = Counter(
            "outbox_sink_partition_pauses_total",
            "Pause actions (partitions stop fetching: buffer full, engine down, stopping)",
            registry=registry,
        )
        self.resumes = Counter(
            "outbox_sink_partition_resumes_total",
            "Resume actions (partitions fetch again)",
            registry=registry,
        )


def consumer_config(settings: Settings) -> dict[str, Any]:
    config: dict[str, Any] = {
        "bootstrap.servers": settings.kafka_bootstrap_servers,
        "group.id": settings.sink_group_id,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "partition.assignment.strategy": "cooperative-sticky",
        "session.timeout.ms": 10_000,
        "heartbeat.interval.ms": 2_000,
        "topic.metadata.refresh.interval.ms": 5_000,
        "fetch.wait.max.ms": 50,
        # librdkafka's default, stated: records of aborted (exactly-once) relay
        # transactions are never delivered; ids stay the idempotency keys either way
        "isolation.level": "read_committed",
    }
    config.update(settings.kafka_config)
    return config


def subscription(settings: Settings) -> list[str]:
    """A regex subscription (``^...``) over the outbox topics."""
    pattern = settings.sink_topics_pattern or f"^{re.escape(settings.topic_prefix)}.*"
    return [pattern if pattern.startswith("^") else f"^{pattern}"]


def classifier(routing: Routing) -> Callable[[Envelope], Verdict]:
    """The routing verdict of a record: skipped, deliverable, or bad input to park at once."""

    def classify(record: Envelope) -> Verdict:
        if routing.is_ignored(record.topic, record.event_type):
            return Verdict(Route.IGNORE, "SINK_IGNORED_TYPES")
        try:
            call = routing.route_envelope(record)
        except Unroutable as exc:
            return Verdict(Route.PARK, exc.reason)
        return Verdict(Route.DELIVER, endpoint=call.path)

    return classify


def route_result(exc: EngineUnavailable) -> Result:
    """The core's result for trouble of an engine route (``exc.endpoint``).

    429: THROTTLED. A Retry-After on another status, or an expired request
    deadline: UNAVAILABLE ``shared`` (the route is slow for everyone). Another
    5xx: SERVER_ERROR (the core blames the record only with per-route
    evidence). The rest - refused, reset, timeouts, 408, 401/403 and 3xx
    (:class:`~sinks.errors.EngineMisconfigured`): UNAVAILABLE, never the record's.
    """
    endpoint = exc.endpoint
    if exc.status == RATE_LIMITED:
        return Result(ResultKind.THROTTLED, exc.reason, exc.retry_after_s, endpoint=endpoint)
    shared = exc.retry_after_s is not None or isinstance(exc.__cause__, http1.RequestDeadline)
    server_error = (
        not shared
        and not isinstance(exc, EngineMisconfigured)
        and exc.status is not None
        and SERVER_ERRORS.start <= exc.status < SERVER_ERRORS.stop
    )
    kind = ResultKind.SERVER_ERROR if server_error else ResultKind.UNAVAILABLE
    return Result(kind, exc.reason, exc.retry_after_s, shared=shared, endpoint=endpoint)


def make_core(settings: Settings, routing: Routing) -> SinkCore:
    backoff_cap_s = max(settings.sink_backoff_max_s, MIN_BACKOFF_S)
    return SinkCore(
        max_in_flight=settings.sink_max_in_flight,
        max_buffered=MAX_BUFFERED,
        inline_attempts=settings.sink_inline_attempts,
        inline_backoff_s=INLINE_BACKOFF_S,
        backoff=lambda: Backoff(base_s=min(0.5, backoff_cap_s), cap_s=backoff_cap_s),
        commit_interval_s=COMMIT_INTERVAL_S,
        classify=classifier(routing),
    )


class Sink:
    """The consumer group member. ``run()`` until ``stop()``."""

    def __init__(
        self,
        settings: Settings,
        *,
        engine: EngineClient,
        lot: ParkingLot,
        registry: CollectorRegistry,
        liveness: Liveness,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.lot = lot
        self.metrics = SinkMetrics(registry)
        self.liveness = liveness
        self.routing = Routing.from_settings(settings)
        self.core = make_core(settings, self.routing)
        self.tracing = SinkTracing.from_env()
        self.kafka_events = KafkaClientEvents(
            "sink-consumer", count=lambda code: self.metrics.kafka_errors.labels(code).inc()
        )
        self._worker: KafkaWorker | None = None
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._park_error: str | None = None
        self._reported: tuple[Circuit, str, bool, bool] | None = None
        self._parked_log = RepeatLog(log, "parked")
        # Skipping is deliberate: each type named once, its repeats only counted.
        self._skipped_log = RepeatLog(log, "skipped", level=logging.INFO, summarize_kinds=False)
        self._type_labels = BoundedLabels(MAX_TYPE_LABELS)
        # Keyed by routed types only: the routing table bounds them.
        self._delivered_of: dict[str, Counter] = {}
        self._attempts_counted = 0  # core.attempts_spent already in retried{kind="record"}
        self._route_gauges_of: dict[str, tuple[Gauge, Gauge, Gauge]] = {}
        self.delivered_count = 0
        self.parked_count = 0

    # -- lifecycle -------------------------------------------------------------
    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        worker = KafkaWorker(
            consumer_config(self.settings),
            subscription(self.settings),
            loop=loop,
            side=self,
            events=self.kafka_events,
            lag_gauge=self.metrics.lag,
            offsets_expired=self.metrics.offsets_expired.inc,
        )
        self._worker = worker.start()
        self._report()
        try:
            while not self._stopping.is_set():
                if worker.done.done():
                    worker.done.result()  # raises what ended the consumer thread
                    raise RuntimeError("the Kafka consumer thread ended")
                self._step()
                await self._sleep()
            await self._shutdown(worker)
        finally:
            self._parked_log.flush()
            self._skipped_log.flush()
            self.liveness.set("stopped", ready=False)

    async def _shutdown(self, worker: KafkaWorker) -> None:
        self.core.stop()
        self._step()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=SHUTDOWN_WAIT_S)
        self._step()
        await worker.close(self.core.final_commits())

    async def _sleep(self) -> None:
        self._wake.clear()
        now = time.monotonic()
        due = self.core.next_due()
        timeout = GAUGE_REFRESH_S if due is None else min(max(due - now, 0.0), GAUGE_REFRESH_S)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=max(timeout, MIN_SLEEP_S))

    def _step(self) -> None:
        """Carry out what the core says now; refresh gauges and readiness."""
        self.liveness.tick()
        for action in self.core.actions(now=time.monotonic()):
            self._carry_out(action)
        self._gauges()
        self._report()
        self._parked_log.tick()
        self._skipped_log.tick()

    def _carry_out(self, action: core.Action) -> None:
        worker = self._worker
        assert worker is not None
        if isinstance(action, Send):
            self._spawn(self._send(action))
        elif isinstance(action, Park):
            self._spawn(self._park(action))
        elif isinstance(action, Commit):
            worker.commit(action.offsets)
        elif isinstance(action, Pause):
            self.metrics.pauses.inc()
            worker.pause(action.partitions)
        elif isinstance(action, Resume):
            self.metrics.resumes.inc()
            worker.resume(action.partitions)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._wake.set()
        if not task.cancelled() and task.exception() is not None:
            log.error("sink task failed", exc_info=task.exception())

    # -- the Kafka side (called on the loop by the worker) ------------------------
    def on_records(self, records: list[Envelope]) -> None:
        now_ms = int(time.time() * 1000)
        for record in records:
            verdict = self.core.consumed(record, now_ms=now_ms)
            if verdict is not None and verdict.route is Route.IGNORE:
                self._skipped(record)
        if self.core.needs_pause():
            self._step()  # pause now: batches already posted must not pile up first
        self._wake.set()

    def _skipped(self, record: Envelope) -> None:
        event_type = record.event_type
        self.metrics.skipped.labels(self._type_labels.label(event_type)).inc()
        self._skipped_log.event(
            event_type,
            "skipping events of type %r (SINK_IGNORED_TYPES); counted in"
            " outbox_sink_skipped_total, logged once",
            event_type,
            extra={"event_type": event_type, "topic": record.topic},
        )

    def on_assign(self, partitions: list[tuple[str, int]]) -> None:
        self.core.assign(partitions)
        self._wake.set()

    def on_revoke(
        self, partitions: list[tuple[str, int]], *, lost: bool
    ) -> list[tuple[str, int, int]]:
        final = self.core.revoke(partitions, lost=lost)
        self._wake.set()
        return final

    def on_commit(self, results: list[tuple[str, int, int, bool]]) -> None:
        for topic, partition, offset, ok in results:
            if not ok:
                self.metrics.commit_failures.inc()
            self.core.commit_result(topic, partition, offset, ok=ok)
        self._wake.set()

    # -- deliveries and parks ---------------------------------------------------------
    async def _send(self, send: Send) -> None:
        record = send.record
        started = time.perf_counter()
        result = await self._deliver(record, send.endpoint)
        if result.kind is ResultKind.DELIVERED:
            self._delivered(record, time.perf_counter() - started)
        elif result.kind in ROUTE_TROUBLE:
            if result.kind is ResultKind.THROTTLED:
                self.metrics.throttled.inc()
            self.metrics.retried.labels("engine").inc()
            self.metrics.route_trouble.labels(result.endpoint or send.endpoint or "engine").inc()
        self.core.sent(record, result, now=time.monotonic())

    async def _deliver(self, record: Envelope, endpoint: str) -> Result:
        """One delivery, as the core's result; ``endpoint``: the route it was sent to.

        A 2xx credits the route it was sent to when that route answered (a quiz
        attempt waiting for the users route whose user sync went through), else
        the route of the record's own call.
        """
        answered: list[str] = []
        try:
            with self.tracing.delivery(record) as trace_headers:
                await deliver(
                    self.engine,
                    event_type=record.event_type,
                    payload=record.value,
                    event_id=record.event_id,
                    routing=self.routing,
                    headers=trace_headers,
                    answered=answered,
                )
        except Unroutable as exc:
            return Result(ResultKind.UNROUTABLE, exc.reason)
        except EngineUnavailable as exc:
            return route_result(exc)
        except SinkError as exc:
            return Result(ResultKind.REJECTED, exc.reason, endpoint=exc.endpoint)
        except Exception as exc:  # our own bug: trouble of the route, spend nothing
            log.exception("delivery of event %s failed unexpectedly", record.event_id)
            return Result(ResultKind.UNAVAILABLE, f"internal error: {type(exc).__name__}")
        credited = endpoint if endpoint in answered else answered[-1]
        return Result(ResultKind.DELIVERED, endpoint=credited)

    def _delivered(self, record: Envelope, elapsed_s: float) -> None:
        self.delivered_count += 1
        event_type = record.event_type or "?"  # a routed type: the routing table bounds them
        counter = self._delivered_of.get(event_type)
        if counter is None:  # (labels() validates and locks: once per type, not per event)
            counter = self._delivered_of[event_type] = self.metrics.delivered.labels(event_type)
        counter.inc()
        self.metrics.engine_latency.observe(elapsed_s)
        if record.timestamp_ms:
            self.metrics.end_to_end.observe(max(time.time() - record.timestamp_ms / 1000, 0.0))

    async def _park(self, park: Park) -> None:
        requests = [self._park_request(item) for item in park.items]
        try:
            await self.lot.park_many(requests)  # bounded: the lot's waits all have a timeout
        except Exception as exc:  # the records stay unsettled; the core parks them again
            self._park_failed(park, exc)
            return
        if self._park_error is not None:
            was = self._park_error
            log.info("parking lot available again (was: %s)", was, extra={"state": "running"})
            self._park_error = None
        self.metrics.lot_available.set(1)
        self.metrics.park_batch.observe(len(requests))
        for item, request in zip(park.items, requests, strict=True):
            self.parked_count += 1
            self.metrics.parked.labels(request.sync_type).inc()
            if request.sync_type == UNROUTABLE:
                label = self._type_labels.label(item.record.event_type)
                self.metrics.unrouted.labels(label).inc()
            self._parked_log.event(
                item.record.event_type or "?",
                "event %s of type %r parked after %d attempts: %s",
                item.record.event_id or item.record.position,
                item.record.event_type,
                item.attempts,
                item.reason,
                extra={
                    "event_id": item.record.event_id,
                    "topic": item.record.topic,
                    "partition": item.record.partition,
                    "offset": item.record.offset,
                },
            )
            self.core.parked(item.record)

    def _park_failed(self, park: Park, exc: Exception) -> None:
        """The records wait (the core parks them again, with a growing wait); readiness says why.

        One log line per change of the reason, not per failed batch.
        """
        self.metrics.park_failures.inc()
        self.metrics.lot_available.set(0)
        if isinstance(exc, ParkingLotUnavailable):
            error = str(exc)
        else:  # not an outage the lot knows: our own bug, or a row PostgreSQL refused
            lines = str(exc).strip().splitlines()
            error = f"parking lot unavailable: {type(exc).__name__}: {lines[0] if lines else ''}"
        if error != self._park_error:
            log.error(
                "%s; %d events wait to be parked (tried again with a growing wait; partitions"
                " pause once %d records are held)",
                error,
                len(park.items),
                MAX_BUFFERED,
                exc_info=None if isinstance(exc, ParkingLotUnavailable) else exc,
                extra={"state": "parking_lot_unavailable"},
            )
        self._park_error = error
        now = time.monotonic()
        for item in park.items:
            self.core.park_failed(item.record, now=now)

    def _park_request(self, item: ParkItem) -> ParkRequest:
        record = item.record
        sync_type = self.routing.sync_type_for(record.event_type) or UNROUTABLE
        return ParkRequest(
            outbox_event_id=record.event_id,
            sync_type=str(sync_type),
            payload=record.value,
            reason=item.reason,
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            key=record.key,
            headers=record.headers,
            retry_in_s=retry_delay_s(item.attempts, self.settings.retry_backoff_base_s),
            attempts=item.attempts,
            routes_fingerprint=self.routing.fingerprint,
        )

    # -- gauges and readiness ----------------------------------------------------------
    def _gauges(self) -> None:
        """Counters the core keeps (O(routes + partitions), never a scan of records)."""
        self.metrics.in_flight.set(self.core.sending)
        self.metrics.held.set(self.core.held)
        self.metrics.tracked.set(self.core.footprint())
        self.metrics.paused.set(len(self.core.paused))
        self.metrics.circuit.set(0 if self.core.circuit is Circuit.CLOSED else 1)
        for route in self.core.routes():
            circuit, window, waiting = self._route_gauges(route.endpoint)
            circuit.set(route.circuit is not Circuit.CLOSED)
            window.set(route.window)
            waiting.set(route.waiting)
        spent = self.core.attempts_spent
        if spent > self._attempts_counted:
            self.metrics.retried.labels("record").inc(spent - self._attempts_counted)
            self._attempts_counted = spent
        self.metrics.oldest_age.set(self.oldest_unprocessed_age_s())
        stalled_s = self.core.stalled_s(time.monotonic())
        self.metrics.stalled_seconds.set(stalled_s)
        self.metrics.stalled.set(1 if self._stalled(stalled_s) else 0)

    def _route_gauges(self, endpoint: str) -> tuple[Gauge, Gauge, Gauge]:
        """One route's gauges (``labels()`` validates and locks: once per route, not per step)."""
        gauges = self._route_gauges_of.get(endpoint)
        if gauges is None:
            name = endpoint or "engine"
            gauges = self._route_gauges_of[endpoint] = (
                self.metrics.route_circuit.labels(name),
                self.metrics.window.labels(name),
                self.metrics.route_waiting.labels(name),
            )
        return gauges

    def _stalled(self, stalled_s: float) -> bool:
        return stalled_s > self.settings.sink_stall_after_s

    def oldest_unprocessed_age_s(self) -> float:
        oldest = self.core.oldest_pending_timestamp_ms()
        return 0.0 if oldest is None else max(time.time() - oldest / 1000, 0.0)

    def _report(self) -> None:
        """Readiness, and one log line per change of the circuit or the parking lot."""
        circuit, reason = self.core.circuit, self.core.circuit_reason
        stalled = self._stalled(self.core.stalled_s(time.monotonic()))
        state = (circuit, reason, self._park_error is None, stalled)
        if state == self._reported:
            return
        previous = self._reported
        self._reported = state
        if circuit is not Circuit.CLOSED:
            status = f"engine unavailable: {reason}"
        elif self._park_error is not None:
            status = self._park_error
        else:
            status = ""
        if stalled:
            status = self._stall_status(status)
        self.liveness.set(status or "running", ready=not status)
        self._log_change(previous, state)

    def _stall_status(self, cause: str) -> str:
        after_s = self.settings.sink_stall_after_s
        status = (
            f"stalled: nothing delivered, parked or committed for over {after_s:g} s"
            f" while work waits ({self.core.held} records held)"
        )
        return f"{status}; {cause}" if cause else status

    def _log_change(
        self,
        previous: tuple[Circuit, str, bool, bool] | None,
        state: tuple[Circuit, str, bool, bool],
    ) -> None:
        """One line per change of the engine's state (OPEN and HALF_OPEN are one: down)."""
        if previous is None:
            return
        was_down, down = previous[0] is not Circuit.CLOSED, state[0] is not Circuit.CLOSED
        extra = {"state": state[0].value}
        if down and not was_down:
            log.warning(
                "engine unavailable: %s; holding its records, probing; other routes deliver",
                state[1],
                extra=extra,
            )
        elif down and previous[1] != state[1]:
            log.warning("engine still unavailable, now: %s", state[1], extra=extra)
        elif was_down and not down:
            log.info("engine is back (was: %s); resuming", previous[1], extra=extra)
        if state[3] and not previous[3]:
            log.warning(
                "sink stalled: nothing delivered, parked or committed for over %g s while"
                " %d records wait",
                self.settings.sink_stall_after_s,
                self.core.held,
                extra={"state": "stalled"},
            )
        elif previous[3] and not state[3]:
            log.info("sink progresses again (was stalled)", extra={"state": "running"})
