"""Kafka's own floor for exactly-once latency: a bare transactional producer, no relay.

The exactly-once relay's commit->read_committed latency holds what no relay can
remove: the transaction window, the acknowledgement of the window's last records
(librdkafka sends one ProduceRequest per partition, and the broker serves one
connection's requests one after another), ``AddPartitionsToTxn`` for every partition a
transaction touches (retried after a fixed 20 ms when it meets the previous
transaction's markers still being written: CONCURRENT_TRANSACTIONS), ``EndTxn``, the
markers, and the consumer's fetch. :func:`floor_latencies` measures that floor on the
same broker, at the same rate and window, with the relay's own producer settings: the
relay's figure beside it, in the same run, tells what the relay adds (the WAL's
decoding and the reading, PostgreSQL's commit->walsender time included).

The loop: paced produce of one record per event (its value the wall time just before
``produce``), a commit once the open transaction is ``window_ms`` old (counted from
its first record, as the relay counts), ``commit_transaction`` on the producing
thread (the simplest correct use; records of the next window wait meanwhile, as the
relay's buffer holds them); a ``read_committed`` consumer timestamps each record on
receipt.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from cdc.kafka.producer import producer_config
from tests.bench.conftest import Pace, create_topics, paced

#: A record's value: the sender's wall clock, as text.
_ENCODING = "ascii"
#: Records of the untimed first transaction: the new topic's metadata, the first
#: registrations and the consumer's first fetches happen before the timing starts (the
#: relay's run has its warm-up too).
WARMUP_RECORDS = 200


@dataclass
class FloorResult:
    """What one run of the bare transactional loop measured."""

    latencies_ms: list[float] = field(default_factory=list)
    commits: int = 0
    pace: Pace = field(default_factory=lambda: Pace(0, 0.0, 0.0))


class _Reader(threading.Thread):
    def __init__(self, consumer: Consumer, result: FloorResult) -> None:
        super().__init__(name="floor-reader", daemon=True)
        self.consumer = consumer
        self.result = result
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                msg = self.consumer.poll(0.05)
                received = time.time()
                if msg is None:
                    continue
                if msg.error():
                    raise RuntimeError(str(msg.error()))
                sent = float(bytes(msg.value() or b"0").decode(_ENCODING))
                self.result.latencies_ms.append((received - sent) * 1000.0)
        except BaseException as exc:  # (handed to the caller)
            self.error = exc


def _wait_for(result: FloorResult, count: int, reader: _Reader) -> None:
    """Until ``count`` records were read (bounded: 60 s; the caller checks the count)."""
    deadline = time.monotonic() + 60
    while len(result.latencies_ms) < count and time.monotonic() < deadline:
        if reader.error is not None:
            return
        time.sleep(0.05)


def floor_latencies(
    kafka: str,
    topic_prefix: str,
    *,
    partitions: int,
    rate_per_s: float,
    duration_s: float,
    window_ms: int,
) -> FloorResult:
    """The bare transactional loop's produce->read_committed latencies (see the module
    docstring); every record must arrive once (asserted by the caller on the count)."""
    topic = f"{topic_prefix}floor-{uuid.uuid4().hex[:8]}"
    create_topics(kafka, [topic], partitions=partitions)
    result = FloorResult()
    consumer = Consumer(
        {
            "bootstrap.servers": kafka,
            "group.id": f"bench-floor-{topic}",
            "enable.auto.commit": False,
            "fetch.wait.max.ms": 5,
            "fetch.error.backoff.ms": 5,
            "isolation.level": "read_committed",
        }
    )
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
    reader = _Reader(consumer, result)
    reader.start()
    config = dict(producer_config(kafka, {}))
    config["transactional.id"] = f"bench-floor-{topic}"
    producer = Producer(config)
    try:
        producer.init_transactions(30)
        producer.begin_transaction()
        for i in range(WARMUP_RECORDS):
            producer.produce(topic, b"0", f"w{i}".encode())
        producer.commit_transaction(30)
        _wait_for(result, WARMUP_RECORDS, reader)
        result.latencies_ms.clear()
        opened = 0.0
        window_s = window_ms / 1000.0
        for i in paced(rate_per_s, duration_s, result.pace):
            if not opened:
                producer.begin_transaction()
                opened = time.monotonic()
            producer.produce(topic, repr(time.time()).encode(_ENCODING), f"k{i % 1000}".encode())
            producer.poll(0)
            if time.monotonic() - opened >= window_s:
                producer.commit_transaction(30)
                result.commits += 1
                opened = 0.0
        if opened:
            producer.commit_transaction(30)
            result.commits += 1
        _wait_for(result, result.pace.events, reader)
    finally:
        reader.stop.set()
        reader.join(10)
        consumer.close()
    if reader.error is not None:
        raise reader.error
    return result
