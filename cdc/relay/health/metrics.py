"""The relay's Prometheus metrics, in a registry of its own.

Guarantees: every label set is bounded - topics (the outbox's aggregate
types), dead-letter codes (:class:`cdc.router.DeadLetterCode`, a fixed set),
librdkafka error names, the relay's states and the standby hosts CDC_PG_DSN
names (at most :data:`cdc.wal.standby_copy.MAX_STANDBY_HOSTS`); never an event's
own values.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

_go_float: Callable[[float], str] = floatToGoString  # how prometheus_client writes a bound


class OneWriterHistogram:
    """A Prometheus histogram observed by one thread, without a lock.

    The relay's main thread observes the commit->ack latency once per
    transaction; prometheus_client's ``Histogram`` takes a lock for the bucket
    and another for the sum, a tenth of a 1-event transaction's cost. Here an
    observation is a bisect and two additions; a scrape (another thread) reads a
    copy of the counts, so its ``_count`` always equals its ``+Inf`` bucket.
    """

    def __init__(
        self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._bounds = tuple(float(b) for b in buckets)
        self._labels = [_go_float(b) for b in self._bounds]
        self._counts = [0] * (len(self._bounds) + 1)  # the last one: above every bound
        self._sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        """One observation (``le`` buckets: a value equal to a bound counts in it)."""
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self._name, self._documentation)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        counts, total = list(self._counts), self._sum
        buckets: list[tuple[str, float]] = []
        cumulative = 0
        for label, count in zip(self._labels, counts, strict=False):
            cumulative += count
            buckets.append((label, cumulative))
        buckets.append(("+Inf", cumulative + counts[-1]))
        yield HistogramMetricFamily(
            self._name, self._documentation, buckets=buckets, sum_value=total
        )


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
        self.latency = OneWriterHistogram(
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
        self.stalled = Gauge(
            "outbox_relay_stalled",
            "1 while records wait and none was acknowledged for CDC_RELAY_STALL_AFTER_S",
            registry=registry,
        )
        self.replication_silences = Counter(
            "outbox_relay_replication_silences_total",
            "Replication connections reopened after CDC_REPLICATION_SILENCE_S without a message",
            registry=registry,
        )
        self.walsender_looks = Counter(
            "outbox_relay_walsender_looks_total",
            "Looks at the walsender of a silent replication connection, by verdict"
            " (leave: working, left alone; end: the path is dead; wait: look again)",
            ["verdict"],
            registry=registry,
        )
        self.slot_takebacks = Counter(
            "outbox_relay_slot_takebacks_total",
            "Slots taken back from the relay's own previous walsender (orphaned by a dead path)",
            registry=registry,
        )
        self.gap_checks = Counter(
            "outbox_relay_gap_checks_total",
            "Gap checks run (each reads the tails of the outbox topics); none while a standby",
            registry=registry,
        )
        self.state = Gauge(
            "outbox_relay_state", "1 for the current state", ["state"], registry=registry
        )
        self.gaps = Counter(
            "outbox_relay_gaps_total",
            "Slot gaps found (a lost, dropped or failed-over slot), by cause (GapCause)",
            ["cause"],
            registry=registry,
        )
        self.recovered = Counter(
            "outbox_relay_recovered_events_total",
            "Outbox rows re-published from the table to close a slot gap",
            registry=registry,
        )
        self.last_recovery_window = Gauge(
            "outbox_relay_last_recovery_window_seconds",
            "Width of the last recovered gap's window (its start to its end)",
            registry=registry,
        )
        self.last_recovery_duration = Gauge(
            "outbox_relay_last_recovery_duration_seconds",
            "How long the last gap recovery took",
            registry=registry,
        )
        self.tail_records_skipped = Counter(
            "outbox_relay_tail_records_skipped_total",
            "Records the gap check's tail read passed by (not the relay's own, or unreadable),"
            " by reason (cdc.records.Skip)",
            ["reason"],
            registry=registry,
        )
        self.start_check_republished = Counter(
            "outbox_relay_start_check_republished_total",
            "Outbox rows the start-up check found missing from Kafka and re-published",
            registry=registry,
        )
        self.slot_wal_status = Gauge(
            "outbox_relay_slot_wal_status",
            "1 for the slot's pg_replication_slots.wal_status (reserved/extended/unreserved/lost)",
            ["status"],
            registry=registry,
        )
        self.slot_safe_wal_size = Gauge(
            "outbox_relay_slot_safe_wal_size_bytes",
            "WAL that may still be written before the slot is invalidated (-1: no limit)",
            registry=registry,
        )
        self.failover_slot_synced = Gauge(
            "outbox_relay_failover_slot_synced",
            "Per standby host of CDC_PG_DSN (17+, a failover slot): 1 it carries the slot for"
            " good, 0 not yet (a temporary copy, or none), -1 the relay cannot look",
            ["standby"],
            registry=registry,
        )
        self._relayed_children: dict[str, Any] = {}

    def relayed_in(self, topic: str) -> Any:
        """The per-topic child of ``relayed`` (cached: ``labels()`` is slow per record)."""
        child = self._relayed_children.get(topic)
        if child is None:
            child = self._relayed_children[topic] = self.relayed.labels(topic)
        return child
