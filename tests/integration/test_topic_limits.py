"""A topic whose ``max.message.bytes`` is below the producer's batch size.

Kafka checks a topic's ``max.message.bytes`` against a whole batch, and librdkafka
fails every record of a refused batch (it does not split it). Real Kafka, real
PostgreSQL, the relay as a process:

* the relay says so, once per topic, when it first uses one (a WARNING naming the
  topic, its limit and ``KAFKA_CONFIG_BATCH_SIZE``); a topic at the broker's default
  and a batch size at or under the limit say nothing;
* with ``KAFKA_CONFIG_BATCH_SIZE`` at the limit (what the warning says to do), one row
  over it among twenty small ones of one key, in one transaction, is dead-lettered
  alone and the twenty reach the topic, in both delivery modes. (With the default
  batch size all twenty-one were dead-lettered: the limitation the warning names.)
"""

from __future__ import annotations

import base64
import json
import logging
import random
from pathlib import Path

import psycopg
import pytest

from cdc.kafka.producer import TopicManager
from tests.harness import RelayConfig, read_topics, start_relay
from tests.integration.test_exactly_once import _create_topic

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


@pytest.mark.parametrize("delivery", ["at-least-once", "exactly-once"])
def test_with_the_batch_size_at_the_limit_only_the_record_over_it_is_dead_lettered(
    db_dsn: str, kafka_bootstrap: str, unique: str, tmp_path: Path, delivery: str
) -> None:
    cfg = RelayConfig(
        db_dsn=db_dsn,
        kafka=kafka_bootstrap,
        unique=unique,
        extra={"CDC_DELIVERY": delivery, "KAFKA_CONFIG_BATCH_SIZE": str(LIMIT)},
    )
    topic = cfg.topic_prefix + "limited"
    _create_topic(kafka_bootstrap, topic, {"max.message.bytes": str(LIMIT)})
    relay, _ = start_relay(cfg, tmp_path, name=f"limits-{delivery}")
    big = base64.b64encode(
        random.Random(1).randbytes(3 * LIMIT)
    ).decode()  # (no compression fits it)
    try:
        with psycopg.connect(db_dsn) as conn, conn.transaction():
            for i in range(21):
                payload = json.dumps({"blob": big} if i == 10 else {"i": i})
                conn.execute(
                    "INSERT INTO outbox (aggregatetype, aggregateid, type, payload)"
                    " VALUES ('limited', 'k', 'T', %s)",
                    (payload,),
                )
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
    assert sum(m.topic() == topic for m in msgs) == 20
    letters = [m for m in msgs if m.topic() == cfg.dlq_topic]
    assert len(letters) == 1 and len(letters[0].value()) > LIMIT
    assert WARNED not in log, "the batch size at the limit: nothing to warn"
