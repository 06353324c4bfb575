"""The idempotent consumer helper (sinks.idempotent) against real PostgreSQL and Kafka.

Each test consumes into a database of its own (the consumer's database, not the
outbox's) and asserts on what that database and Kafka hold afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from cdc.outbox import OutboxEvent, write_event
from sinks.core.delivery import Envelope
from sinks.idempotent import (
    ConsumerOptions,
    ConsumerUsageError,
    FailurePolicy,
    IdempotentConsumer,
    Outcome,
    Processed,
    prune_ledger,
)
from tests.harness import (
    ROOT,
    RelayConfig,
    drop_slot,
    headers_of,
    read_topics,
    start_relay,
    wait_until,
)
from tests.records import RawProducer, RawRecord

pytestmark = pytest.mark.integration

Conn = psycopg.Connection[Any]


@pytest.fixture
def consumer_dsn(empty_db_dsn: str) -> str:
    """The consuming service's own database, with the table its handler writes."""
    with psycopg.connect(empty_db_dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE handled (event_id text, value text, at timestamptz DEFAULT now())"
        )
    return empty_db_dsn


def _topic(kafka: str, name: str, partitions: int = 1) -> str:
    admin = AdminClient({"bootstrap.servers": kafka})
    for future in admin.create_topics([NewTopic(name, partitions, 1)]).values():
        future.result(timeout=30)
    return name


def _produce(
    kafka: str, topic: str, records: list[tuple[bytes, bytes, list[tuple[str, bytes]]]]
) -> None:
    producer = Producer({"bootstrap.servers": kafka, "partitioner": "murmur2_random"})
    for key, value, headers in records:
        producer.produce(topic, value, key, headers=headers)  # type: ignore[arg-type]
    assert producer.flush(30) == 0


def _relay_record(event_id: str, key: str = "k1", n: int = 0) -> tuple[bytes, bytes, list[Any]]:
    """A record as the relay writes it."""
    headers = [
        ("id", event_id.encode()),
        ("type", b"OrderPlaced"),
        ("aggregatetype", b"order"),
        ("lsn", b"0/1A2B3C4"),
        ("commit_ts", b"2026-11-29T10:00:00.000001Z"),
    ]
    return key.encode(), json.dumps({"n": n}, separators=(",", ":")).encode(), headers


def _drive(
    consumer: IdempotentConsumer, until: Callable[[list[Processed]], bool], timeout_s: float = 60
) -> list[Processed]:
    """Poll until ``until(processed so far)``; the records processed, in order."""
    seen: list[Processed] = []
    deadline = time.monotonic() + timeout_s
    while not until(seen):
        assert time.monotonic() < deadline, f"timed out; got {[p.outcome for p in seen]}"
        done = consumer.poll_once(0.2)
        if done is not None and done.outcome is not Outcome.STALE:
            seen.append(done)
    return seen


def _count(outcome: Outcome, n: int) -> Callable[[list[Processed]], bool]:
    return lambda seen: sum(p.outcome is outcome for p in seen) >= n


def _recording_handler(conn: Conn, record: Envelope) -> None:
    conn.execute(
        "INSERT INTO handled (event_id, value) VALUES (%s, %s)",
        (record.event_id, (record.value or b"").decode()),
    )


@contextmanager
def _consumer(
    dsn: str,
    kafka: str,
    topic: str,
    group: str,
    handler: Callable[[Conn, Envelope], object],
    **opts: Any,
) -> Iterator[IdempotentConsumer]:
    """A consumer named ``billing`` on its own connection; both closed at the end."""
    with (
        psycopg.connect(dsn) as conn,
        IdempotentConsumer(
            conn,
            handler,
            kafka_config={"bootstrap.servers": kafka, "group.id": group},
            topics=[topic],
            options=ConsumerOptions(name="billing", retry_backoff_s=0.2, **opts),
        ) as consumer,
    ):
        yield consumer


def _rows(dsn: str, query: str, *args: object) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(query, args).fetchall()


def _committed(kafka: str, group: str, topic: str, partitions: int = 1) -> list[int]:
    admin = AdminClient({"bootstrap.servers": kafka})
    request = ConsumerGroupTopicPartitions(
        group, [TopicPartition(topic, p) for p in range(partitions)]
    )
    result = admin.list_consumer_group_offsets([request])[group].result(timeout=30)
    return [tp.offset for tp in result.topic_partitions]


@pytest.fixture
def relay_cfg(db_dsn: str, kafka_bootstrap: str, unique: str) -> Iterator[RelayConfig]:
    config = RelayConfig(db_dsn=db_dsn, kafka=kafka_bootstrap, unique=unique)
    yield config
    drop_slot(db_dsn, config.slot)


def test_a_duplicate_delivery_and_an_offset_replay_are_skipped_and_the_handler_writes_once(
    relay_cfg: RelayConfig, consumer_dsn: str, tmp_path: Path
) -> None:
    """Events come from the real relay; one is produced a second time (same id),
    then the group's offsets are replayed from the start."""
    kafka, topic = relay_cfg.kafka, relay_cfg.topic_prefix + "order"
    group = f"g-{relay_cfg.unique}"
    relay, _ = start_relay(relay_cfg, tmp_path)
    try:
        events = [
            OutboxEvent(
                aggregate_type="order",
                aggregate_id=f"o{i}",
                event_type="OrderPlaced",
                payload={"n": i},
            )
            for i in range(5)
        ]
        with psycopg.connect(relay_cfg.db_dsn) as conn, conn.transaction():
            for event in events:
                write_event(conn, event)
        first = read_topics(kafka, [topic], expect=5)
    finally:
        relay.close()
    again = first[0]
    _produce(kafka, topic, [(again.key(), again.value(), list(again.headers()))])
    ids = {str(e.event_id) for e in events}

    with _consumer(consumer_dsn, kafka, topic, group, _recording_handler) as consumer:
        seen = _drive(consumer, lambda s: len(s) == 6)
    assert sorted(p.outcome.value for p in seen) == ["duplicate"] + ["handled"] * 5
    assert {p.event_id for p in seen} == ids

    admin = AdminClient({"bootstrap.servers": kafka})
    meta = admin.list_topics(topic, timeout=15).topics[topic]
    rewind = [TopicPartition(topic, p, 0) for p in meta.partitions]
    admin.alter_consumer_group_offsets([ConsumerGroupTopicPartitions(group, rewind)])[group].result(
        30
    )
    with _consumer(consumer_dsn, kafka, topic, group, _recording_handler) as consumer:
        replayed = _drive(consumer, lambda s: len(s) == 6)
    assert {p.outcome for p in replayed} == {Outcome.DUPLICATE}

    handled = _rows(consumer_dsn, "SELECT event_id, count(*) FROM handled GROUP BY event_id")
    assert dict(handled) == dict.fromkeys(ids, 1), "the handler's writes happened once per event"
    ledger = _rows(
        consumer_dsn,
        "SELECT event_id, outcome FROM processed_events WHERE consumer_name = 'billing'",
    )
    assert dict(ledger) == dict.fromkeys(ids, "handled")


def test_a_handler_exception_rolls_back_its_writes_and_the_ledger_row_and_the_record_comes_again(
    consumer_dsn: str, kafka_bootstrap: str, unique: str
) -> None:
    topic = _topic(kafka_bootstrap, f"idem-fail-{unique}")
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    _produce(kafka_bootstrap, topic, [_relay_record(first, n=1), _relay_record(second, n=2)])
    calls: list[tuple[str, int]] = []
    seen_between: list[tuple[int, int]] = []

    def flaky(conn: Conn, record: Envelope) -> None:
        calls.append((record.event_id, record.offset))
        if len(calls) == 2:  # the retry: what did the failed attempt leave behind?
            seen_between.append(
                (
                    _rows(consumer_dsn, "SELECT count(*) FROM handled WHERE event_id = %s", first)[
                        0
                    ][0],
                    _rows(
                        consumer_dsn,
                        "SELECT count(*) FROM processed_events WHERE event_id = %s",
                        first,
                    )[0][0],
                )
            )
        _recording_handler(conn, record)
        if len(calls) == 1:
            raise RuntimeError("downstream hiccup")

    with _consumer(consumer_dsn, kafka_bootstrap, topic, f"g-{unique}", flaky) as consumer:
        seen = _drive(consumer, _count(Outcome.HANDLED, 2))
    assert [(p.outcome, p.event_id, p.record.offset) for p in seen] == [
        (Outcome.RETRY, first, 0),
        (Outcome.HANDLED, first, 0),
        (Outcome.HANDLED, second, 1),
    ]
    assert seen_between == [(0, 0)], "handler row and ledger row were both rolled back"
    assert calls == [(first, 0), (first, 0), (second, 1)]
    handled = _rows(consumer_dsn, "SELECT event_id FROM handled ORDER BY at")
    assert [r[0] for r in handled] == [first, second]
    assert _committed(kafka_bootstrap, f"g-{unique}", topic) == [2]


def _worker(
    dsn: str, kafka: str, topic: str, group: str, commit_ms: int, log: Path
) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.integration.idempotent_worker",
                dsn,
                kafka,
                topic,
                group,
                "billing",
                str(commit_ms),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "LOG_LEVEL": "WARNING"},
        )


def _lines(log: Path, outcome: str) -> list[str]:
    return [
        line.split()[1] for line in log.read_text().splitlines() if line.startswith(outcome + " ")
    ]


def test_kill_9_between_the_handler_commit_and_the_offset_commit_skips_the_event_on_restart(
    consumer_dsn: str, kafka_bootstrap: str, unique: str, tmp_path: Path
) -> None:
    """The first worker never commits an offset (commit interval of an hour):
    every transaction commits, then the process is killed with SIGKILL."""
    topic = _topic(kafka_bootstrap, f"idem-kill-{unique}", partitions=2)
    group = f"g-{unique}"
    ids = [str(uuid.uuid4()) for _ in range(20)]
    _produce(
        kafka_bootstrap, topic, [_relay_record(i, key=f"k{n % 5}", n=n) for n, i in enumerate(ids)]
    )
    log = tmp_path / "worker.log"
    first = _worker(consumer_dsn, kafka_bootstrap, topic, group, 3_600_000, log)
    try:
        wait_until(lambda: len(_lines(log, "handled")) == 20, 90, "20 events handled")
        assert _rows(consumer_dsn, "SELECT count(*) FROM processed_events")[0][0] == 20
        assert all(o < 0 for o in _committed(kafka_bootstrap, group, topic, 2)), (
            "no offset committed"
        )
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
    second = _worker(consumer_dsn, kafka_bootstrap, topic, group, 200, log)
    try:
        wait_until(lambda: len(_lines(log, "duplicate")) == 20, 120, "20 duplicates skipped")
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0
    finally:
        if second.poll() is None:
            second.kill()
    assert sorted(_lines(log, "duplicate")) == sorted(ids)
    assert len(_lines(log, "handled")) == 20, "nothing was handled twice"
    handled = _rows(consumer_dsn, "SELECT event_id, count(*) FROM handled GROUP BY event_id")
    assert dict(handled) == dict.fromkeys(ids, 1)
    assert sum(_committed(kafka_bootstrap, group, topic, 2)) == 20, "offsets now past every event"


def test_a_debezium_format_record_is_accepted_unchanged_and_dedupes_with_the_relay_format(
    consumer_dsn: str, kafka_bootstrap: str, unique: str
) -> None:
    """Debezium's outbox router writes the payload as stored, the ``id`` header and
    its ``__debezium.context.*`` headers, no ``type``/``lsn``/``commit_ts``."""
    topic = _topic(kafka_bootstrap, f"outbox.event.order-{unique}")
    event_id = str(uuid.uuid4())
    payload = b'{"id": 1, "lineItems": [{"item": "Debezium in Action", "quantity": 2}]}'
    debezium = [
        ("id", event_id.encode()),
        ("__debezium.context.connectorLogicalName", b"dbserver1"),
        ("__debezium.context.taskId", b"0"),
        ("__debezium.context.connectorName", b"outbox-connector"),
    ]
    _produce(kafka_bootstrap, topic, [(b"1", payload, debezium), _relay_record(event_id, key="1")])
    got: list[Envelope] = []

    def handler(conn: Conn, record: Envelope) -> None:
        got.append(record)
        _recording_handler(conn, record)
        assert json.loads(record.value or b"")["lineItems"][0]["quantity"] == 2

    with _consumer(consumer_dsn, kafka_bootstrap, topic, f"g-{unique}", handler) as consumer:
        seen = _drive(consumer, lambda s: len(s) == 2)
    assert [(p.outcome, p.event_id) for p in seen] == [
        (Outcome.HANDLED, event_id),
        (Outcome.DUPLICATE, event_id),
    ]
    assert len(got) == 1
    assert (got[0].key, got[0].value, got[0].event_type) == (b"1", payload, "")
    assert got[0].headers["__debezium.context.taskId"] == b"0"
    assert _rows(consumer_dsn, "SELECT value FROM handled") == [(payload.decode(),)]


def _always_fails(conn: Conn, record: Envelope) -> None:
    _recording_handler(conn, record)
    raise ValueError(f"cannot apply {record.event_id}")


def test_a_record_that_keeps_failing_and_one_without_an_id_are_parked_and_the_partition_moves_on(
    consumer_dsn: str, kafka_bootstrap: str, unique: str
) -> None:
    topic = _topic(kafka_bootstrap, f"idem-park-{unique}")
    poison, fine = str(uuid.uuid4()), str(uuid.uuid4())
    no_id = (b"k1", b"\x00not json", [("type", b"OrderPlaced"), ("blob", b"\xff\x00")])
    _produce(kafka_bootstrap, topic, [_relay_record(poison), no_id, _relay_record(fine)])

    def handler(conn: Conn, record: Envelope) -> None:
        if record.event_id == poison:
            _always_fails(conn, record)
        _recording_handler(conn, record)

    with _consumer(
        consumer_dsn, kafka_bootstrap, topic, f"g-{unique}", handler, max_attempts=3
    ) as c:
        seen = _drive(c, _count(Outcome.HANDLED, 1))
    assert [p.outcome for p in seen] == [
        Outcome.RETRY,
        Outcome.RETRY,
        Outcome.PARKED,
        Outcome.PARKED,
        Outcome.HANDLED,
    ]
    parked = _rows(
        consumer_dsn,
        'SELECT event_id, "offset", attempts, reason, record_key, record_value, header_names,'
        ' header_values FROM idempotent_parked_events ORDER BY "offset"',
    )
    assert [(r[0], r[1], r[2]) for r in parked] == [(poison, 0, 3), (None, 1, 0)]
    assert parked[0][3] == f"ValueError: cannot apply {poison}"
    assert "no id header" in parked[1][3]
    assert (parked[1][4], parked[1][5]) == (b"k1", b"\x00not json"), "bad input kept byte for byte"
    assert (parked[1][6], parked[1][7]) == (["type", "blob"], [b"OrderPlaced", b"\xff\x00"])
    assert _rows(consumer_dsn, "SELECT event_id FROM handled") == [(fine,)], (
        "failed writes rolled back"
    )
    ledger = dict(_rows(consumer_dsn, "SELECT event_id, outcome FROM processed_events"))
    assert ledger == {poison: "parked", fine: "handled"}
    assert _committed(kafka_bootstrap, f"g-{unique}", topic) == [3]


def test_a_record_that_keeps_failing_is_dead_lettered_with_its_headers_and_the_partition_moves_on(
    consumer_dsn: str, kafka_bootstrap: str, unique: str
) -> None:
    topic = _topic(kafka_bootstrap, f"idem-dlq-{unique}")
    dlq = _topic(kafka_bootstrap, f"idem-dlq-{unique}.dlq")
    poison, fine = str(uuid.uuid4()), str(uuid.uuid4())
    _produce(kafka_bootstrap, topic, [_relay_record(poison, n=7), _relay_record(fine)])

    def handler(conn: Conn, record: Envelope) -> None:
        if record.event_id == poison:
            _always_fails(conn, record)
        _recording_handler(conn, record)

    with _consumer(
        consumer_dsn,
        kafka_bootstrap,
        topic,
        f"g-{unique}",
        handler,
        max_attempts=2,
        on_failure=FailurePolicy.DEAD_LETTER,
        dead_letter_topic=dlq,
    ) as consumer:
        seen = _drive(consumer, _count(Outcome.HANDLED, 1))
    assert [p.outcome for p in seen] == [Outcome.RETRY, Outcome.DEAD_LETTERED, Outcome.HANDLED]
    dead = read_topics(kafka_bootstrap, [dlq], expect=1)
    assert len(dead) == 1
    h = headers_of(dead[0])
    assert (dead[0].key(), dead[0].value()) == (b"k1", b'{"n":7}')
    assert (h["id"], h["type"], h["lsn"]) == (poison.encode(), b"OrderPlaced", b"0/1A2B3C4")
    assert h["dlq.reason"] == f"ValueError: cannot apply {poison}".encode()
    assert (h["dlq.original.topic"], h["dlq.original.partition"], h["dlq.original.offset"]) == (
        topic.encode(),
        b"0",
        b"0",
    )
    assert h["dlq.consumer"] == b"billing"
    ledger = dict(_rows(consumer_dsn, "SELECT event_id, outcome FROM processed_events"))
    assert ledger == {poison: "dead_lettered", fine: "handled"}
    assert _rows(consumer_dsn, "SELECT count(*) FROM idempotent_parked_events") == [(0,)]
    assert _committed(kafka_bootstrap, f"g-{unique}", topic) == [2]


def test_prune_ledger_deletes_only_rows_older_than_the_age_and_of_the_named_consumer(
    consumer_dsn: str, kafka_bootstrap: str, unique: str
) -> None:
    topic = _topic(kafka_bootstrap, f"idem-prune-{unique}")
    with _consumer(consumer_dsn, kafka_bootstrap, topic, f"g-{unique}", _recording_handler) as c:
        conn = c.conn
        rows = [
            ("billing", "old-1", "2 days"),
            ("billing", "old-2", "3 days"),
            ("billing", "new-1", "1 minute"),
            ("shipping", "old-3", "2 days"),
        ]
        for name, event_id, age in rows:
            conn.execute(
                "INSERT INTO processed_events (consumer_name, event_id, outcome, topic,"
                ' "partition", "offset", processed_at)'
                " VALUES (%s, %s, 'handled', 't', 0, 0, now() - %s::interval)",
                (name, event_id, age),
            )
        conn.commit()
        assert prune_ledger(conn, older_than_s=86_400, consumer_name="billing", batch_size=1) == 2
        left = _rows(
            consumer_dsn, "SELECT consumer_name, event_id FROM processed_events ORDER BY 2"
        )
        assert left == [("billing", "new-1"), ("shipping", "old-3")]
        assert prune_ledger(conn, older_than_s=86_400) == 1


def test_a_connection_left_inside_a_transaction_is_refused_before_anything_runs(
    consumer_dsn: str, kafka_bootstrap: str, unique: str
) -> None:
    topic = _topic(kafka_bootstrap, f"idem-usage-{unique}")
    _produce(kafka_bootstrap, topic, [_relay_record(str(uuid.uuid4()))])
    with _consumer(consumer_dsn, kafka_bootstrap, topic, f"g-{unique}", _recording_handler) as c:
        c.conn.execute("SELECT 1")  # opens a transaction and leaves it open
        with pytest.raises(ConsumerUsageError, match="idle"):
            _drive(c, lambda s: len(s) == 1)
        c.conn.rollback()
        seen = _drive(c, lambda s: len(s) == 1)
    assert [p.outcome for p in seen] == [Outcome.HANDLED], "the refused record came again"


def test_a_dead_letter_kafka_refuses_spends_no_attempt_and_moves_no_offset(
    consumer_dsn: str, kafka_bootstrap: str, unique: str
) -> None:
    """The dead-letter topic's name is invalid, so Kafka refuses the dead letter:
    the record is neither lost nor marked processed, and it will come again."""
    topic = _topic(kafka_bootstrap, f"idem-dlqfail-{unique}")
    poison = str(uuid.uuid4())
    _produce(kafka_bootstrap, topic, [_relay_record(poison)])
    with _consumer(
        consumer_dsn,
        kafka_bootstrap,
        topic,
        f"g-{unique}",
        _always_fails,
        max_attempts=1,
        on_failure=FailurePolicy.DEAD_LETTER,
        dead_letter_topic="not a valid topic!",
    ) as consumer:
        seen = _drive(consumer, lambda s: len(s) == 1)
        assert [(p.outcome, p.event_id) for p in seen] == [(Outcome.RETRY, poison)]
        assert consumer.stats.dead_lettered == 0
    assert _rows(consumer_dsn, "SELECT count(*) FROM processed_events") == [(0,)]
    assert _rows(consumer_dsn, "SELECT count(*) FROM handled") == [(0,)]
    assert all(o < 0 for o in _committed(kafka_bootstrap, f"g-{unique}", topic)), "offset kept"


#: The pause after the failure in the rebalance test: long enough for a rebalance inside it.
BACKOFF_S = 10.0


class _CountingConsumer(IdempotentConsumer):
    """Counts the assignments it is given (the rebalance really happened to it)."""

    assignments = 0

    def _on_assign(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        self.assignments += 1
        super()._on_assign(consumer, partitions)


def test_a_partition_paused_after_a_failure_resumes_after_its_backoff_across_a_rebalance(
    consumer_dsn: str, kafka_bootstrap: str, unique: str
) -> None:
    """Issue 22 item 2: a rebalance during the pause used to stall the partition for good."""
    topic = _topic(kafka_bootstrap, f"idem-rebalance-{unique}")
    other = _topic(kafka_bootstrap, f"idem-rebalance-other-{unique}")
    ids = [str(uuid.uuid4()) for _ in range(3)]
    _produce(kafka_bootstrap, topic, [_relay_record(e, n=i) for i, e in enumerate(ids)])
    calls: list[str] = []

    def fails_once(conn: Conn, record: Envelope) -> None:
        calls.append(record.event_id)
        if len(calls) == 1:
            raise RuntimeError("downstream hiccup")
        _recording_handler(conn, record)

    group = f"g-{unique}"
    fast = {"heartbeat.interval.ms": 200, "session.timeout.ms": 6000}
    with (
        psycopg.connect(consumer_dsn) as conn,
        _CountingConsumer(
            conn,
            fails_once,
            kafka_config={"bootstrap.servers": kafka_bootstrap, "group.id": group, **fast},
            topics=[topic],
            options=ConsumerOptions(name="billing", retry_backoff_s=BACKOFF_S),
        ) as consumer,
    ):
        seen = _drive(consumer, _count(Outcome.RETRY, 1))
        failed_at = time.monotonic()
        assert consumer.held_partitions == {(topic, 0)}
        before = consumer.assignments
        newcomer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group, **fast})
        try:
            newcomer.subscribe([other])  # joins the group: everyone is revoked and reassigned
            deadline = time.monotonic() + 60
            while consumer.assignments == before or not newcomer.assignment():
                assert time.monotonic() < deadline, "the rebalance did not happen"
                consumer.poll_once(0.1)
                newcomer.poll(0.1)
            assert time.monotonic() - failed_at < BACKOFF_S, "the rebalance came inside the backoff"
            while sum(p.outcome is Outcome.HANDLED for p in seen) < 3:
                assert time.monotonic() < deadline, f"stalled: {[p.outcome for p in seen]}"
                done = consumer.poll_once(0.1)
                newcomer.poll(0)
                if done is not None and done.outcome is not Outcome.STALE:
                    seen.append(done)
        finally:
            newcomer.close()
    assert [p.event_id for p in seen if p.outcome is Outcome.HANDLED] == ids
    assert calls == [ids[0], *ids]
    assert [r[0] for r in _rows(consumer_dsn, "SELECT event_id FROM handled ORDER BY at")] == ids


def test_a_record_whose_header_name_is_not_utf8_is_dead_lettered_with_the_reason_not_a_crash(
    consumer_dsn: str, kafka_bootstrap: str, unique: str
) -> None:
    """Issue 22 item 1: such a record used to raise SystemError in poll_once (a crash loop)."""
    topic = _topic(kafka_bootstrap, f"idem-bytes-{unique}")
    dlq = _topic(kafka_bootstrap, f"idem-bytes-{unique}.dlq")
    fine = str(uuid.uuid4())
    hostile = RawRecord(b"k1", b"\x00raw", ((b"id\xff", b"x"), (b"type", None)))
    key, value, headers = _relay_record(fine)
    good = RawRecord(key, value, tuple((n.encode(), v) for n, v in headers))
    RawProducer(kafka_bootstrap).send(topic, 0, [hostile, hostile, good])
    with _consumer(
        consumer_dsn,
        kafka_bootstrap,
        topic,
        f"g-{unique}",
        _recording_handler,
        on_failure=FailurePolicy.DEAD_LETTER,
        dead_letter_topic=dlq,
    ) as consumer:
        seen = _drive(consumer, _count(Outcome.HANDLED, 1))
    assert [p.outcome for p in seen] == [Outcome.DEAD_LETTERED] * 2 + [Outcome.HANDLED]
    dead = read_topics(kafka_bootstrap, [dlq], expect=2)
    assert [(m.key(), m.value()) for m in dead] == [(b"k1", b"\x00raw")] * 2, "kept byte for byte"
    reason = headers_of(dead[0])["dlq.reason"].decode()
    assert reason == "unreadable_headers: a header name is not UTF-8 (byte 0xff at 2)"
    assert _rows(consumer_dsn, "SELECT event_id FROM handled") == [(fine,)]
    assert _committed(kafka_bootstrap, f"g-{unique}", topic) == [3]
