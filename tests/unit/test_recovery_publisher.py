"""The gap recovery's publisher (cdc.relay.republish.Publisher) against a producer
that reports like confluent-kafka with ``delivery.report.only.error``: a delivered
record calls nothing, a refused one calls its callback; reports carry no headers.

A record the broker refuses when it reports (not when ``produce`` is called) is
dead-lettered with its event id, found by its key and value among the records its
callback counted (the report has no headers), even among records alike in key."""

from __future__ import annotations

import dataclasses
from typing import Any

from confluent_kafka import KafkaError

from cdc import constants as c
from cdc.relay.republish import Acks, Publisher
from cdc.router import KafkaRecord
from cdc.settings import Settings
from tests.unit.test_relay_routing import FakeTopics

DLQ = "outbox.dlq"


class Report:
    """A delivery report's message: no headers (as librdkafka's)."""

    def __init__(self, topic: str, key: bytes, value: bytes, timestamp: int) -> None:
        self._topic, self._key, self._value, self._ts = topic, key, value, timestamp

    def topic(self) -> str:
        return self._topic

    def key(self) -> bytes:
        return self._key

    def value(self) -> bytes:
        return self._value

    def headers(self) -> None:
        return None

    def timestamp(self) -> tuple[int, int]:
        return (1, self._ts)


class ReportingProducer:
    """Refuses the records whose key is in ``refuse`` when it reports them."""

    def __init__(self, refuse: set[bytes]) -> None:
        self.refuse = refuse
        self.produced: list[tuple[str, bytes, list[tuple[str, bytes]]]] = []
        self.pending: list[tuple[Any, Report]] = []

    def produce(
        self,
        topic: str,
        value: bytes,
        key: bytes,
        partition: int,
        callback: Any,
        on_delivery: Any,
        timestamp: int,
        headers: list[tuple[str, bytes]],
    ) -> None:
        self.produced.append((topic, key, list(headers)))
        self.pending.append((callback, Report(topic, key, value, timestamp)))

    def poll(self, timeout: float = 0) -> int:
        pending, self.pending = self.pending, []
        for callback, report in pending:
            if report.key() in self.refuse and report.topic() != DLQ:
                callback(KafkaError(KafkaError.INVALID_TIMESTAMP), report)
        return len(pending)

    def flush(self, timeout: float = 0) -> int:
        self.poll()
        return len(self.pending)

    def __len__(self) -> int:
        return len(self.pending)


def _record(n: int) -> KafkaRecord:
    event_id = f"{n:08d}-5d1c-4f7e-9a53-0e6f3c1d2a10"
    headers = [(c.HEADER_ID, event_id.encode()), (c.HEADER_TYPE, b"T"), ("recovered", b"7")]
    return KafkaRecord("outbox.event.user", b"k%d" % n, b'{"n": %d}' % n, headers, 1_000, event_id)


def test_a_record_refused_in_its_report_is_dead_lettered_with_its_event_id() -> None:
    producer = ReportingProducer(refuse={b"k1"})
    topics = FakeTopics()
    settings = Settings(pg_dsn="postgresql://x", kafka_bootstrap_servers="x:1", dlq_topic=DLQ)
    publisher = Publisher(settings, producer, topics, Acks())  # type: ignore[arg-type]
    records = [_record(n) for n in range(3)]
    alike = dataclasses.replace(
        records[1], event_id="00000009-5d1c-4f7e-9a53-0e6f3c1d2a10", value=b"{}"
    )
    for record in [*records, alike]:  # (the last: same key as a refused one, another value)
        publisher.send(record)

    publisher.wait_acked()

    dead = [(key, dict(headers)) for topic, key, headers in producer.produced if topic == DLQ]
    assert [(key, h[c.HEADER_ID]) for key, h in dead] == [
        (b"k1", records[1].event_id.encode()),
        (b"k1", alike.event_id.encode()),
    ]
    assert all(h[c.HEADER_DLQ_REASON].startswith(b"Kafka refused the record") for _, h in dead)
    assert publisher.sent == 4, "each refused record is replaced by its dead letter"
    assert not producer.pending
