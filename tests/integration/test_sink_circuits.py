"""Issue 47 item 3, black box: a route's circuit closes once nothing of it waits.

Two members of one group, one reading only the quiz topic, one only the user topic.
A quiz attempt arrives before its user: the quiz member syncs the user itself, and
that ``users/sync`` answers 500 - the quiz member's users route opens (it delivered
nothing there since) and its probes fail. The user member then delivers the
registration; the
attempt, sent as the users route's probe, is delivered by the quiz route alone (the
engine knows its user now). Nothing of the users route waits any more on the quiz
member: its ``/readyz`` answers 200 and ``outbox_sink_route_circuit_open`` is 0
(it said "engine unavailable: /api/internal/users/sync" for good, everything delivered).
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from pathlib import Path

import pytest

from sinks.shared.routes import USERS_SYNC_PATH, derived_user_sync_key
from sinks.stub.server import StubServer
from tests.harness import (
    RelayConfig,
    SinkConfig,
    create_topics,
    http_status,
    produce,
    start_sink,
    wait_until,
)
from tests.integration.conftest import API_KEY

pytestmark = pytest.mark.integration


def _readyz(port: int) -> tuple[int | None, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return None, ""


def _users_circuit_open(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    lines = [
        line
        for line in text.splitlines()
        if line.startswith("outbox_sink_route_circuit_open") and USERS_SYNC_PATH in line
    ]
    return lines[0].rsplit(" ", 1)[1] if lines else "absent"


def test_a_member_whose_users_probe_the_quiz_route_delivered_is_ready_again(
    relay_cfg: RelayConfig, stub: StubServer, tmp_path: Path
) -> None:
    user_topic = relay_cfg.topic_prefix + "user"
    quiz_topic = relay_cfg.topic_prefix + "quiz_attempt"
    create_topics(relay_cfg.kafka, [user_topic, quiz_topic], partitions=1)
    user, attempt = str(uuid.uuid4()), str(uuid.uuid4())
    # the quiz member's own sync of the user fails until the registration gets there
    stub.add_faults({"event_id": derived_user_sync_key(attempt), "status": 500, "times": -1})
    quiz_cfg = SinkConfig(
        relay=relay_cfg,
        engine_url=stub.url,
        api_key=API_KEY,
        extra={"SINK_TOPICS_PATTERN": f"^{quiz_topic}$"},
    )
    user_cfg = SinkConfig(
        relay=relay_cfg,
        engine_url=stub.url,
        api_key=API_KEY,
        extra={"SINK_TOPICS_PATTERN": f"^{user_topic}$"},
    )
    quiz_member, quiz_port = start_sink(quiz_cfg, tmp_path, name="quiz-member")
    user_member, _ = start_sink(user_cfg, tmp_path, name="user-member")
    try:
        body = {"attempt_id": str(uuid.uuid4()), "user_id": user, "quiz_id": "q", "score": 3}
        produce(
            relay_cfg.kafka,
            quiz_topic,
            [
                (
                    user.encode(),
                    json.dumps(body).encode(),
                    {"id": attempt.encode(), "type": b"QuizAttemptSubmitted"},
                )
            ],
        )
        wait_until(
            lambda: USERS_SYNC_PATH in _readyz(quiz_port)[1],
            60,
            "the quiz member's users route to open on the 500",
            interval_s=0.2,
        )
        registration = {"user_id": user}
        produce(
            relay_cfg.kafka,
            user_topic,
            [
                (
                    user.encode(),
                    json.dumps(registration).encode(),
                    {"id": str(uuid.uuid4()).encode(), "type": b"UserRegistered"},
                )
            ],
        )
        wait_until(lambda: stub.applied(event_id=attempt)["count"] == 1, 60, "the attempt applied")
        wait_until(
            lambda: _readyz(quiz_port)[0] == 200,
            30,
            f"the quiz member ready once everything is delivered ({_readyz(quiz_port)})",
            interval_s=0.5,
        )
        assert _users_circuit_open(quiz_port) in ("0.0", "absent")
        assert http_status(f"http://127.0.0.1:{quiz_port}/readyz") == 200
    finally:
        quiz_member.close()
        user_member.close()
