"""``make bench-compare``: the relay, ``pg_recvlogical`` and Debezium (as it comes and
tuned) drain the same backlog, one after the other, each from its own copy of one slot
(the same LSN to the byte), into topics of their own on the same broker.

Per contender and per case (1-event and 100-event transactions): drain events/s,
events per CPU-second of its process, peak RSS, start-up to the first record
(tests/bench/compare/contenders.py says how each is measured). Then every record
Debezium wrote is compared with the relay's, record for record (key, value bytes,
headers, partition and offset: tests/bench/compare/records.py); one difference fails the
test. Figures are printed and written as JSON (``compare-drain-<n>.json``), never
asserted.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import psycopg
import pytest

from tests.bench.compare import records
from tests.bench.compare.conftest import PARTITIONS
from tests.bench.compare.contenders import (
    DEBEZIUM_VARIANTS,
    Figures,
    copy_slots,
    run_debezium,
    run_pg_recvlogical,
    run_relay,
)
from tests.bench.conftest import create_topics
from tests.bench.report import fmt, load_average, print_table, write_figures
from tests.bench.test_relay_bench import _fill, _pg_recvlogical, _server
from tests.harness import RelayConfig, free_port

pytestmark = [pytest.mark.bench, pytest.mark.integration]

#: BENCH_COMPARE_EVENTS: the backlog per case (fewer for a quick proof that it runs).
EVENTS = int(os.environ.get("BENCH_COMPARE_EVENTS", "200000"))
#: BENCH_COMPARE_ONLY=relay,pg_recvlogical: a subset of the contenders, in this order.
ORDER = ("pg_recvlogical", "relay", "debezium", "debezium-tuned")
ONLY = [c for c in os.environ.get("BENCH_COMPARE_ONLY", ",".join(ORDER)).split(",") if c]
KAFKA_VERSION = "4.1.1"
DEBEZIUM_VERSION = "3.6.1.Final"


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("per_tx", [1, 100], ids=["1-event-tx", "100-event-tx"])
def test_contenders_drain_one_backlog_and_write_the_same_records(
    per_tx: int,
    cfg: RelayConfig,
    tmp_path: Path,
    slots_to_drop: list[str],
    request: pytest.FixtureRequest,
) -> None:
    unknown = set(ONLY) - set(ORDER)
    assert not unknown, f"BENCH_COMPARE_ONLY: unknown contenders {unknown}"
    load_at_start = load_average()
    aggregate = f"cmp{per_tx}"
    prefixes = {
        "relay": cfg.topic_prefix,
        "debezium": f"d{cfg.unique}.outbox.event.",
        "debezium-tuned": f"e{cfg.unique}.outbox.event.",
    }
    topics = {name: prefix + aggregate for name, prefix in prefixes.items()}
    create_topics(cfg.kafka, [*topics.values(), cfg.dlq_topic], partitions=PARTITIONS)
    slots = {name: f"{cfg.slot}_{name.replace('-', '_')}" for name in ORDER}
    slots_to_drop.extend(slots.values())
    lsn = copy_slots(cfg.db_dsn, slots["relay"], [s for n, s in slots.items() if n != "relay"])
    insert_rate = _fill(cfg.db_dsn, aggregate, EVENTS, per_tx)
    with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        endpos = row[0]
        # WAL past endpos, so pg_recvlogical sees a message beyond it and stops.
        conn.execute("SELECT pg_logical_emit_message(false, 'bench-end', '')")

    jars = request.getfixturevalue("debezium_jars") if "debezium" in " ".join(ONLY) else None
    ran: dict[str, Figures] = {}
    for name in [c for c in ORDER if c in ONLY]:
        if name == "pg_recvlogical":
            ran[name] = run_pg_recvlogical(
                _pg_recvlogical(), cfg.db_dsn, tmp_path, slot=slots[name], endpos=endpos,
                events=EVENTS,
            )  # fmt: skip
        elif name == "relay":
            ran[name] = run_relay(
                cfg, tmp_path, slot=slots[name], topics=[topics[name]], events=EVENTS
            )
        else:
            assert name in DEBEZIUM_VARIANTS and jars is not None
            ran[name] = run_debezium(
                name, jars, tmp_path, kafka=cfg.kafka, dsn=cfg.db_dsn, slot=slots[name],
                topic_prefix=prefixes[name], topics=[topics[name]], events=EVENTS,
                rest_port=free_port(),
            )  # fmt: skip

    comparisons: dict[str, records.Comparison] = {}
    if "relay" in ran:
        relay_records, relay_total = records.by_id(
            records.read(cfg.kafka, [topics["relay"]], expect=EVENTS)
        )
        for name in DEBEZIUM_VARIANTS:
            if name in ran:
                comparisons[name] = records.compare(
                    relay_records,
                    records.read(cfg.kafka, [topics[name]], expect=EVENTS),
                    relay_total=relay_total,
                )

    server = _server(cfg.db_dsn)
    relay = ran.get("relay")
    print_table(
        f"make bench-compare: {EVENTS:,} events in {per_tx}-event transactions ({server},"
        f" Kafka {KAFKA_VERSION}, Debezium {DEBEZIUM_VERSION}; inserted at"
        f" {insert_rate:,.0f}/s; slots copied at {lsn}; load {load_at_start} -> {load_average()})",
        [
            "contender",
            "drain ev/s",
            "x relay",
            "ev per CPU-s",
            "x relay",
            "peak RSS MB",
            "start-up s",
            "CPU s total",
            "records vs relay",
        ],
        [
            [
                name,
                fmt(f.events_per_s),
                _times(f.events_per_s, relay.events_per_s if relay else math.nan),
                fmt(f.events_per_cpu_s),
                _times(f.events_per_cpu_s, relay.events_per_cpu_s if relay else math.nan),
                fmt(f.peak_rss_mb, 1),
                fmt(f.startup_s, 2),
                fmt(f.cpu_total_s, 1),
                _verdict(comparisons.get(name), name),
            ]
            for name, f in ran.items()
        ],
    )
    print(
        "  (drain = first record -> last record in Kafka, pg_recvlogical: in its file;"
        " start-up = spawn -> first record; CPU = the contender's process, all threads)"
    )
    write_figures(
        f"compare-drain-{per_tx}",
        {
            "server": server,
            "kafka": KAFKA_VERSION,
            "debezium": DEBEZIUM_VERSION,
            "events": EVENTS,
            "events_per_tx": per_tx,
            "partitions": PARTITIONS,
            "slot_lsn": lsn,
            "insert_events_per_s": insert_rate,
            "contenders": [
                f.as_json()
                | ({"records_vs_relay": comparisons[name].summary()} if name in comparisons else {})
                for name, f in ran.items()
            ],
        },
        load_at_start=load_at_start,
    )
    for name, comparison in comparisons.items():
        assert comparison.ok, (
            f"{name}: {comparison.differences:,} records differ from the relay's"
            f" ({comparison.identical:,} identical); first ones:\n" + "\n".join(comparison.examples)
        )


def _times(value: float, relay: float) -> str:
    return "-" if math.isnan(value) or math.isnan(relay) or relay <= 0 else f"{value / relay:.2f}"


def _verdict(comparison: records.Comparison | None, name: str) -> str:
    if name == "relay":
        return "(itself)"
    if comparison is None:
        return "-"
    if comparison.ok:
        return f"{comparison.identical:,} identical"
    return f"{comparison.differences:,} DIFFER"
