"""Record for record: Debezium's outbox router (bench/debezium/connector.properties, as
it comes) and the relay, from copies of one slot, on a varied outbox: two aggregate
types, keys of every kind, payloads whose text no re-encoding would keep (numbers
beyond a double, escapes, non-ASCII, empty and nested objects, 60 KB), 1-event and
large transactions, a transaction spanning both topics, a rolled-back transaction and
a rolled-back savepoint (published by neither), a row with a span context, and deletes
of the outbox (published by neither). Every record must match on key, value bytes, the
headers both write, partition and offset (tests/bench/compare/records.py).

Runnable alone (``make bench-compare-records``); ``make bench-compare`` runs it too, and
its drains compare every record of their backlogs the same way.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import psycopg
import pytest

from tests.bench.compare import records
from tests.bench.compare.conftest import PARTITIONS
from tests.bench.compare.contenders import copy_slots, run_debezium, run_relay
from tests.bench.conftest import create_topics
from tests.bench.report import load_average, write_figures
from tests.harness import RelayConfig, free_port

pytestmark = [pytest.mark.bench, pytest.mark.integration]

INSERT = (
    "INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload, tracingspancontext)"
    " VALUES (%s, %s, %s, %s, %s::jsonb, %s)"
)
#: Payload texts; jsonb stores its own form of each (jsonb_out), which both publish.
PAYLOADS = [
    "{}",
    '{"user_id": "u-1", "email": "ana@example.org"}',
    '{"big": 18446744073709551616, "precise": 0.10000000000000000000001, "exp": 1.5e400}',
    '{"text": "line\\nbreak \\"quoted\\" tab\\t back\\\\slash \\u00e9 \\ud83d\\ude00"}',
    '{"unicode": "Zoë ünïcödé 日本語 😀", "empty": "", "null": null, "t": true, "f": false}',
    '{"nested": {"a": [1, [2, [3, {"b": {"c": []}}]]], "d": {"e": {}}}, "arr": [null, 1.0]}',
    '{"z": 1, "a": 2, "m": {"y": 1, "b": 2}}',
    json.dumps({"blob": "x" * 60_000, "n": 1}),
]
KEYS = ["user-1", "user-2", "Zoë", "日本", "k" * 200, "42", " spaced key ", "a/b:c"]
TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _write(dsn: str) -> int:
    """The varied outbox; returns how many events committed (and so must be published)."""
    committed = 0
    n = 0

    def row(aggregate: str, *, trace: str | None = None) -> tuple[object, ...]:
        nonlocal n
        n += 1
        return (
            str(uuid.uuid4()),
            aggregate,
            KEYS[n % len(KEYS)],
            "UserRegistered" if aggregate == "user" else "QuizCompleted",
            PAYLOADS[n % len(PAYLOADS)],
            trace,
        )

    with psycopg.connect(dsn, autocommit=True) as conn:
        for i in range(200):  # 1-event transactions, both topics
            conn.execute(INSERT, row("user" if i % 3 else "quiz"))
            committed += 1
        for size in (50, 500):  # large transactions
            with conn.transaction():
                for i in range(size):
                    conn.execute(INSERT, row("quiz" if i % 2 else "user"))
            committed += size
        with conn.transaction():  # a span context: the relay adds traceparent
            conn.execute(INSERT, row("user", trace=TRACE))
        committed += 1
        with conn.transaction():  # a rolled-back savepoint inside a committed transaction
            conn.execute(INSERT, row("user"))
            try:
                with conn.transaction():
                    conn.execute(INSERT, row("user"))
                    raise RuntimeError("roll back the savepoint")
            except RuntimeError:
                pass
            conn.execute(INSERT, row("quiz"))
        committed += 2
        try:
            with conn.transaction():  # rolled back: published by neither
                for _ in range(5):
                    conn.execute(INSERT, row("user"))
                raise RuntimeError("roll back")
        except RuntimeError:
            pass
        # Housekeeping deletes of the outbox: the publication publishes inserts only.
        conn.execute("DELETE FROM outbox WHERE id IN (SELECT id FROM outbox LIMIT 10)")
        for i in range(100):
            conn.execute(INSERT, row("user" if i % 2 else "quiz"))
            committed += 1
    return committed


@pytest.mark.timeout(600)
def test_debezium_writes_the_relays_records_byte_for_byte(
    cfg: RelayConfig,
    tmp_path: Path,
    slots_to_drop: list[str],
    debezium_jars: Path,
) -> None:
    load_at_start = load_average()
    dbz_prefix = f"d{cfg.unique}.outbox.event."
    aggregates = ["user", "quiz"]
    relay_topics = [cfg.topic_prefix + a for a in aggregates]
    dbz_topics = [dbz_prefix + a for a in aggregates]
    create_topics(cfg.kafka, [*relay_topics, *dbz_topics, cfg.dlq_topic], partitions=PARTITIONS)
    relay_slot, dbz_slot = f"{cfg.slot}_relay", f"{cfg.slot}_debezium"
    slots_to_drop.extend([relay_slot, dbz_slot])
    lsn = copy_slots(cfg.db_dsn, relay_slot, [dbz_slot])
    events = _write(cfg.db_dsn)

    run_relay(cfg, tmp_path, slot=relay_slot, topics=relay_topics, events=events)
    run_debezium(
        "debezium", debezium_jars, tmp_path, kafka=cfg.kafka, dsn=cfg.db_dsn, slot=dbz_slot,
        topic_prefix=dbz_prefix, topics=dbz_topics, events=events, rest_port=free_port(),
    )  # fmt: skip
    relay_records, relay_total = records.by_id(records.read(cfg.kafka, relay_topics, expect=events))
    comparison = records.compare(
        relay_records, records.read(cfg.kafka, dbz_topics, expect=events), relay_total=relay_total
    )
    # The relay's own records: its traceparent, and no dead letter.
    traced = [r for r in relay_records.values() if r.header("traceparent") is not None]
    assert [r.header("traceparent") for r in traced] == [TRACE.encode()]
    print(
        f"\n== records, relay vs Debezium (as it comes), slots copied at {lsn}: {events:,}"
        f" events committed; relay {comparison.relay_records:,}, Debezium"
        f" {comparison.other_records:,}, identical {comparison.identical:,}, different"
        f" {comparison.differences:,}; Debezium's timestamp - the relay's (commit time):"
        f" {comparison.timestamp_delta_ms} ms"
    )
    write_figures(
        "compare-records",
        {"events": events, "slot_lsn": lsn, "debezium": comparison.summary()},
        load_at_start=load_at_start,
    )
    assert comparison.ok, (
        f"{comparison.differences:,} records differ ({comparison.identical:,} identical):\n"
        + "\n".join(comparison.examples)
    )
    assert comparison.relay_records == events
