"""The sink against real Kafka, PostgreSQL and the engine stub over HTTP.

Events enter through the real relay (outbox -> WAL -> Kafka), so each test
exercises the whole pipeline; assertions are on what the stub applied and on
what the parking lot holds.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

import httpx
import psycopg
import pytest

from cdc.outbox import OutboxEvent, register_user, write_event
from sinks.stub.server import StubServer
from tests.harness import (
    Proc,
    RelayConfig,
    SinkConfig,
    free_port,
    start_sink,
    wait_until,
)
from tests.integration.conftest import API_KEY

pytestmark = pytest.mark.integration


def _users(dsn: str, n: int) -> list[tuple[str, str]]:
    """Register ``n`` users; return (user_id, event_id) pairs."""
    with psycopg.connect(dsn) as conn:
        out = []
        for _ in range(n):
            w = register_user(conn, email=f"{uuid.uuid4()}@ex.org", display_name="U")
            out.append((str(w.entity_id), str(w.event_id)))
    return out


def _attempts(
    dsn: str, users: list[str], per_user: int, *, per_tx: int = 50, first_score: int = 0
) -> list[dict]:
    """Quiz attempt events, ``per_user`` for each user, interleaved across users.

    Each user's scores count up from ``first_score``: the order the engine must keep.
    """
    events = []
    with psycopg.connect(dsn) as conn:
        batch: list[OutboxEvent] = []
        for seq in range(first_score, first_score + per_user):
            for user in users:
                payload = {
                    "attempt_id": str(uuid.uuid4()),
                    "user_id": user,
                    "quiz_id": "q",
                    "score": seq,
                    "submitted_at": "2026-01-01T00:00:00+00:00",
                }
                batch.append(
                    OutboxEvent(
                        aggregate_type="quiz_attempt",
                        aggregate_id=user,
                        event_type="QuizAttemptSubmitted",
                        payload=payload,
                    )
                )
                events.append({"event_id": str(batch[-1].event_id), **payload})
                if len(batch) >= per_tx:
                    _flush(conn, batch)
        _flush(conn, batch)
    return events


def _flush(conn: psycopg.Connection, batch: list[OutboxEvent]) -> None:  # type: ignore[type-arg]
    with conn.transaction():
        for event in batch:
            write_event(conn, event)
    batch.clear()


def _scores_by_user(items: list[dict]) -> dict[str, list[int]]:  # type: ignore[type-arg]
    """Quiz-attempt scores per user, in the order the engine applied them."""
    scores: dict[str, list[int]] = defaultdict(list)
    for item in items:
        if item["path"].endswith("quiz-attempts/sync"):
            scores[item["user_id"]].append(item["body"]["score"])
    return scores


def _applied_ids(stub: StubServer) -> list[str]:
    return [item["event_id"] for item in stub.applied()["items"]]


def _wait_applied(stub: StubServer, ids: set[str], timeout_s: float, sink: Proc) -> None:
    def done() -> bool:
        if not sink.alive():
            raise AssertionError(f"sink exited:\n{sink.log_tail()}")
        try:
            return ids <= set(_applied_ids(stub))
        except httpx.TransportError:  # the stub refuses connections (an outage window)
            return False

    try:
        wait_until(done, timeout_s, f"{len(ids)} events applied", interval_s=0.5)
    except AssertionError as exc:
        missing = len(ids - set(_applied_ids(stub)))
        raise AssertionError(
            f"{exc}; {missing} missing\n{_sink_gauges(sink)}\n{sink.log_tail()}"
        ) from None


def _sink_gauges(sink: Proc) -> str:
    """The sink's own gauges (held, in flight, paused, circuit, lag): why it is stuck."""
    try:
        text = httpx.get(f"http://127.0.0.1:{sink.env['SINK_HTTP_PORT']}/metrics").text
    except httpx.HTTPError as exc:
        return f"(no metrics: {exc})"
    return "\n".join(
        line
        for line in text.splitlines()
        if line.startswith("outbox_sink_")
        and not line.startswith("outbox_sink_engine_seconds")
        and "_bucket" not in line
    )


def _parked(dsn: str, event_ids: list[str]) -> list[tuple]:  # type: ignore[type-arg]
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT event_id, event_type, status, retry_count, last_error, outbox_event_id::text"
            " FROM failed_sync_events WHERE outbox_event_id::text = ANY(%s) ORDER BY event_id",
            (event_ids,),
        ).fetchall()


def test_ten_thousand_events_over_two_hundred_users_applied_once_in_per_user_order(
    relay_cfg: RelayConfig,
    relay: Proc,
    sink_cfg: SinkConfig,
    stub: StubServer,
    tmp_path: Path,
) -> None:
    sink, _ = start_sink(sink_cfg, tmp_path)
    try:
        users = _users(relay_cfg.db_dsn, 200)
        attempts = _attempts(relay_cfg.db_dsn, [u for u, _ in users], per_user=49)
        ids = {e for _, e in users} | {a["event_id"] for a in attempts}
        assert len(ids) >= 10_000
        _wait_applied(stub, ids, 300, sink)
    finally:
        sink.close()
    applied = stub.applied()["items"]
    ours = [i for i in applied if i["event_id"] in ids]
    assert len(ours) == len(ids), "each event applied exactly once"
    scores = _scores_by_user(ours)
    assert len(scores) == 200
    for user, seq in scores.items():
        assert seq == list(range(49)), f"attempts of {user} out of order: {seq[:10]}"
    assert _parked(relay_cfg.db_dsn, list(ids)) == []


def test_engine_outage_and_error_bursts_spend_no_attempts_and_park_nothing(
    relay_cfg: RelayConfig,
    relay: Proc,
    sink_cfg: SinkConfig,
    stub: StubServer,
    tmp_path: Path,
) -> None:
    sink, _ = start_sink(sink_cfg, tmp_path)
    try:
        first = _users(relay_cfg.db_dsn, 50)
        _wait_applied(stub, {e for _, e in first}, 60, sink)
        stub.add_faults({"refuse_connections_s": 30})
        during = _users(relay_cfg.db_dsn, 100)
        time.sleep(31)
        stub.add_faults({"path": "/api/internal/users/sync", "statuses": [500, 503, 500, 503]})
        stub.add_faults(
            {"path": "/api/internal/users/sync", "statuses": [429], "headers": {"Retry-After": "1"}}
        )
        stub.add_faults({"path": "/api/internal/users/sync", "statuses": [408, 408]})
        after = _users(relay_cfg.db_dsn, 100)
        ids = {e for _, e in first + during + after}
        _wait_applied(stub, ids, 180, sink)
    finally:
        sink.close()
    assert _parked(relay_cfg.db_dsn, list(ids)) == []
    stats = stub.stats()
    assert stats["by_status"].get("503", 0) + stats["by_status"].get("500", 0) >= 1
    ours = [i for i in stub.applied()["items"] if i["event_id"] in ids]
    assert len(ours) == len(ids)


def test_poison_event_is_parked_with_reason_and_admin_retry_turns_it_done(
    relay_cfg: RelayConfig,
    relay: Proc,
    sink_cfg: SinkConfig,
    stub: StubServer,
    tmp_path: Path,
) -> None:
    poison = OutboxEvent(
        aggregate_type="user",
        aggregate_id=str(uuid.uuid4()),
        event_type="UserRegistered",
        payload={"user_id": str(uuid.uuid4())},
    )
    stub.add_faults(
        {
            "event_id": str(poison.event_id),
            "status": 400,
            "times": -1,
            "body": {"error": "invalid_user"},
        }
    )
    sink, port = start_sink(sink_cfg, tmp_path)
    try:
        before = _users(relay_cfg.db_dsn, 20)
        with psycopg.connect(relay_cfg.db_dsn) as conn, conn.transaction():
            write_event(conn, poison)
        after = _users(relay_cfg.db_dsn, 20)
        _wait_applied(stub, {e for _, e in before + after}, 60, sink)
        wait_until(lambda: _parked(relay_cfg.db_dsn, [str(poison.event_id)]), 30, "parked row")
        row = _parked(relay_cfg.db_dsn, [str(poison.event_id)])[0]
        assert row[1] == "USER_SYNC"
        assert row[2] == "FAILED"
        assert "400" in row[4]
        assert str(poison.event_id) not in _applied_ids(stub)

        stub.clear_faults()
        admin = f"http://127.0.0.1:{port}/api/v1/admin/failed-sync-events"
        auth = {"Authorization": f"Bearer {sink_cfg.admin_token}"}
        listed = httpx.get(admin, headers=auth).json()
        assert row[0] in [e["event_id"] for e in listed["data"]["events"]]
        answer = httpx.post(
            f"{admin}/retry",
            headers=auth,
            json={"event_ids": [row[0], 999_999_999], "retry_all": False},
        )
        assert answer.status_code == 200
        body = answer.json()
        assert body["success"] is True
        assert body["data"] == {"processed_count": 1, "done_count": 1, "failed_count": 0}
        assert "999999999" in body["message"]
    finally:
        sink.close()
    assert _parked(relay_cfg.db_dsn, [str(poison.event_id)])[0][2] == "DONE"
    assert str(poison.event_id) in _applied_ids(stub)


def test_wrong_api_key_pauses_the_sink_reports_it_and_parks_nothing(
    relay_cfg: RelayConfig,
    relay: Proc,
    sink_cfg: SinkConfig,
    stub: StubServer,
    tmp_path: Path,
) -> None:
    sink_cfg.api_key = "wrong-key"
    sink, port = start_sink(sink_cfg, tmp_path)
    try:
        users = _users(relay_cfg.db_dsn, 10)
        ready = f"http://127.0.0.1:{port}/readyz"
        wait_until(lambda: httpx.get(ready).status_code == 503, 30, "readyz to report it")
        assert "401" in httpx.get(ready).text
        time.sleep(3)
        assert sink.alive()
        assert _parked(relay_cfg.db_dsn, [e for _, e in users]) == []
        assert not set(_applied_ids(stub)) & {e for _, e in users}
    finally:
        sink.close()


def test_admin_api_needs_a_token_validates_bodies_and_never_fails_with_500(
    relay_cfg: RelayConfig,
    sink_cfg: SinkConfig,
    tmp_path: Path,
) -> None:
    sink, port = start_sink(sink_cfg, tmp_path)
    try:
        base = f"http://127.0.0.1:{port}/api/v1/admin/failed-sync-events"
        auth = {"Authorization": f"Bearer {sink_cfg.admin_token}"}
        assert httpx.get(base).status_code == 401
        assert httpx.get(base, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert httpx.get(base, headers=auth).status_code == 200
        as_json = {**auth, "content-type": "application/json"}
        assert httpx.post(f"{base}/retry", headers=as_json, content=b"{not json").status_code == 400
        assert httpx.post(f"{base}/retry", headers=auth, content=b"{not json").status_code == 415
        assert (
            httpx.post(f"{base}/retry", headers=auth, json={"event_ids": ["x"]}).status_code == 422
        )
        assert httpx.post(f"{base}/retry", headers=auth, json={}).status_code == 422
        unknown = httpx.post(f"{base}/retry", headers=auth, json={"event_ids": [123456789]})
        assert unknown.status_code == 200
        assert unknown.json()["data"]["processed_count"] == 0
        assert "123456789" in unknown.json()["message"]
        assert httpx.get(f"http://127.0.0.1:{port}/openapi.json").status_code == 200
        assert "outbox_sink_delivered_total" in httpx.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        sink.close()
    assert "test-admin-token" not in sink.log_path.read_text()
    assert API_KEY not in sink.log_path.read_text()


def test_quiz_attempt_of_a_user_unknown_to_the_engine_syncs_the_user_first(
    relay_cfg: RelayConfig,
    relay: Proc,
    sink_cfg: SinkConfig,
    stub: StubServer,
    tmp_path: Path,
) -> None:
    """... and says so once, not once per event: ten users synced make one line in full
    and one summary (issue 39: it was 59 of 78 lines)."""
    users = [str(uuid.uuid4()) for _ in range(10)]  # never registered: no UserRegistered
    user = users[0]
    attempts = _attempts(relay_cfg.db_dsn, users, per_user=3)
    sink, _ = start_sink(sink_cfg, tmp_path)
    try:
        _wait_applied(stub, {a["event_id"] for a in attempts}, 60, sink)
        assert sink.terminate() == 0  # (SIGTERM: its summaries are written as it stops)
    finally:
        sink.close()
    items = stub.applied(user_id=user)["items"]
    assert items[0]["path"].endswith("users/sync"), "the user is synced before its attempts"
    assert [i["body"]["score"] for i in items[1:]] == [0, 1, 2]
    log = sink.log_path.read_text()
    assert log.count("syncing the user first") == 1, log
    assert "synced the user first for 9 more events of type" in log, log


def test_kill_9_of_the_sink_mid_stream_then_restart_applies_everything_once(
    relay_cfg: RelayConfig,
    relay: Proc,
    sink_cfg: SinkConfig,
    stub: StubServer,
    tmp_path: Path,
    record_property: object,
) -> None:
    stub.add_faults({"latency_ms": 2})
    users = _users(relay_cfg.db_dsn, 100)
    attempts = _attempts(relay_cfg.db_dsn, [u for u, _ in users], per_user=30)
    ids = {e for _, e in users} | {a["event_id"] for a in attempts}
    sink, _ = start_sink(sink_cfg, tmp_path)
    wait_until(lambda: len(_applied_ids(stub)) >= 500, 60, "500 applied before the kill")
    sink.kill()
    sink.close()
    again, _ = start_sink(sink_cfg, tmp_path, name="sink-restarted")
    try:
        _wait_applied(stub, ids, 180, again)
    finally:
        again.close()
    ours = [i for i in stub.applied()["items"] if i["event_id"] in ids]
    assert len(ours) == len(ids), "applied once: redeliveries were absorbed as duplicates"
    duplicates = stub.stats()["duplicates"]
    print(f"\nsink kill -9: {len(ids)} events, {duplicates} duplicate deliveries absorbed")
    record_property("duplicates", duplicates)  # type: ignore[operator]


def test_two_sink_instances_one_leaves_mid_stream_nothing_is_lost(
    relay_cfg: RelayConfig,
    relay: Proc,
    sink_cfg: SinkConfig,
    stub: StubServer,
    tmp_path: Path,
) -> None:
    stub.add_faults({"latency_ms": 2})
    first, _ = start_sink(sink_cfg, tmp_path, name="sink-a")
    second, _ = start_sink(sink_cfg, tmp_path, name="sink-b")
    try:
        users = _users(relay_cfg.db_dsn, 100)
        attempts = _attempts(relay_cfg.db_dsn, [u for u, _ in users], per_user=30)
        ids = {e for _, e in users} | {a["event_id"] for a in attempts}
        wait_until(lambda: len(_applied_ids(stub)) >= 500, 60, "500 applied")
        assert first.terminate(timeout_s=30) == 0, "a leaving sink exits cleanly"
        _wait_applied(stub, ids, 180, second)
    finally:
        first.close()
        second.close()
    ours = [i for i in stub.applied()["items"] if i["event_id"] in ids]
    assert len(ours) == len(ids)
    scores = _scores_by_user(ours)
    assert all(seq == list(range(30)) for seq in scores.values())


def test_after_the_engine_lost_its_data_a_replay_reapplies_exactly_the_events_since(
    relay_cfg: RelayConfig,
    relay: Proc,
    sink_cfg: SinkConfig,
    stub: StubServer,
    tmp_path: Path,
) -> None:
    sink, _ = start_sink(sink_cfg, tmp_path)
    try:
        before = _users(relay_cfg.db_dsn, 30)
        _wait_applied(stub, {e for _, e in before}, 60, sink)
        time.sleep(1.0)
        since = datetime.now(UTC)
        time.sleep(1.0)
        after = _users(relay_cfg.db_dsn, 20)
        _wait_applied(stub, {e for _, e in after}, 60, sink)
    finally:
        assert sink.terminate() == 0
        sink.close()
    stub.reset()
    env = sink_cfg.env(free_port())
    replay = subprocess.run(
        [
            sys.executable,
            "-m",
            "cdc.cli",
            "replay",
            "--group",
            sink_cfg.group,
            "--all-topics",
            "--to-datetime",
            since.isoformat(),
            "--execute",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert replay.returncode == 0, replay.stdout + replay.stderr
    again, _ = start_sink(sink_cfg, tmp_path, name="sink-after-replay")
    try:
        _wait_applied(stub, {e for _, e in after}, 60, again)
        time.sleep(3.0)  # room for anything older to (wrongly) arrive too
    finally:
        again.close()
    assert set(_applied_ids(stub)) == {e for _, e in after}
