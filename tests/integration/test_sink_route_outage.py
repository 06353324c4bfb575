"""One engine route failing while the other works: judged per route (issue 35).

Real Kafka, real PostgreSQL, the engine stub over real HTTP. Records are produced
straight into the outbox topics in the record contract's format (registrations on
the ``user`` topic, quiz attempts on ``quiz_attempt``, both keyed by user id), as a
mixed stream that goes on through the fault:

* ``quiz-attempts/sync`` down for over a minute - answering 503 without
  ``Retry-After``, 500, a read timeout (answers slower than the client waits),
  or 401 - while ``users/sync`` answers 2xx: nothing parked, no attempt spent,
  every event applied once in per-key order, and every registration of the
  outage applied *during* it (the users route is never held by the quiz route);
* a quiz attempt whose payload makes the quiz route answer 500 every time while
  other attempts succeed: that record is parked after its attempts, with the
  reason; the route keeps delivering around it.

These tests mostly wait (a minute of outage each): they belong to the waiting lane.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from sinks.shared.routes import QUIZ_ATTEMPTS_SYNC_PATH, USERS_SYNC_PATH
from sinks.stub.server import StubServer
from tests.harness import (
    Proc,
    RelayConfig,
    SinkConfig,
    create_topics,
    produce,
    start_sink,
    wait_until,
)
from tests.integration.conftest import API_KEY

pytestmark = [pytest.mark.integration, pytest.mark.fault]

PARTITIONS = 4
#: How long the quiz route stays down ("over a minute").
OUTAGE_S = 65.0
#: One registration and one quiz attempt are produced this often during the outage.
TICK_S = 0.5
#: A user's attempts are produced this long after its registration at the earliest, so
#: the registration is taken in first (the two topics are read independently).
ATTEMPT_AFTER_S = 3.0
#: The engine's read timeout in the timeout case, and how slow the quiz route is then.
READ_TIMEOUT_S = 1.0
SLOW_ROUTE_MS = 2500

Record = tuple[bytes, bytes, dict[str, bytes]]

#: The quiz route's fault, per case: what the stub is told.
FAULTS: dict[str, dict[str, Any]] = {
    "503": {"path": QUIZ_ATTEMPTS_SYNC_PATH, "status": 503, "times": -1},
    "500": {"path": QUIZ_ATTEMPTS_SYNC_PATH, "status": 500, "times": -1},
    "read-timeout": {"path_latency_ms": {QUIZ_ATTEMPTS_SYNC_PATH: SLOW_ROUTE_MS}},
    "401": {"path": QUIZ_ATTEMPTS_SYNC_PATH, "status": 401, "times": -1},
}


@dataclass
class Stream:
    """The events produced, in order, and the users they are about."""

    relay: RelayConfig
    registered_at: dict[str, float] = field(default_factory=dict)  # user -> when produced
    scores: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # next score
    registrations: dict[str, str] = field(default_factory=dict)  # event id -> user
    attempts: dict[str, tuple[str, int]] = field(default_factory=dict)  # event id -> score

    @property
    def user_topic(self) -> str:
        return self.relay.topic_prefix + "user"

    @property
    def quiz_topic(self) -> str:
        return self.relay.topic_prefix + "quiz_attempt"

    def register(self, n: int) -> set[str]:
        records, ids = [], set()
        for _ in range(n):
            user = str(uuid.uuid4())
            event_id = str(uuid.uuid4())
            payload = {"user_id": user, "email": f"{user}@r.example", "display_name": "R"}
            records.append(_record(user, event_id, "UserRegistered", "user", payload))
            self.registrations[event_id] = user
            self.registered_at[user] = time.monotonic()
            ids.add(event_id)
        produce(self.relay.kafka, self.user_topic, records)
        return ids

    def attempt(self, users: list[str], event_id: str = "") -> set[str]:
        """One attempt of each user (``event_id``: the id of a single one)."""
        records, ids = [], set()
        for user in users:
            score = self.scores[user]
            self.scores[user] += 1
            event_id = event_id or str(uuid.uuid4())
            payload = {
                "attempt_id": str(uuid.uuid4()),
                "user_id": user,
                "quiz_id": "q1",
                "score": score,
                "submitted_at": datetime.now(UTC).isoformat(),
            }
            records.append(_record(user, event_id, "QuizAttemptSubmitted", "quiz_attempt", payload))
            self.attempts[event_id] = (user, score)
            ids.add(event_id)
            event_id = ""
        produce(self.relay.kafka, self.quiz_topic, records)
        return ids

    def settled_users(self, applied: set[str]) -> list[str]:
        """Users whose registration was applied (``applied``: users), or produced long
        enough ago to be taken in before any attempt of theirs."""
        now = time.monotonic()
        return [
            u for u, at in self.registered_at.items() if u in applied or now - at >= ATTEMPT_AFTER_S
        ]

    @property
    def ids(self) -> set[str]:
        return set(self.registrations) | set(self.attempts)


def _record(user: str, event_id: str, event_type: str, aggregate: str, payload: object) -> Record:
    headers = {
        "id": event_id.encode(),
        "type": event_type.encode(),
        "aggregatetype": aggregate.encode(),
    }
    return user.encode(), json.dumps(payload).encode(), headers


@pytest.fixture
def stream(db_dsn: str, kafka_bootstrap: str, unique: str) -> Iterator[Stream]:
    relay = RelayConfig(db_dsn=db_dsn, kafka=kafka_bootstrap, unique=unique, partitions=PARTITIONS)
    names = [relay.topic_prefix + "user", relay.topic_prefix + "quiz_attempt"]
    create_topics(kafka_bootstrap, names, partitions=PARTITIONS)
    yield Stream(relay)


def _metrics(port: int) -> dict[str, float]:
    """``name{labels}`` -> value of the sink's samples (a busy sink is given a few tries)."""
    for attempt in range(5):
        try:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            break
        except httpx.HTTPError:
            if attempt == 4:
                raise
    samples = {}
    for line in text.splitlines():
        if line.startswith("outbox_sink_"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def _route(name: str, route: str) -> str:
    return f'{name}{{route="{route}"}}'


def _parked(dsn: str, prefix: str) -> list[tuple[str, str, int]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT outbox_event_id::text, last_error, retry_count FROM failed_sync_events"
            " WHERE kafka_topic LIKE %s",
            (prefix + "%",),
        ).fetchall()
    return [(r[0], r[1], r[2]) for r in rows]


def _applied(stub: StubServer) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = stub.applied(limit=100_000)["items"]
    return items


def _wait_applied(stub: StubServer, ids: set[str], timeout_s: float, sink: Proc) -> None:
    def done() -> bool:
        assert sink.alive(), sink.log_tail()
        return ids <= {i["event_id"] for i in _applied(stub)}

    try:
        wait_until(done, timeout_s, f"{len(ids)} events applied", interval_s=0.5)
    except AssertionError as exc:
        missing = len(ids - {i["event_id"] for i in _applied(stub)})
        raise AssertionError(f"{exc}; {missing} missing\n{sink.log_tail(30)}") from None


def _assert_applied_once_in_per_key_order(stream: Stream, applied: list[dict[str, Any]]) -> None:
    ours = [i for i in applied if i["event_id"] in stream.ids]
    assert len(ours) == len(stream.ids), "each event applied exactly once"
    first_attempt: dict[str, int] = {}
    scores: dict[str, list[int]] = defaultdict(list)
    registered: dict[str, int] = {}
    for item in ours:
        if item["event_id"] in stream.attempts:
            user, score = stream.attempts[item["event_id"]]
            scores[user].append(score)
            first_attempt.setdefault(user, item["seq"])
        else:
            registered[stream.registrations[item["event_id"]]] = item["seq"]
    for user, seq in scores.items():
        assert seq == sorted(set(seq)), f"{user}: attempts out of order {seq}"
        assert registered[user] < first_attempt[user], f"{user}: an attempt before its user"


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_the_quiz_route_down_for_a_minute_holds_only_its_own_records(
    fault: str, stream: Stream, stub: StubServer, tmp_path: Path
) -> None:
    extra = {"ENGINE_READ_TIMEOUT_S": str(READ_TIMEOUT_S)} if fault == "read-timeout" else {}
    cfg = SinkConfig(relay=stream.relay, engine_url=stub.url, api_key=API_KEY, extra=extra)
    sink, port = start_sink(cfg, tmp_path)
    rng = random.Random(35)
    try:
        warm = stream.register(10)
        _wait_applied(stub, warm, 60, sink)
        warm_users = {stream.registrations[i] for i in warm}
        for _ in range(2):
            _wait_applied(stub, stream.attempt(list(stream.registered_at)), 60, sink)

        stub.add_faults(FAULTS[fault])
        down_at = time.monotonic()
        during: set[str] = set()
        samples: list[dict[str, float]] = []
        while time.monotonic() - down_at < OUTAGE_S:
            during |= stream.register(1)
            stream.attempt([rng.choice(stream.settled_users(warm_users))])
            if len(samples) < int((time.monotonic() - down_at) / 10):
                samples.append(_metrics(port))  # every ~10 s: how each route stands
            time.sleep(TICK_S)
        _wait_applied(stub, during, 60, sink)  # still down: the users route delivered them
        outage = _metrics(port)
        stub.clear_faults()
        up_at = time.time()

        _wait_applied(stub, stream.ids, 180, sink)
        after = _metrics(port)
    finally:
        sink.close()
    applied = _applied(stub)
    late = [i for i in applied if i["event_id"] in during and i["applied_at"] >= up_at]
    assert late == [], f"{len(late)} registrations of the outage waited for the quiz route"
    assert _parked(stream.relay.db_dsn, stream.relay.topic_prefix) == []
    assert after.get('outbox_sink_retried_total{kind="record"}', 0.0) == 0, "attempts spent"
    assert outage[_route("outbox_sink_route_circuit_open", QUIZ_ATTEMPTS_SYNC_PATH)] == 1
    assert all(
        s.get(_route("outbox_sink_route_circuit_open", USERS_SYNC_PATH), 0.0) == 0
        for s in [*samples, outage]
    ), "the users route's circuit opened"
    assert outage[_route("outbox_sink_route_trouble_total", QUIZ_ATTEMPTS_SYNC_PATH)] > 0
    assert outage.get(_route("outbox_sink_route_trouble_total", USERS_SYNC_PATH), 0.0) == 0
    assert after[_route("outbox_sink_route_circuit_open", QUIZ_ATTEMPTS_SYNC_PATH)] == 0
    _assert_applied_once_in_per_key_order(stream, applied)


def test_a_payload_that_crashes_its_route_is_parked_and_the_route_keeps_delivering(
    stream: Stream, stub: StubServer, tmp_path: Path
) -> None:
    cfg = SinkConfig(relay=stream.relay, engine_url=stub.url, api_key=API_KEY)
    sink, port = start_sink(cfg, tmp_path)
    rng = random.Random(500)
    try:
        users = stream.register(20)
        _wait_applied(stub, users, 60, sink)
        victim = next(iter(stream.registered_at))
        poison_id = str(uuid.uuid4())
        stub.add_faults({"event_id": poison_id, "status": 500, "times": -1})
        poison = stream.attempt([victim], event_id=poison_id)
        others = set()
        started = time.monotonic()
        while time.monotonic() - started < 20:  # other attempts flow around it
            others |= stream.attempt(rng.sample(list(stream.registered_at), 4))
            time.sleep(0.2)
        wait_until(
            lambda: _parked(stream.relay.db_dsn, stream.relay.topic_prefix),
            120,
            "the crashing payload parked",
        )
        _wait_applied(stub, stream.ids - poison, 120, sink)
        spent = _metrics(port).get('outbox_sink_retried_total{kind="record"}', 0.0)
    finally:
        sink.close()
    parked = _parked(stream.relay.db_dsn, stream.relay.topic_prefix)
    assert [p[0] for p in parked] == [poison_id], parked
    assert "HTTP 500" in parked[0][1] and "(after 3 attempts)" in parked[0][1], parked[0][1]
    assert spent == 3, f"{spent} attempts spent: only the crashing payload's 3"
    applied = _applied(stub)
    assert poison_id not in {i["event_id"] for i in applied}
    with psycopg.connect(stream.relay.db_dsn) as conn:
        row = conn.execute(
            "SELECT extract(epoch FROM created_at) FROM failed_sync_events"
            " WHERE outbox_event_id = %s",
            (poison_id,),
        ).fetchone()
    assert row is not None
    around = [i for i in applied if i["event_id"] in others and i["applied_at"] < float(row[0])]
    assert len(around) >= 10, f"only {len(around)} attempts applied while it failed"
    stream.attempts.pop(poison_id)
    _assert_applied_once_in_per_key_order(stream, applied)
