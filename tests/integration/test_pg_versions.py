"""The server the stack runs, read by version: what differs between PostgreSQL 15 and 18.

Runs on every version (the default lane, the pg18 lane, the 16/17 smoke lane):

* the server is the one the lane asked for (``OUTBOX_PG_VERSION``; edge: a lane that
  silently ran the system's 15 would prove nothing about 16, 17 or 18);
* the relay's slot is a failover slot exactly where ``CDC_FAILOVER_SLOT=auto`` says
  (17+), ``on`` before 17 stops the relay with one line naming the setting, and
  :func:`cdc.wal.slots.read_slot` reads the version's columns (edge: catalog
  columns that do not exist before 16/17);
* ``IDENTIFY_SYSTEM`` answers the same two fields the gap check uses, and pgoutput
  protocol 1 with ``messages`` streams a transactional logical message on each version
  (edge: protocol and message options by version);
* the preflight's failover-slot finding matches the version; on 17+ the relay's
  /readyz says after its state that the standbys' copies of the slot are unknown
  (a one-host DSN: no standby to read), and stays 200.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from pydantic import SecretStr

from cdc.check import Status, failover_slots
from cdc.settings import Settings
from cdc.wal.slots import identify_system, read_slot
from cdc.wal.standby_copy import ONE_HOST_NOTE
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


@pytest.fixture
def version(db_dsn: str) -> int:
    with psycopg.connect(db_dsn) as conn:
        return conn.info.server_version


@pytest.fixture
def cfg(db_dsn: str, kafka_bootstrap: str) -> Iterator[RelayConfig]:
    config = RelayConfig(db_dsn=db_dsn, kafka=kafka_bootstrap, unique=uuid.uuid4().hex[:10])
    yield config
    drop_slot(db_dsn, config.slot)


def test_the_stack_runs_the_postgresql_the_lane_asked_for(version: int) -> None:
    asked = os.environ.get("OUTBOX_PG_VERSION")
    if asked:
        assert version // 10_000 == int(asked), f"asked {asked}, the server is {version}"
    assert version >= 150_000, "PostgreSQL 15 is the oldest supported"


def test_identify_system_and_the_slot_row_by_version(db_dsn: str, version: int) -> None:
    identity = identify_system(db_dsn)
    assert identity.system_id.isdigit() and identity.timeline >= 1
    slot = f"pgver_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        if version >= 170_000:
            conn.execute(
                "SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, false, true)",
                (slot,),
            )
        else:
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        try:
            row = read_slot(conn, slot)
        finally:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
    assert row is not None and row.plugin == "pgoutput" and row.wal_status == "reserved"
    assert row.invalidated is None and row.synced is False
    assert row.failover is (version >= 170_000)


def _body(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return str(answer.read().decode())
    except urllib.error.HTTPError as exc:
        return str(exc.read().decode())


def test_the_relay_makes_a_failover_slot_where_the_server_has_them(
    cfg: RelayConfig, version: int, tmp_path: Path
) -> None:
    cfg.extra["CDC_MESSAGES"] = "on"  # (pgoutput's messages 'true' on every version)
    relay, port = start_relay(cfg, tmp_path)
    try:
        with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
            # a transactional logical message through pgoutput (messages 'true', proto 1)
            conn.execute("SELECT pg_logical_emit_message(true, 'pgver', 'x')")
            conn.execute(
                "INSERT INTO outbox (aggregatetype, aggregateid, type, payload)"
                " VALUES ('pgver', 'k', 'Written', '{}')"
            )
            row = read_slot(conn, cfg.slot)
        read_topics(cfg.kafka, [cfg.topic_prefix + "pgver"], expect=1)
        assert relay.alive(), relay.log_tail()
        if version >= 170_000:  # a failover slot on a one-host DSN: its standbys unknown
            url = f"http://127.0.0.1:{port}/readyz"
            wait_until(lambda: _body(url).splitlines()[1:] == [ONE_HOST_NOTE], 60, "/readyz's note")
            assert http_status(url) == 200
    finally:
        relay.close()
    assert row is not None and row.failover is (version >= 170_000)
    settings = Settings(pg_dsn=SecretStr(cfg.db_dsn), slot=cfg.slot)
    with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
        finding = next(f for f in failover_slots(conn, settings) if f.item == "failover slot")
    assert finding.status is Status.OK, finding
    if version < 170_000:
        assert f"PostgreSQL {version // 10_000} has none" in finding.detail
    else:
        assert "is a failover slot" in finding.detail


def test_failover_on_before_17_stops_the_relay_with_one_line(
    cfg: RelayConfig, version: int, tmp_path: Path
) -> None:
    if version >= 170_000:
        cfg.extra["CDC_FAILOVER_SLOT"] = "off"  # 17+: `off` makes a plain slot
        relay, _ = start_relay(cfg, tmp_path)
        relay.close()
        with psycopg.connect(cfg.db_dsn) as conn:
            row = read_slot(conn, cfg.slot)
        assert row is not None and row.failover is False
        return
    cfg.extra["CDC_FAILOVER_SLOT"] = "on"
    relay = Proc(["relay"], cfg.env(free_port()), tmp_path / "relay.log").start()
    try:
        code = relay.proc.wait(120)
    finally:
        relay.close()
    log = relay.log_path.read_text()
    assert code != 0, log
    assert "CDC_FAILOVER_SLOT=on" in log and "PostgreSQL 17" in log, log
    assert "Traceback" not in log, log
    with psycopg.connect(cfg.db_dsn) as conn:
        assert read_slot(conn, cfg.slot) is None, "no plain slot made instead"
