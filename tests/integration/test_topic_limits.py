"""A topic whose ``max.message.bytes`` is below the producer's batch size.

Kafka checks a topic's ``max.message.bytes`` against a whole batch, and librdkafka
fails every record of a refused batch (it does not split it). Real Kafka, real
PostgreSQL, the relay as a process:

* the relay says so, once per topic, when it first uses one (a WARNING naming the
  topic, its limit and ``KAFKA_CONFIG_BATCH_SIZE``); a topic at the broker's default
  and a batch size at or under the limit say nothing;
* one row over the limit among twenty small ones of one key, in one transaction: at
  the default batch size (the batch refused whole) the relay ends its session, and
  read again each of the batch's records is produced alone - the twenty reach the
  topic, only the big one is dead-lettered, in both delivery modes (before, all
  twenty-one were dead-lettered); with ``KAFKA_CONFIG_BATCH_SIZE`` at the limit (what
  the warning says to do) no batch is refused whole at all;
* republishing (the audit's repair, the start-up check: :func:`republish`) the same:
  forty rows, one of them over the limit, default batching - the refused batch's
  records made again from their rows and produced alone, only the big one
  dead-lettered, in both modes; gap recovery (the same publisher, the slot's
  snapshot) at-least-once.
"""

from __future__ import annotations

import base64
import json
import logging
import random
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from cdc.kafka.producer import TopicManager
from cdc.relay.gaps import recovery
from cdc.repair import republish
from tests.harness import RelayConfig, drop_slot, read_topics, start_relay
from tests.integration.test_exactly_once import _create_topic
from tests.integration.test_gap_evidence import _first_run, _settings, _topic, _write, gap_config
from tests.integration.test_republish_redo import (
    TOPIC_MAX_BYTES,
    _assert_once_with_a_dead_letter,
    _write_big,
)

pytestmark = pytest.mark.integration

LIMIT = 4096
WARNED = "is below the producer's batch size"


def _manager(kafka: str, overrides: dict[str, str]) -> TopicManager:
    return TopicManager(bootstrap=kafka, overrides=overrides, partitions=1, replication_factor=-1)


def test_a_topic_limit_below_the_batch_size_is_warned_once_when_first_used(
    kafka_bootstrap: str, unique: str, caplog: pytest.LogCaptureFixture
) -> None:
    small, default = f"t{unique}.small", f"t{unique}.default"
    _create_topic(kafka_bootstrap, small, {"max.message.bytes": str(LIMIT)})
    _create_topic(kafka_bootstrap, default, {})
    with caplog.at_level(logging.WARNING, logger="cdc.relay"):
        manager = _manager(kafka_bootstrap, {})
        manager.ensure([small, default])
        manager.ensure([small])  # (known: not read again)
    warned = [r.getMessage() for r in caplog.records if WARNED in r.getMessage()]
    assert len(warned) == 1 and small in warned[0] and "KAFKA_CONFIG_BATCH_SIZE" in warned[0]
    assert f"max.message.bytes {LIMIT} " in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cdc.relay"):
        _manager(kafka_bootstrap, {"batch.size": str(LIMIT)}).ensure([small, default])
    assert not [r for r in caplog.records if WARNED in r.getMessage()]


@pytest.mark.parametrize(
    ("delivery", "batch"),
    [
        ("at-least-once", "default"),
        ("exactly-once", "default"),
        ("exactly-once", "at the limit"),
    ],
)
def test_only_the_record_over_the_limit_is_dead_lettered_its_batch_mates_reach_the_topic(
    db_dsn: str, kafka_bootstrap: str, unique: str, tmp_path: Path, delivery: str, batch: str
) -> None:
    extra = {"CDC_DELIVERY": delivery}
    if batch == "at the limit":
        extra["KAFKA_CONFIG_BATCH_SIZE"] = str(LIMIT)
    cfg = RelayConfig(db_dsn=db_dsn, kafka=kafka_bootstrap, unique=unique, extra=extra)
    topic = cfg.topic_prefix + "limited"
    _create_topic(kafka_bootstrap, topic, {"max.message.bytes": str(LIMIT)})
    relay, _ = start_relay(cfg, tmp_path, name=f"limits-{delivery}")
    big = base64.b64encode(
        random.Random(1).randbytes(3 * LIMIT)
    ).decode()  # (no compression fits it)
    try:
        with psycopg.connect(db_dsn) as conn, conn.transaction():
            ids = [
                str(
                    conn.execute(
                        "INSERT INTO outbox (aggregatetype, aggregateid, type, payload)"
                        " VALUES ('limited', 'k', 'T', %s) RETURNING id",
                        (json.dumps({"blob": big} if i == 10 else {"i": i}),),
                    ).fetchone()[0]  # type: ignore[index]
                )
                for i in range(21)
            ]
        msgs = read_topics(
            kafka_bootstrap,
            [topic, cfg.dlq_topic],
            expect=21,
            idle_s=2,
            committed_only=delivery == "exactly-once",
        )
        log = relay.log_path.read_text()
    finally:
        relay.close()
    delivered = [_id(m) for m in msgs if m.topic() == topic]
    assert set(delivered) == set(ids) - {ids[10]}, "every batch-mate of the big one delivered"
    if delivery == "exactly-once":
        assert len(delivered) == 20, "each once"
    else:  # (at least once; in the order written: one key, one partition)
        assert delivered[:20] == [i for i in ids if i != ids[10]]
    letters = [m for m in msgs if m.topic() == cfg.dlq_topic]
    assert [_id(m) for m in letters] == [ids[10]]
    assert len(letters[0].value()) > LIMIT
    # (a refusal of the big record in a batch of its own reads the same: judged alone too)
    assert "kafka refused a batch of records" in log
    assert (WARNED in log) == (batch == "default"), "the batch size at the limit: no warning"


def _id(msg: Any) -> str:
    return dict(msg.headers())["id"].decode()


@pytest.fixture
def cfg(db_dsn: str, kafka_bootstrap: str, unique: str) -> Iterator[RelayConfig]:
    yield from gap_config(db_dsn, kafka_bootstrap, unique)


@pytest.mark.parametrize("delivery", ["at-least-once", "exactly-once"])
def test_republishing_dead_letters_only_the_record_over_the_limit(
    cfg: RelayConfig,
    db_dsn: str,
    kafka_bootstrap: str,
    delivery: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _create_topic(kafka_bootstrap, _topic(cfg), {"max.message.bytes": str(TOPIC_MAX_BYTES)})
    ids = _write(db_dsn, 20)
    big = _write_big(db_dsn)
    ids += [big, *_write(db_dsn, 19)]
    settings = _settings(cfg, delivery=delivery)
    blob = b"".join(uuid.UUID(i).bytes for i in ids)
    with caplog.at_level(logging.WARNING, logger="cdc.relay"):
        sent = republish.republish(settings, memoryview(blob), origin="test/x", mark="audit-r")
    assert sent == len(ids)
    assert "with their batch" in caplog.text, "a batch was refused whole, then judged alone"
    msgs = read_topics(
        kafka_bootstrap,
        [_topic(cfg), cfg.dlq_topic],
        expect=len(ids),
        idle_s=1,
        committed_only=delivery == "exactly-once",
    )
    if delivery == "exactly-once":
        _assert_once_with_a_dead_letter(cfg, msgs, ids, big)
    else:
        assert {_id(m) for m in msgs if m.topic() == _topic(cfg)} == set(ids) - {big}
        assert [_id(m) for m in msgs if m.topic() == cfg.dlq_topic] == [big]


def test_gap_recovery_dead_letters_only_the_record_over_the_limit(
    cfg: RelayConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _create_topic(cfg.kafka, _topic(cfg), {"max.message.bytes": str(TOPIC_MAX_BYTES)})
    first = _first_run(cfg, tmp_path)
    drop_slot(cfg.db_dsn, cfg.slot)  # (the gap: the slot is gone, rows written after it)
    stranded = _write(cfg.db_dsn, 9)
    big = _write_big(cfg.db_dsn)
    stranded += [big, *_write(cfg.db_dsn, 9)]
    settings = _settings(cfg)
    gap = recovery.open_gap(settings, recovery.inspect(settings))
    with caplog.at_level(logging.WARNING, logger="cdc.relay"):
        recovery.recover(settings, gap)
    assert "with their batch" in caplog.text, "a batch was refused whole, then judged alone"
    # (the window holds rows other tests of the database wrote just before: more
    # records than ours, so a read is done again until each of ours is in - bounded)
    deadline = time.monotonic() + 60
    while True:
        msgs = read_topics(
            cfg.kafka, [_topic(cfg), cfg.dlq_topic], expect=len(first) + len(stranded), idle_s=1
        )
        if {_id(m) for m in msgs} >= set(stranded) or time.monotonic() > deadline:
            break
    assert {_id(m) for m in msgs if m.topic() == _topic(cfg)} >= set(stranded) - {big}
    # (their own big rows are dead-lettered too)
    letters = [_id(m) for m in msgs if m.topic() == cfg.dlq_topic]
    assert [i for i in letters if i in set(stranded)] == [big]
