"""Benchmarks of issue 11's parts, each a side-by-side ratio measured in one run.

* Partitioner: the same backlog drained by the relay with ``murmur2_random``
  (the default, Java-compatible) and with ``consistent_random`` (librdkafka's
  CRC32), runs interleaved, each on its own slot created before the backlog.
* Sharding: one relay on the whole outbox against two relays on row-filtered
  publications (``hashtext(aggregateid) & 1``) running at once, draining the
  same backlog; interleaved runs, slots created before the backlog.
* Backlog guard: the cost of ``check()`` answered from the cache against a full
  measurement (TTL 0), while a backlog waits in the slot.

Medians of the runs are printed with the machine's load average; no figure is
asserted, only that every event arrived.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from cdc.backlog import BacklogGuard
from cdc.settings import Settings
from tests.bench.conftest import acked_transactions, create_topics, relayed, topic_record_count
from tests.bench.report import fmt, print_table
from tests.harness import Proc, RelayConfig, free_port, http_status, start_relay, wait_until

pytestmark = [pytest.mark.bench, pytest.mark.integration]

EVENTS = 30_000
EVENTS_PER_TX = 100
REPEATS = 5
PARTITIONS = 6
CACHED_CHECKS = 20_000
MEASURED_CHECKS = 30


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min), {os.cpu_count()} cores"


def _fill(dsn: str, aggregate: str) -> None:
    """EVENTS outbox rows of ``aggregate`` in EVENTS_PER_TX-row transactions, server-side."""
    assert aggregate.isalnum()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"""
            DO $$
            BEGIN
              FOR lo IN 0..{EVENTS - 1} BY {EVENTS_PER_TX} LOOP
                INSERT INTO outbox (aggregatetype, aggregateid, type, payload)
                SELECT '{aggregate}', 'u' || i, 'UserRegistered',
                       jsonb_build_object('user_id', gen_random_uuid(), 'n', i)
                FROM generate_series(lo, lo + {EVENTS_PER_TX} - 1) AS i;
                COMMIT;
              END LOOP;
            END $$
            """
        )


def _slots(dsn: str, names: list[str]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_create_logical_replication_slot(name, 'pgoutput')"
            " FROM unnest(%s::text[]) AS name",
            (names,),
        )


def _transactions(dsn: str, aggregate: str, shard: int | None = None) -> int:
    """WAL transactions holding rows of ``aggregate`` (of one ``shard``'s row filter)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(DISTINCT xmin::text) FROM outbox WHERE aggregatetype = %(aggregate)s"
            " AND (%(shard)s::int IS NULL OR (hashtext(aggregateid) & 1) = %(shard)s::int)",
            {"aggregate": aggregate, "shard": shard},
        ).fetchone()
    return int(row[0]) if row else 0


def _first_ready(relays: list[tuple[Proc, int]]) -> float:
    """Wait until every relay answers /readyz (polled every 10 ms); the monotonic time
    the first one did: it streams from then on, whether the others are ready or not."""
    ready: dict[int, float] = {}

    def all_ready() -> bool:
        for proc, port in relays:
            if port in ready:
                continue
            if not proc.alive():
                raise AssertionError(f"relay exited early:\n{proc.log_tail()}")
            if http_status(f"http://127.0.0.1:{port}/readyz", timeout_s=1) == 200:
                ready[port] = time.monotonic()
        return len(ready) == len(relays)

    wait_until(all_ready, 120, "relays /readyz", interval_s=0.01)
    return min(ready.values())


def _drain_s(
    cfg: RelayConfig, tmp: Path, runs: list[tuple[dict[str, str], int]], topic: str
) -> float:
    """Start one relay per (env overlay, WAL transactions it streams) in ``runs`` at
    once; seconds from the first one ready (streaming) until each had its transactions
    acknowledged by Kafka (counted at the acknowledgement:
    :func:`tests.bench.conftest.wait_drained`); then, not timed, EVENTS in ``topic``
    (summed over the relays)."""
    relays: list[tuple[Proc, int]] = []
    try:
        for n, (extra, _) in enumerate(runs):
            relays.append(
                start_relay(
                    replace(cfg, extra={**cfg.extra, **extra}),
                    tmp,
                    name=f"r{n}-{extra['CDC_SLOT']}",
                    wait_ready=False,
                )
            )
        started = _first_ready(relays)
        wait_until(
            lambda: all(
                acked_transactions(port) >= transactions
                for (_, port), (_, transactions) in zip(relays, runs, strict=True)
            ),
            600,
            "every transaction acknowledged",
            interval_s=0.02,
        )
        elapsed_s = time.monotonic() - started
        wait_until(
            lambda: sum(relayed(port, topic) for _, port in relays) >= EVENTS,
            60,
            f"{EVENTS} events relayed",
        )
        return elapsed_s
    finally:
        for proc, _ in relays:
            proc.close()


@pytest.fixture
def cfg(db_dsn: str, kafka_bootstrap: str, unique: str) -> RelayConfig:
    return RelayConfig(
        db_dsn=db_dsn,
        kafka=kafka_bootstrap,
        unique=unique,
        partitions=PARTITIONS,
        extra={"LOG_LEVEL": "WARNING"},
    )


@pytest.mark.timeout(1200)
def test_partitioner_murmur2_against_crc32_drain_rate(
    cfg: RelayConfig, tmp_path: Path, slots_to_drop: list[str]
) -> None:
    topic = cfg.topic_prefix + "part"
    create_topics(cfg.kafka, [topic, cfg.dlq_topic], partitions=PARTITIONS)
    plan = [
        (run, partitioner, f"{cfg.slot}_{partitioner[:5]}_{run}")
        for run in range(REPEATS)
        for partitioner in ("murmur2_random", "consistent_random")
    ]
    slots_to_drop.extend(slot for _, _, slot in plan)
    _slots(cfg.db_dsn, [slot for _, _, slot in plan])
    _fill(cfg.db_dsn, "part")
    transactions = _transactions(cfg.db_dsn, "part")
    rates: dict[str, list[float]] = {"murmur2_random": [], "consistent_random": []}
    for _, partitioner, slot in plan:
        overlay = {"CDC_SLOT": slot, "KAFKA_CONFIG_PARTITIONER": partitioner}
        seconds = _drain_s(cfg, tmp_path, [(overlay, transactions)], topic)
        rates[partitioner].append(EVENTS / seconds)
    assert topic_record_count(cfg.kafka, topic) == EVENTS * len(plan)
    pairs = [
        m / c for m, c in zip(rates["murmur2_random"], rates["consistent_random"], strict=True)
    ]
    print_table(
        f"relay drain of {EVENTS:,} events ({EVENTS_PER_TX}-event tx), by partitioner,"
        f" runs interleaved; {_load()}",
        ["partitioner", "runs ev/s", "median ev/s"],
        [[p, " ".join(fmt(r) for r in rates[p]), fmt(statistics.median(rates[p]))] for p in rates]
        + [
            [
                "ratio murmur2/crc32 per pair",
                " ".join(fmt(r, 2) for r in pairs),
                fmt(statistics.median(pairs), 2),
            ]
        ],
    )


@pytest.mark.timeout(1200)
def test_sharded_relays_against_one_relay_drain_rate(
    cfg: RelayConfig, tmp_path: Path, slots_to_drop: list[str]
) -> None:
    topic = cfg.topic_prefix + "shard"
    create_topics(cfg.kafka, [topic, cfg.dlq_topic], partitions=PARTITIONS)
    pubs = [f"pub_{cfg.unique}_s{s}" for s in range(2)]
    with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
        for shard, pub in enumerate(pubs):
            conn.execute(
                sql.SQL(
                    "CREATE PUBLICATION {} FOR TABLE outbox"
                    " WHERE ((hashtext(aggregateid) & 1) = {}) WITH (publish = 'insert')"
                ).format(sql.Identifier(pub), sql.Literal(shard))
            )
    single = [f"{cfg.slot}_one_{run}" for run in range(REPEATS)]
    sharded = [[f"{cfg.slot}_s{s}_{run}" for s in range(2)] for run in range(REPEATS)]
    slots_to_drop.extend(single + [s for pair in sharded for s in pair])
    _slots(cfg.db_dsn, single + [s for pair in sharded for s in pair])
    _fill(cfg.db_dsn, "shard")
    # (a transaction with rows of both shards is streamed, and acknowledged, by both)
    whole = _transactions(cfg.db_dsn, "shard")
    per_shard = [_transactions(cfg.db_dsn, "shard", shard) for shard in range(2)]
    one_rates, two_rates = [], []
    try:
        for run in range(REPEATS):
            one = [({"CDC_SLOT": single[run]}, whole)]
            one_rates.append(EVENTS / _drain_s(cfg, tmp_path, one, topic))
            overlays = [
                (
                    {"CDC_SLOT": slot, "CDC_PUBLICATION": pub, "CDC_PUBLICATION_FILTERED": "true"},
                    transactions,
                )
                for slot, pub, transactions in zip(sharded[run], pubs, per_shard, strict=True)
            ]
            two_rates.append(EVENTS / _drain_s(cfg, tmp_path, overlays, topic))
    finally:
        with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
            for pub in pubs:
                conn.execute(sql.SQL("DROP PUBLICATION {}").format(sql.Identifier(pub)))
    assert topic_record_count(cfg.kafka, topic) == EVENTS * 2 * REPEATS
    one, two = statistics.median(one_rates), statistics.median(two_rates)
    pairs = [b / a for a, b in zip(one_rates, two_rates, strict=True)]
    print_table(
        f"drain of {EVENTS:,} events: one relay vs two row-filtered shards, runs interleaved;"
        f" {_load()}",
        ["setup", "runs ev/s", "median ev/s"],
        [
            ["1 relay, 1 slot", " ".join(fmt(r) for r in one_rates), fmt(one)],
            ["2 relays, 2 slots", " ".join(fmt(r) for r in two_rates), fmt(two)],
            [
                "ratio 2 shards / 1 per pair",
                " ".join(fmt(r, 2) for r in pairs),
                fmt(statistics.median(pairs), 2),
            ],
        ],
    )


def test_backlog_guard_cached_check_against_a_full_measurement(
    cfg: RelayConfig, slots_to_drop: list[str]
) -> None:
    """A backlog waits in the slot (no relay runs), so each measurement peeks it."""
    slots_to_drop.append(cfg.slot)
    _slots(cfg.db_dsn, [cfg.slot])
    _fill(cfg.db_dsn, "guard")
    env = cfg.env(free_port())
    cached = BacklogGuard(Settings.from_env({**env, "CDC_BACKLOG_CACHE_TTL_S": "3600"}))
    uncached = BacklogGuard(Settings.from_env({**env, "CDC_BACKLOG_CACHE_TTL_S": "0"}))
    try:
        warm = cached.check()
        assert warm.slot_lag_bytes and warm.relay_age_s is not None, warm.problems
        rounds: list[tuple[float, float]] = []
        for _ in range(REPEATS):
            started = time.perf_counter()
            for _ in range(CACHED_CHECKS):
                cached.check()
            per_cached = (time.perf_counter() - started) / CACHED_CHECKS
            started = time.perf_counter()
            for _ in range(MEASURED_CHECKS):
                uncached.check()
            per_measured = (time.perf_counter() - started) / MEASURED_CHECKS
            rounds.append((per_cached, per_measured))
    finally:
        cached.close()
        uncached.close()
    c, m = statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds)
    print_table(
        f"backlog guard check() with {EVENTS:,} events waiting in the slot; {_load()}",
        ["call", "runs (us per call)", "median us"],
        [
            ["cached (within TTL)", " ".join(fmt(r[0] * 1e6, 1) for r in rounds), fmt(c * 1e6, 1)],
            ["full measurement", " ".join(fmt(r[1] * 1e6) for r in rounds), fmt(m * 1e6)],
            ["ratio measurement / cached", "", fmt(m / c)],
        ],
    )
