"""Exactly-once publishing's cost: drain rate against at-least-once, commit->read_committed latency.

Drain: for each of 1-event and 100-event transactions, a pair of slots per run is
created at one moment, ``BENCH_EOS_EVENTS`` events (300,000 by default) are
written while nothing streams, then - ``REPEATS`` times, interleaved - an
at-least-once relay drains one slot and an exactly-once relay the other, each timed
from its ``/readyz`` until Kafka acknowledged every transaction of the backlog
(:func:`tests.bench.conftest.wait_drained`) and, exactly-once, the last Kafka
transaction committed (the exactly-once relay's commits fall inside that time; its
reading goes on during them, buffering the next transaction: cdc.relay.delivery.overlap).
Each run's relay CPU and the machine's are printed beside it, with the load average.
Goal (issue 40): exactly-once / at-least-once >= 0.8, judged on the median of the
pairs' ratios - each pair runs back to back on the same machine state, and on this
2-core machine one mode's rate moves by up to 30% between pairs, which the pair's
ratio cancels and a ratio of the two modes' medians does not (printed beside it).
Why 300,000: a drain is timed
from /readyz, and each session has fixed costs that are not a rate - the first
transaction's partition registrations, the last commit, the poll of the relay's metrics
every 20 ms; 100,000 events in 100-event transactions drain in about a second, and in
60,000-event runs the ratio came out 0.52-0.66 where 300,000-event runs of the same code
gave 0.94-1.02 (the at-least-once relay's short drains run ahead on its in-flight bound).

Latency: a paced writer commits 1-event transactions at 2,000/s for
``BENCH_EOS_LATENCY_S`` seconds while an exactly-once relay runs; a consumer with
``isolation.level=read_committed`` timestamps every record on receipt and subtracts
its ``commit_ts`` header: the figure holds the wait for the Kafka commit
(``CDC_TX_MAX_MS``) and Kafka's consume delay. Goal: p99 <= 100 ms. Beside it, in the
same run and on the same broker: Kafka's own floor (:mod:`tests.bench.kafka_txn_floor`:
a bare transactional producer at the same rate and window, no relay, no PostgreSQL),
and the ratio of the two p99s - the part of the figure the relay is answerable for.

Only correctness is asserted (every event arrives once); the figures are printed
with their goals and recorded for ``make bench``'s summary.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from cdc.settings import Settings
from tests.bench.conftest import Pace, create_topics, paced, slots_to_drop, wait_drained
from tests.bench.kafka_txn_floor import floor_latencies
from tests.bench.report import (
    CpuMeter,
    fmt,
    histogram_buckets,
    load_average,
    metric_sum,
    percentile,
    print_table,
    record_goal,
    scrape,
)
from tests.bench.test_relay_bench import (
    PARTITIONS,
    WARMUP_EVENTS,
    _fill,
    _insert_sql,
    _Receiver,
    _wait_ready_precisely,
    cfg,
)
from tests.harness import RelayConfig, start_relay, wait_until

pytestmark = [pytest.mark.bench, pytest.mark.integration]

__all__ = ["cfg", "slots_to_drop"]  # (fixtures, shared with the relay bench)

#: Timed drains per mode and case (median reported).
REPEATS = int(os.environ.get("BENCH_EOS_REPEATS", "5"))
GOAL_RATIO = 0.8
#: The drain's backlog per case (see the module docstring for why this many).
EOS_EVENTS = int(os.environ.get("BENCH_EOS_EVENTS", "300000"))
#: The window a relay with default settings commits at (the floor uses the same).
DEFAULT_TX_MAX_MS = int(Settings.model_fields["tx_max_ms"].default)
LATENCY_RATE_PER_S = 2_000
LATENCY_DURATION_S = float(os.environ.get("BENCH_EOS_LATENCY_S", "15"))
GOAL_P99_MS = 100.0
EOS = {"CDC_DELIVERY": "exactly-once"}


@dataclass(frozen=True)
class _Drain:
    """One timed drain: the relay's rate, and the CPU the relay and the machine used."""

    per_s: float
    #: CPU % of one core over the drain (the machine: all cores, 2 cores = 200)
    relay_cpu_pct: float
    machine_cpu_pct: float
    #: exactly-once: the relay's commits (count, mean ms, p99 bucket ms) and the records
    #: it read while one was under way (buffered for the next)
    commits: tuple[int, float, float] | None = None
    overlapped: int = 0

    @property
    def per_cpu_s(self) -> float:
        """Events per relay CPU-second: less moved by the machine's other load."""
        share = self.relay_cpu_pct / 100.0
        return self.per_s / share if share > 0 else math.nan  # (a drain too short to meter)


def _drain(
    cfg: RelayConfig, tmp: Path, *, slot: str, topic: str, per_tx: int, extra: dict[str, str]
) -> _Drain:
    """The relay's drain of the backlog of ``slot``, timed from its /readyz until every
    transaction was acknowledged by Kafka and, exactly-once, committed."""
    # (each repeat's slot shares the topic: its start finds its own newest record
    # (none yet) only under every earlier drain's records)
    tail = {"CDC_GAP_TAIL_MAX_RECORDS": str(max(100_000, EOS_EVENTS * (REPEATS + 1)))}
    run_cfg = replace(cfg, extra={**cfg.extra, **extra, **tail, "CDC_SLOT": slot})
    relay, port = start_relay(run_cfg, tmp, name=f"relay-{slot}", wait_ready=False)
    try:
        t_ready = _wait_ready_precisely(relay, port)
        cpu = CpuMeter({"relay": relay.pid}).start()
        drained = wait_drained(
            port,
            topic,
            events=EOS_EVENTS,
            transactions=math.ceil(EOS_EVENTS / per_tx),
            committed=extra == EOS,
        )
        elapsed_s = drained - t_ready
        cpu_pct = cpu.stop()
        text = scrape(port) if extra == EOS else ""
        assert relay.terminate() == 0, relay.log_tail()
    finally:
        relay.close()
    drain = _Drain(EOS_EVENTS / elapsed_s, cpu_pct["relay"], cpu_pct["machine"])
    if not text:
        return drain
    overlapped = int(metric_sum(text, "outbox_relay_kafka_commit_overlap_records_total"))
    return replace(drain, commits=_commit_seconds(text), overlapped=overlapped)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("per_tx", [1, 100], ids=["1-event-tx", "100-event-tx"])
def test_exactly_once_drains_a_backlog_at_most_a_fifth_slower_than_at_least_once(
    per_tx: int, cfg: RelayConfig, tmp_path: Path, slots_to_drop: list[str]
) -> None:
    aggregate = f"eos{per_tx}"
    topic = cfg.topic_prefix + aggregate
    alo_slots = [f"{cfg.slot}_alo{run}" for run in range(REPEATS)]
    eos_slots = [f"{cfg.slot}_eos{run}" for run in range(REPEATS)]
    create_topics(cfg.kafka, [topic, cfg.dlq_topic], partitions=PARTITIONS)
    with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
        slots_to_drop.extend(alo_slots + eos_slots)
        conn.execute(
            "SELECT pg_create_logical_replication_slot(name, 'pgoutput')"
            " FROM unnest(%s::text[]) AS name",
            (alo_slots + eos_slots,),
        )
    _fill(cfg.db_dsn, aggregate, EOS_EVENTS, per_tx)
    load_before = load_average()
    alo: list[_Drain] = []
    eos: list[_Drain] = []
    for run, (alo_slot, eos_slot) in enumerate(zip(alo_slots, eos_slots, strict=True)):
        # (each mode goes first every other run: a first drain reads the WAL from disk)
        order = [(alo, alo_slot, {}), (eos, eos_slot, EOS)]
        for drains, slot, extra in order if run % 2 == 0 else order[::-1]:
            drains.append(_drain(cfg, tmp_path, slot=slot, topic=topic, per_tx=per_tx, extra=extra))
    median_alo = statistics.median(d.per_s for d in alo)
    median_eos = statistics.median(d.per_s for d in eos)
    ratio = statistics.median(e.per_s / a.per_s for a, e in zip(alo, eos, strict=True))
    cpu_ratio = statistics.median(e.per_cpu_s / a.per_cpu_s for a, e in zip(alo, eos, strict=True))
    print_table(
        f"exactly-once vs at-least-once drain, {EOS_EVENTS:,} events in {per_tx}-event"
        f" transactions ({REPEATS} runs each, interleaved; load average {load_before} before,"
        f" {load_average()} after, {os.cpu_count()} cores)",
        [
            "run",
            "at-least-once ev/s",
            "relay CPU %",
            "machine CPU %",
            "exactly-once ev/s",
            "relay CPU %",
            "machine CPU %",
            "ratio",
            "ratio per relay CPU-s",
        ],
        [
            [
                str(i + 1),
                fmt(a.per_s),
                fmt(a.relay_cpu_pct),
                fmt(a.machine_cpu_pct),
                fmt(e.per_s),
                fmt(e.relay_cpu_pct),
                fmt(e.machine_cpu_pct),
                fmt(e.per_s / a.per_s, 2),
                fmt(e.per_cpu_s / a.per_cpu_s, 2),
            ]
            for i, (a, e) in enumerate(zip(alo, eos, strict=True))
        ]
        + [
            [
                "median",
                fmt(median_alo),
                "",
                "",
                fmt(median_eos),
                "",
                "",
                f"{ratio:.2f} (goal >= {GOAL_RATIO}; median / median"
                f" {median_eos / median_alo:.2f})",
                fmt(cpu_ratio, 2),
            ]
        ],
    )
    for i, e in enumerate(eos):
        if e.commits is not None:
            count, mean_ms, p99_le_ms = e.commits
            print(
                f"  exactly-once run {i + 1}: {count:,} commits, mean {mean_ms:.1f} ms, p99 <="
                f" {p99_le_ms:g} ms (bucket); {e.overlapped:,} records read during a commit"
            )
    print(
        "  (each drain: /readyz -> all acknowledged; CPU % of one core, machine = all"
        " processes; per relay CPU-s = ev/s / the relay's CPU share, less moved by other load;"
        " the median row's ratio: the median of the pairs')"
    )
    record_goal(
        f"exactly-once / at-least-once drain, {per_tx}-event tx", ratio, at_least=GOAL_RATIO
    )
    assert all(math.isfinite(d.per_s) and d.per_s > 0 for d in alo + eos)


def _commit_seconds(text: str) -> tuple[int, float, float]:
    """The relay's commits from its /metrics: how many, their mean (ms) and the bucket
    bound (ms) at or below which 99% of them ended."""
    name = "outbox_relay_kafka_commit_seconds"
    count = metric_sum(text, f"{name}_count")
    total = metric_sum(text, f"{name}_sum")
    buckets = sorted(histogram_buckets(text, name).items())
    p99_le = next((le for le, v in buckets if v >= 0.99 * count), math.inf)
    return int(count), 1000.0 * total / count if count else math.nan, 1000.0 * p99_le


@pytest.mark.timeout(600)
def test_exactly_once_commit_to_read_committed_consumer_latency_at_2000_per_s(
    cfg: RelayConfig, tmp_path: Path, slots_to_drop: list[str]
) -> None:
    topic = cfg.topic_prefix + "latency"
    create_topics(cfg.kafka, [topic, cfg.dlq_topic], partitions=PARTITIONS)
    slots_to_drop.append(cfg.slot)
    expect = round(LATENCY_RATE_PER_S * LATENCY_DURATION_S)
    consumer = Consumer(
        {
            "bootstrap.servers": cfg.kafka,
            "group.id": f"bench-eos-latency-{cfg.unique}",
            "enable.auto.commit": False,
            "fetch.wait.max.ms": 5,
            "fetch.error.backoff.ms": 5,
            "isolation.level": "read_committed",
        }
    )
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
    receiver = _Receiver(consumer)
    receiver.start()
    eos_cfg = replace(cfg, extra={**cfg.extra, **EOS})
    relay, port = start_relay(eos_cfg, tmp_path)
    payload = '{"user_id": "00000000-0000-0000-0000-000000000000", "source": "bench"}'
    pace = Pace(0, 0.0, 0.0)
    try:
        with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
            for i in range(WARMUP_EVENTS):
                conn.execute(_insert_sql("Warmup"), (f"w{i}", payload))
            wait_until(lambda: receiver.warmup >= WARMUP_EVENTS, 60, "warm-up records")
            for i in paced(LATENCY_RATE_PER_S, LATENCY_DURATION_S, pace):
                conn.execute(_insert_sql("BenchLatency"), (f"k{i % 1000}", payload))
        wait_until(lambda: len(receiver.ids) >= expect or receiver.error, 120, "latency records")
        commits = _commit_seconds(scrape(port))
        assert relay.terminate() == 0, relay.log_tail()
    finally:
        receiver.stop.set()
        receiver.join(10)
        consumer.close()
        relay.close()
    assert receiver.error is None, receiver.error
    assert len(receiver.ids) == expect, f"{len(receiver.ids)} of {expect} events arrived"
    assert len(receiver.latencies_s) == expect, "a record seen twice by read_committed"
    lat_ms = [s * 1000.0 for s in receiver.latencies_s]
    p50, p99 = percentile(lat_ms, 50), percentile(lat_ms, 99)
    floor = floor_latencies(
        cfg.kafka,
        cfg.topic_prefix,
        partitions=PARTITIONS,
        rate_per_s=LATENCY_RATE_PER_S,
        duration_s=LATENCY_DURATION_S,
        window_ms=DEFAULT_TX_MAX_MS,
    )
    assert len(floor.latencies_ms) == floor.pace.events, "the floor's records arrived once"
    floor_p50 = percentile(floor.latencies_ms, 50)
    floor_p99 = percentile(floor.latencies_ms, 99)
    print_table(
        f"exactly-once commit->read_committed consumer, {LATENCY_RATE_PER_S:,}/s offered for"
        f" {LATENCY_DURATION_S:.0f} s (1-event transactions, CDC_TX_MAX_MS {DEFAULT_TX_MAX_MS}"
        f" (default); load average {load_average()}, {os.cpu_count()} cores)",
        ["figure", "relay", "Kafka's floor", "relay / floor", "goal"],
        [
            [
                "offered rate achieved ev/s",
                fmt(pace.rate_per_s),
                fmt(floor.pace.rate_per_s),
                "",
                "",
            ],
            ["p50 ms", fmt(p50, 1), fmt(floor_p50, 1), fmt(p50 / floor_p50, 2), ""],
            [
                "p99 ms",
                fmt(p99, 1),
                fmt(floor_p99, 1),
                fmt(p99 / floor_p99, 2),
                f"relay <= {GOAL_P99_MS:.0f}",
            ],
            ["max ms", fmt(max(lat_ms), 1), fmt(max(floor.latencies_ms), 1), "", ""],
        ],
    )
    count, mean_ms, p99_le_ms = commits
    print(
        f"  relay's commits (outbox_relay_kafka_commit_seconds, due -> Kafka's answer): {count:,},"
        f" mean {mean_ms:.1f} ms, p99 <= {p99_le_ms:g} ms (bucket)"
    )
    print(
        "  (relay: PostgreSQL commit_ts -> receipt; floor: a bare transactional producer on"
        f" the same broker, produce -> receipt, {floor.commits} commits: kafka_txn_floor.py)"
    )
    record_goal(
        f"exactly-once commit->read_committed p99 ms at {LATENCY_RATE_PER_S:,}/s",
        p99,
        at_most=GOAL_P99_MS,
        digits=1,
    )


# -- sharded relays: exactly-once against at-least-once, two relays at once -------------

#: The sharded drains' aggregate type (each drain's topic: its own prefix + this).
AGGREGATE = "eosshard"
#: The sharding recipe's row filter (docs/relay/scaling.md), a `%` in it.
SHARD_FILTER = "(((hashtext(aggregateid) & 2147483647) % 2) = {shard})"


def _shard_drain(
    cfg: RelayConfig,
    tmp: Path,
    *,
    slots: list[str],
    pubs: list[str],
    topic: str,
    shares: list[int],
    per_tx: int,
    extra: dict[str, str],
) -> float:
    """Both shards' relays started at once on their backlogs; events/s over the two
    (from the later /readyz until both acknowledged - exactly-once: committed - every
    transaction)."""
    relays = []
    try:
        for shard, (slot, pub) in enumerate(zip(slots, pubs, strict=True)):
            run = replace(
                cfg,
                extra={
                    **cfg.extra,
                    **extra,
                    "CDC_SLOT": slot,
                    "CDC_PUBLICATION": pub,
                    "CDC_PUBLICATION_FILTERED": "true",
                    # (the recipe: both shards share one prefix; each drain a prefix of its
                    # own, so a start reads an empty tail, not every earlier drain's records:
                    # 2,400,000 of them kept a start past the 60 s readiness bound at load 20)
                    "CDC_TOPIC_PREFIX": topic[: -len(AGGREGATE)],
                },
            )
            relays.append(start_relay(run, tmp, name=f"shard{shard}-{slot}", wait_ready=False))
        ready = max(_wait_ready_precisely(relay, port) for relay, port in relays)
        drained = max(
            wait_drained(
                port,
                topic,
                events=share,
                transactions=math.ceil(EOS_EVENTS / per_tx),
                committed=extra == EOS,
            )
            for (_, port), share in zip(relays, shares, strict=True)
        )
        for relay, _ in relays:
            assert relay.terminate() == 0, relay.log_tail()
    finally:
        for relay, _ in relays:
            relay.close()
    return EOS_EVENTS / (drained - ready)


@pytest.mark.timeout(3600)
def test_sharded_exactly_once_drains_beside_sharded_at_least_once(
    cfg: RelayConfig, tmp_path: Path, slots_to_drop: list[str]
) -> None:
    """Two sharded relays (the recipe: row-filtered publications with a `%`, a slot
    each, one topic prefix) drain one backlog of 100-event transactions, in both modes,
    pairs interleaved: the exactly-once / at-least-once ratio (median of the pairs).
    Each relay keeps its checkpoints in a topic of its own."""
    per_tx = 100
    aggregate = AGGREGATE
    pubs = [f"pub_{cfg.unique}_s{shard}" for shard in range(2)]
    runs = [
        {
            mode: [f"{cfg.slot}_{mode}{run}_s{shard}" for shard in range(2)]
            for mode in ("alo", "eos")
        }
        for run in range(REPEATS)
    ]
    topics = {
        (i, mode): f"{cfg.topic_prefix}{mode}{i}.{aggregate}"
        for i in range(REPEATS)
        for mode in ("alo", "eos")
    }
    create_topics(cfg.kafka, [*topics.values(), cfg.dlq_topic], partitions=PARTITIONS)
    every_slot = [slot for run in runs for slots in run.values() for slot in slots]
    with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
        for shard, pub in enumerate(pubs):
            conn.execute(
                f"CREATE PUBLICATION {pub} FOR TABLE outbox WHERE"
                f" {SHARD_FILTER.format(shard=shard)} WITH (publish = 'insert')"
            )
        slots_to_drop.extend(every_slot)
        conn.execute(
            "SELECT pg_create_logical_replication_slot(name, 'pgoutput')"
            " FROM unnest(%s::text[]) AS name",
            (every_slot,),
        )
    try:
        _fill(cfg.db_dsn, aggregate, EOS_EVENTS, per_tx)
        with psycopg.connect(cfg.db_dsn) as conn:
            shares = [
                int(
                    conn.execute(  # type: ignore[index]
                        f"SELECT count(*) FROM outbox WHERE aggregatetype = %s AND"
                        f" {SHARD_FILTER.format(shard=shard).replace('%', '%%')}",
                        (aggregate,),
                    ).fetchone()[0]
                )
                for shard in range(2)
            ]
        load_before = load_average()
        pairs = []
        for i, run in enumerate(runs):
            order = [("alo", {}), ("eos", EOS)]
            rates: dict[str, float] = {}
            for mode, extra in order if i % 2 == 0 else order[::-1]:
                rates[mode] = _shard_drain(
                    cfg,
                    tmp_path,
                    slots=run[mode],
                    pubs=pubs,
                    topic=topics[(i, mode)],
                    shares=shares,
                    per_tx=per_tx,
                    extra=extra,
                )
            pairs.append((rates["alo"], rates["eos"]))
    finally:
        with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
            for pub in pubs:
                conn.execute(f"DROP PUBLICATION IF EXISTS {pub}")
    ratio = statistics.median(e / a for a, e in pairs)
    print_table(
        f"two sharded relays: exactly-once vs at-least-once drain, {EOS_EVENTS:,} events in"
        f" {per_tx}-event transactions ({shares[0]:,} / {shares[1]:,} per shard; {REPEATS}"
        f" pairs, interleaved; load average {load_before} before, {load_average()} after,"
        f" {os.cpu_count()} cores, the machine shared)",
        ["pair", "at-least-once ev/s", "exactly-once ev/s", "ratio"],
        [[str(i + 1), fmt(a), fmt(e), fmt(e / a, 2)] for i, (a, e) in enumerate(pairs)]
        + [["median", "", "", f"{ratio:.2f} (goal >= {GOAL_RATIO})"]],
    )
    record_goal("exactly-once / at-least-once drain, 2 sharded relays", ratio, at_least=GOAL_RATIO)
