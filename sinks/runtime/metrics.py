"""The sink's Prometheus metrics: one :class:`SinkMetrics` per consumer, on the process's registry.

What it is for: every ``outbox_sink_*`` series the consumer shell
(:mod:`sinks.runtime.sink`) and its Kafka thread (:mod:`sinks.kafka.worker`)
update; the alert rules, the dashboard and the metrics reference name these
series, so a name or a label here is a contract (the observability tests hold
the three to the code). Guarantees: every label set is bounded by what the sink
owns - ``type`` by the routing table or by
:class:`~sinks.shared.logs.BoundedLabels` (the rest count as ``other``),
``route`` by the route catalogue, ``code`` by librdkafka's error codes,
``kind`` and ``sync_type`` by their enums - never by the records' own values;
defining the metrics does no I/O.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


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
        self.fetch_restarts = Counter(
            "outbox_sink_fetch_restarts_total",
            "Partitions that should have been fetching, silent while the broker held records"
            " past the next offset expected: resumed and sought there (each logged as a WARNING)",
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
        self.park_refused = Counter(
            "outbox_sink_park_refused_total",
            "Park batches PostgreSQL refused for what they carry (split, down to the record)",
            registry=registry,
        )
        self.park_skipped = Counter(
            "outbox_sink_park_skipped_total",
            "Records the parking lot refused even without their payload: skipped (logged)",
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
