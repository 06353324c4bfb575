"""The relay partitions keys exactly as Kafka's Java producer does (murmur2).

The reference is Kafka's own Java code, run from the jars the local stack already
resolved (``.dev/kafka/libs``): ``Utils.toPositive(Utils.murmur2(key)) % partitions``
and the producer's ``BuiltInPartitioner.partitionForKey``. The relay then writes
records with those keys through the real broker, and each record must sit on the
partition Java computed for its topic's partition count.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import psycopg
import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from cdc.kafka.producer import PRODUCER_DEFAULTS, producer_config
from cdc.outbox import OutboxEvent, write_event
from tests.conftest import IN_CI
from tests.harness import ROOT, Proc, RelayConfig, drop_slot, headers_of, read_topics, start_relay

pytestmark = pytest.mark.integration

JAVA_SOURCE = ROOT / "tests" / "integration" / "java" / "KafkaPartitionOf.java"
KAFKA_LIBS = ROOT / ".dev" / "kafka" / "libs"

#: Keys the relay accepts (any non-empty text): murmur2 works on 4-byte blocks,
#: so lengths 1..9 exercise every tail; bytes >= 0x80 (non-ASCII UTF-8) are
#: where a port that forgets Java's signed bytes would go wrong.
KEYS: tuple[str, ...] = (
    "a",
    "ab",
    "abc",
    "abcd",
    "abcde",
    "abcdef",
    "abcdefg",
    "abcdefgh",
    "abcdefghi",
    "0",
    "42",
    "user-1",
    "user-2",
    "3f0c9b1e-6a57-4c1d-9a0e-2b7f4e8d1c55",
    "00000000-0000-0000-0000-000000000000",
    "ORDER#2026/11/29",
    "k" * 1000,
    " ",  # whitespace-only keys are non-empty text: the relay sends them as they are
    "  ",
    "\t",
    "\u00a0",  # no-break space (2 UTF-8 bytes)
    "\u200b",  # zero-width space (3 UTF-8 bytes)
    "é",
    "ü",
    "ß",
    "naïve-café",
    "ключ-17",
    "Ωμέγα",
    "日本語のキー",
    "한국어",
    "עברית",
    "🎉",
    "🎉🎉",
    "a🎉b",
    "e\u0301",  # e + combining acute: not normalised, bytes kept
    "\U0010ffff",
    *(f"user-{i:04d}" for i in range(40)),
)


def java_partitions(pairs: Sequence[tuple[int, bytes]]) -> list[int]:
    """Partition per (partition count, key) as Kafka's Java producer computes it."""
    java = shutil.which("java")
    clients = list(KAFKA_LIBS.glob("kafka-clients-*.jar")) if KAFKA_LIBS.is_dir() else []
    if java is None or not clients:
        reason = (
            "java is not on PATH"
            if java is None
            else f"no kafka-clients jar in {KAFKA_LIBS} (`make up` resolves the Kafka jars)"
        )
        if IN_CI:
            pytest.fail(f"murmur2 reference unavailable in CI: {reason}", pytrace=False)
        pytest.skip(f"murmur2 reference unavailable: {reason}")
    lines = "".join(f"{n} {key.hex()}\n" for n, key in pairs)
    run = subprocess.run(
        [java, "-cp", f"{KAFKA_LIBS}/*", str(JAVA_SOURCE)],
        input=lines,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert run.returncode == 0, f"java failed:\n{run.stderr[-3000:]}"
    out: list[int] = []
    for row in run.stdout.split():
        out.append(int(row))
    by_utils, by_producer = out[0::2], out[1::2]
    assert by_utils == by_producer, "Utils.murmur2 formula and the Java producer disagree"
    assert len(by_utils) == len(pairs)
    return by_utils


@pytest.fixture(scope="module")
def reference() -> Callable[[int, bytes], int]:
    """(partitions, key) -> Java's partition, for every key of this module, computed once."""
    counts = (3, 5, 12)
    pairs = [(n, key.encode()) for n in counts for key in KEYS] + [(n, b"") for n in counts]
    table = dict(zip(pairs, java_partitions(pairs), strict=True))
    return lambda n, key: table[(n, key)]


@pytest.fixture
def cfg(db_dsn: str, kafka_bootstrap: str, unique: str) -> Iterator[RelayConfig]:
    config = RelayConfig(db_dsn=db_dsn, kafka=kafka_bootstrap, unique=unique, partitions=3)
    yield config
    drop_slot(db_dsn, config.slot)


def _create_topics(kafka: str, topics: dict[str, int]) -> None:
    admin = AdminClient({"bootstrap.servers": kafka})
    new = [NewTopic(t, num_partitions=n, replication_factor=1) for t, n in topics.items()]
    for future in admin.create_topics(new, request_timeout=30).values():
        future.result(timeout=30)


def test_producer_defaults_to_the_java_partitioner_and_lets_the_setting_override() -> None:
    assert PRODUCER_DEFAULTS["partitioner"] == "murmur2_random"
    assert producer_config("k:9092", {})["partitioner"] == "murmur2_random"
    override = producer_config("k:9092", {"partitioner": "consistent_random"})
    assert override["partitioner"] == "consistent_random"


def test_relay_puts_every_key_on_the_partition_kafkas_java_producer_picks(
    cfg: RelayConfig, tmp_path: Path, reference: Callable[[int, bytes], int]
) -> None:
    """Three topics of 3 (created by the relay), 5 and 12 partitions (created
    beforehand): the relay hashes against each topic's real partition count."""
    counts = {"p3": 3, "p5": 5, "p12": 12}
    _create_topics(cfg.kafka, {cfg.topic_prefix + "p5": 5, cfg.topic_prefix + "p12": 12})
    relay: Proc
    relay, _ = start_relay(cfg, tmp_path)
    try:
        with psycopg.connect(cfg.db_dsn) as conn, conn.transaction():
            for aggregate in counts:
                for key in KEYS:
                    write_event(
                        conn,
                        OutboxEvent(
                            aggregate_type=aggregate,
                            aggregate_id=key,
                            event_type="Placed",
                            payload={"key": key},
                        ),
                    )
        topics = [cfg.topic_prefix + a for a in counts]
        msgs = read_topics(cfg.kafka, topics, expect=len(counts) * len(KEYS))
    finally:
        relay.close()
    assert len(msgs) == len(counts) * len(KEYS)
    wrong = []
    for msg in msgs:
        partitions = counts[headers_of(msg)["aggregatetype"].decode()]
        expected = reference(partitions, msg.key())
        if msg.partition() != expected:
            wrong.append((msg.topic(), msg.key(), msg.partition(), expected))
    assert not wrong, f"records off Java's partition (topic, key, got, java): {wrong[:10]}"
    placed = {(m.topic(), m.key().decode()) for m in msgs}
    assert placed == {(t, k) for t in topics for k in KEYS}, "every key arrived, once per topic"


def test_dead_letters_with_an_empty_key_land_where_java_puts_the_empty_key(
    cfg: RelayConfig, tmp_path: Path, reference: Callable[[int, bytes], int]
) -> None:
    """An event the router refuses (no aggregateid) is dead-lettered with an empty
    key: the empty key is hashed too (murmur2 of zero bytes), never scattered."""
    _create_topics(cfg.kafka, {cfg.dlq_topic: 5})
    relay, _ = start_relay(cfg, tmp_path)
    try:
        with psycopg.connect(cfg.db_dsn) as conn:
            for n in range(4):
                with conn.transaction():
                    conn.execute(
                        "INSERT INTO outbox (aggregatetype, aggregateid, type, payload)"
                        " VALUES ('p3', '', 'NoKey', %s::jsonb)",
                        (f'{{"n": {n}}}',),
                    )
        dead = read_topics(cfg.kafka, [cfg.dlq_topic], expect=4)
    finally:
        relay.close()
    assert len(dead) == 4
    assert all(b"aggregateid" in headers_of(m)["dlq.reason"] for m in dead)
    assert {(m.key() or b"", m.partition()) for m in dead} == {(b"", reference(5, b""))}
