"""Produce keyed records with one partitioner through the relay's producer settings and
wait for every acknowledgement: the command ``farm-bench`` pairs to compare partitioners.

    KAFKA_BOOTSTRAP_SERVERS=... farm-bench -n 10 \\
        --vs '.venv/bin/python -m tests.bench.produce_rate consistent_random 200000' \\
        -- .venv/bin/python -m tests.bench.produce_rate murmur2_random 200000

Keys are uuid strings (what ``aggregateid`` holds in the demo), values ~150 bytes
of JSON, into the 6-partition topic ``bench-partitioner`` (created when missing).
"""

from __future__ import annotations

import os
import sys
import uuid

from confluent_kafka.admin import AdminClient, NewTopic

from cdc.kafka.producer import make_producer

TOPIC = "bench-partitioner"
PARTITIONS = 6


def main(partitioner: str, count: int) -> None:
    bootstrap = os.environ["KAFKA_BOOTSTRAP_SERVERS"]
    admin = AdminClient({"bootstrap.servers": bootstrap})
    if TOPIC not in admin.list_topics(timeout=15).topics:
        for future in admin.create_topics([NewTopic(TOPIC, PARTITIONS, 1)]).values():
            future.result(timeout=30)
    producer = make_producer(bootstrap, {"partitioner": partitioner})
    keys = [str(uuid.uuid4()).encode() for _ in range(1000)]
    value = b'{"user_id":"3f0c9b1e-6a57-4c1d-9a0e-2b7f4e8d1c55","email":"u1@example.org",'
    value += b'"display_name":"User 1","registered_at":"2026-11-29T10:00:00+00:00"}'
    for i in range(count):
        while True:
            try:
                producer.produce(TOPIC, value, keys[i % len(keys)])
                break
            except BufferError:
                producer.poll(0.05)
        if i % 1000 == 0:
            producer.poll(0)
    assert producer.flush(120) == 0


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
