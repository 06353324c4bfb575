"""Event types the engine does not need, against real Kafka, PostgreSQL and the stub.

Records are produced straight into the outbox topics in the record contract's
format (the relay's own tests cover the WAL side), so a test can put 50,000
of a type the sink should skip or park in front of the routed ones.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path

import httpx
import psycopg
import pytest

from sinks.stub.server import StubServer
from tests.harness import (
    Proc,
    RelayConfig,
    SinkConfig,
    create_topics,
    group_caught_up,
    produce,
    start_sink,
    wait_until,
)
from tests.integration.conftest import API_KEY
from tests.integration.test_sink import _applied_ids, _scores_by_user, _wait_applied

pytestmark = pytest.mark.integration

PARTITIONS = 4
FLOOD = 50_000


@pytest.fixture
def topics(db_dsn: str, kafka_bootstrap: str, unique: str) -> RelayConfig:
    cfg = RelayConfig(db_dsn=db_dsn, kafka=kafka_bootstrap, unique=unique, partitions=PARTITIONS)
    create_topics(
        kafka_bootstrap,
        [cfg.topic_prefix + "user", cfg.topic_prefix + "quiz_attempt"],
        partitions=PARTITIONS,
    )
    return cfg


def _record(event_type: str, key: str, payload: dict[str, object]) -> tuple[bytes, bytes, dict]:
    event_id = str(uuid.uuid4())
    headers = {"id": event_id.encode(), "type": event_type.encode(), "aggregatetype": b"user"}
    return key.encode(), json.dumps(payload).encode(), headers


def _routed(users: list[str], per_user: int) -> list[tuple[bytes, bytes, dict]]:
    """Each user's registration, then ``per_user`` quiz attempts scored 0, 1, 2, ..."""
    out = [_record("UserRegistered", u, {"user_id": u}) for u in users]
    for score in range(per_user):
        out += [
            _record(
                "QuizAttemptSubmitted",
                u,
                {"attempt_id": str(uuid.uuid4()), "user_id": u, "quiz_id": "q", "score": score},
            )
            for u in users
        ]
    return out


def _ids(records: list[tuple[bytes, bytes, dict]]) -> set[str]:
    return {headers["id"].decode() for _, _, headers in records}


def _metric(port: int, line_start: str) -> float:
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics").text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _parked_count(dsn: str, topic: str, event_type: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM failed_sync_events"
            " WHERE kafka_topic = %s AND kafka_headers->>'type' = %s",
            (topic, event_type),
        ).fetchone()
    assert row is not None
    return int(row[0])


def _sink_cfg(topics: RelayConfig, stub: StubServer, **extra: str) -> SinkConfig:
    return SinkConfig(relay=topics, engine_url=stub.url, api_key=API_KEY, extra=dict(extra))


def test_fifty_thousand_ignored_events_among_routed_ones_are_skipped_counted_and_committed(
    topics: RelayConfig, stub: StubServer, tmp_path: Path
) -> None:
    user_topic = topics.topic_prefix + "user"
    users = [str(uuid.uuid4()) for _ in range(100)]
    routed = _routed(users, per_user=5)
    ignored = [
        _record("UserEmailChanged", users[i % len(users)], {"user_id": users[i % len(users)]})
        for i in range(FLOOD)
    ]
    step = FLOOD // len(routed)
    interleaved = []
    for i, record in enumerate(routed):
        interleaved.append(record)
        interleaved += ignored[i * step : (i + 1) * step]
    interleaved += ignored[len(routed) * step :]
    assert produce(topics.kafka, user_topic, interleaved) == FLOOD + len(routed)
    cfg = _sink_cfg(topics, stub, SINK_IGNORED_TYPES="UserEmailChanged")
    sink, port = start_sink(cfg, tmp_path)
    try:
        _wait_applied(stub, _ids(routed), 240, sink)
        wait_until(
            lambda: group_caught_up(topics.kafka, cfg.group, [user_topic]),
            60,
            "committed offsets at the end of every partition",
        )
        skipped = _metric(port, 'outbox_sink_skipped_total{type="UserEmailChanged"}')
    finally:
        sink.close()
    assert skipped == FLOOD
    assert _parked_count(topics.db_dsn, user_topic, "UserEmailChanged") == 0
    applied = [i for i in stub.applied()["items"] if i["event_id"] in _ids(routed)]
    assert len(applied) == len(routed)
    assert all(seq == list(range(5)) for seq in _scores_by_user(applied).values())
    assert not _ids(ignored) & set(_applied_ids(stub))
    log = sink.log_path.read_text()
    assert log.count("skipping events of type 'UserEmailChanged'") == 1, "logged once per type"


class _Readyz:
    """/readyz sampled in the background: every status seen."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/readyz"
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            try:
                self.statuses.append(httpx.get(self.url, timeout=2).status_code)
            except httpx.HTTPError:
                continue

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join(5)
        return self.statuses


def test_a_flood_of_unknown_events_is_parked_in_batches_without_stalling_routed_ones(
    topics: RelayConfig, stub: StubServer, tmp_path: Path
) -> None:
    user_topic = topics.topic_prefix + "user"
    users = [str(uuid.uuid4()) for _ in range(100)]
    flood = [
        _record("ShinyNewEvent", users[i % len(users)], {"user_id": users[i % len(users)]})
        for i in range(FLOOD)
    ]
    routed = _routed(users, per_user=3)  # behind the flood, on the same partitions
    produce(topics.kafka, user_topic, flood + routed)
    sink, port = start_sink(_sink_cfg(topics, stub), tmp_path)
    ready = _Readyz(port)
    started = time.monotonic()
    try:
        _wait_applied(stub, _ids(routed), 240, sink)
        routed_wait_s = time.monotonic() - started
        wait_until(
            lambda: _parked_count(topics.db_dsn, user_topic, "ShinyNewEvent") == FLOOD,
            240,
            f"{FLOOD} parked",
        )
        parked_s = time.monotonic() - started
        batches = _metric(port, "outbox_sink_park_batch_size_count")
        unrouted = _metric(port, 'outbox_sink_unrouted_total{type="ShinyNewEvent"}')
    finally:
        statuses = ready.stop()
        sink.close()
    print(
        f"\n{FLOOD} unknown events ahead of {len(routed)} routed ones: routed all applied after"
        f" {routed_wait_s:.1f} s, flood parked after {parked_s:.1f} s"
        f" ({FLOOD / parked_s:,.0f}/s) in {batches:.0f} round-trips"
    )
    assert unrouted == FLOOD
    assert batches <= FLOOD / 10, f"{batches} park round-trips for {FLOOD} events: not batched"
    with psycopg.connect(topics.db_dsn) as conn:
        reasons = conn.execute(
            "SELECT DISTINCT event_type, last_error FROM failed_sync_events"
            " WHERE kafka_topic = %s AND kafka_headers->>'type' = 'ShinyNewEvent'",
            (user_topic,),
        ).fetchall()
    assert reasons == [("UNROUTABLE", "no route for event type 'ShinyNewEvent'")]
    assert statuses and set(statuses) == {200}, "readyz stayed ready through the flood"
    scores = _scores_by_user([i for i in stub.applied()["items"] if i["event_id"] in _ids(routed)])
    assert all(seq == list(range(3)) for seq in scores.values())
    parked_lines = [line for line in sink.log_path.read_text().splitlines() if "parked" in line]
    assert len(parked_lines) <= 10, f"{len(parked_lines)} log lines for the flood"


def test_the_scheduler_leaves_unroutable_rows_alone_until_a_route_is_added(
    topics: RelayConfig, stub: StubServer, tmp_path: Path
) -> None:
    user_topic = topics.topic_prefix + "user"
    users = [str(uuid.uuid4()) for _ in range(20)]
    changes = [_record("UserEmailChanged", u, {"user_id": u}) for u in users]
    produce(topics.kafka, user_topic, changes)
    scheduled = {
        "OUTBOX_SCHEDULER_ENABLED": "true",
        "OUTBOX_SCHEDULER_INTERVAL_S": "1",
        "OUTBOX_RETRY_BACKOFF_BASE_S": "0.2",
    }
    cfg = _sink_cfg(topics, stub, **scheduled)
    cfg.scheduler = True
    first: Proc | None = None
    second: Proc | None = None
    try:
        first, _ = start_sink(cfg, tmp_path, name="sink-before")
        wait_until(
            lambda: _parked_count(topics.db_dsn, user_topic, "UserEmailChanged") == len(users),
            60,
            "parked as UNROUTABLE",
        )
        time.sleep(5)  # five scheduler periods, every row long due
        untouched = stub.requests()
        with psycopg.connect(topics.db_dsn) as conn:
            counts = conn.execute(
                "SELECT DISTINCT status, retry_count FROM failed_sync_events"
                " WHERE kafka_topic = %s",
                (user_topic,),
            ).fetchall()
        assert first.terminate() == 0
        routed = _sink_cfg(topics, stub, **scheduled, SINK_ROUTES="UserEmailChanged=USER_SYNC")
        routed.scheduler = True
        second, _ = start_sink(routed, tmp_path, name="sink-with-route")
        _wait_applied(stub, _ids(changes), 60, second)
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.close()
    assert not _ids(changes) & set(untouched), "the scheduler tried rows it could not route"
    assert counts == [("FAILED", 0)]
    with psycopg.connect(topics.db_dsn) as conn:
        done = conn.execute(
            "SELECT DISTINCT status FROM failed_sync_events WHERE kafka_topic = %s", (user_topic,)
        ).fetchall()
    assert done == [("DONE",)]
