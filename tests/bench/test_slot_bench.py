"""Slot-loss benchmarks: gap recovery's throughput beside the relay's streaming rate,
and the standby-safe mode's added commit->Kafka latency.

Recovery vs streaming (the local stack; :data:`REPEATS` runs, interleaved): a relay
starts on a fresh slot and publishes a few warm-up events; it stops and its slot
is dropped; :data:`EVENTS` events are committed; the relay starts again, finds the
gap (``slot_missing``) and re-publishes the window from the outbox table in an
exported snapshot (``CDC_GAP_MARGIN_S=0``: the window starts at its last record
in Kafka). Its own ``outbox_relay_recovered_events_total`` and
``outbox_relay_last_recovery_duration_seconds`` give rows/s (slot creation,
table read, publishing and waiting for every ack). Then, with the relay stopped,
as many events are committed again and the relay drains them from the new
slot: ``/readyz`` -> all acknowledged gives the streaming rate.

Standby-safe latency (a primary with a streaming standby of the bench's own,
:mod:`tests.clusters`, the standby connected directly): two relays stream the
same commits at the same time, one with ``CDC_STANDBY_SAFE`` naming the standby
and one without; a paced writer commits 1-event transactions; a consumer
timestamps every record on receipt and subtracts its ``commit_ts`` header. p50
and p99 per relay, side by side, with their ratio and the load average.

Figures are printed; only correctness is asserted (every event arrived).
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from psycopg import sql

from cdc.migrate import migrate
from tests.bench.conftest import Pace, create_topics, paced, wait_drained
from tests.bench.report import fmt, metric_sum, percentile, print_table, scrape
from tests.clusters import STANDBY_SLOT, ClusterPair, clusters_root
from tests.conftest import drop_database
from tests.harness import (
    Proc,
    RelayConfig,
    drop_slot,
    headers_of,
    http_status,
    start_relay,
    wait_until,
)

pytestmark = [pytest.mark.bench, pytest.mark.integration]

EVENTS = 20_000
EVENTS_PER_TX = 100
REPEATS = 3
WARMUP = 50
PARTITIONS = 6
LATENCY_RATE_PER_S = 300
LATENCY_DURATION_S = 15.0
PAYLOAD_SQL = (
    "jsonb_build_object('user_id', gen_random_uuid(), 'email', 'u' || i || '@example.org',"
    " 'display_name', 'User ' || i, 'registered_at', now())"
)


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.1f} / {five:.1f} / {fifteen:.1f} (1/5/15 min, 2 cores)"


def _fill(dsn: str, aggregate: str, total: int, per_tx: int = EVENTS_PER_TX) -> None:
    assert aggregate.isalnum()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"""
            DO $$
            BEGIN
              FOR lo IN 0..{total - 1} BY {per_tx} LOOP
                INSERT INTO outbox (aggregatetype, aggregateid, type, payload)
                SELECT '{aggregate}', 'u' || i, 'UserRegistered', {PAYLOAD_SQL}
                FROM generate_series(lo, least(lo + {per_tx}, {total}) - 1) AS i;
                COMMIT;
              END LOOP;
            END $$
            """
        )


def _ready(proc: Proc, port: int, timeout_s: float = 300.0) -> float:
    def ready() -> bool:
        if not proc.alive():
            raise AssertionError(f"relay exited early:\n{proc.log_tail()}")
        return http_status(f"http://127.0.0.1:{port}/readyz", timeout_s=1) == 200

    wait_until(ready, timeout_s, "relay /readyz", interval_s=0.01)
    return time.monotonic()


def _relayed(port: int, topic: str) -> float:
    return metric_sum(scrape(port), "outbox_relay_events_total", topic=topic)


def _recovery_run(cfg: RelayConfig, tmp: Path, run: int) -> tuple[float, float, int]:
    """One run on its own slot and topics: (recovery rows/s, streaming ev/s, rows recovered)."""
    warm, gap, tail = f"warm{run}", f"gap{run}", f"tail{run}"
    create_topics(
        cfg.kafka, [cfg.topic_prefix + t for t in (warm, gap, tail)], partitions=PARTITIONS
    )
    relay, port = start_relay(cfg, tmp, name=f"first-{run}")
    try:
        _fill(cfg.db_dsn, warm, WARMUP)
        wait_until(lambda: _relayed(port, cfg.topic_prefix + warm) >= WARMUP, 120, "warm-up")
        assert relay.terminate() == 0, relay.log_tail()
    finally:
        relay.close()
    drop_slot(cfg.db_dsn, cfg.slot)
    _fill(cfg.db_dsn, gap, EVENTS)  # committed while the slot is gone

    relay, port = start_relay(cfg, tmp, name=f"recover-{run}", wait_ready=False)
    try:
        _ready(relay, port)
        text = scrape(port)
        rows = int(metric_sum(text, "outbox_relay_recovered_events_total"))
        seconds = metric_sum(text, "outbox_relay_last_recovery_duration_seconds")
        assert rows >= EVENTS, f"recovered {rows} of {EVENTS}"
        assert relay.terminate() == 0, relay.log_tail()
    finally:
        relay.close()

    _fill(cfg.db_dsn, tail, EVENTS)  # the same amount, now in the new slot
    relay, port = start_relay(cfg, tmp, name=f"stream-{run}", wait_ready=False)
    try:
        started = _ready(relay, port)
        drained = wait_drained(
            port,
            cfg.topic_prefix + tail,
            events=EVENTS,
            transactions=math.ceil(EVENTS / EVENTS_PER_TX),
        )
        stream_per_s = EVENTS / (drained - started)
        assert relay.terminate() == 0, relay.log_tail()
    finally:
        relay.close()
    return rows / seconds, stream_per_s, rows


@pytest.mark.timeout(1800)
def test_gap_recovery_republishes_from_the_table_beside_the_streaming_rate(
    db_dsn: str, kafka_bootstrap: str, unique: str, tmp_path: Path
) -> None:
    runs = []
    for run in range(REPEATS):
        cfg = RelayConfig(
            db_dsn=db_dsn,
            kafka=kafka_bootstrap,
            unique=f"{unique}{run}",
            partitions=PARTITIONS,
            extra={"LOG_LEVEL": "WARNING", "CDC_GAP_MARGIN_S": "0"},
        )
        try:
            runs.append(_recovery_run(cfg, tmp_path, run))
        finally:
            drop_slot(db_dsn, cfg.slot)
    rows = [
        [str(n + 1), fmt(rec), fmt(stream), fmt(rec / stream, 2), fmt(count)]
        for n, (rec, stream, count) in enumerate(runs)
    ]
    med_rec = statistics.median(r[0] for r in runs)
    med_stream = statistics.median(r[1] for r in runs)
    rows.append(["median", fmt(med_rec), fmt(med_stream), fmt(med_rec / med_stream, 2), ""])
    print_table(
        f"gap recovery from the outbox table vs streaming, {EVENTS:,} events"
        f" (100-event transactions; {_load()})",
        ["run", "recovery rows/s", "streaming ev/s", "ratio", "rows recovered"],
        rows,
    )
    print(
        "  (recovery: the relay's own duration - new slot with an exported snapshot, table read,"
        " publish, every ack; streaming: /readyz -> all acknowledged)"
    )


# --- standby-safe latency ---------------------------------------------------------------


@pytest.fixture(scope="module")
def direct_pair() -> Iterator[ClusterPair]:
    pair = ClusterPair.create(clusters_root(), proxied_link=False)
    try:
        yield pair
    finally:
        pair.close()


class _Receiver(threading.Thread):
    """Consumes both topics; per topic, receive time - commit_ts of every record."""

    def __init__(self, consumer: Consumer) -> None:
        super().__init__(name="latency-receiver", daemon=True)
        self.consumer = consumer
        self.latencies_s: dict[str, list[float]] = {}
        self.ids: dict[str, set[str]] = {}
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                msg = self.consumer.poll(0.05)
                received = time.time()
                if msg is None:
                    continue
                if msg.error():
                    raise RuntimeError(str(msg.error()))
                headers = headers_of(msg)
                committed = datetime.fromisoformat(headers["commit_ts"].decode())
                topic = msg.topic()
                self.latencies_s.setdefault(topic, []).append(received - committed.timestamp())
                self.ids.setdefault(topic, set()).add(headers["id"].decode())
        except BaseException as exc:
            self.error = exc


@pytest.mark.timeout(900)
def test_standby_safe_mode_added_commit_to_kafka_latency(
    direct_pair: ClusterPair, kafka_bootstrap: str, unique: str, tmp_path: Path
) -> None:
    pair = direct_pair
    name = f"cdc_bench_{unique}"
    with psycopg.connect(pair.primary.dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    migrate(pair.primary.dsn(name))
    dsn = pair.dsn(name)
    off = RelayConfig(dsn, kafka_bootstrap, f"{unique}off", PARTITIONS, {"LOG_LEVEL": "WARNING"})
    on = replace(
        off,
        unique=f"{unique}on",
        extra={**off.extra, "CDC_STANDBY_SAFE": STANDBY_SLOT},
    )
    topics = {cfg.topic_prefix + "lat": label for cfg, label in ((off, "off"), (on, "on"))}
    create_topics(kafka_bootstrap, list(topics), partitions=PARTITIONS)
    consumer = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": f"bench-safe-{unique}",
            "enable.auto.commit": False,
            "fetch.wait.max.ms": 5,
            "fetch.error.backoff.ms": 5,
        }
    )
    consumer.assign(
        [TopicPartition(t, p, OFFSET_BEGINNING) for t in topics for p in range(PARTITIONS)]
    )
    receiver = _Receiver(consumer)
    receiver.start()
    relays = [start_relay(cfg, tmp_path, name=f"relay-{cfg.unique}") for cfg in (off, on)]
    pace = Pace(0, 0.0, 0.0)
    expect = round(LATENCY_RATE_PER_S * LATENCY_DURATION_S)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for i in paced(LATENCY_RATE_PER_S, LATENCY_DURATION_S, pace):
                conn.execute(
                    "INSERT INTO outbox (aggregatetype, aggregateid, type, payload)"
                    " VALUES ('lat', %s, 'BenchLatency', '{\"source\": \"bench\"}')",
                    (f"k{i % 100}",),
                )
        wait_until(
            lambda: all(len(receiver.ids.get(t, ())) >= expect for t in topics) or receiver.error,
            180,
            "latency records",
        )
        held_lag = metric_sum(scrape(relays[1][1]), "outbox_relay_standby_lag_bytes")
        for proc, _ in relays:
            assert proc.terminate() == 0, proc.log_tail()
    finally:
        receiver.stop.set()
        receiver.join(10)
        consumer.close()
        for proc, _ in relays:
            proc.close()
        drop_database(pair.primary.dsn(), pair.primary.dsn(name))
    assert receiver.error is None, receiver.error
    for topic in topics:
        assert len(receiver.ids[topic]) == expect, f"{topic}: {len(receiver.ids[topic])}"
    ms = {label: [s * 1000 for s in receiver.latencies_s[t]] for t, label in topics.items()}
    rows = []
    for q in (50, 99):
        off_ms, on_ms = percentile(ms["off"], q), percentile(ms["on"], q)
        rows.append(
            [f"p{q}", fmt(off_ms, 1), fmt(on_ms, 1), fmt(on_ms - off_ms, 1), fmt(on_ms / off_ms, 2)]
        )
    print_table(
        f"standby-safe mode: commit -> consumer receive, {LATENCY_RATE_PER_S}/s offered for"
        f" {LATENCY_DURATION_S:.0f} s, both relays on the same commits ({_load()})",
        ["quantile", "off ms", "on ms", "added ms", "ratio on/off"],
        rows,
    )
    print(
        f"  (writer achieved {pace.rate_per_s:,.0f}/s, at most {pace.max_behind_s * 1000:.0f} ms"
        f" behind; standby lag at the end {held_lag:,.0f} bytes; poll interval 5 ms)"
    )
