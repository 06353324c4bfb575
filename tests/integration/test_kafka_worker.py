"""The sink's Kafka thread against the real broker: what it hands the loop is bounded.

The loop here is not running while records are fetched (a loop busy with
something else looks the same to the thread): the thread must stop fetching
once HANDOFF_MAX_RECORDS records wait for the loop, and every record must
still reach the loop, in offset order, once it runs.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from cdc.kafkalog import KafkaClientEvents
from sinks.core.delivery import Envelope
from sinks.kafka.worker import CONSUME_BATCH, HANDOFF_MAX_RECORDS, KafkaWorker
from tests.harness import create_topics, produce, wait_until

pytestmark = pytest.mark.integration

RECORDS = 20_000


class Side:
    def __init__(self) -> None:
        self.records: list[Envelope] = []
        self.assigned: list[tuple[str, int]] = []

    def on_records(self, records: list[Envelope]) -> None:
        self.records.extend(records)

    def on_assign(self, partitions: list[tuple[str, int]]) -> None:
        self.assigned.extend(partitions)

    def on_revoke(
        self, partitions: list[tuple[str, int]], *, lost: bool
    ) -> list[tuple[str, int, int]]:
        return []

    def on_commit(self, results: list[tuple[str, int, int, bool]]) -> None:
        pass


def test_a_loop_that_does_not_take_records_stops_the_thread_fetching_and_loses_none(
    kafka_bootstrap: str, unique: str
) -> None:
    topic = f"t{unique}.handoff"
    create_topics(kafka_bootstrap, [topic], partitions=1)
    produce(kafka_bootstrap, topic, ((b"k", str(i).encode(), {}) for i in range(RECORDS)))
    loop = asyncio.new_event_loop()
    side = Side()
    worker = KafkaWorker(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": f"g{unique}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        },
        [topic],
        loop=loop,
        side=side,
        events=KafkaClientEvents("handoff-test"),
    ).start()
    try:
        wait_until(lambda: worker.handoff >= HANDOFF_MAX_RECORDS, 60, "the hand-off filled up")
        filled = worker.handoff
        time.sleep(2.0)  # the thread keeps serving commands, and fetches nothing more
        assert worker.handoff == filled
        assert filled < HANDOFF_MAX_RECORDS + CONSUME_BATCH

        async def drain() -> None:
            while len(side.records) < RECORDS:
                await asyncio.sleep(0.01)

        loop.run_until_complete(asyncio.wait_for(drain(), 60))
        assert [int(r.value or b"") for r in side.records] == list(range(RECORDS))
        loop.run_until_complete(asyncio.wait_for(worker.close([]), 30))
    finally:
        loop.close()
