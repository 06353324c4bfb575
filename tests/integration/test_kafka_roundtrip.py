"""A round trip through the real broker: produce, consume, headers intact."""

from __future__ import annotations

from confluent_kafka import Consumer, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic


def test_produce_and_consume_keep_key_value_headers_and_timestamp(
    kafka_bootstrap: str, unique: str
) -> None:
    topic = f"t.roundtrip.{unique}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    for fut in admin.create_topics([NewTopic(topic, num_partitions=3)]).values():
        fut.result(timeout=30)
    producer = Producer(
        {"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True, "acks": "all"}
    )
    errors: list[object] = []
    producer.produce(
        topic,
        key=b"agg-1",
        value=b'{"a":1}',
        timestamp=1_700_000_000_123,
        headers=[("id", b"e-1"), ("type", b"UserRegistered")],
        on_delivery=lambda err, _msg: errors.append(err) if err else None,
    )
    assert producer.flush(30) == 0
    assert errors == []
    consumer = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": f"g-{unique}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    try:
        consumer.subscribe([topic])
        msg = None
        for _ in range(60):
            msg = consumer.poll(1.0)
            if msg is not None:
                break
        assert msg is not None, "no record consumed within 60 s"
        if msg.error():
            raise KafkaException(msg.error())
        assert msg.key() == b"agg-1"
        assert msg.value() == b'{"a":1}'
        assert msg.headers() == [("id", b"e-1"), ("type", b"UserRegistered")]
        assert msg.timestamp()[1] == 1_700_000_000_123
    finally:
        consumer.close()
        admin.delete_topics([topic])
