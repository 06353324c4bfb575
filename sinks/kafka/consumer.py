"""The sink's consumer loop: a thin asyncio shell around :class:`sinks.core.machine.SinkCore`.

Every decision - what to send, when to probe, what to park, what to commit,
what to pause - is the core's (see :mod:`sinks.core.machine` for the invariants and
the circuit's transitions). This shell only carries the core's actions out
and reports what came of them:

* Kafka lives on its own thread (:class:`sinks.kafka.worker.KafkaWorker`);
  records, assignments, revocations and commit results arrive here as calls
  on the event loop, and pause/resume/commit go back as commands - so no
  Kafka call ever blocks deliveries, the admin API or the scheduler;
* a :class:`~sinks.core.machine.Send` becomes one task that delivers through
  :func:`sinks.engine.dispatch.deliver` and maps the outcome to a core
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
  never shows) and the consumer reaches a broker (``kafka unreachable: <why>``, at
  once while records are held, after :data:`KAFKA_UNREACHABLE_IDLE_S` with nothing
  held; :class:`cdc.kafkalog.KafkaReach`); a state change is logged once, with its
  reason;
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
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from cdc.health import Liveness
from cdc.kafkalog import KafkaClientEvents
from cdc.settings import Settings
from sinks.core import machine as core
from sinks.core.delivery import Envelope
from sinks.core.errors import EngineMisconfigured, EngineUnavailable, SinkError, Unroutable
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
from sinks.engine import http1
from sinks.engine.client import EngineClient
from sinks.engine.dispatch import USER_SYNCS, deliver
from sinks.kafka.config import consumer_config, subscription
from sinks.kafka.metrics import SinkMetrics
from sinks.kafka.worker import KafkaWorker
from sinks.parking.lot import ParkingLot, ParkingLotUnavailable, ParkRequest
from sinks.shared.logs import BoundedLabels, RepeatLog
from sinks.shared.routes import Routing
from sinks.shared.tracing import SinkTracing

log = logging.getLogger("sinks.consumer")  # the name operators filter on: kept across moves

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
#: With nothing held, a consumer that reaches no broker for this long makes /readyz say
#: ``kafka unreachable``: a broker restart or a leader move is shorter.
KAFKA_UNREACHABLE_IDLE_S = 10.0
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
CHECKPOINT_RECORD = "the relay's checkpoint topic, CDC_CHECKPOINT_TOPIC"  #: (a pattern took it)


def classifier(routing: Routing, checkpoint_topic: str = "") -> Callable[[Envelope], Verdict]:
    """A record's routing verdict: skipped, deliverable, or bad input to park at once."""

    def classify(record: Envelope) -> Verdict:
        if record.topic == checkpoint_topic:
            return Verdict(Route.IGNORE, CHECKPOINT_RECORD)
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
    (:class:`~sinks.core.errors.EngineMisconfigured`): UNAVAILABLE, never the record's.
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
        classify=classifier(routing, settings.checkpoint_topic_name),
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
            "sink-consumer",
            count=lambda code: self.metrics.kafka_errors.labels(code).inc(),
            reach=True,
        )
        #: the last evidence of a working broker: records, an assignment, a commit
        self._kafka_heard_at: float | None = None
        self._worker: KafkaWorker | None = None
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._park_error: str | None = None
        self._reported: tuple[Circuit, str, bool, bool, str] | None = None
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
        worker = KafkaWorker(
            consumer_config(self.settings),
            subscription(self.settings),
            loop=asyncio.get_running_loop(),
            side=self,
            events=self.kafka_events,
            lag_gauge=self.metrics.lag,
            offsets_expired=self.metrics.offsets_expired.inc,
            fetch_restarted=self.metrics.fetch_restarts.inc,
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
            USER_SYNCS.flush()
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
        USER_SYNCS.tick()

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
        self._kafka_heard_at = time.monotonic()
        now_ms = int(time.time() * 1000)
        for record in records:
            verdict = self.core.consumed(record, now_ms=now_ms)
            if verdict is not None and verdict.route is Route.IGNORE:
                self._skipped(record, verdict.reason)
        if self.core.needs_pause():
            self._step()  # pause now: batches already posted must not pile up first
        self._wake.set()

    def _skipped(self, record: Envelope, reason: str) -> None:
        self.metrics.skipped.labels(self._type_labels.label(record.event_type)).inc()
        self._skipped_log.event(  # (SINK_IGNORED_TYPES: once per type; checkpoints: per topic)
            f"topic {record.topic}" if reason == CHECKPOINT_RECORD else record.event_type,
            "skipping events of type %r (%s); counted in outbox_sink_skipped_total, logged once",
            record.event_type,
            reason,
            extra={"event_type": record.event_type, "topic": record.topic},
        )

    def on_assign(self, partitions: list[tuple[str, int]]) -> None:
        self._kafka_heard_at = time.monotonic()
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
            if ok:
                self._kafka_heard_at = time.monotonic()
            else:
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
        unreachable = self._kafka_unreachable()
        state = (circuit, reason, self._park_error is None, stalled, unreachable)
        if state == self._reported:
            return
        previous = self._reported
        self._reported = state
        if unreachable:
            status = unreachable
        elif circuit is not Circuit.CLOSED:
            status = f"engine unavailable: {reason}"
        elif self._park_error is not None:
            status = self._park_error
        else:
            status = ""
        if stalled:
            status = self._stall_status(status)
        self.liveness.set(status or "running", ready=not status)
        self._log_change(previous, state)

    def _kafka_unreachable(self) -> str:
        """``kafka unreachable: <why>`` while no broker answers (overruled by records, an
        assignment or a commit since): at once with records held or being sent, after
        :data:`KAFKA_UNREACHABLE_IDLE_S` with none (what waits in Kafka is unseen)."""
        reach = self.kafka_events.reach
        away_s = reach.unreachable_s(progress_at=self._kafka_heard_at) if reach else None
        busy = self.core.held or self.core.sending
        if away_s is None or (not busy and away_s < KAFKA_UNREACHABLE_IDLE_S):
            return ""
        return f"kafka unreachable: {self.kafka_events.why_unreachable()}"

    def _stall_status(self, cause: str) -> str:
        after_s = self.settings.sink_stall_after_s
        status = (
            f"stalled: nothing delivered, parked or committed for over {after_s:g} s"
            f" while work waits ({self.core.held} records held)"
        )
        return f"{status}; {cause}" if cause else status

    def _log_change(
        self,
        previous: tuple[Circuit, str, bool, bool, str] | None,
        state: tuple[Circuit, str, bool, bool, str],
    ) -> None:
        """One line per change of the engine's state (OPEN and HALF_OPEN are one: down),
        and one when Kafka becomes unreachable (or reachable again)."""
        if previous is None:
            return
        if state[4] and not previous[4]:
            log.warning("sink: %s; not ready until a broker answers", state[4])
        elif previous[4] and not state[4]:
            log.info("sink: kafka reachable again")
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
