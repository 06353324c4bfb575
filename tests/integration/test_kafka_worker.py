"""The sink's Kafka thread against the real broker: what it hands the loop is bounded, and
a partition left stopped while it should fetch is restarted (the wait for records is bounded).

The loop here is not running while records are fetched (a loop busy with
something else looks the same to the thread): the thread must stop fetching
once HANDOFF_MAX_RECORDS records wait for the loop, and every record must
still reach the loop, in offset order, once it runs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import pytest
from confluent_kafka import Producer

from cdc.kafka.log import KafkaClientEvents
from sinks.core.delivery import Envelope
from sinks.kafka.worker import CONSUME_BATCH, HANDOFF_MAX_RECORDS, KafkaWorker, _Resume
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


class LosesResumes(KafkaWorker):
    """A worker whose next resume never reaches librdkafka (its bookkeeping says resumed):
    the partition stays stopped in the client while the sink expects records - the shape
    of a lost resume, whatever loses it."""

    lose = 0

    def _serve(self, consumer: Any, command: Any) -> None:
        if isinstance(command, _Resume) and self.lose > 0:
            self.lose -= 1
            self._paused.difference_update(command.partitions)
            self._watch.resumed(command.partitions, time.monotonic())
            return
        super()._serve(consumer, command)


def test_a_partition_left_stopped_after_a_resume_is_restarted_and_loses_nothing(
    kafka_bootstrap: str, unique: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Edge: a partition that should fetch and does not (a resume lost between the sink
    and the client) while the other partition keeps flowing; and an idle partition is
    never restarted for being idle."""
    topic = f"t{unique}.stall"
    create_topics(kafka_bootstrap, [topic], partitions=2)

    def write(start: int, count: int) -> None:
        producer = Producer({"bootstrap.servers": kafka_bootstrap, "acks": "all"})
        for partition in (0, 1):
            for i in range(start, start + count):
                producer.produce(topic, f"{partition}:{i}".encode(), b"k", partition=partition)
        assert producer.flush(30) == 0

    write(0, 100)
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    side = Side()
    restarts: list[int] = []
    worker = LosesResumes(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": f"g{unique}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        },
        [topic],
        loop=loop,
        side=side,
        events=KafkaClientEvents("stall-test"),
        fetch_restarted=lambda: restarts.append(1),
        stall_after_s=2.0,
    ).start()

    def got(partition: int) -> list[int]:
        values = [(r.value or b"").decode().split(":") for r in list(side.records)]
        return [int(i) for p, i in values if int(p) == partition]

    try:
        wait_until(lambda: len(side.records) >= 200, 60, "the first records")
        worker.pause(((topic, 0),))
        worker.lose = 1
        worker.resume(((topic, 0),))
        wait_until(lambda: worker.lose == 0, 30, "the resume lost")
        with caplog.at_level(logging.WARNING, logger="sinks.kafka_worker"):
            write(100, 100)
            wait_until(lambda: len(got(1)) >= 200, 60, "the other partition flowing")
            wait_until(lambda: len(got(0)) >= 200, 60, "the stopped partition restarted")
        assert got(0) == list(range(200)), "records skipped or read twice on partition 0"
        assert got(1) == list(range(200))
        assert restarts == [1], restarts
        assert any(
            "fetching restarted" in r.getMessage() and f"{topic}[0]" in r.getMessage()
            for r in caplog.records
        ), [r.getMessage() for r in caplog.records]
        time.sleep(3 * 2.0)  # both partitions idle now: checked, never restarted
        assert restarts == [1], restarts
        asyncio.run_coroutine_threadsafe(worker.close([]), loop).result(30)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
        loop.close()
