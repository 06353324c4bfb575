"""Relay fault tests: kill -9, Kafka outage beyond wal_sender_timeout,
PostgreSQL restart, hot-standby takeover. Every event id must reach Kafka.

These drive the local stack (compose/stack.sh) and so need it: against
externally provided services they fail in CI and skip elsewhere.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from cdc.wal.replproto import str_to_lsn
from tests.conftest import IN_CI, Services
from tests.harness import (
    Proc,
    RelayConfig,
    drop_slot,
    headers_of,
    http_status,
    read_topics,
    slot_confirmed_lsn,
    stack,
    start_relay,
    wait_for_ready,
    wait_until,
)
from tests.integration.test_relay_errors import metric, readyz

pytestmark = [pytest.mark.integration, pytest.mark.fault]


@pytest.fixture(autouse=True)
def local_stack(services: Services) -> None:
    if services.origin != "local-stack":
        msg = "fault tests stop and start services: they need the local stack"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture
def cfg(db_dsn: str, kafka_bootstrap: str, unique: str) -> Iterator[RelayConfig]:
    config = RelayConfig(db_dsn=db_dsn, kafka=kafka_bootstrap, unique=unique, partitions=4)
    yield config
    drop_slot(db_dsn, config.slot)


def _bulk(dsn: str, aggregate: str, total: int, *, per_tx: int = 500, start: int = 0) -> None:
    """``total`` events of ``aggregate`` over 200 keys, ``per_tx`` per transaction."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for first in range(start, start + total, per_tx):
            conn.execute(
                "INSERT INTO outbox (aggregatetype, aggregateid, type, payload)"
                " SELECT %s, 'k' || (i %% 200), 'Bulk', jsonb_build_object('seq', i)"
                " FROM generate_series(%s::int, %s::int) AS i",
                (aggregate, first, min(first + per_tx, start + total) - 1),
            )


def _expected_ids(dsn: str, aggregate: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT id::text FROM outbox WHERE aggregatetype = %s", (aggregate,)
        ).fetchall()
    return {r[0] for r in rows}


def _relayed(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        float(m) for m in re.findall(r"^outbox_relay_events_total\{[^}]*\} (\S+)$", text, re.M)
    )


def _assert_all_arrived(
    cfg: RelayConfig, aggregate: str, expected: set[str], record_property: object
) -> Counter[str]:
    msgs = read_topics(
        cfg.kafka, [cfg.topic_prefix + aggregate], expect=len(expected), timeout_s=240
    )
    seen = Counter(headers_of(m)["id"].decode() for m in msgs)
    missing = expected - set(seen)
    duplicates = sum(n - 1 for n in seen.values())
    print(f"\n{aggregate}: {len(expected)} events, {len(msgs)} records, {duplicates} duplicates")
    record_property("duplicates", duplicates)  # type: ignore[operator]
    assert not missing, f"{len(missing)} events never reached Kafka"
    return seen


def test_kill_9_mid_stream_then_restart_loses_no_event(
    cfg: RelayConfig, tmp_path: Path, record_property: object
) -> None:
    relay, port = start_relay(cfg, tmp_path)
    try:
        _bulk(cfg.db_dsn, "crash", 50_000)
        wait_until(lambda: _relayed(port) >= 5_000, 120, "5,000 events relayed")
        relay.kill()
        relayed_before_kill = _relayed_safe(port)
        assert relayed_before_kill is None, "the killed relay still answers"
        again, _ = start_relay(cfg, tmp_path, name="relay-restarted")
        try:
            _assert_all_arrived(cfg, "crash", _expected_ids(cfg.db_dsn, "crash"), record_property)
        finally:
            again.close()
    finally:
        relay.close()


def _relayed_safe(port: int) -> float | None:
    try:
        return _relayed(port)
    except OSError:
        return None


@pytest.fixture
def short_wal_sender_timeout(db_dsn: str) -> Iterator[None]:
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET wal_sender_timeout = '5s'")
        conn.execute("SELECT pg_reload_conf()")
    yield
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM RESET wal_sender_timeout")
        conn.execute("SELECT pg_reload_conf()")


def test_kafka_outage_longer_than_wal_sender_timeout_loses_nothing_and_never_confirms_early(
    cfg: RelayConfig, tmp_path: Path, short_wal_sender_timeout: None, record_property: object
) -> None:
    """While Kafka is away the confirmed LSN never reaches a transaction Kafka
    has not acknowledged: it stays at or below the commit LSN (``lsn`` header)
    of the first transaction committed after the kill. (It may pass the WAL
    position of the kill: an idle relay confirms a keepalive's position, which
    can lie among the inserts of a transaction whose commit the server has not
    decoded yet - safe, as the server sends again every transaction whose
    commit lies at or past the confirmed LSN.)"""
    relay, port = start_relay(cfg, tmp_path)
    try:
        _bulk(cfg.db_dsn, "outage", 2_000)
        wait_until(lambda: _relayed(port) >= 2_000, 60, "first events relayed")
        stack("kill", "kafka")
        try:
            samples = []
            deadline = time.monotonic() + 15  # three times wal_sender_timeout
            seq = 2_000
            while time.monotonic() < deadline:
                _bulk(cfg.db_dsn, "outage", 500, start=seq)
                seq += 500
                samples.append(slot_confirmed_lsn(cfg.db_dsn, cfg.slot))
                time.sleep(0.5)
            assert relay.alive(), f"relay died during the outage:\n{relay.log_tail()}"
        finally:
            stack("up", "kafka")
        expected = _expected_ids(cfg.db_dsn, "outage")
        _assert_all_arrived(cfg, "outage", expected, record_property)
        msgs = read_topics(cfg.kafka, [cfg.topic_prefix + "outage"], expect=len(expected))
        first_commit = min(
            str_to_lsn(headers_of(m)["lsn"].decode())
            for m in msgs
            if json.loads(m.value())["seq"] >= 2_000
        )
        assert max(samples) <= first_commit, (
            "confirmed_flush_lsn passed events Kafka never acknowledged"
        )
        assert relay.alive()
        log = relay.log_path.read_text()
        assert log.count("relay session ended") <= 3, "reconnect storm during the outage"
    finally:
        relay.close()


def test_postgres_restart_relay_reconnects_and_resumes(
    cfg: RelayConfig, tmp_path: Path, record_property: object
) -> None:
    relay, port = start_relay(cfg, tmp_path)
    try:
        _bulk(cfg.db_dsn, "pgrestart", 1_000)
        wait_until(lambda: _relayed(port) >= 1_000, 60, "events before the restart")
        stack("down", "pg")
        time.sleep(2)
        stack("up", "pg")
        _bulk(cfg.db_dsn, "pgrestart", 1_000, start=1_000)
        wait_for_ready(relay, port, timeout_s=90)
        _assert_all_arrived(
            cfg, "pgrestart", _expected_ids(cfg.db_dsn, "pgrestart"), record_property
        )
        assert relay.alive()
    finally:
        relay.close()


def test_standby_takes_over_when_the_active_relay_is_killed(
    cfg: RelayConfig, tmp_path: Path, record_property: object
) -> None:
    active, _ = start_relay(cfg, tmp_path, name="active")
    standby: Proc | None = None
    try:
        standby, standby_port = start_relay(cfg, tmp_path, name="standby", wait_ready=False)
        wait_until(
            lambda: (
                http_status(f"http://127.0.0.1:{standby_port}/readyz") == 503
                and "standby" in standby.log_tail()
            ),
            60,
            "standby to wait",
        )
        _bulk(cfg.db_dsn, "ha", 1_000)
        active.kill()
        _bulk(cfg.db_dsn, "ha", 1_000, start=1_000)
        wait_for_ready(standby, standby_port, timeout_s=60)
        _assert_all_arrived(cfg, "ha", _expected_ids(cfg.db_dsn, "ha"), record_property)
    finally:
        active.close()
        if standby is not None:
            standby.close()


def test_a_dead_letter_produce_raising_buffer_error_holds_backs_off_and_retries(
    cfg: RelayConfig, tmp_path: Path, record_property: object
) -> None:
    """Kafka away and the producer's local queue full (5 records): produce()
    raises BufferError for the dead letter of a malformed event. Before, the
    relay spun inside the dead letter's produce; now it holds (not reading WAL,
    /readyz naming the cause), retries after a growing back-off, and writes it
    when Kafka is back. Nothing is lost, nothing exits."""
    cfg.extra.update(
        {
            "KAFKA_CONFIG_QUEUE_BUFFERING_MAX_MESSAGES": "5",
            "CDC_MAX_IN_FLIGHT": "50",
            "CDC_MESSAGES": "on",  # (the malformed event is a logical message)
        }
    )
    relay, port = start_relay(cfg, tmp_path)
    try:
        _bulk(cfg.db_dsn, "qfull", 5, per_tx=5)
        wait_until(lambda: _relayed(port) >= 5, 60, "the topic to exist")
        stack("kill", "kafka")
        try:
            _bulk(cfg.db_dsn, "qfull", 5, per_tx=5, start=5)
            with psycopg.connect(cfg.db_dsn) as conn, conn.transaction():
                conn.execute("SELECT pg_logical_emit_message(true, 'outbox', 'not json')")
            cause = f"held: dead letter to {cfg.dlq_topic} not written: the producer's local"

            seen: list[tuple[int, str]] = []

            def held() -> bool:
                status, body = readyz(port)
                if not seen or seen[-1] != (status, body):
                    seen.append((status, body))
                return status == 503 and body.startswith(cause)

            try:
                wait_until(held, 60, "/readyz to name the held dead letter")
            except AssertionError as exc:
                raise AssertionError(f"{exc}; /readyz said {seen}\n{relay.log_tail()}") from None
            # Written once it holds: read in the malformed message's turn, these waited
            # in the ordinary records' back-pressure (the queue full) before the turn's
            # end could try the dead letter - /readyz said "backpressure" (pg18 lane, once).
            _bulk(cfg.db_dsn, "qfull", 5, per_tx=5, start=10)
            wait_until(
                lambda: metric(port, "outbox_relay_dead_letter_retries_total") >= 3,
                60,
                "three failed attempts",
            )
            assert relay.alive(), relay.log_tail()
            log = relay.log_path.read_text()
            delays = [float(d) for d in re.findall(r"local queue is full; retrying in (\S+)s", log)]
            assert delays[:3] == [0.5, 1.0, 2.0], "the back-off grows"
        finally:
            stack("up", "kafka")
        wait_for_ready(relay, port, timeout_s=120)
        dead = read_topics(cfg.kafka, [cfg.dlq_topic], expect=1)
        assert [m.value() for m in dead] == [b"not json"]
        _assert_all_arrived(cfg, "qfull", _expected_ids(cfg.db_dsn, "qfull"), record_property)
        assert relay.alive()
    finally:
        relay.close()
