"""The sink's consumer loop: Kafka -> engine, at least once, per-key order.

Invariants (DESIGN.md, "Sink invariants"):

1. An offset is committed only when every record at or below it in that
   partition is delivered (2xx) or parked (:class:`OffsetWatermark`). Records
   of one key are delivered in order; different keys run concurrently up to
   ``SINK_MAX_IN_FLIGHT`` (:class:`KeyScheduler`).
2. Engine-wide trouble (refused, timeouts, 408, 429, 5xx, 401/403) spends no
   attempt: the circuit opens, every partition is paused (the loop keeps
   polling, so group membership holds) and one probe is sent after a growing,
   jittered backoff that honours ``Retry-After``.
3. Only a record the healthy engine rejects (other 4xx, or one record failing
   while others succeed) spends attempts, and is parked after the limit.
4. A quiz attempt whose user the engine lacks syncs the user first (dispatch).
5. A record that cannot be routed is parked at once with the reason.

Circuit transitions::

    CLOSED --engine-wide failure--> OPEN --probe due--> HALF_OPEN
    HALF_OPEN --probe delivered--> CLOSED (partitions resumed, backoff reset)
    HALF_OPEN --probe failed-----> OPEN (longer backoff)

The loop runs on one asyncio event loop; rebalance callbacks run inside
``consume()`` on that same thread, so no state is shared across threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cdc.health import Liveness
from cdc.settings import Settings
from sinks.delivery import Envelope, KeyScheduler, OffsetWatermark, RecordState
from sinks.dispatch import deliver
from sinks.engine import EngineClient
from sinks.errors import EngineUnavailable, SinkError, Unroutable
from sinks.parking import ParkingLot, ParkRequest
from sinks.retry import Backoff, retry_delay_s
from sinks.routes import sync_type_for

log = logging.getLogger(__name__)

#: Records fetched per consume() call.
CONSUME_BATCH = 1_000
#: Longest the loop sleeps when idle: bounds the added delivery latency.
IDLE_WAIT_S = 0.01
#: Queued records (per instance) above which partitions pause to bound memory.
MAX_BUFFERED = 20_000
#: Committed offsets are sent at most this often (and on revoke and shutdown).
COMMIT_INTERVAL_S = 1.0
#: Attempts a record the engine rejects gets inline, with this first backoff.
INLINE_ATTEMPTS = 3
INLINE_BACKOFF_S = 0.2
#: Floor of the probe backoff (SINK_BACKOFF_MAX_S=0 would mean a busy loop).
MIN_BACKOFF_S = 0.1
#: Shutdown waits this long for deliveries in flight.
SHUTDOWN_WAIT_S = 10.0
#: Lag / oldest-age gauges refresh period.
LAG_REFRESH_S = 5.0


class Circuit(enum.Enum):
    CLOSED = "closed"  # engine healthy: deliveries flow
    OPEN = "open"  # engine-wide trouble: partitions paused, waiting to probe
    HALF_OPEN = "half_open"  # one probe delivery in flight


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
            "Deliveries retried (engine-wide or record-specific)",
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
            "outbox_sink_circuit_open", "1 while the engine circuit is open", registry=registry
        )
        self.lag = Gauge(
            "outbox_sink_consumer_lag", "End offset - committed, summed", registry=registry
        )
        self.oldest_age = Gauge(
            "outbox_sink_oldest_unprocessed_age_seconds",
            "Age of the oldest record not yet delivered or parked",
            registry=registry,
        )
        self.in_flight = Gauge(
            "outbox_sink_in_flight", "Engine requests in flight", registry=registry
        )


@dataclass
class _Partition:
    """What the sink holds for one assigned partition in one assignment generation."""

    generation: int
    watermark: OffsetWatermark
    timestamps: dict[int, int]  # pending offset -> record timestamp (ms)


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
    }
    config.update(settings.kafka_config)
    return config


def subscription(settings: Settings) -> list[str]:
    """A regex subscription (``^...``) over the outbox topics."""
    pattern = settings.sink_topics_pattern or f"^{re.escape(settings.topic_prefix)}.*"
    return [pattern if pattern.startswith("^") else f"^{pattern}"]


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
        self.circuit = Circuit.CLOSED
        self.circuit_reason = ""
        self._scheduler = KeyScheduler(max_in_flight=settings.sink_max_in_flight)
        self._parts: dict[tuple[str, int], _Partition] = {}
        self._generation = 0
        self._stash: dict[tuple[str, int, int], Envelope] = {}
        self._record_gen: dict[tuple[str, int, int], int] = {}
        backoff_cap_s = max(settings.sink_backoff_max_s, MIN_BACKOFF_S)
        self._backoff = Backoff(base_s=min(0.5, backoff_cap_s), cap_s=backoff_cap_s)
        self._next_probe = 0.0
        self._successes = 0
        self._paused = False
        self._paused_tps: set[tuple[str, int]] = set()
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._last_commit = 0.0
        self._consumer: Consumer | None = None
        self.delivered_count = 0
        self.parked_count = 0

    # -- lifecycle -------------------------------------------------------------
    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    async def run(self) -> None:
        consumer = Consumer(consumer_config(self.settings))
        self._consumer = consumer
        consumer.subscribe(
            subscription(self.settings),
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_revoke,
        )
        self._report()
        lag_task = asyncio.create_task(self._lag_loop())
        try:
            while not self._stopping.is_set():
                self.liveness.tick()
                self._poll(consumer)
                self._start_ready()
                self._commit(consumer, force=False)
                self._apply_pause(consumer)
                await self._idle()
            await self._drain()
            self._commit(consumer, force=True)
        finally:
            lag_task.cancel()
            consumer.close()
            self.liveness.set("stopped", ready=False)

    async def _idle(self) -> None:
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=IDLE_WAIT_S)

    async def _drain(self) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=SHUTDOWN_WAIT_S)

    # -- Kafka -----------------------------------------------------------------
    def _poll(self, consumer: Consumer) -> None:
        busy = bool(self._tasks) or self._scheduler.queued > 0
        msgs = consumer.consume(CONSUME_BATCH, 0 if busy else IDLE_WAIT_S)
        for msg in msgs:
            err = msg.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    log.warning("consumer error: %s", err)
                continue
            self._take(Envelope.from_kafka(msg))

    def _take(self, env: Envelope) -> None:
        part = self._parts.get(env.topic_partition)
        if part is None:  # not (or no longer) assigned: it will be consumed again
            return
        part.watermark.track(env.offset)
        part.timestamps[env.offset] = env.timestamp_ms or int(time.time() * 1000)
        self._record_gen[env.position] = part.generation
        if env.position in self._stash or self._scheduler.state(env) is not RecordState.UNKNOWN:
            self._stash[env.position] = env  # an orphan of an earlier assignment is in flight
            return
        self._scheduler.submit(env)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            self._generation += 1
            self._parts[(tp.topic, tp.partition)] = _Partition(
                self._generation, OffsetWatermark(), {}
            )
        self._report()
        log.info("assigned %s", _names(partitions))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        offsets = []
        for tp in partitions:
            part = self._parts.pop((tp.topic, tp.partition), None)
            if part is None:
                continue
            if part.watermark.committable is not None:
                offsets.append(TopicPartition(tp.topic, tp.partition, part.watermark.committable))
            self._scheduler.drop_partition(tp.topic, tp.partition)
            self._paused_tps.discard((tp.topic, tp.partition))
        if offsets:
            try:
                consumer.commit(offsets=offsets, asynchronous=False)
            except Exception as exc:  # the group moved on; the new owner redelivers
                log.warning("commit on revoke failed: %s", exc)
        self._report()
        log.info("revoked %s", _names(partitions))

    def _commit(self, consumer: Consumer, *, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._last_commit < COMMIT_INTERVAL_S:
            return
        self._last_commit = now
        offsets = []
        for (topic, partition), part in self._parts.items():
            offset = part.watermark.take_committable()
            if offset is not None:
                offsets.append(TopicPartition(topic, partition, offset))
        if offsets:
            try:
                if force:
                    consumer.commit(offsets=offsets, asynchronous=False)
                else:
                    consumer.commit(offsets=offsets, asynchronous=True)
            except Exception as exc:
                log.warning("offset commit failed (will retry): %s", exc)

    def _apply_pause(self, consumer: Consumer) -> None:
        """Pause every assigned partition while the circuit is open or the buffer is full.

        Partitions assigned while paused are paused here too (an assignment
        becomes effective only after the rebalance callback returns).
        """
        want = self.circuit is not Circuit.CLOSED or self._scheduler.queued > MAX_BUFFERED
        if not want and not self._paused:
            return
        assigned = consumer.assignment()
        if want:
            fresh = [tp for tp in assigned if (tp.topic, tp.partition) not in self._paused_tps]
            if fresh:
                consumer.pause(fresh)
                self._paused_tps.update((tp.topic, tp.partition) for tp in fresh)
        else:
            consumer.resume(assigned)
            self._paused_tps.clear()
        self._paused = want

    # -- delivery --------------------------------------------------------------
    def _start_ready(self) -> None:
        if self.circuit is Circuit.OPEN:
            if time.monotonic() < self._next_probe:
                return
            probe = self._scheduler.ready(limit=1)
            if not probe:
                return
            self._set_circuit(Circuit.HALF_OPEN, self.circuit_reason)
            self._spawn(probe[0])
            return
        if self.circuit is Circuit.HALF_OPEN:
            return
        for env in self._scheduler.ready():
            self._spawn(env)

    def _spawn(self, env: Envelope) -> None:
        task = asyncio.create_task(self._deliver(env))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        self.metrics.in_flight.set(self._scheduler.in_flight)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._wake.set()
        if not task.cancelled() and task.exception() is not None:
            log.error("delivery task failed", exc_info=task.exception())

    async def _deliver(self, env: Envelope) -> None:
        attempts = 0
        while True:
            successes_before = self._successes
            started = time.perf_counter()
            try:
                await deliver(
                    self.engine, event_type=env.event_type, payload=env.value, event_id=env.event_id
                )
            except Unroutable as exc:
                await self._park(env, exc.reason, attempts)
                return
            except EngineUnavailable as exc:
                if self._successes == successes_before or self.circuit is not Circuit.CLOSED:
                    self._engine_down(env, exc)
                    return
                attempts += 1  # others succeed meanwhile: this record's own trouble
                self.metrics.retried.labels("record").inc()
                if attempts >= INLINE_ATTEMPTS:
                    await self._park(
                        env,
                        f"failed {attempts} times while others succeeded: {exc.reason}",
                        attempts,
                    )
                    return
            except SinkError as exc:
                attempts += 1
                self.metrics.retried.labels("record").inc()
                if attempts >= INLINE_ATTEMPTS:
                    await self._park(env, exc.reason, attempts)
                    return
            else:
                self._delivered(env, time.perf_counter() - started)
                return
            await asyncio.sleep(INLINE_BACKOFF_S * 2 ** (attempts - 1))

    def _delivered(self, env: Envelope, elapsed_s: float) -> None:
        self._successes += 1
        self.delivered_count += 1
        self.metrics.delivered.labels(env.event_type or "?").inc()
        self.metrics.engine_latency.observe(elapsed_s)
        if env.timestamp_ms:
            self.metrics.end_to_end.observe(max(time.time() - env.timestamp_ms / 1000, 0.0))
        if self.circuit is Circuit.HALF_OPEN:
            log.info("engine is back (%s); resuming", self.circuit_reason)
            self._backoff.reset()
            self._set_circuit(Circuit.CLOSED, "")
        self._settle(env)

    def _engine_down(self, env: Envelope, exc: EngineUnavailable) -> None:
        self._scheduler.release(env)
        self._release_orphan(env)
        self.metrics.retried.labels("engine").inc()
        if self.circuit is Circuit.OPEN:
            return
        delay_s = self._backoff.next_delay_s(exc.retry_after_s)
        self._next_probe = time.monotonic() + delay_s
        if self.circuit is Circuit.CLOSED:
            log.warning(
                "engine unavailable (%s): pausing partitions, probing in %.1fs", exc.reason, delay_s
            )
        self._set_circuit(Circuit.OPEN, exc.reason)

    def _set_circuit(self, state: Circuit, reason: str) -> None:
        self.circuit = state
        self.circuit_reason = reason
        self.metrics.circuit.set(0 if state is Circuit.CLOSED else 1)
        self._report()
        self._wake.set()

    def _report(self) -> None:
        """Readiness: ready unless the circuit is open; the text says what is assigned."""
        if self.circuit is Circuit.CLOSED:
            self.liveness.set(f"running ({len(self._parts)} partitions assigned)", ready=True)
        else:
            self.liveness.set(
                f"engine unavailable: {self.circuit_reason}",
                ready=self.circuit is Circuit.HALF_OPEN,
            )

    async def _park(self, env: Envelope, reason: str, attempts: int) -> None:
        sync_type = sync_type_for(env.event_type) or "UNROUTABLE"
        try:
            row = await self.lot.park(
                ParkRequest(
                    outbox_event_id=env.event_id,
                    sync_type=str(sync_type),
                    payload=env.value,
                    reason=reason,
                    topic=env.topic,
                    partition=env.partition,
                    offset=env.offset,
                    key=env.key,
                    headers=env.headers,
                    retry_in_s=retry_delay_s(0, self.settings.retry_backoff_base_s),
                )
            )
        except Exception as exc:
            # Cannot park: do not move the offset; treat as engine-wide trouble.
            log.error("cannot park event %s (%s): %s", env.event_id, reason, exc)
            self._engine_down(env, EngineUnavailable(f"parking lot unavailable: {exc}"))
            return
        log.warning(
            "event %s parked as failed_sync_events #%d after %d attempts: %s",
            env.event_id or env.position,
            row,
            attempts,
            reason,
        )
        self.parked_count += 1
        self.metrics.parked.labels(str(sync_type)).inc()
        self._settle(env)

    def _settle(self, env: Envelope) -> None:
        """Delivered or parked: free the key's lane and let the watermark move."""
        self._scheduler.finish(env)
        gen = self._record_gen.pop(env.position, None)
        part = self._parts.get(env.topic_partition)
        if part is not None and gen == part.generation:
            part.watermark.done(env.offset)
            part.timestamps.pop(env.offset, None)
        self._release_orphan(env)
        self.metrics.in_flight.set(self._scheduler.in_flight)
        self._wake.set()

    def _release_orphan(self, env: Envelope) -> None:
        stashed = self._stash.pop(env.position, None)
        if stashed is not None and self._scheduler.state(stashed) is RecordState.UNKNOWN:
            self._scheduler.submit(stashed)
        elif stashed is not None:
            self._stash[env.position] = stashed

    # -- gauges ----------------------------------------------------------------
    async def _lag_loop(self) -> None:
        while True:
            await asyncio.sleep(LAG_REFRESH_S)
            self.metrics.oldest_age.set(self.oldest_unprocessed_age_s())

    def oldest_unprocessed_age_s(self) -> float:
        oldest: int | None = None
        for part in self._parts.values():
            offset = part.watermark.oldest_pending
            if offset is not None and offset in part.timestamps:
                ts = part.timestamps[offset]
                oldest = ts if oldest is None else min(oldest, ts)
        return 0.0 if oldest is None else max(time.time() - oldest / 1000, 0.0)


def _names(partitions: list[TopicPartition]) -> str:
    return ", ".join(f"{tp.topic}[{tp.partition}]" for tp in partitions) or "nothing"
