"""The compiled produce call publishes, byte for byte, what Producer.produce publishes.

The same rows - keys, values with any byte, transactions with and without an
``origin`` header, with and without a ``traceparent`` - go to one topic through the
compiled call and to another through ``Producer.produce`` with the relay's Python
header list (:func:`cdc.router.row_headers`), on the relay's own producer settings.
Both topics are read back: every record must match its twin in partition, key,
value, headers (names, values, order) and timestamp.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from cdc.producer import make_producer
from cdc.relay import fast_produce
from cdc.router import TxContext, row_headers
from tests.conftest import IN_CI

pytestmark = pytest.mark.integration

PARTITIONS = 3
ROWS = 600


class Runs(list[tuple[int, bytes]]):
    """A run of records' callback (as cdc.relay.producing.Reports); counts failures."""

    failed = 0

    def __call__(self, err: KafkaError | None, msg: Any) -> None:
        if err is not None:
            self.failed += 1


def _rows() -> list[tuple[bytes, bytes, bytes, bytes, TxContext, bytes | None]]:
    rng = random.Random(25)
    txs = [
        TxContext("0/16B3748", 1_764_000_000_123_456),
        TxContext("0/16B3A00", 1_764_000_001_000_001, ("origin", b"cluster-a\x00\xff")),
    ]
    rows = []
    for i in range(ROWS):
        key = b"agg-%d" % rng.randrange(40)
        value = b'{"n": %d, "raw": "' % i + bytes(rng.randrange(256) for _ in range(i % 50)) + b'"}'
        trace = rng.choice([None, b"", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"])
        rows.append((key, value, b"id-%06d" % i, b"Type\xc3\xa9", txs[i % 2], trace))
    return rows


def _read(kafka: str, topic: str, unique: str, count: int) -> dict[int, list[tuple[Any, ...]]]:
    consumer = Consumer(
        {
            "bootstrap.servers": kafka,
            "group.id": f"g-{topic}-{unique}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    by_partition: dict[int, list[tuple[Any, ...]]] = {}
    try:
        consumer.subscribe([topic])
        seen = 0
        for _ in range(120):
            for msg in consumer.consume(1000, 1.0):
                if msg.error():
                    raise KafkaException(msg.error())
                by_partition.setdefault(msg.partition(), []).append(
                    (msg.key(), msg.value(), msg.headers(), msg.timestamp())
                )
                seen += 1
            if seen >= count:
                break
    finally:
        consumer.close()
    assert sum(map(len, by_partition.values())) == count
    return by_partition


def test_the_compiled_call_publishes_what_producer_produce_publishes(
    kafka_bootstrap: str, unique: str
) -> None:
    compiled_topic, python_topic = f"t.fast.c.{unique}", f"t.fast.py.{unique}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    for future in admin.create_topics(
        [NewTopic(t, num_partitions=PARTITIONS) for t in (compiled_topic, python_topic)]
    ).values():
        future.result(timeout=30)
    producer = make_producer(kafka_bootstrap, {}, failed_reports_only=True)
    fast = fast_produce.bind(producer, "rdkafka")
    if fast is None:
        message = "cdc.relay._produce is not bound: the compiled call was not compared"
        if IN_CI:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    runs = Runs()
    baseline = sys.getrefcount(runs)
    rows = _rows()
    try:
        for key, value, event_id, event_type, tx, trace in rows:
            err = fast(
                producer,
                compiled_topic,
                value,
                key,
                tx.timestamp_ms,
                event_id,
                event_type,
                b"user",
                tx.headers,
                trace,
                runs,
            )
            assert err == 0
            headers = row_headers(event_id, event_type, b"user", tx, trace)
            producer.produce(python_topic, value, key, -1, runs, None, tx.timestamp_ms, headers)  # type: ignore[arg-type]
        assert producer.flush(60) == 0
        assert runs.failed == 0
        assert sys.getrefcount(runs) == baseline  # every record's reference let go
        compiled = _read(kafka_bootstrap, compiled_topic, unique, len(rows))
        python = _read(kafka_bootstrap, python_topic, unique, len(rows))
        assert compiled == python
        # and what was published is the rows themselves, in order within a key
        first = next(iter(compiled.values()))[0]
        key, value, event_id, event_type, tx, trace = next(r for r in rows if r[0] == first[0])
        assert first[:3] == (key, value, row_headers(event_id, event_type, b"user", tx, trace))
        assert first[3][1] == tx.timestamp_ms
    finally:
        admin.delete_topics([compiled_topic, python_topic])
