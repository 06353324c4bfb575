"""The relay survives its own error paths, against the real PostgreSQL and Kafka.

* a real librdkafka fatal error (``enable.gapless.guarantee`` on, and a record
  the broker refuses for its size - so a dead letter is pending when the
  producer dies): the producer is rebuilt, ``/readyz`` reports it meanwhile,
  and every event arrives;
* the dead-letter topic deleted (broker auto-creation is off in the local
  stack) and then a record to dead-letter: the relay holds, reports, and
  resumes with the record in the topic once it is back;
* dead letters Kafka refuses for their own size are written minimal, no exit;
* 100,000 distinct refused events: the poison ids and the dead-letter metric's
  series stay bounded, and every event is in the dead-letter topic.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from cdc.relay.health.state import POISON_MAX
from cdc.relay.stream.dead_letters import DLQ_MINIMAL_FIELD_BYTES
from cdc.wal.replproto import str_to_lsn
from tests.harness import (
    Proc,
    RelayConfig,
    drop_slot,
    headers_of,
    read_topics,
    slot_confirmed_lsn,
    start_relay,
    wait_for_ready,
    wait_until,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def cfg(db_dsn: str, kafka_bootstrap: str, unique: str) -> Iterator[RelayConfig]:
    config = RelayConfig(db_dsn=db_dsn, kafka=kafka_bootstrap, unique=unique, partitions=3)
    yield config
    drop_slot(db_dsn, config.slot)


def metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def metric(port: int, name: str, labels: str = "") -> float:
    """The value of ``name{labels}`` (0 when absent)."""
    pattern = rf"^{re.escape(name)}{re.escape('{' + labels + '}') if labels else ''} (\S+)$"
    found = re.search(pattern, metrics_text(port), re.M)
    return float(found.group(1)) if found else 0.0


def readyz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


class ReadyzSampler:
    """Records every distinct ``/readyz`` answer while the test runs."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.seen: list[tuple[int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ReadyzSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                answer = readyz(self.port)
            except OSError:
                continue
            if not self.seen or self.seen[-1] != answer:
                self.seen.append(answer)


def create_topic(kafka: str, topic: str, *, partitions: int, config: dict[str, str]) -> None:
    admin = AdminClient({"bootstrap.servers": kafka})
    new = NewTopic(topic, num_partitions=partitions, replication_factor=-1, config=config)
    admin.create_topics([new])[topic].result(timeout=30)


def delete_topic(kafka: str, topic: str) -> None:
    admin = AdminClient({"bootstrap.servers": kafka})
    admin.delete_topics([topic])[topic].result(timeout=30)
    wait_until(
        lambda: topic not in admin.list_topics(timeout=10).topics, 30, f"{topic} to be deleted"
    )


def insert_events(dsn: str, aggregate: str, total: int, *, per_tx: int = 100) -> list[str]:
    """``total`` small events of ``aggregate`` over 50 keys; their ids."""
    ids: list[str] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        for first in range(0, total, per_tx):
            rows = conn.execute(
                "INSERT INTO outbox (aggregatetype, aggregateid, type, payload)"
                " SELECT %s, 'k' || (i %% 50), 'Small', jsonb_build_object('seq', i)"
                " FROM generate_series(%s::int, %s::int) AS i RETURNING id::text",
                (aggregate, first, min(first + per_tx, total) - 1),
            ).fetchall()
            ids += [r[0] for r in rows]
    return ids


def insert_one(dsn: str, aggregatetype: str, aggregateid: str, payload_sql: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "INSERT INTO outbox (aggregatetype, aggregateid, type, payload)"
            f" VALUES (%s, %s, 'Odd', {payload_sql}) RETURNING id::text",
            (aggregatetype, aggregateid),
        ).fetchone()
    assert row is not None
    return str(row[0])


def wal_lsn(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    return str_to_lsn(row[0])


def ids_in(msgs: list) -> set[str]:  # type: ignore[type-arg]
    return {headers_of(m)["id"].decode() for m in msgs}


def json_lines(proc: Proc) -> list[dict[str, object]]:
    out = []
    for line in proc.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def test_a_real_fatal_producer_error_rebuilds_the_producer_and_every_event_arrives(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    """The topic refuses records over 100 kB; with the gap-less guarantee on,
    librdkafka turns the refusal of one 200 kB record into a fatal error (the
    real one, raised from ``poll``). Small batches keep the other records out
    of the refused batch. The same transaction carries a malformed event, whose
    dead letter is pending or in flight when the producer dies. The refused
    record's report is served while the dead producer is discarded; after the
    rebuild the transaction is read again and both go to the dead-letter topic."""
    topic = cfg.topic_prefix + "gap"
    create_topic(cfg.kafka, topic, partitions=3, config={"max.message.bytes": "100000"})
    cfg.extra.update(
        {
            "KAFKA_CONFIG_ENABLE_GAPLESS_GUARANTEE": "true",
            "KAFKA_CONFIG_BATCH_SIZE": "16384",
            "KAFKA_CONFIG_COMPRESSION_TYPE": "none",
            "LOG_FORMAT": "json",
            "CDC_MESSAGES": "on",  # (a logical message that is not JSON)
        }
    )
    relay, port = start_relay(cfg, tmp_path)
    try:
        with ReadyzSampler(port) as sampler:
            before = insert_events(cfg.db_dsn, "gap", 2_000)
            with psycopg.connect(cfg.db_dsn) as conn, conn.transaction():
                row = conn.execute(
                    "INSERT INTO outbox (aggregatetype, aggregateid, type, payload)"
                    " VALUES ('gap', 'k1', 'Big', jsonb_build_object('blob', (SELECT"
                    " string_agg(md5(i::text), '') FROM generate_series(1, 6250) AS i)))"
                    " RETURNING id::text"
                ).fetchone()
                conn.execute("SELECT pg_logical_emit_message(true, 'outbox', 'not json')")
            assert row is not None
            big = str(row[0])
            after = insert_events(cfg.db_dsn, "gap", 2_000)
            wait_until(
                lambda: metric(port, "outbox_relay_producer_rebuilds_total") >= 1,
                120,
                "a producer rebuild",
            )
            # (read until every id is in, bounded: the sessions the refusal ends read
            # records again, and duplicates once made the count before the last events)
            deadline = time.monotonic() + 240
            while True:
                msgs = read_topics(cfg.kafka, [topic], expect=4_000, timeout_s=240)
                if set(before + after) <= ids_in(msgs) or time.monotonic() > deadline:
                    break
            dead = read_topics(cfg.kafka, [cfg.dlq_topic], expect=2, timeout_s=120)
            wait_for_ready(relay, port, timeout_s=60)
        assert relay.alive(), relay.log_tail()
        missing = set(before + after) - ids_in(msgs)
        assert not missing, f"{len(missing)} events never reached Kafka"
        assert big not in ids_in(msgs)
        assert ids_in(dead) == {big, ""}, "both dead-lettered (maybe twice)"
        reasons = {headers_of(m)["id"].decode(): headers_of(m)["dlq.reason"] for m in dead}
        assert b"too large" in reasons[big].lower()
        assert b"not JSON" in reasons[""]
        rebuilding = [body for status, body in sampler.seen if body.startswith("rebuilding")]
        assert rebuilding, sampler.seen
        assert all(status == 503 for status, body in sampler.seen if body.startswith("rebuild"))
        assert "_GAPLESS_GUARANTEE" in rebuilding[0]
        assert metric(port, "outbox_relay_dead_lettered_total", 'reason="too_large"') >= 1
        assert metric(port, "outbox_relay_kafka_errors_total", 'code="_GAPLESS_GUARANTEE"') >= 1
        lines = json_lines(relay)
        assert any(
            line.get("logger") == "cdc.kafka.log"
            and line.get("kafka_error") == "_GAPLESS_GUARANTEE"
            and line.get("fatal") is True
            for line in lines
        ), "the fatal error is logged with its fields"
        assert any(line.get("state") == "rebuilding" for line in lines)
        assert any(str(line.get("logger", "")).startswith("kafka.producer") for line in lines), (
            "librdkafka's own log lines reach the JSON log"
        )
    finally:
        relay.close()


def test_dead_letter_topic_deleted_then_a_record_to_dead_letter_holds_reports_and_resumes(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    """Broker auto-creation is off, so the dead letter cannot be written until
    the topic is back: the relay stays up, stops confirming at the record,
    answers 503 naming the cause, and writes it once the topic exists.
    (topic.metadata.propagation.max.ms=3000 only makes librdkafka report the
    missing topic after 3 s instead of 30 s.)"""
    cfg.extra["KAFKA_CONFIG_TOPIC_METADATA_PROPAGATION_MAX_MS"] = "3000"
    cfg.extra["CDC_MESSAGES"] = "on"  # (the record to dead-letter is a logical message)
    relay, port = start_relay(cfg, tmp_path)
    try:
        first = insert_events(cfg.db_dsn, "held", 10)
        read_topics(cfg.kafka, [cfg.topic_prefix + "held"], expect=10)
        delete_topic(cfg.kafka, cfg.dlq_topic)
        with psycopg.connect(cfg.db_dsn) as conn, conn.transaction():
            conn.execute("SELECT pg_logical_emit_message(true, 'outbox', 'not json at all')")
            # The record's transaction commits after this position: the slot may be
            # confirmed up to its commit, never past it (a keepalive answered while the
            # transaction is open may confirm the WAL already read, the message included:
            # an uncommitted transaction is decoded again from its start after a restart).
            row = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
            assert row is not None
            boundary = str_to_lsn(row[0])
        later = insert_events(cfg.db_dsn, "held", 10)

        def held() -> bool:
            status, body = readyz(port)
            return status == 503 and body.startswith(
                f"held: dead letter to {cfg.dlq_topic} not written"
            )

        wait_until(held, 120, "/readyz to report the held dead letter")
        samples = []
        for _ in range(10):
            samples.append(slot_confirmed_lsn(cfg.db_dsn, cfg.slot))
            time.sleep(0.3)
        assert max(samples) <= boundary, "confirmed past a record not yet dead-lettered"
        assert relay.alive(), relay.log_tail()
        assert metric(port, "outbox_relay_dead_letter_retries_total") >= 1

        create_topic(cfg.kafka, cfg.dlq_topic, partitions=1, config={})
        wait_for_ready(relay, port, timeout_s=120)
        dead = read_topics(cfg.kafka, [cfg.dlq_topic], expect=1)
        assert [m.value() for m in dead] == [b"not json at all"]
        assert b"not JSON" in headers_of(dead[0])["dlq.reason"]
        msgs = read_topics(cfg.kafka, [cfg.topic_prefix + "held"], expect=20)
        assert set(first + later) <= ids_in(msgs)
        end = wal_lsn(cfg.db_dsn)
        wait_until(lambda: slot_confirmed_lsn(cfg.db_dsn, cfg.slot) >= end, 60, "confirmation")
        assert relay.alive()
        assert metric(port, "outbox_relay_dead_lettered_total", 'reason="not_json"') == 1
        assert "dead letters are written again" in relay.log_path.read_text()
    finally:
        relay.close()


def test_dead_letters_kafka_refuses_for_their_size_are_written_minimal_and_the_relay_stays_up(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    """A 1.2 MB key (its record and its full dead letter both over
    message.max.bytes: produce() raises for the dead letter) and a 1.2 MB
    aggregatetype (quoted twice in the reason header). Before, the exception
    from the dead letter's produce() ended the process."""
    relay, port = start_relay(cfg, tmp_path)
    try:
        big_key = insert_one(cfg.db_dsn, "minimal", "k" * 1_200_000, "'{}'::jsonb")
        big_type = insert_one(cfg.db_dsn, "t" * 1_200_000, "k1", "'{}'::jsonb")
        after = insert_events(cfg.db_dsn, "minimal", 10)
        dead = read_topics(cfg.kafka, [cfg.dlq_topic], expect=2)
        msgs = read_topics(cfg.kafka, [cfg.topic_prefix + "minimal"], expect=10)
        assert relay.alive(), relay.log_tail()
        by_id = {headers_of(m)["id"].decode(): m for m in dead}
        assert set(by_id) == {big_key, big_type}
        key_letter = by_id[big_key]
        assert key_letter.key() == b"k" * DLQ_MINIMAL_FIELD_BYTES
        assert json.loads(key_letter.value())["original_key_size"] == 1_200_000
        type_letter = headers_of(by_id[big_type])
        assert type_letter["dlq.reason"].startswith(b"aggregatetype 'ttt")
        assert all(len(v) <= DLQ_MINIMAL_FIELD_BYTES for v in type_letter.values())
        assert ids_in(msgs) == set(after)
        assert metric(port, "outbox_relay_dead_lettered_total", 'reason="too_large"') == 1
        assert metric(port, "outbox_relay_dead_lettered_total", 'reason="invalid_topic"') == 1
    finally:
        relay.close()


def test_distinct_refused_events_beyond_the_bound_keep_poison_ids_and_metric_series_bounded(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    """The topic refuses every record (its timestamps may not lie in the past:
    ``message.timestamp.before.max.ms=0``): more distinct events than the poison ids'
    bound (POISON_MAX plus CDC_MAX_IN_FLIGHT, 2,000 here) are refused by the broker -
    their batches first (each session ends, the next reads them again at once), then
    each alone - remembered and dead-lettered; 1,000 more have distinct
    aggregatetypes that make no topic (distinct reason texts)."""
    topic = cfg.topic_prefix + "refused"
    create_topic(cfg.kafka, topic, partitions=3, config={"message.timestamp.before.max.ms": "0"})
    in_flight = 2_000
    bound = POISON_MAX + in_flight
    cfg.extra.update({"LOG_LEVEL": "ERROR", "CDC_MAX_IN_FLIGHT": str(in_flight)})
    relay, port = start_relay(cfg, tmp_path)
    try:
        refused = insert_events(cfg.db_dsn, "refused", bound + 3_000, per_tx=1_000)
        with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
            rows = conn.execute(
                "INSERT INTO outbox (aggregatetype, aggregateid, type, payload)"
                " SELECT 'no topic ' || i, 'k', 'Odd', '{}'::jsonb"
                " FROM generate_series(1, 1000) AS i RETURNING id::text"
            ).fetchall()
        unroutable = [r[0] for r in rows]
        end = wal_lsn(cfg.db_dsn)
        # (confirmed: every event is in Kafka - a dead letter may be there twice, from
        # sessions that read it again)
        wait_until(lambda: slot_confirmed_lsn(cfg.db_dsn, cfg.slot) >= end, 600, "confirmation")
        dead = read_topics(cfg.kafka, [cfg.dlq_topic], expect=len(refused) + 1_000, idle_s=1)
        accepted = read_topics(cfg.kafka, [topic], expect=0, timeout_s=60, idle_s=1)

        assert relay.alive(), relay.log_tail()
        assert set(refused) | set(unroutable) == ids_in(dead) | ids_in(accepted)
        assert len(ids_in(dead)) == len(refused) + 1_000, "every one refused by the broker"
        assert metric(port, "outbox_relay_poison_ids") == bound
        series = re.findall(
            r'^outbox_relay_dead_lettered_total\{reason="([^"]+)"\}', metrics_text(port), re.M
        )
        assert sorted(series) == ["invalid_record", "invalid_topic"]
        # (each at least once: a session ended by a refused batch reads them again)
        assert metric(port, "outbox_relay_dead_lettered_total", 'reason="invalid_topic"') >= 1_000
    finally:
        relay.close()
