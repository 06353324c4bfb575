"""A publication's row filter is data, never query text (issue 49, item 6).

The relay reads its publication's row filter from ``pg_publication_tables`` and puts
the server's own text into the queries that must see only its share of the outbox:
gap recovery's window (``cdc.relay.gaps.recovery._window_query``), the outbox's emptiness
check, the audit's reads (periodic, CLI and the start-up check's). Before issue 49
those queries also took client-side parameters, so psycopg read the filter's ``%`` as
a placeholder: the documented N-shard recipe
(``((hashtext(aggregateid) & 2147483647) % N) = i``, docs/relay/scaling.md) failed
every periodic audit (``incomplete placeholder: '%'``) and could not recover a lost
slot; a filter's ``%%`` would have been read as ``%``.

Each filter, on a database of its own (the audit judges every row of its share):

* ``n-shard``: the docs' N-shard filter (N = 2, shard 0), with ``%``;
* ``quotes-and-%%``: ``strpos(aggregateid, '%%') = 0 AND aggregateid <> 'o''brien'``:
  quotes, and a ``%%`` whose meaning changes if read as ``%`` (keys holding one
  ``%`` belong to the share, keys holding ``%%`` do not).

One relay with the filtered publication and a periodic audit every 2 s: the share's
events arrive, the audit runs clean (never ``failed``); the relay stops, more events
are written, the slot is dropped; the next start recovers the gap through the filter:
every event of the share arrives, none of another share; the periodic audit is clean
again and ``outbox-cdc audit`` exits 0 with nothing missing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from cdc.migrate import migrate
from cdc.outbox import OutboxEvent, write_event
from tests.harness import (
    ROOT,
    RelayConfig,
    drop_slot,
    free_port,
    headers_of,
    read_topics,
    start_relay,
    wait_until,
)

pytestmark = pytest.mark.integration

#: Bound of every wait on the pipeline (generous: the machine is shared and loaded).
WAIT_S = 180

#: name -> the publication's row filter
FILTERS = {
    "n-shard": "((hashtext(aggregateid) & 2147483647) % 2) = 0",
    "quotes-and-%%": "strpos(aggregateid, '%%') = 0 AND aggregateid <> 'o''brien'",
}
KEYS = [
    *[f"cust-{i}" for i in range(30)],
    *[f"k-50%-{i}" for i in range(6)],  # one %: of the share under the second filter
    *[f"k-%%-{i}" for i in range(6)],  # %%: not of it
    "o'brien",
]


def _of_the_share(conn: psycopg.Connection[tuple[object, ...]], name: str, key: str) -> bool:
    """Whether ``key`` is of shard 0 under filter ``name`` (written out, not the filter)."""
    if name == "n-shard":
        row = conn.execute("SELECT (hashtext(%s) & 2147483647) %% 2", (key,)).fetchone()
        assert row is not None
        return row[0] == 0
    return "%%" not in key and key != "o'brien"


@pytest.fixture
def db(empty_db_dsn: str) -> str:
    migrate(empty_db_dsn)
    return empty_db_dsn


@pytest.fixture(params=list(FILTERS))
def shard(
    request: pytest.FixtureRequest, db: str, kafka_bootstrap: str, unique: str
) -> Iterator[tuple[str, RelayConfig]]:
    name = str(request.param)
    pub = f"pub_{unique}"
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE PUBLICATION {} FOR TABLE outbox WHERE ({}) WITH (publish = 'insert')")
            .format(sql.Identifier(pub), sql.SQL(FILTERS[name]))
            .as_string(conn)
        )
    config = RelayConfig(
        db_dsn=db,
        kafka=kafka_bootstrap,
        unique=unique,
        partitions=2,
        extra={
            "CDC_PUBLICATION": pub,
            "CDC_PUBLICATION_FILTERED": "true",
            "CDC_AUDIT_INTERVAL_S": "2",
            "CDC_AUDIT_SETTLE_S": "1",
            "CDC_AUDIT_WINDOW_S": "600",
            "CDC_GAP_MARGIN_S": "5",
        },
    )
    yield name, config
    drop_slot(db, config.slot)


def _write(dsn: str, n: int) -> dict[str, str]:
    """One event per key in one transaction: id -> key."""
    written = {}
    with psycopg.connect(dsn) as conn, conn.transaction():
        for key in KEYS:
            event = OutboxEvent(
                aggregate_type="account", aggregate_id=key, event_type="T", payload={"n": n}
            )
            written[str(write_event(conn, event))] = key
    return written


def _audit_runs(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    runs = {}
    for line in text.splitlines():
        if line.startswith("outbox_audit_runs_total{"):
            name, _, value = line.rpartition(" ")
            runs[name.split('"')[1]] = float(value)
    return runs


def _a_clean_run_after(port: int, clean_before: float) -> None:
    wait_until(
        lambda: _audit_runs(port).get("clean", 0) > clean_before,
        WAIT_S,
        "a clean periodic audit",
        interval_s=0.5,
    )
    assert _audit_runs(port).get("failed", 0) == 0, "a periodic audit failed"


def test_a_shard_with_any_row_filter_is_audited_and_recovers_its_lost_slot(
    shard: tuple[str, RelayConfig], tmp_path: Path
) -> None:
    name, cfg = shard
    topic = cfg.topic_prefix + "account"
    with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
        share = {k for k in KEYS if _of_the_share(conn, name, k)}
    assert share and set(KEYS) - share, "the keys fall on both sides of the filter"

    relay, port = start_relay(cfg, tmp_path, name="relay")
    try:
        first = _write(cfg.db_dsn, 1)
        mine_first = {i for i, k in first.items() if k in share}
        msgs = read_topics(cfg.kafka, [topic], expect=len(mine_first), idle_s=1.0)
        assert {headers_of(m)["id"].decode() for m in msgs} == mine_first
        _a_clean_run_after(port, _audit_runs(port).get("clean", 0))
    finally:
        relay.close()
    assert "incomplete placeholder" not in relay.log_path.read_text()

    second = _write(cfg.db_dsn, 2)  # committed while the relay is down ...
    drop_slot(cfg.db_dsn, cfg.slot)  # ... and its slot is lost

    relay, port = start_relay(cfg, tmp_path, name="relay-again")
    try:
        mine = {i for i, k in {**first, **second}.items() if k in share}
        msgs: list = []  # type: ignore[type-arg]

        def all_arrived() -> bool:
            msgs[:] = read_topics(cfg.kafka, [topic], expect=len(mine), idle_s=1.0)
            return mine <= {headers_of(m)["id"].decode() for m in msgs}

        wait_until(all_arrived, WAIT_S, "every event of the share in Kafka", interval_s=1.0)
        seen = {headers_of(m)["id"].decode() for m in msgs}
        assert not seen - mine, "events of another share were published"
        assert any("recovered" in headers_of(m) for m in msgs), "the gap was closed from the table"
        _a_clean_run_after(port, 0)
        log = relay.log_path.read_text()
        assert "slot_missing" in log, "the lost slot was reported as a gap"
        assert "incomplete placeholder" not in log
        env = cfg.env(free_port())
        proc = subprocess.run(
            [sys.executable, "-m", "cdc.cli", "audit", "--json", "--since", "1h"],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert json.loads(proc.stdout)["missing_count"] == 0
    finally:
        relay.close()
