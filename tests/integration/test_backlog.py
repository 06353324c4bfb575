"""The backlog guard against real PostgreSQL and Kafka: a stopped or wedged relay
shows as "over" (read from the database, not from the relay), a caught-up one as
"ok"; a consumer group's oldest unprocessed record is measured from Kafka."""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition

from cdc.backlog import BacklogGuard, BacklogState
from cdc.outbox import Written, register_user
from cdc.settings import Settings
from sinks.cli.demo import Refused, register_guarded
from tests.harness import (
    Proc,
    RelayConfig,
    drop_slot,
    free_port,
    http_status,
    read_topics,
    start_relay,
    wait_until,
)

pytestmark = pytest.mark.integration

#: Limits small enough for a test to cross them within seconds.
LIMIT_ENV = {
    "CDC_BACKLOG_MAX_RELAY_AGE_S": "1",
    "CDC_BACKLOG_MAX_GROUP_AGE_S": "1",
    "CDC_BACKLOG_CACHE_TTL_S": "0.2",
    "CDC_BACKLOG_RETRY_AFTER_S": "3",
}


@pytest.fixture
def cfg(db_dsn: str, kafka_bootstrap: str, unique: str) -> Iterator[RelayConfig]:
    config = RelayConfig(db_dsn=db_dsn, kafka=kafka_bootstrap, unique=unique, extra=LIMIT_ENV)
    yield config
    drop_slot(db_dsn, config.slot)


@pytest.fixture
def guard(cfg: RelayConfig) -> Iterator[BacklogGuard]:
    settings = Settings.from_env({**cfg.env(free_port()), **LIMIT_ENV})
    g = BacklogGuard(settings)
    yield g
    g.close()


def _register(dsn: str, count: int) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [
            str(register_user(conn, email=f"{uuid.uuid4()}@ex.org", display_name="B").event_id)
            for _ in range(count)
        ]


def _backlog(port: int, query: str = "") -> tuple[int, dict[str, object], str | None]:
    url = f"http://127.0.0.1:{port}/backlog{query}"
    try:
        with urllib.request.urlopen(url, timeout=20) as resp:
            return resp.status, json.loads(resp.read()), resp.headers.get("Retry-After")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers.get("Retry-After")


def test_guard_is_over_while_the_relay_is_stopped_with_committed_events_and_ok_after_catch_up(
    cfg: RelayConfig, guard: BacklogGuard, tmp_path: Path
) -> None:
    relay, port = start_relay(cfg, tmp_path)
    try:
        wait_until(lambda: guard.check().state is BacklogState.OK, 30, "ok while streaming")
        status, doc, _ = _backlog(port)
        assert (status, doc["state"]) == (200, "ok")
        assert relay.terminate() == 0
    finally:
        relay.close()

    ids = _register(cfg.db_dsn, 50)
    over = wait_until(lambda: (b := guard.check()).over and b, 30, "over while stopped")
    assert over.relay_age_s is not None and over.relay_age_s > 1
    assert over.slot_lag_bytes is not None and over.slot_lag_bytes > 0
    assert any(e.startswith("relay_age_s ") for e in over.exceeded)
    assert over.retry_after_s == 3

    relay, port = start_relay(cfg, tmp_path, name="relay-again")
    try:
        done = wait_until(
            lambda: (b := guard.check()).state is BacklogState.OK and b, 60, "ok after catch-up"
        )
        assert done.relay_age_s == 0.0
        msgs = read_topics(cfg.kafka, [cfg.topic_prefix + "user"], expect=len(ids))
        assert {dict(m.headers())["id"].decode() for m in msgs} == set(ids)
        status, doc, retry_after = _backlog(port)
        assert (status, doc["state"], retry_after) == (200, "ok", None)
    finally:
        relay.close()


def test_a_standby_relay_answers_429_while_the_active_relay_is_wedged_then_200(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    """The active relay is frozen (SIGSTOP: it holds the slot, confirms nothing);
    its hot standby cannot take over yet, but its /backlog reads the database."""
    active, _ = start_relay(cfg, tmp_path, name="active")
    standby_port = free_port()
    standby = Proc(["relay"], cfg.env(standby_port), tmp_path / "standby.log").start()
    try:
        wait_until(
            lambda: http_status(f"http://127.0.0.1:{standby_port}/readyz") == 503,
            60,
            "standby waiting",
        )
        os.kill(active.pid, signal.SIGSTOP)
        try:
            _register(cfg.db_dsn, 20)
            _, doc, retry_after = wait_until(
                lambda: (r := _backlog(standby_port))[0] == 429 and r, 30, "429 from the standby"
            )
            assert doc["state"] == "over"
            assert retry_after == "3"
            assert doc["retry_after_s"] == 3
        finally:
            os.kill(active.pid, signal.SIGCONT)
        wait_until(lambda: _backlog(standby_port)[0] == 200, 60, "200 after the relay resumed")
        assert _backlog(standby_port)[1]["state"] == "ok"
    finally:
        standby.close()
        active.close()


def _commit_to_end(kafka: str, group: str, topic: str) -> None:
    """Commit ``group``'s offsets at the end of every partition of ``topic``."""
    consumer = Consumer({"bootstrap.servers": kafka, "group.id": group})
    try:
        parts = consumer.list_topics(topic, timeout=15).topics[topic].partitions
        ends = [
            TopicPartition(topic, p, consumer.get_watermark_offsets(TopicPartition(topic, p))[1])
            for p in parts
        ]
        consumer.commit(offsets=ends, asynchronous=False)
    finally:
        consumer.close()


def test_group_whose_oldest_record_waits_past_the_limit_is_429_and_200_once_committed(
    cfg: RelayConfig, guard: BacklogGuard, tmp_path: Path
) -> None:
    group = f"g-{cfg.unique}"
    relay, port = start_relay(cfg, tmp_path)
    try:
        ids = _register(cfg.db_dsn, 5)
        read_topics(cfg.kafka, [cfg.topic_prefix + "user"], expect=len(ids))
        _, doc, retry_after = wait_until(
            lambda: (r := _backlog(port, f"?group={group}"))[0] == 429 and r,
            30,
            "the group's oldest record older than 1 s",
        )
        assert doc["group"] == group
        assert isinstance(doc["group_age_s"], float) and doc["group_age_s"] > 1
        assert doc["exceeded"] == [f"group_age_s {doc['group_age_s']:g} > 1"]
        assert retry_after == "3"
        lib = guard.check(group=group)
        assert lib.over and lib.group_age_s is not None and lib.group_age_s > 1

        _commit_to_end(cfg.kafka, group, cfg.topic_prefix + "user")
        wait_until(lambda: _backlog(port, f"?group={group}")[0] == 200, 30, "200 once committed")
        assert _backlog(port, f"?group={group}")[1]["group_age_s"] == 0.0
        # (the library answers from a measurement up to its TTL old)
        wait_until(lambda: guard.check(group=group).group_age_s == 0.0, 10, "library: 0")
        assert _backlog(port, "?group=no%20such")[0] == 400
    finally:
        relay.close()


def test_the_demo_registration_path_refuses_with_retry_after_while_over_and_registers_when_ok(
    cfg: RelayConfig, guard: BacklogGuard, tmp_path: Path
) -> None:
    relay, _ = start_relay(cfg, tmp_path)
    relay.terminate()
    relay.close()
    _register(cfg.db_dsn, 3)  # committed while no relay runs
    wait_until(lambda: guard.check().over, 30, "over")
    with psycopg.connect(cfg.db_dsn) as conn:
        users_before = conn.execute("SELECT count(*) FROM users").fetchone()
        email = f"{uuid.uuid4()}@ex.org"
        refused = register_guarded(conn, guard, group="", email=email, name="R")
        assert isinstance(refused, Refused)
        assert refused.retry_after_s == 3
        assert "relay_age_s" in refused.reason
        assert conn.execute("SELECT count(*) FROM users").fetchone() == users_before
        relay, _ = start_relay(cfg, tmp_path, name="relay-again")
        try:
            wait_until(lambda: guard.check().state is BacklogState.OK, 60, "ok after catch-up")
            written = register_guarded(conn, guard, group="", email=email, name="R")
        finally:
            relay.close()
        assert isinstance(written, Written)
        row = conn.execute("SELECT email FROM users WHERE id = %s", (written.entity_id,)).fetchone()
        assert row == (email,)
