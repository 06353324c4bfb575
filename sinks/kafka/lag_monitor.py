"""``outbox_sink_consumer_lag``, measured off the consumer's thread.

Guarantees: the gauge is end offset - committed offset summed over what the group
assigned to this member (a partition without a commit counts from its low
watermark), refreshed every :data:`LAG_REFRESH_S` by a thread and a client of its
own, so the member's fetching never waits on these broker round-trips; a refresh
that fails keeps the last value (and says so at DEBUG).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition
from prometheus_client import Gauge

from cdc.kafka.log import KafkaClientEvents

log = logging.getLogger("sinks.kafka_worker")  # the name operators filter on: kept across moves

#: The consumer-lag gauge is refreshed this often (two broker requests per partition).
LAG_REFRESH_S = 5.0
#: Broker requests of the lag refresh give up after this.
LAG_QUERY_TIMEOUT_S = 2.0

TP = tuple[str, int]


class LagMonitor:
    """``outbox_sink_consumer_lag`` = end offset - committed offset, summed over the assignment.

    Runs on a daemon thread with a consumer of its own that never subscribes
    (it only reads the group's committed offsets and the watermarks), so the
    member's fetching is never held up by these broker round-trips. A
    partition without a commit counts from its low watermark. A failed
    refresh keeps the last value (and says so at DEBUG).
    """

    def __init__(
        self,
        config: dict[str, Any],
        *,
        gauge: Gauge,
        assigned: Callable[[], set[TP]],
        period_s: float = LAG_REFRESH_S,
    ) -> None:
        keep = ("bootstrap.servers", "group.id", "security.", "sasl.", "ssl.", "client.")
        self._config = {
            k: v for k, v in config.items() if isinstance(k, str) and k.startswith(keep)
        }
        self._config["enable.auto.commit"] = False
        self._gauge = gauge
        self._assigned = assigned
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kafka-lag", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        events = KafkaClientEvents("sink-lag")
        try:
            config = {k: v for k, v in self._config.items() if k != "stats_cb"}
            config["statistics.interval.ms"] = 0  # (the consumer's statistics are not its)
            client = Consumer({**config, **events.config()})
        except KafkaException as exc:
            log.warning("consumer-lag gauge disabled: %s", exc)
            return
        try:
            while not self._stop.wait(self._period_s):
                lag = self.measure(client, sorted(self._assigned()))
                if lag is not None:
                    self._gauge.set(lag)
        finally:
            client.close()

    @staticmethod
    def measure(client: Consumer, partitions: list[TP]) -> int | None:
        """The lag of ``partitions`` now; ``None`` when the broker did not answer."""
        if not partitions:
            return 0
        try:
            committed = client.committed(
                [TopicPartition(t, p) for t, p in partitions], timeout=LAG_QUERY_TIMEOUT_S
            )
            lag = 0
            for tp in committed:
                low, high = client.get_watermark_offsets(
                    TopicPartition(tp.topic, tp.partition), timeout=LAG_QUERY_TIMEOUT_S
                )
                start = tp.offset if tp.offset >= 0 else low
                lag += max(0, high - max(start, low))
        except KafkaException as exc:
            log.debug("lag refresh failed: %s", exc)
            return None
        return lag
