"""Sharding the outbox across two slots with PostgreSQL 15 publication row filters.

Each relay streams its own slot of its own publication, whose row filter takes
the keys of one hash bucket (``hashtext(aggregateid) & 1``). A key therefore
always goes through the same relay, and both relays hash keys to partitions the
same way (murmur2), so per-key order holds on the shared topics.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from cdc.outbox import OutboxEvent, write_event
from tests.harness import RelayConfig, drop_slot, free_port, headers_of, read_topics, start_relay

pytestmark = pytest.mark.integration

SHARDS = 2
KEYS = [f"cust-{i}" for i in range(60)]
EVENTS_PER_KEY = 4


@pytest.fixture
def shards(db_dsn: str, kafka_bootstrap: str, unique: str) -> Iterator[list[RelayConfig]]:
    """One relay configuration per shard: own publication (row filter) and slot."""
    configs = []
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        for shard in range(SHARDS):
            pub, slot = f"pub_{unique}_s{shard}", f"slot_{unique}_s{shard}"
            conn.execute(
                sql.SQL(
                    "CREATE PUBLICATION {} FOR TABLE outbox"
                    " WHERE ((hashtext(aggregateid) & {}) = {}) WITH (publish = 'insert')"
                ).format(sql.Identifier(pub), sql.Literal(SHARDS - 1), sql.Literal(shard))
            )
            # Both slots start at the same WAL position, before any event is written.
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
            configs.append(
                RelayConfig(
                    db_dsn=db_dsn,
                    kafka=kafka_bootstrap,
                    unique=unique,
                    partitions=4,
                    extra={
                        "CDC_PUBLICATION": pub,
                        "CDC_SLOT": slot,
                        "CDC_PUBLICATION_FILTERED": "true",
                    },
                )
            )
    yield configs
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        for cfg in configs:
            drop_slot(db_dsn, cfg.extra["CDC_SLOT"])
            conn.execute(
                sql.SQL("DROP PUBLICATION {}").format(sql.Identifier(cfg.extra["CDC_PUBLICATION"]))
            )


def test_two_relays_on_row_filtered_publications_split_keys_and_keep_per_key_order(
    shards: list[RelayConfig], tmp_path: Path
) -> None:
    cfg_a, cfg_b = shards
    topic = cfg_a.topic_prefix + "account"
    with psycopg.connect(cfg_a.db_dsn) as conn:
        shard_of = {
            k: conn.execute("SELECT hashtext(%s) & 1", (k,)).fetchone()[0]  # type: ignore[index]
            for k in KEYS
        }
        seq = 0
        for round_ in range(EVENTS_PER_KEY):
            with conn.transaction():  # each transaction mixes keys of both shards
                for key in KEYS:
                    write_event(
                        conn,
                        OutboxEvent(
                            aggregate_type="account",
                            aggregate_id=key,
                            event_type="Changed",
                            payload={"seq": seq, "round": round_},
                        ),
                    )
                    seq += 1
    assert set(shard_of.values()) == {0, 1}, "the keys cover both shards"
    shard0 = [k for k in KEYS if shard_of[k] == 0]

    relay_a, _ = start_relay(cfg_a, tmp_path, name="relay-s0")
    try:
        only_a = read_topics(cfg_a.kafka, [topic], expect=len(shard0) * EVENTS_PER_KEY)
    finally:
        relay_a.close()
    assert {m.key().decode() for m in only_a} == set(shard0), "relay A streamed its keys only"
    assert len(only_a) == len(shard0) * EVENTS_PER_KEY

    relay_b, _ = start_relay(cfg_b, tmp_path, name="relay-s1")
    try:
        msgs = read_topics(cfg_b.kafka, [topic], expect=seq)
    finally:
        relay_b.close()
    ids = [headers_of(m)["id"] for m in msgs]
    assert len(ids) == len(set(ids)) == seq, "every event once, across both relays"
    partitions: dict[str, set[int]] = defaultdict(set)
    order: dict[str, list[int]] = defaultdict(list)
    for m in sorted(msgs, key=lambda m: (m.partition(), m.offset())):
        partitions[m.key().decode()].add(m.partition())
        order[m.key().decode()].append(json.loads(m.value())["seq"])
    assert all(len(p) == 1 for p in partitions.values()), "one partition per key"
    assert all(s == sorted(s) for s in order.values()), "commit order per key"
    assert set(order) == set(KEYS)


def _write_round(
    conn: psycopg.Connection[tuple[object, ...]], keys: list[str], n: int
) -> list[str]:
    ids = []
    with conn.transaction():
        for key in keys:
            event = OutboxEvent(
                aggregate_type="account",
                aggregate_id=key,
                event_type="Changed",
                payload={"round": n},
            )
            ids.append(str(write_event(conn, event)))
    return ids


def test_a_shards_gap_recovery_republishes_only_the_rows_of_its_own_row_filter(
    shards: list[RelayConfig], tmp_path: Path, unique: str
) -> None:
    """Edge: slot lifetime x sharding. Shard 0's slot is dropped while its relay is
    down; its recovery re-reads the outbox table through its publication's row filter,
    so it re-publishes its own keys' events (all of them) and none of shard 1's."""
    cfg_a, _ = shards
    topic = cfg_a.topic_prefix + "account"
    keys = [f"acct-{unique}-{i}" for i in range(40)]
    with psycopg.connect(cfg_a.db_dsn, autocommit=True) as conn:
        shard_of = {
            k: conn.execute("SELECT hashtext(%s) & 1", (k,)).fetchone()[0]  # type: ignore[index]
            for k in keys
        }
        assert set(shard_of.values()) == {0, 1}, "the keys cover both shards"
        shard0 = {k for k in keys if shard_of[k] == 0}
        first = _write_round(conn, keys, 0)
        relay, _ = start_relay(cfg_a, tmp_path, name="relay-s0")
        try:
            read_topics(cfg_a.kafka, [topic], expect=len(shard0))
        finally:
            relay.close()
        second = _write_round(conn, keys, 1)  # committed while shard 0's relay is down
    drop_slot(cfg_a.db_dsn, cfg_a.extra["CDC_SLOT"])  # ... and its slot is lost

    relay, _ = start_relay(cfg_a, tmp_path, name="relay-s0-again")
    try:
        msgs = read_topics(cfg_a.kafka, [topic], expect=2 * len(shard0) + len(shard0))
    finally:
        relay.close()
    log = (tmp_path / "relay-s0-again.log").read_text(encoding="utf-8", errors="replace")
    assert "slot_missing" in log, "the lost slot was reported as a gap"
    recovered = [m for m in msgs if "recovered" in headers_of(m)]
    assert recovered, "the gap was closed from the table"
    # (rows of other tests in the shared database are in the window too: judge each
    # relayed key by its bucket, not by this test's key list)
    relayed = sorted({m.key().decode() for m in msgs})
    with psycopg.connect(cfg_a.db_dsn) as conn:
        buckets = {
            k: conn.execute("SELECT hashtext(%s) & 1", (k,)).fetchone()[0]  # type: ignore[index]
            for k in relayed
        }
    assert set(buckets.values()) == {0}, "no key of the other shard relayed"
    seen = {headers_of(m)["id"].decode() for m in msgs}
    mine = {i for i, k in zip(first + second, keys + keys, strict=True) if k in shard0}
    assert mine <= seen, "every event of the shard reached Kafka"


#: 40 keys, 30 of shard 0 and 10 of shard 1 (``hashtext(k) & 1``): shard 0 holds three
#: quarters of the window's rows - a share that reads the window in its order (at half,
#: two shards' even split, the places are sorted instead: about as fast, the same rows).
SKEWED_KEYS = (
    "SELECT array_agg(k) AS keys FROM ("
    "(SELECT 'k' || i AS k FROM generate_series(1, 1000) AS i"
    " WHERE (hashtext('k' || i) & 1) = 0 LIMIT 30) UNION ALL"
    " (SELECT 'k' || i FROM generate_series(1, 1000) AS i"
    " WHERE (hashtext('k' || i) & 1) = 1 LIMIT 10)) AS keyset"
)


@pytest.mark.timeout(600)
def test_a_shards_large_repair_reads_the_window_and_republishes_only_its_own_rows(
    shards: list[RelayConfig], tmp_path: Path, unique: str
) -> None:
    """Shape: a sharded relay's `audit --repair` at the size that reads the window in its
    index's order (cdc.repair.rows: 50,000 ids and more, at least half the window).
    110,000 rows over both shards in 110 transactions, three quarters of them shard
    0's (:data:`SKEWED_KEYS`); shard 0's relay publishes them, its records are deleted
    from Kafka (DeleteRecords), and `outbox-cdc audit --repair` of shard 0 republishes
    them. The window holds both shards' rows; only the shard's missing ids are kept:
    each of its events once, marked, no key of shard 1."""
    from datetime import UTC, datetime

    from tests.integration.test_audit import _audit, _delete_all_records

    cfg_a, _ = shards
    aggregate = f"bulk{unique}"
    topic = cfg_a.topic_prefix + aggregate
    relay, _ = start_relay(cfg_a, tmp_path, name="relay-s0")  # (its first start: before)
    try:
        since = datetime.now(UTC).isoformat()
        with psycopg.connect(cfg_a.db_dsn, autocommit=True) as conn:
            for part in range(110):
                conn.execute(
                    "INSERT INTO outbox (aggregatetype, aggregateid, type, payload)"
                    " SELECT %s, keys[1 + g %% 40], 'Bulk', jsonb_build_object('n', g)"
                    " FROM generate_series(%s::int, %s::int) AS g, (" + SKEWED_KEYS + ") AS s",
                    (aggregate, part * 1000, part * 1000 + 999),
                )
            mine = {
                str(row[0])
                for row in conn.execute(
                    "SELECT id FROM outbox"
                    " WHERE aggregatetype = %s AND (hashtext(aggregateid) & 1) = 0",
                    (aggregate,),
                )
            }
        assert len(mine) >= 50_000, len(mine)
        read_topics(cfg_a.kafka, [topic], expect=len(mine), idle_s=1)
    finally:
        relay.close()
    _delete_all_records(cfg_a.kafka, topic)
    with psycopg.connect(cfg_a.db_dsn, autocommit=True) as conn:
        # (the window's share is judged on the planner's count: statistics that do not
        # know the 110,000 new rows yet - autovacuum comes later - send the repair the
        # other way, correct but not the one tested here)
        conn.execute("ANALYZE outbox")
    until = datetime.now(UTC).isoformat()
    env = {**cfg_a.env(free_port()), "LOG_LEVEL": "INFO"}
    code, doc, stderr = _audit(env, "--repair", "--since", since, "--until", until)
    assert code == 1, stderr[-3000:]  # (something was missing: repaired)
    assert doc["missing_count"] == doc["repaired"] == len(mine), doc["missing_count"]
    assert "read in the window's order" in stderr, stderr[-3000:]
    msgs = read_topics(cfg_a.kafka, [topic], expect=len(mine), idle_s=1)
    ids = [headers_of(m)["id"].decode() for m in msgs]
    assert len(ids) == len(set(ids)) and set(ids) == mine, "each of the shard's events once"
    assert all(headers_of(m).get("recovered", b"").startswith(b"audit-") for m in msgs)
