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
import statistics
from dataclasses import dataclass, replace
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
#: BENCH_COMPARE_REPEATS: drains per contender and case, the order of the contenders
#: rotated each time (medians reported); each drain has its own copy of the slot.
REPEATS = int(os.environ.get("BENCH_COMPARE_REPEATS", "1"))
#: BENCH_COMPARE_ONLY=relay,pg_recvlogical: a subset of the contenders, in this order.
ORDER = ("pg_recvlogical", "relay", "debezium", "debezium-tuned")
ONLY = [c for c in os.environ.get("BENCH_COMPARE_ONLY", ",".join(ORDER)).split(",") if c]
KAFKA_VERSION = "4.1.1"
DEBEZIUM_VERSION = "3.6.1.Final"
#: Topic prefix letter of each contender that writes to Kafka (the relay's is its own).
PREFIX_LETTER = {"debezium": "d", "debezium-tuned": "e"}


@dataclass(frozen=True)
class Drain:
    """One contender's drain: its repeat, its slot, where it publishes."""

    name: str
    repeat: int
    slot: str
    #: The topic prefix (the relay's is its configuration's) and the case's topic under it.
    prefix: str
    topic: str
    cfg: RelayConfig


def _drains(cfg: RelayConfig, names: list[str], aggregate: str) -> list[Drain]:
    """Every drain of the case, in running order: each repeat rotates the contenders."""
    out = []
    for repeat in range(REPEATS):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            run_cfg = replace(cfg, unique=f"{cfg.unique}r{repeat}")
            prefix = (
                run_cfg.topic_prefix
                if name in ("relay", "pg_recvlogical")
                else f"{PREFIX_LETTER[name]}{run_cfg.unique}.outbox.event."
            )
            slot = f"{cfg.slot}_{name.replace('-', '_')}_{repeat}"
            out.append(Drain(name, repeat, slot, prefix, prefix + aggregate, run_cfg))
    return out


@pytest.mark.timeout(1800)
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
    assert REPEATS >= 1, "BENCH_COMPARE_REPEATS must be at least 1"
    load_at_start = load_average()
    aggregate = f"cmp{per_tx}"
    drains = _drains(cfg, [c for c in ORDER if c in ONLY], aggregate)
    kafka_drains = [d for d in drains if d.name != "pg_recvlogical"]
    dead_letters = [d.cfg.dlq_topic for d in kafka_drains if d.name == "relay"]
    create_topics(cfg.kafka, [d.topic for d in kafka_drains] + dead_letters, partitions=PARTITIONS)
    slots_to_drop.extend(d.slot for d in drains)
    lsn = copy_slots(cfg.db_dsn, drains[0].slot, [d.slot for d in drains[1:]])
    insert_rate = _fill(cfg.db_dsn, aggregate, EVENTS, per_tx)
    with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        endpos = row[0]
        # WAL past endpos, so pg_recvlogical sees a message beyond it and stops.
        conn.execute("SELECT pg_logical_emit_message(false, 'bench-end', '')")

    jars = request.getfixturevalue("debezium_jars") if "debezium" in " ".join(ONLY) else None
    ran: dict[str, list[Figures]] = {name: [] for name in ORDER if name in ONLY}
    for d in drains:
        if d.name == "pg_recvlogical":
            figures = run_pg_recvlogical(
                _pg_recvlogical(), cfg.db_dsn, tmp_path, slot=d.slot, endpos=endpos,
                events=EVENTS,
            )  # fmt: skip
        elif d.name == "relay":
            figures = run_relay(d.cfg, tmp_path, slot=d.slot, topics=[d.topic], events=EVENTS)
        else:
            assert d.name in DEBEZIUM_VARIANTS and jars is not None
            figures = run_debezium(
                d.name, jars, tmp_path / f"r{d.repeat}", kafka=cfg.kafka, dsn=cfg.db_dsn,
                slot=d.slot, topic_prefix=d.prefix, topics=[d.topic], events=EVENTS,
                rest_port=free_port(),
            )  # fmt: skip
        ran[d.name].append(figures)

    comparisons: dict[str, list[records.Comparison]] = {}
    relay_topics = [d.topic for d in drains if d.name == "relay"]
    if relay_topics:
        relay_records, relay_total = records.by_id(
            records.read(cfg.kafka, relay_topics[:1], expect=EVENTS)
        )
        for d in drains:
            if d.name in DEBEZIUM_VARIANTS:
                comparisons.setdefault(d.name, []).append(
                    records.compare(
                        relay_records,
                        records.read(cfg.kafka, [d.topic], expect=EVENTS),
                        relay_total=relay_total,
                    )
                )

    server = _server(cfg.db_dsn)
    medians = {name: _median(runs) for name, runs in ran.items()}
    relay = medians.get("relay")
    print_table(
        f"make bench-compare: {EVENTS:,} events in {per_tx}-event transactions ({server},"
        f" Kafka {KAFKA_VERSION}, Debezium {DEBEZIUM_VERSION}; inserted at"
        f" {insert_rate:,.0f}/s; slots copied at {lsn}; {REPEATS} drain(s) per contender,"
        f" medians; load {load_at_start} -> {load_average()})",
        [
            "contender",
            "drain ev/s",
            "range",
            "x relay",
            "ev per CPU-s",
            "x relay",
            "peak RSS MB",
            "start-up s",
            "2nd half ev/s",
            "2nd half ev/CPU-s",
            "records vs relay",
        ],
        [
            [
                name,
                fmt(m["events_per_s"]),
                _range([f.events_per_s for f in ran[name]]),
                _times(m["events_per_s"], relay["events_per_s"] if relay else math.nan),
                fmt(m["events_per_cpu_s"]),
                _times(m["events_per_cpu_s"], relay["events_per_cpu_s"] if relay else math.nan),
                fmt(m["peak_rss_mb"], 1),
                fmt(m["startup_s"], 2),
                fmt(m["late_events_per_s"]),
                fmt(m["late_events_per_cpu_s"]),
                _verdict(comparisons.get(name), name),
            ]
            for name, m in medians.items()
        ],
    )
    print(
        "  (drain = first record -> last record in Kafka, pg_recvlogical: in its file;"
        " start-up = spawn -> first record; CPU = the contender's process, all threads;"
        " peak RSS = the highest of the drains; 2nd half = the backlog's middle record to its"
        " last, without the start of the drain)"
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
            "repeats": REPEATS,
            "running_order": [f"{d.name}#{d.repeat}" for d in drains],
            "slot_lsn": lsn,
            "insert_events_per_s": insert_rate,
            "contenders": [
                {"name": name, **m, "runs": [f.as_json() for f in ran[name]]}
                | (
                    {"records_vs_relay": [c.summary() for c in comparisons[name]]}
                    if name in comparisons
                    else {}
                )
                for name, m in medians.items()
            ],
        },
        load_at_start=load_at_start,
    )
    for name, found in comparisons.items():
        for comparison in found:
            assert comparison.ok, (
                f"{name}: {comparison.differences:,} records differ from the relay's"
                f" ({comparison.identical:,} identical); first ones:\n"
                + "\n".join(comparison.examples)
            )


def _median(runs: list[Figures]) -> dict[str, float]:
    """Medians of a contender's drains (peak RSS: the highest)."""
    return {
        "events_per_s": statistics.median(f.events_per_s for f in runs),
        "events_per_cpu_s": statistics.median(f.events_per_cpu_s for f in runs),
        "startup_s": statistics.median(f.startup_s for f in runs),
        "peak_rss_mb": max(f.peak_rss_mb for f in runs),
        "late_events_per_s": statistics.median(f.late_events_per_s for f in runs),
        "late_events_per_cpu_s": statistics.median(f.late_events_per_cpu_s for f in runs),
    }


def _range(values: list[float]) -> str:
    return f"{min(values):,.0f}-{max(values):,.0f}" if len(values) > 1 else ""


def _times(value: float, relay: float) -> str:
    return "-" if math.isnan(value) or math.isnan(relay) or relay <= 0 else f"{value / relay:.2f}"


def _verdict(found: list[records.Comparison] | None, name: str) -> str:
    if name == "relay":
        return "(itself)"
    if not found:
        return "-"
    different = sum(c.differences for c in found)
    if different == 0 and all(c.ok for c in found):
        return f"{sum(c.identical for c in found):,} identical"
    return f"{different:,} DIFFER"
