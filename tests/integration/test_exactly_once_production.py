"""CDC_DELIVERY=exactly-once at production shape, against real PostgreSQL and Kafka.

* a delivery failure inside the machinery: events larger than their topic's
  ``max.message.bytes`` under a steady writer, the relay caught up (its due commits
  flush): the relay stays up (no traceback, no exit), each refused event is
  dead-lettered once, every other event reaches read_committed once, in per-key
  order;
* several relays on one cluster: two sharded exactly-once relays (the documented
  recipe: row-filtered publications with the ``%`` filter, a slot each, one topic
  prefix), one killed -9 eight times while the other commits continuously, and
  foreign transactional producers' transactions left open on the checkpoint topic the
  relays of the prefix shared before and on the killed relay's own: every start
  reads its checkpoint without waiting, and read_committed sees every event once, in
  per-key order;
* the upgrade from the shared checkpoint topic: read there once, then the relay's own;
* a checkpoint and the relay's own records of a history a same-timeline restore lost
  (their rows not in the table, their LSNs reused): nothing skipped;
* a Kafka transaction outliving ``CDC_TX_TIMEOUT_MS`` (the relay SIGSTOPped past it,
  no standby): the transaction coordinator aborts it; the relay resumes - not
  "fenced", no exit - and nothing is lost or published twice;
* ``audit --repair`` of a window many times ``CDC_REPUBLISH_TX_MAX_RECORDS`` deleted from Kafka
  (DeleteRecords), while the relay streams a writer's events into the same
  partitions: the repair commits in bounded transactions - a read_committed consumer
  sees the writer's new events between the repair's first and last records (the
  partitions' last stable offset never held for the whole repair) - and afterwards
  every row is in Kafka once.
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import Producer
from psycopg import sql

from cdc.relay.delivery.checkpoint import TOPIC_CONFIG
from cdc.settings.checkpoint_names import default_checkpoint_topic
from tests.conftest import IN_CI, Services
from tests.harness import RelayConfig, drop_slot, headers_of, start_relay
from tests.integration.test_exactly_once import (
    Writer,
    _create_topic,
    _expected_ids,
    _forge_checkpoint,
    _insert,
    _publish_then_stop,
    _tally,
    read_committed,
)

pytestmark = [pytest.mark.integration, pytest.mark.fault]


@pytest.fixture(autouse=True)
def local_stack(services: Services) -> None:
    if services.origin != "local-stack":
        msg = "these exactly-once tests signal and stop services: they need the local stack"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture
def cfg(db_dsn: str, kafka_bootstrap: str, unique: str) -> Iterator[RelayConfig]:
    config = RelayConfig(
        db_dsn=db_dsn,
        kafka=kafka_bootstrap,
        unique=unique,
        partitions=4,
        extra={"CDC_DELIVERY": "exactly-once"},
    )
    yield config
    drop_slot(db_dsn, config.slot)


#: Events over the topic's max.message.bytes, one every second or so, under the writer.
BIG_EVENTS = 6


def test_a_delivery_failure_during_a_caught_up_commit_aborts_and_dead_letters_the_event(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    """A steady writer (100 events/s, the relay caught up: each due commit waits for
    its acknowledgements in a flush) and, every second, an event the broker refuses
    (over the topic's 20 kB ``max.message.bytes``): its failed delivery report arrives
    inside a commit - often inside the flush - and aborts that Kafka transaction. The
    relay never exits and never prints a traceback; it reads again from the
    checkpoint and dead-letters each refused event once; every other event is in the
    topic once, per key in the order written."""
    aggregate = "refusing"
    topic = cfg.topic_prefix + aggregate
    _create_topic(cfg.kafka, topic, {"max.message.bytes": "20000"})
    # (batch.size below the event: it travels in a batch of its own - a broker refuses
    # a whole batch, and the relay would take its other records for refused too)
    cfg.extra.update({"KAFKA_CONFIG_COMPRESSION_TYPE": "none", "KAFKA_CONFIG_BATCH_SIZE": "16384"})
    relay, _ = start_relay(cfg, tmp_path, name="relay")
    writer = Writer(cfg.db_dsn, aggregate)
    big: list[str] = []
    try:
        writer.start()
        with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
            for i in range(BIG_EVENTS):
                time.sleep(1.0)
                row = conn.execute(
                    "INSERT INTO outbox (aggregatetype, aggregateid, type, payload)"
                    " VALUES (%s, %s, 'Big', jsonb_build_object('blob', (SELECT"
                    " string_agg(md5(g::text), '') FROM generate_series(1, 1000) AS g)))"
                    " RETURNING id::text",
                    (aggregate, f"big{i}"),
                ).fetchone()
                assert row is not None
                big.append(str(row[0]))
                assert relay.alive(), relay.log_tail()
        time.sleep(1.0)
        writer.stop.set()
        writer.join(30)
        assert writer.error is None, writer.error
        expected = _expected_ids(cfg.db_dsn, aggregate) - set(big)
        msgs = read_committed(cfg.kafka, topic, expect=len(expected))
        dead = [
            m
            for m in read_committed(cfg.kafka, cfg.dlq_topic, expect=BIG_EVENTS, idle_s=3.0)
            if headers_of(m)["id"].decode() in big
        ]
        assert relay.alive(), relay.log_tail()
        log = relay.log_path.read_text(errors="replace")
    finally:
        writer.stop.set()
        relay.close()
    assert "Traceback" not in log, log[-4000:]
    assert "aborting the Kafka transaction" in log
    missing, duplicates = _tally(msgs, expected)
    assert (missing, duplicates) == (0, 0)
    assert Counter(headers_of(m)["id"].decode() for m in dead) == Counter(dict.fromkeys(big, 1))
    print(
        f"\n{len(expected)} events once, {BIG_EVENTS} refused events dead-lettered once;"
        f" transactions aborted: {log.count('aborting the Kafka transaction')}"
    )


#: kill -9s of one shard's relay while the other commits (the issue's figure)
SHARD_KILLS = 8
SHARDS = 2


@pytest.fixture
def eos_shards(db_dsn: str, kafka_bootstrap: str, unique: str) -> Iterator[list[RelayConfig]]:
    """The sharding recipe of docs/relay/scaling.md in exactly-once mode: a publication
    per shard whose row filter takes one bucket of ``(hashtext(aggregateid) &
    2147483647) % 2`` (a ``%`` in the filter), a slot each made before any event, one
    topic prefix."""
    configs = []
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        for shard in range(SHARDS):
            pub, slot = f"pub_{unique}_s{shard}", f"slot_{unique}_s{shard}"
            conn.execute(
                sql.SQL(
                    "CREATE PUBLICATION {} FOR TABLE outbox WHERE"
                    " (((hashtext(aggregateid) & 2147483647) % {}) = {})"
                    " WITH (publish = 'insert')"
                ).format(sql.Identifier(pub), sql.Literal(SHARDS), sql.Literal(shard))
            )
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
            configs.append(
                RelayConfig(
                    db_dsn=db_dsn,
                    kafka=kafka_bootstrap,
                    unique=unique,
                    partitions=4,
                    extra={
                        "CDC_DELIVERY": "exactly-once",
                        "CDC_PUBLICATION": pub,
                        "CDC_SLOT": slot,
                        "CDC_PUBLICATION_FILTERED": "true",
                    },
                )
            )
    yield configs
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        for shard_cfg in configs:
            drop_slot(db_dsn, shard_cfg.extra["CDC_SLOT"])
            conn.execute(
                sql.SQL("DROP PUBLICATION {}").format(
                    sql.Identifier(shard_cfg.extra["CDC_PUBLICATION"])
                )
            )


def _foreign_open_transaction(kafka: str, topic: str) -> Producer:
    """A transactional producer of another id with a transaction left open on ``topic``
    (created compacted, one partition, as the relays created it): its last stable
    offset stays there until the producer is aborted (or 15 minutes pass)."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": kafka})
    if topic not in admin.list_topics(timeout=30).topics:
        new = NewTopic(topic, num_partitions=1, replication_factor=-1, config=TOPIC_CONFIG)
        admin.create_topics([new])[topic].result(timeout=30)
    producer = Producer(
        {
            "bootstrap.servers": kafka,
            "transactional.id": f"foreign-{topic}",
            "transaction.timeout.ms": 900_000,
        }
    )
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, b"0/0", b"foreign")
    assert producer.flush(30) == 0
    return producer


def test_sharded_relays_one_killed_9_8_times_while_the_other_commits_every_event_once(
    eos_shards: list[RelayConfig], tmp_path: Path
) -> None:
    """Both shards in exactly-once mode under a writer (100 events/s over keys of both
    shards); a foreign transaction left open on the shared checkpoint topic of before
    and another on shard 0's own (its last stable offset held before every checkpoint
    of shard 0: they are read past it, and count as far as shard 0's committed records
    show them). Shard
    0's relay is killed -9 eight times (every other time during its start-up: fencing,
    the checkpoint read, the first transaction) while shard 1's commits every 20 ms.
    Each start of shard 0 reads its checkpoint (no "not read" failure, none waits for
    shard 1 or the foreign producer) and streams again; read_committed sees every event
    once, per key in the order written."""
    cfg_a, cfg_b = eos_shards
    aggregate = "sharded"
    foreign = [
        _foreign_open_transaction(cfg_a.kafka, topic)
        for topic in (
            default_checkpoint_topic(cfg_a.topic_prefix),  # (the shared one of before)
            default_checkpoint_topic(cfg_a.topic_prefix, cfg_a.extra["CDC_SLOT"]),  # (its own)
        )
    ]
    writer = Writer(cfg_a.db_dsn, aggregate)
    relay_b, _ = start_relay(cfg_b, tmp_path, name="shard1")
    relay_a, _ = start_relay(cfg_a, tmp_path, name="shard0-0")
    logs = [relay_a.log_path]
    rng = random.Random(48)
    try:
        writer.start()
        for i in range(SHARD_KILLS):
            time.sleep(rng.uniform(1.0, 3.0))
            relay_a.kill()
            relay_a.close()
            starting = i % 2 == 0 and i + 1 < SHARD_KILLS
            relay_a, _ = start_relay(
                cfg_a, tmp_path, name=f"shard0-{i + 1}", wait_ready=not starting
            )
            logs.append(relay_a.log_path)
        if not relay_a.alive():
            raise AssertionError(relay_a.log_tail())
        time.sleep(2.0)
        writer.stop.set()
        writer.join(30)
        assert writer.error is None, writer.error
        expected = _expected_ids(cfg_a.db_dsn, aggregate)
        msgs = read_committed(cfg_a.kafka, cfg_a.topic_prefix + aggregate, expect=len(expected))
        assert relay_b.alive(), relay_b.log_tail()
    finally:
        writer.stop.set()
        relay_a.close()
        relay_b.close()
        for producer in foreign:
            producer.abort_transaction(30)
    texts = [p.read_text(errors="replace") for p in logs]
    missing, duplicates = _tally(msgs, expected)
    starts = sum(t.count("WAL transactions below the checkpoint are skipped") for t in texts)
    print(
        f"\n{len(expected)} events, shard 0 killed -9 {SHARD_KILLS} times: {starts} sessions"
        f" read their checkpoint; missing {missing}, duplicates {duplicates}"
    )
    assert not any("not read to" in t for t in texts), "a checkpoint read did not end"
    assert any("records lie past its last stable offset" in t for t in texts[1:])
    assert (missing, duplicates) == (0, 0)
    keys = {m.key() for m in msgs}
    assert len(keys) > 10, keys  # (both shards' keys)


def test_a_relay_upgraded_from_the_shared_checkpoint_topic_reads_it_once(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    """A relay of before wrote its checkpoints to the topic every relay of the prefix
    shared (here: CDC_CHECKPOINT_TOPIC set to that name). The upgraded relay (the
    default: its own topic) finds none in its own topic, reads the shared one once,
    skips what it covers (nothing published twice), and commits to its own; the next
    start reads its own topic only."""
    shared = default_checkpoint_topic(cfg.topic_prefix)
    before = replace(cfg, extra={**cfg.extra, "CDC_CHECKPOINT_TOPIC": shared})
    relay, _ = start_relay(before, tmp_path, name="before")
    try:
        first = _insert(cfg.db_dsn, "upgrade", 30)
        read_committed(cfg.kafka, cfg.topic_prefix + "upgrade", expect=30, idle_s=1.0)
        assert relay.terminate() == 0, relay.log_tail()
    finally:
        relay.close()
    logs = []
    for n in range(2):
        relay, _ = start_relay(cfg, tmp_path, name=f"after-{n}")
        try:
            later = _insert(cfg.db_dsn, "upgrade", 10, start=31 + 10 * n)
            first += later
            msgs = read_committed(cfg.kafka, cfg.topic_prefix + "upgrade", expect=len(first))
            assert relay.terminate() == 0, relay.log_tail()
        finally:
            relay.close()
        logs.append(relay.log_path.read_text(errors="replace"))
    seen = Counter(headers_of(m)["id"].decode() for m in msgs)
    assert set(seen) == set(first) and max(seen.values()) == 1
    assert f"read from {shared}, the topic relays shared before" in logs[0]
    assert "the topic relays shared before" not in logs[1]


def test_a_relay_paused_past_the_transaction_timeout_resumes_nothing_lost_nothing_twice(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    """CDC_TX_TIMEOUT_MS=15000 and transactions held open 4 s (CDC_TX_MAX_MS), so the
    SIGSTOP finds one open; the relay stays stopped 30 s - past the timeout and the
    coordinator's 10 s abort round - with a writer going and no standby. On SIGCONT the
    producer's epoch has moved on: the relay tells the coordinator's timeout from a
    takeover (its own session still holds the slot), says so in one WARNING, takes a
    new producer and goes on - no "fenced", no exit; read_committed sees every event
    once, per key in the order written."""
    cfg.extra.update({"CDC_TX_TIMEOUT_MS": "15000", "CDC_TX_MAX_MS": "4000"})
    aggregate = "paused"
    relay, _ = start_relay(cfg, tmp_path, name="relay")
    writer = Writer(cfg.db_dsn, aggregate, rate=50)
    try:
        writer.start()
        time.sleep(3.0)
        assert relay.proc is not None
        relay.proc.send_signal(signal.SIGSTOP)
        time.sleep(30.0)
        relay.proc.send_signal(signal.SIGCONT)
        time.sleep(10.0)
        writer.stop.set()
        writer.join(30)
        assert writer.error is None, writer.error
        expected = _expected_ids(cfg.db_dsn, aggregate)
        msgs = read_committed(cfg.kafka, cfg.topic_prefix + aggregate, expect=len(expected))
        assert relay.alive(), relay.log_tail()
        log = relay.log_path.read_text(errors="replace")
    finally:
        writer.stop.set()
        relay.close()
    missing, duplicates = _tally(msgs, expected)
    said = [line for line in log.splitlines() if "transaction coordinator" in line]
    print(f"\n{len(expected)} events; missing {missing}, duplicates {duplicates}; {said}")
    # (librdkafka's own lines say "fenced by a newer instance": the relay's verdict is
    # what counts - never its fenced exit)
    assert "publishes nothing more" not in log and "RelayFencedError" not in log, log[-3000:]
    assert len(said) == 1, said
    assert "past CDC_TX_TIMEOUT_MS (15000 ms)" in said[0]
    assert (missing, duplicates) == (0, 0)


#: The repaired window, and the bound of one Kafka transaction of the repair: the
#: window is 40 transactions (the make-test shape of the 10,000,000-row bench).
REPAIR_ROWS = 20_000
REPAIR_TX_RECORDS = 500


def _audit(cfg: RelayConfig, out: Path, *args: str) -> subprocess.Popen[bytes]:
    """``outbox-cdc audit --json`` in a process of its own; its output to ``out``
    (``.json`` and ``.log``: a pipe nobody reads while it runs would block it)."""
    from tests.harness import ROOT, free_port

    with out.with_suffix(".json").open("wb") as stdout, out.with_suffix(".log").open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "cdc.cli", "audit", "--json", *args],
            env=cfg.env(free_port()),
            cwd=ROOT,
            stdout=stdout,
            stderr=log,
        )


@pytest.mark.timeout(900)
def test_a_repair_of_a_large_window_commits_in_bounded_transactions_while_streaming_goes_on(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    """20,000 rows published, then deleted from Kafka (DeleteRecords); a writer goes on
    (50 events/s into the same topic's partitions) while ``audit --repair`` republishes
    the window with CDC_REPUBLISH_TX_MAX_RECORDS=500. A read_committed consumer reading throughout
    sees the writer's new events arrive between the repair's first and last records:
    the repair never holds the partitions' last stable offset for its whole length (in
    one transaction every repaired record would appear at once, and the new events
    behind it). Afterwards each row of the window is in Kafka once, marked, and the
    writer's events once."""
    from datetime import UTC, datetime

    from tests.integration.test_audit import _delete_all_records

    cfg.extra["CDC_REPUBLISH_TX_MAX_RECORDS"] = str(REPAIR_TX_RECORDS)
    aggregate = "repaired"
    topic = cfg.topic_prefix + aggregate
    relay, _ = start_relay(cfg, tmp_path, name="relay")
    writer = Writer(cfg.db_dsn, aggregate, rate=50)
    consumer = None
    try:
        since = datetime.now(UTC).isoformat()
        time.sleep(1.1)
        with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
            for part in range(4):
                conn.execute(
                    "INSERT INTO outbox (aggregatetype, aggregateid, type, payload)"
                    " SELECT %s, 'w' || (g %% 97), 'Bulk', jsonb_build_object('n', g)"
                    " FROM generate_series(%s::int, %s::int) AS g",
                    (aggregate, part * 5_000 + 1, (part + 1) * 5_000),
                )
        window = _expected_ids(cfg.db_dsn, aggregate)
        assert len(window) == REPAIR_ROWS
        read_committed(cfg.kafka, topic, expect=REPAIR_ROWS, idle_s=1.0)
        time.sleep(1.1)
        until = datetime.now(UTC).isoformat()
        _delete_all_records(cfg.kafka, topic)
        consumer = _Tail(cfg.kafka, topic)
        writer.start()
        time.sleep(2.0)
        out = tmp_path / "audit"
        audit = _audit(cfg, out, "--since", since, "--until", until, "--repair")
        try:
            deadline = time.monotonic() + 600
            while audit.poll() is None and time.monotonic() < deadline:
                consumer.read(0.2)
        finally:
            if audit.poll() is None:
                audit.kill()
            audit.wait(30)
        log = out.with_suffix(".log").read_text(errors="replace")
        assert audit.returncode == 1, log[-3000:]
        repaired = json.loads(out.with_suffix(".json").read_text())
        time.sleep(2.0)
        writer.stop.set()
        writer.join(30)
        assert writer.error is None, writer.error
        everything = _expected_ids(cfg.db_dsn, aggregate)
        deadline = time.monotonic() + 120
        while len(consumer.seen) < len(everything) and time.monotonic() < deadline:
            consumer.read(0.5)
        consumer.read(3.0)
    finally:
        writer.stop.set()
        relay.close()
        if consumer is not None:
            consumer.close()
    assert repaired["repaired"] == REPAIR_ROWS, repaired
    seen = Counter(event_id for event_id, _ in consumer.seen)
    assert set(seen) == everything and max(seen.values()) == 1, "every row once"
    order = [recovered for _, recovered in consumer.seen]
    first, last = order.index(True), len(order) - 1 - order[::-1].index(True)
    between = order[first:last].count(False)
    commits = consumer.batches_with_repaired
    print(
        f"\nrepaired {REPAIR_ROWS} rows in transactions of <= {REPAIR_TX_RECORDS}:"
        f" {between} streamed events seen between the first and the last repaired record,"
        f" repaired records seen in {commits} separate reads"
    )
    assert between > 0, "the streamed events waited behind the whole repair"
    assert commits > 1
    said = re.search(r"in (\d+) Kafka transactions of at most (\d+) records", log)
    assert said is not None, log[-3000:]
    transactions, bound = int(said[1]), int(said[2])
    assert bound == REPAIR_TX_RECORDS and transactions >= REPAIR_ROWS // REPAIR_TX_RECORDS


class _Tail:
    """A read_committed consumer from the partitions' current ends: each record's id
    and whether it was republished (``recovered``), in the order it saw them."""

    def __init__(self, kafka: str, topic: str) -> None:
        from confluent_kafka import Consumer, TopicPartition
        from confluent_kafka.admin import AdminClient

        parts = AdminClient({"bootstrap.servers": kafka}).list_topics(topic, timeout=15)
        self.consumer = Consumer(
            {
                "bootstrap.servers": kafka,
                "group.id": f"tail-{topic}",
                "isolation.level": "read_committed",
                "enable.auto.commit": False,
            }
        )
        ends = []
        for p in parts.topics[topic].partitions:
            high = self.consumer.get_watermark_offsets(TopicPartition(topic, p), 10)[1]
            ends.append(TopicPartition(topic, p, high))
        self.consumer.assign(ends)
        self.seen: list[tuple[str, bool]] = []
        self.batches_with_repaired = 0

    def read(self, timeout_s: float) -> None:
        msgs = self.consumer.consume(10_000, timeout_s)
        got = False
        for m in msgs:
            if m.error() is not None:
                continue
            headers = headers_of(m)
            recovered = "recovered" in headers
            got = got or recovered
            self.seen.append((headers["id"].decode(), recovered))
        self.batches_with_repaired += got

    def close(self) -> None:
        self.consumer.close()


def test_a_checkpoint_of_a_history_the_server_lost_counts_for_nothing_past_it(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    """A server rewound on the same timeline (a disk snapshot restored): Kafka still
    holds a checkpoint and the relay's own records of the later history it lost, at
    LSNs the new history reuses. Made here as it looks to the relay: its records with
    its origin and LSNs at the server's current position, whose rows the table does not
    hold, and a checkpoint there. The rows written since (at those LSNs) are not
    skipped: the records count as evidence only where the table holds their rows."""
    cfg.extra["CDC_GAP_MARGIN_S"] = "1"
    published, origin = _publish_then_stop(cfg, tmp_path, "rewound")
    while_down = _insert(cfg.db_dsn, "rewound", 20, start=51)
    with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()
    assert row is not None
    lost = [str(uuid.uuid4()) for _ in range(3)]  # (rows of the lost history)
    producer = Producer({"bootstrap.servers": cfg.kafka})
    for i, event_id in enumerate(lost):
        producer.produce(
            cfg.topic_prefix + "rewound",
            json.dumps({"seq": 1000 + i}).encode(),
            f"k{i}".encode(),
            headers=[("id", event_id.encode()), ("origin", origin), ("lsn", row[0].encode())],
        )
    assert producer.flush(30) == 0
    _forge_checkpoint(cfg, origin, str(row[0]))
    time.sleep(2.5)
    relay, _ = start_relay(cfg, tmp_path, name="second")
    try:
        later = _insert(cfg.db_dsn, "rewound", 10, start=71)
        expected = published + while_down + later
        msgs = read_committed(
            cfg.kafka, cfg.topic_prefix + "rewound", expect=len(expected) + len(lost)
        )
        log = relay.log_path.read_text(errors="replace")
    finally:
        relay.close()
    assert f"checkpoint {row[0]} of {origin.decode()} counts up to" in log, log[-3000:]
    seen = Counter(headers_of(m)["id"].decode() for m in msgs)
    assert set(expected) <= set(seen), f"lost: {sorted(set(expected) - set(seen))}"
    assert max(seen[i] for i in expected) == 1
