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
* ``/readyz`` says what :class:`sinks.runtime.readiness.Readiness` makes of the
  core, the parking lot and the broker, refreshed every step;
* an engine answer is mapped to a core result by its meaning
  (:func:`sinks.runtime.verdicts.failure_result`), with the engine route of the request that failed
  (``SinkError.endpoint``): a 429 is ``THROTTLED``; a ``Retry-After`` on
  another status, and an expired request deadline, are ``UNAVAILABLE``
  marked ``shared``; another 5xx is ``SERVER_ERROR`` (blamed on the record
  only with per-route evidence, by the core); everything else that is not
  about the record - refused, reset, timeouts, 408, 401/403, 3xx, the sink's
  own errors - is ``UNAVAILABLE``: trouble of the route, never an attempt.

SIGTERM (:meth:`Sink.stop`): take and send nothing new, wait for what is in
flight (half of ``SINK_SHUTDOWN_S`` at most), commit, leave the group - all of it
within ``SINK_SHUTDOWN_S``: a broker that does not answer is given up on at the
bound (the commit left undone: the group redelivers from its last one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from cdc.health import Liveness
from cdc.kafka.log import KafkaClientEvents
from cdc.settings import Settings
from sinks.core import machine as core
from sinks.core.backoff import Backoff
from sinks.core.delivery import Envelope
from sinks.core.endpoints import Circuit
from sinks.core.errors import SinkError
from sinks.core.machine import (
    Commit,
    Disposition,
    Park,
    Pause,
    Result,
    ResultKind,
    Resume,
    Send,
    SinkCore,
)
from sinks.engine.client import EngineClient
from sinks.engine.dispatch import USER_SYNCS, deliver
from sinks.kafka.config import consumer_config, subscription
from sinks.kafka.worker import KafkaWorker
from sinks.parking.lot import ParkingLot
from sinks.runtime.metrics import SinkMetrics
from sinks.runtime.parks import MAX_BUFFERED_BYTES, ParkingShell
from sinks.runtime.readiness import Readiness
from sinks.runtime.verdicts import CHECKPOINT_RECORD, classifier, failure_result
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
#: The least a shutdown is given, whatever SINK_SHUTDOWN_S says (a commit round-trip).
MIN_SHUTDOWN_S = 1.0
#: Gauges refresh period; also the longest the loop sleeps (liveness ticks).
GAUGE_REFRESH_S = 1.0
#: The shortest sleep: a timer the core reports as due now never becomes a busy loop.
MIN_SLEEP_S = 0.001
#: Distinct event types named in the per-type metrics; the rest count as "other"
#: (types come from other teams' producers: their number is not ours to bound).
MAX_TYPE_LABELS = 50
#: Results that are trouble of an engine route (counted per route; no attempt spent).
ROUTE_TROUBLE = frozenset({ResultKind.UNAVAILABLE, ResultKind.SERVER_ERROR, ResultKind.THROTTLED})


def make_core(settings: Settings, routing: Routing) -> SinkCore:
    backoff_cap_s = max(settings.sink_backoff_max_s, MIN_BACKOFF_S)
    return SinkCore(
        max_in_flight=settings.sink_max_in_flight,
        max_buffered=MAX_BUFFERED,
        inline_attempts=settings.sink_inline_attempts,
        inline_backoff_s=INLINE_BACKOFF_S,
        backoff=lambda: Backoff(base_s=min(0.5, backoff_cap_s), cap_s=backoff_cap_s),
        commit_interval_s=COMMIT_INTERVAL_S,
        classify=classifier(routing, settings.is_checkpoint_topic),
        max_buffered_bytes=MAX_BUFFERED_BYTES,
    )


class Sink(ParkingShell):
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
        self.readiness = Readiness(
            settings=settings, core=self.core, liveness=liveness, kafka_events=self.kafka_events
        )
        #: the last evidence of a working broker: records, an assignment, a commit
        self._kafka_heard_at: float | None = None
        self._worker: KafkaWorker | None = None
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._park_error: str | None = None
        self._park_turn = asyncio.Lock()
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
        """Within ``SINK_SHUTDOWN_S``: what is in flight ends (half of it at most), the
        settled offsets are committed, the group is left."""
        bound_s = max(self.settings.sink_shutdown_s, MIN_SHUTDOWN_S)
        deadline = time.monotonic() + bound_s
        self.core.stop()
        self._step()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=bound_s / 2)
        self._step()
        left_s = max(deadline - time.monotonic(), MIN_SHUTDOWN_S / 2)
        if not await worker.close(self.core.final_commits(), timeout_s=left_s):
            log.warning(
                "Kafka did not confirm the final commit and the group's leave within"
                " SINK_SHUTDOWN_S=%g s: ending without them (the group redelivers from its"
                " last commit: duplicates possible, nothing lost)",
                self.settings.sink_shutdown_s,
                extra={"state": "stopping"},
            )

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
            if verdict is not None and verdict.disposition is Disposition.IGNORE:
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
        except SinkError as exc:
            return failure_result(exc)
        except Exception as exc:  # our own bug: trouble of the route, spend nothing
            log.exception("delivery of event %s failed unexpectedly", record.event_id)
            return failure_result(exc)
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

    # -- gauges and readiness ----------------------------------------------------------
    def _gauges(self) -> None:
        """Counters the core keeps (O(routes + partitions), never a scan of records)."""
        self.metrics.in_flight.set(self.core.sending)
        self.metrics.held.set(self.core.held)
        self.metrics.tracked.set(self.core.footprint())
        self.metrics.paused.set(len(self.core.paused))
        self.metrics.circuit.set(0 if self.core.circuit is Circuit.CLOSED else 1)
        for route in self.core.endpoints():
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
        self.metrics.stalled.set(1 if self.readiness.stalled(stalled_s) else 0)

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

    def oldest_unprocessed_age_s(self) -> float:
        oldest = self.core.oldest_pending_timestamp_ms()
        return 0.0 if oldest is None else max(time.time() - oldest / 1000, 0.0)

    def _report(self) -> None:
        """Readiness, and one log line per change (:class:`~sinks.runtime.readiness.Readiness`)."""
        self.readiness.report(park_error=self._park_error, kafka_heard_at=self._kafka_heard_at)
