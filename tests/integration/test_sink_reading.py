"""Issue 47 items 1, 2, 7: what the sink reads, against real Kafka, PostgreSQL and the stub.

* a valid JSON payload nested 5,000 levels deep (a ``RecursionError`` for Python's
  ``json``, once a stalled partition) among good records of its partition: parked
  with the depth rule's reason, every good record delivered, the group's commit
  reaches the end; a quiz attempt's numbers beyond a double (``1e400`` too) reach
  the engine as written;
* routed records whose ``id`` is missing, ``evt-1``, a uuid in braces or ``urn:``:
  parked as unroutable, never sent under any key (the scheduler on); an upper-case
  uuid is sent under its canonical text only; a replay to earliest and a restart
  park no second row and deliver nothing a second time.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from confluent_kafka import KafkaException

from cdc.migrate import migrate
from sinks.stub.server import StubServer
from tests.conftest import create_database, drop_database
from tests.harness import (
    ROOT,
    RelayConfig,
    SinkConfig,
    create_topics,
    free_port,
    group_caught_up,
    produce,
    start_sink,
    wait_until,
)
from tests.integration.conftest import API_KEY

pytestmark = pytest.mark.integration

DEPTH = 5_000
CLI = (sys.executable, "-m", "cdc.cli")


def _caught_up(kafka: str, group: str, topics: list[str]) -> bool:
    try:
        return group_caught_up(kafka, group, topics)
    except KafkaException:  # (a coordinator still moving: asked again)
        return False


@pytest.fixture
def own_db_dsn(pg_server: str) -> Iterator[str]:
    """A parking lot of its own: this test counts every row in it."""
    dsn = create_database(pg_server, "cdc_reading")
    migrate(dsn)
    yield dsn
    drop_database(pg_server, dsn)


@pytest.fixture
def topics(own_db_dsn: str, kafka_bootstrap: str, unique: str) -> RelayConfig:
    cfg = RelayConfig(db_dsn=own_db_dsn, kafka=kafka_bootstrap, unique=unique, partitions=1)
    create_topics(
        kafka_bootstrap,
        [cfg.topic_prefix + "user", cfg.topic_prefix + "quiz_attempt"],
        partitions=1,
    )
    return cfg


def _record(
    event_type: str, user: str, payload: bytes, event_id: bytes | None
) -> tuple[bytes, bytes, dict[str, bytes]]:
    headers = {"type": event_type.encode()}
    if event_id is not None:
        headers["id"] = event_id
    return user.encode(), payload, headers


def _rows(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT kafka_offset, event_type, outbox_event_id::text, status, last_error"
            " FROM failed_sync_events ORDER BY kafka_offset"
        ).fetchall()


def test_a_deeply_nested_payload_is_parked_and_its_partition_moves_on(
    topics: RelayConfig, stub: StubServer, tmp_path: Path
) -> None:
    users = [str(uuid.uuid4()) for _ in range(40)]
    topic = topics.topic_prefix + "user"
    good = [_record("UserRegistered", u, json.dumps({"user_id": u}).encode(), None) for u in users]
    good = [(k, v, {**h, "id": str(uuid.uuid4()).encode()}) for k, v, h in good]
    deep_user = str(uuid.uuid4())
    deep = b'{"user_id": "%s", "x": ' % deep_user.encode() + b"[" * DEPTH + b"]" * DEPTH + b"}"
    deep_id = str(uuid.uuid4())
    records = [*good[:20], _record("UserRegistered", deep_user, deep, deep_id.encode()), *good[20:]]
    quiz = topics.topic_prefix + "quiz_attempt"
    numbers = (
        b'{"user_id": "%s", "score": 12345678901234567890.5, "max": 1e400}' % users[0].encode()
    )
    produce(topics.kafka, topic, records)
    attempt_id = str(uuid.uuid4()).encode()
    produce(topics.kafka, quiz, [_record("QuizAttemptSubmitted", users[0], numbers, attempt_id)])
    cfg = SinkConfig(relay=topics, engine_url=stub.url, api_key=API_KEY)
    sink, _port = start_sink(cfg, tmp_path)
    try:
        wait_until(
            lambda: _caught_up(topics.kafka, cfg.group, [topic, quiz]),
            90,
            "the group's commit to reach the end of both topics",
            interval_s=0.5,
        )
        applied = stub.applied(limit=10_000)["items"]
    finally:
        sink.close()
    delivered = {i["event_id"] for i in applied if i["path"].endswith("users/sync")}
    assert {h["id"].decode() for _, _, h in good} <= delivered, "every good record delivered"
    assert deep_id not in {i["event_id"] for i in applied}
    ((offset, sync_type, event_id, status, reason),) = _rows(topics.db_dsn)
    assert (offset, sync_type, event_id, status) == (20, "USER_SYNC", deep_id, "FAILED")
    assert "nested more than 512 levels deep" in reason
    (attempt,) = [i for i in applied if i["path"].endswith("quiz-attempts/sync")]
    assert attempt["body_text"] == numbers.decode(), "the payload's own text, byte for byte"
    log = sink.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "RecursionError" not in log


def _replay_to_earliest(cfg: SinkConfig, topics: list[str]) -> None:
    env = cfg.env(free_port())
    for topic in topics:
        done = subprocess.run(
            [*CLI, "replay", "--group", cfg.group, "--topic", topic, "--to-earliest", "--execute"],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr


def test_no_record_reaches_the_engine_under_a_key_that_is_not_its_own_uuid(
    topics: RelayConfig, stub: StubServer, tmp_path: Path
) -> None:
    user = str(uuid.uuid4())
    event = uuid.uuid4()
    forms = {
        "missing": None,
        "evt-1": b"evt-1",
        "braces": b"{%s}" % str(uuid.uuid4()).encode(),
        "urn": b"urn:uuid:%s" % str(uuid.uuid4()).encode(),
    }
    topic = topics.topic_prefix + "user"
    payload = json.dumps({"user_id": user}).encode()
    records = [_record("UserRegistered", user, payload, raw) for raw in forms.values()]
    records.append(_record("UserRegistered", user, payload, str(event).upper().encode()))
    produce(topics.kafka, topic, records)
    cfg = SinkConfig(
        relay=topics,
        engine_url=stub.url,
        api_key=API_KEY,
        scheduler=True,
        # the scheduler runs every second and takes any row at once (before issue 47 it
        # sent keyless rows under parked-<row id>)
        extra={"OUTBOX_SCHEDULER_INTERVAL_S": "1", "OUTBOX_RETRY_BACKOFF_BASE_S": "0.1"},
    )
    for run in ("first", "after the replay"):
        sink, _port = start_sink(cfg, tmp_path, name=f"sink-{run.split()[0]}")
        try:
            wait_until(
                lambda: _caught_up(topics.kafka, cfg.group, [topic]),
                60,
                f"the group to commit the topic's end ({run})",
                interval_s=0.5,
            )
            wait_until(lambda: stub.stats()["requests"] >= 1, 30, "the keyed record's delivery")
            time.sleep(3)  # three scheduler runs
            assert sink.terminate() == 0  # leaves the group: the replay may run
        finally:
            sink.close()
        if run == "first":
            _replay_to_earliest(cfg, [topic])
    keys = stub.requests()
    assert set(keys) == {str(event)}, f"requests under keys other than the event's own: {keys}"
    assert len(stub.applied()["items"]) == 1, "applied once"
    rows = _rows(topics.db_dsn)
    assert [r[0] for r in rows] == [0, 1, 2, 3], "one row per record, after a replay too"
    assert {r[1] for r in rows} == {"UNROUTABLE"}
    assert {r[2] for r in rows} == {None}


def test_a_record_postgresql_refuses_is_split_out_parked_without_payload_or_skipped(
    topics: RelayConfig, stub: StubServer, tmp_path: Path
) -> None:
    """Issue 47 item 5: PostgreSQL refuses rows for what they carry (a trigger here,
    SQLSTATE 22023): the batch is split down to the culprits - offset 3, refused with
    its payload, is parked without it; offset 7, refused even so, is skipped (ERROR
    line, ``outbox_sink_park_skipped_total``); every other record is parked whole and
    the partition commits its end (the batch was built again forever: a stall)."""
    with psycopg.connect(topics.db_dsn, autocommit=True) as conn:
        conn.execute(
            """CREATE FUNCTION refuse_some() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
              IF NEW.kafka_offset = 7 OR (NEW.kafka_offset = 3 AND NEW.payload_json <> '') THEN
                RAISE EXCEPTION 'refused offset %', NEW.kafka_offset USING ERRCODE = '22023';
              END IF;
              RETURN NEW;
            END $$"""
        )
        conn.execute(
            "CREATE TRIGGER refuse_some BEFORE INSERT ON failed_sync_events"
            " FOR EACH ROW EXECUTE FUNCTION refuse_some()"
        )
    topic = topics.topic_prefix + "user"
    records = [
        _record("OrderPlaced", f"o{n}", b'{"n": %d}' % n, str(uuid.uuid4()).encode())
        for n in range(10)
    ]
    produce(topics.kafka, topic, records)
    cfg = SinkConfig(relay=topics, engine_url=stub.url, api_key=API_KEY)
    sink, port = start_sink(cfg, tmp_path)
    try:
        wait_until(
            lambda: _caught_up(topics.kafka, cfg.group, [topic]),
            60,
            "the partition's commit at its end",
            interval_s=0.5,
        )
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    finally:
        sink.close()
    rows = {r[0]: r for r in _rows(topics.db_dsn)}
    assert sorted(rows) == [0, 1, 2, 3, 4, 5, 6, 8, 9], "all but the record refused whole"
    assert "payload of" in rows[3][4] and "read it from" in rows[3][4]
    with psycopg.connect(topics.db_dsn) as conn:
        payloads = dict(
            conn.execute("SELECT kafka_offset, payload_json FROM failed_sync_events").fetchall()
        )
    assert payloads[3] == "" and payloads[0] == '{"n": 0}'
    assert "outbox_sink_park_skipped_total 1.0" in metrics
    log = sink.log_path.read_text(errors="replace")
    assert f"{topic}[0]@7" in log and "skipped" in log
    assert "Traceback" not in log
