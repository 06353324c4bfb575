"""A stuck parking lot against the real sink, Kafka, PostgreSQL and the stub (issue 35, item 2).

``LOCK TABLE failed_sync_events IN ACCESS EXCLUSIVE MODE`` is held by another
session while an unroutable record and 100,000 good records arrive on one
partition: the record cannot be parked, so nothing behind it can commit. The
sink must hold a bounded number of records (pause at the core's bound, RSS
flat), say why in ``/readyz``, answer the admin API with 503 (not hang), keep
``/metrics`` and the scheduler alive - and once the lock is gone park the
record, deliver the rest and commit to the end.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest

from cdc.migrate import migrate
from sinks.http.admin import LIST_PATH, RETRY_PATH
from sinks.kafka.worker import CONSUME_BATCH, HANDOFF_MAX_RECORDS
from sinks.runtime.sink import MAX_BUFFERED
from sinks.stub.server import StubServer
from tests.harness import (
    Proc,
    RelayConfig,
    SinkConfig,
    create_topics,
    group_caught_up,
    http_status,
    produce,
    start_sink,
    wait_until,
)
from tests.integration.conftest import API_KEY
from tests.rss import RssSampler

pytestmark = pytest.mark.integration

GOOD = 100_000
#: What the sink may hold at most: its bound, plus what was on its way when it paused
#: (the batch that crossed it, the records handed to the loop, a fetch under way).
HELD_BOUND = MAX_BUFFERED + HANDOFF_MAX_RECORDS + 2 * CONSUME_BATCH
#: How long the test watches the paused sink with the lock held (memory, fetching).
WATCH_S = 8.0
#: RSS the paused sink may gain while watched (allocator noise); fetching on
#: would add the records themselves (~1 KiB each in Python objects).
RSS_GROWTH_BOUND = 8 * 1024 * 1024
#: An admin request must be answered within this (the lot's waits are seconds).
ANSWER_BOUND_S = 30.0


@pytest.fixture
def lot_db(empty_db_dsn: str) -> str:
    """A database of this test's own: its scheduler retries only this test's parked rows
    (in the session's database it found rows earlier modules parked, and delivered one
    of them to this test's engine: 100,001 applied of 100,000)."""
    migrate(empty_db_dsn, demo=True)
    return empty_db_dsn


@contextlib.contextmanager
def _table_locked(dsn: str) -> Iterator[None]:
    with psycopg.connect(dsn) as conn:
        conn.execute("LOCK TABLE failed_sync_events IN ACCESS EXCLUSIVE MODE")
        yield
        conn.rollback()


def _sink_samples(port: int) -> dict[str, float]:
    """Every ``outbox_sink_*`` sample, labelled ones too (a stuck run's evidence)."""
    out = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text.splitlines():
        if line.startswith("outbox_sink_") and "_bucket{" not in line and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _record(event_type: str) -> tuple[bytes, bytes, dict[str, bytes]]:
    user = str(uuid.uuid4())
    headers = {
        "id": str(uuid.uuid4()).encode(),
        "type": event_type.encode(),
        "aggregatetype": b"user",
    }
    return user.encode(), json.dumps({"user_id": user}).encode(), headers


def _gauges(port: int) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text.splitlines():
        if line.startswith("outbox_sink_") and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _readyz(port: int) -> tuple[int, str]:
    response = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=30)
    return response.status_code, response.text


def _parked_rows(dsn: str, topic: str) -> list[tuple[str, str]]:
    with psycopg.connect(dsn) as conn:
        return [
            (str(r[0]), str(r[1]))
            for r in conn.execute(
                "SELECT event_type, last_error FROM failed_sync_events WHERE kafka_topic = %s",
                (topic,),
            )
        ]


def _all_held_delivered(stub: StubServer, port: int) -> bool:
    """True once every record held but the unparked one is delivered; fails at once when
    more records than the bound were delivered (fetched past it while nothing commits)."""
    applied = stub.stats()["applied"]
    assert applied <= HELD_BOUND, f"{applied} records delivered behind the unparked one"
    return bool(applied == _gauges(port)["outbox_sink_held_records"] - 1)


@pytest.mark.timeout(900)  # (100,000 records on a loaded machine; every wait inside is bounded)
def test_a_locked_parking_lot_pauses_at_the_bound_answers_503_and_commits_everything_after(
    lot_db: str, kafka_bootstrap: str, unique: str, stub: StubServer, tmp_path: Path
) -> None:
    db_dsn = lot_db
    topics = RelayConfig(db_dsn=db_dsn, kafka=kafka_bootstrap, unique=unique, partitions=1)
    topic = topics.topic_prefix + "user"
    create_topics(kafka_bootstrap, [topic], partitions=1)
    records = [_record("ShinyNewEvent")] + [_record("UserRegistered") for _ in range(GOOD)]
    assert produce(kafka_bootstrap, topic, records) == GOOD + 1
    cfg = SinkConfig(
        relay=topics,
        engine_url=stub.url,
        api_key=API_KEY,
        scheduler=True,
        extra={"OUTBOX_SCHEDULER_INTERVAL_S": "1"},
    )
    admin = {"Authorization": f"Bearer {cfg.admin_token}"}
    started = time.monotonic()
    with _table_locked(db_dsn):
        sink, port = start_sink(cfg, tmp_path, wait_ready=False)
        try:
            with RssSampler(sink.pid) as rss:
                wait_until(
                    lambda: "parking lot unavailable" in _readyz(port)[1], 60, "/readyz says why"
                )
                status, reason = _readyz(port)
                assert status == 503
                assert "failed_sync_events is locked by another session" in reason
                wait_until(
                    lambda: _gauges(port)["outbox_sink_paused_partitions"] == 1,
                    120,
                    "the partition paused",
                    interval_s=0.5,
                )
                held_at_pause = _gauges(port)["outbox_sink_held_records"]
                assert MAX_BUFFERED < held_at_pause <= HELD_BOUND

                for method, path, body in (("GET", LIST_PATH, None), ("POST", RETRY_PATH, {})):
                    asked = time.monotonic()
                    answer = httpx.request(
                        method,
                        f"http://127.0.0.1:{port}{path}",
                        headers=admin,
                        json={"retry_all": True} if body is not None else None,
                        timeout=ANSWER_BOUND_S,
                    )
                    print(
                        f"\n{method} {path}: {answer.status_code} after"
                        f" {time.monotonic() - asked:.1f} s: {answer.json()['message']}"
                    )
                    assert answer.status_code == 503
                    assert answer.json()["message"].startswith("parking lot unavailable: ")

                # Every record held but the unroutable one is delivered (settled behind it).
                wait_until(
                    lambda: _all_held_delivered(stub, port), 240, "held delivered", interval_s=1.0
                )
                watch_from = rss.now()
                applied_from = stub.stats()["applied"]
                held_from = _gauges(port)["outbox_sink_held_records"]
                time.sleep(WATCH_S)
                gauges = _gauges(port)
                watched_peak = rss.peak_since(time.monotonic() - WATCH_S)
                applied_to = stub.stats()["applied"]
        except BaseException:
            sink.close()
            raise
        locked_s = time.monotonic() - started
    try:
        print(
            f"held {held_at_pause:.0f} at the pause; {applied_from} -> {applied_to} applied and"
            f" RSS {watch_from / 2**20:.1f} -> {watched_peak / 2**20:.1f} MiB while watched;"
            f" lock held {locked_s:.0f} s"
        )
        assert applied_to == applied_from < HELD_BOUND, "records fetched while paused"
        assert gauges["outbox_sink_held_records"] == held_from <= HELD_BOUND
        assert gauges["outbox_sink_paused_partitions"] == 1
        assert gauges["outbox_sink_parking_lot_available"] == 0
        assert watched_peak - watch_from < RSS_GROWTH_BOUND, "memory grows while paused"

        _wait_all_applied_while_progressing(stub, sink, port)
        wait_until(
            lambda: group_caught_up(kafka_bootstrap, cfg.group, [topic]),
            120,
            "commits",
            interval_s=1.0,
        )
        wait_until(lambda: http_status(f"http://127.0.0.1:{port}/readyz") == 200, 60, "ready")
        assert _gauges(port)["outbox_sink_parking_lot_available"] == 1
        listed = httpx.get(f"http://127.0.0.1:{port}{LIST_PATH}", headers=admin, timeout=30)
        assert listed.status_code == 200
    finally:
        sink.close()
    print(f"all committed {time.monotonic() - started:.0f} s after the start")
    assert _parked_rows(db_dsn, topic) == [
        ("UNROUTABLE", "no route for event type 'ShinyNewEvent'")
    ]
    stats = stub.stats()
    assert (stats["applied"], stats["duplicates"]) == (GOOD, 0)
    log = sink.log_path.read_text()
    # (a partition left stopped after the release - seen once in CI, cause unknown - is
    # restarted by the sink's fetch watch: the count is the evidence when it happens)
    print(f"fetch restarts: {log.count('fetching restarted')}")
    assert "scheduler run failed: parking lot unavailable" in log
    assert "parking lot available again" in log


#: After the release, the records are delivered as fast as the machine allows (a loaded
#: one: minutes); the test fails when none is applied for this long - stuck, not slow.
STUCK_AFTER_S = 180.0


def _wait_all_applied_while_progressing(stub: StubServer, sink: Proc, port: int) -> None:
    applied = last = stub.stats()["applied"]
    moved_at = time.monotonic()
    while applied < GOOD:
        time.sleep(1.0)
        applied = stub.stats()["applied"]
        if applied > last:
            last, moved_at = applied, time.monotonic()
        if time.monotonic() - moved_at >= STUCK_AFTER_S:  # what the sink says, to find why
            gauges = {k: v for k, v in _sink_samples(port).items() if v}
            raise AssertionError(
                f"no record applied for {STUCK_AFTER_S:.0f} s after the release: {applied} of"
                f" {GOOD}; stub {stub.stats()}; sink samples {gauges};"
                f" sink log:\n{sink.log_tail(30)}"
            )
    assert applied == GOOD
