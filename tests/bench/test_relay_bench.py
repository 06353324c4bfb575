"""Relay benchmarks: drain throughput against the ``pg_recvlogical`` ceiling,
commit->ack latency at a fixed offered rate, and peak RSS.

Throughput: for each of 1-event and 100-event transactions, relay slots and
``<slot>_ceiling`` slots are created at the same moment, 100,000 events are
written while nothing streams, then - three times, interleaved -
``pg_recvlogical`` drains a ceiling slot to ``/dev/null`` (the cost of
decoding and shipping the same WAL with no Python and no Kafka) and a relay
drains its own slot into Kafka, timed from its ``/readyz`` until Kafka acknowledged
every transaction of the backlog (:func:`tests.bench.conftest.wait_drained`: the
relay counts them at the acknowledgement). Medians are reported, with CPU per
process, because the machine may carry other load.

Latency: a paced writer commits 1-event transactions at 2,000/s while the
relay runs; a consumer in this process timestamps every record on receipt
and subtracts its ``commit_ts`` header, so the figure includes Kafka's
consume delay (``fetch.wait.max.ms`` = 5). The relay's own
``outbox_relay_commit_to_ack_seconds`` histogram (diffed over the run and
interpolated inside its coarse buckets) is printed beside it.

Figures are printed with their targets; only correctness is asserted.
"""

from __future__ import annotations

import glob
import json
import math
import os
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from tests.bench.conftest import (
    Pace,
    create_topics,
    paced,
    topic_record_count,
    wait_drained,
    walsender_pid,
)
from tests.bench.report import (
    CpuMeter,
    bucket_diff,
    fmt,
    histogram_buckets,
    histogram_quantile,
    kafka_pid,
    load_average,
    peak_rss_mb,
    percentile,
    print_table,
    record_goal,
    scrape,
    write_figures,
)
from tests.clusters import stack_bindir
from tests.harness import Proc, RelayConfig, headers_of, http_status, start_relay, wait_until
from tests.integration.test_relay_errors import readyz

pytestmark = [pytest.mark.bench, pytest.mark.integration]

#: BENCH_RELAY_EVENTS: fewer for a quick proof that the bench runs (figures need 100,000).
EVENTS_PER_CASE = int(os.environ.get("BENCH_RELAY_EVENTS", "100000"))
#: Timed drains per case (median reported): the machine may carry other load.
REPEATS = 3
PARTITIONS = 6
LATENCY_RATE_PER_S = 2_000
LATENCY_DURATION_S = 15.0
WARMUP_EVENTS = 200
TARGET_RATIO = 0.7
#: Issue 25's goals: relay / pg_recvlogical by events per transaction.
GOAL_RATIO = {1: 1.0, 100: 0.9}
TARGET_P99_MS = 50.0
TARGET_RSS_MB = 100.0
EXTRA_VAR = "BENCH_RELAY_EXTRA"
LATENCY_METRIC = "outbox_relay_commit_to_ack_seconds"
#: A user-registration-like payload (~150 bytes of JSON), built server-side.
PAYLOAD_SQL = (
    "jsonb_build_object('user_id', gen_random_uuid(), 'email', 'u' || i || '@example.org',"
    " 'display_name', 'User ' || i, 'registered_at', now())"
)


@dataclass
class RelaySummary:
    """Rows collected over the module, printed once at its end."""

    throughput: list[list[object]] = field(default_factory=list)
    peak_rss_mb: dict[str, float] = field(default_factory=dict)


@pytest.fixture(scope="module")
def summary() -> Iterator[RelaySummary]:
    result = RelaySummary()
    yield result
    if result.throughput:
        print_table(
            f"relay drain throughput vs pg_recvlogical, medians (target ratio >= {TARGET_RATIO})",
            ["case", "pg_recvlogical ev/s", "relay ev/s", "ratio", "ratio range", "target"],
            result.throughput,
        )
    if result.peak_rss_mb:
        print_table(
            f"relay peak RSS (VmHWM; target <= {TARGET_RSS_MB:.0f} MB)",
            ["run", "peak RSS MB", "target"],
            [
                [run, fmt(mb, 1), _verdict(mb <= TARGET_RSS_MB)]
                for run, mb in result.peak_rss_mb.items()
            ],
        )


@pytest.fixture
def cfg(db_dsn: str, kafka_bootstrap: str, unique: str) -> RelayConfig:
    return RelayConfig(
        db_dsn=db_dsn,
        kafka=kafka_bootstrap,
        unique=unique,
        partitions=PARTITIONS,
        # BENCH_RELAY_EXTRA='{"KAFKA_CONFIG_COMPRESSION_TYPE": "lz4"}': the relay's
        # environment for an A/B of a setting (the bench's own variables win).
        extra={**json.loads(os.environ.get(EXTRA_VAR, "{}")), "LOG_LEVEL": "WARNING"},
    )


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _fill(dsn: str, aggregate: str, total: int, per_tx: int) -> float:
    """``total`` outbox rows of ``aggregate``, ``per_tx`` per transaction, written
    server-side (a DO loop with COMMIT per transaction); returns rows/s."""
    assert aggregate.isalnum()
    started = time.monotonic()
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
    return total / (time.monotonic() - started)


def _pg_recvlogical() -> str:
    """The stack's server's own pg_recvlogical (``make up PG=18``: the wheel's), else the
    newest installed one (zonky's 16/17 builds carry none)."""
    own = stack_bindir()
    if own is not None and (own / "pg_recvlogical").exists():
        return str(own / "pg_recvlogical")
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_recvlogical"))
    if not found:
        pytest.skip("pg_recvlogical not found under /usr/lib/postgresql/*/bin")
    return found[-1]


def _server(dsn: str) -> str:
    """``PostgreSQL 18.6``: the figures are per server version (make bench runs 15 and 18)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return f"PostgreSQL {str(row[0]).split()[0] if row else '?'}"


def _ceiling_events_per_s(dsn: str, slot: str, endpos: str, events: int) -> float:
    """Drain ``slot`` to ``endpos`` with pg_recvlogical (same pgoutput options as the relay)."""
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    password = str(info.pop("password", "") or "")
    env = dict(os.environ, PGPASSWORD=password)
    args = [
        _pg_recvlogical(),
        "-d",
        psycopg.conninfo.make_conninfo("", **info),
        "--slot",
        slot,
        "--start",
        "-o",
        "proto_version=1",
        "-o",
        "publication_names=outbox_pub",
        "-o",
        "messages=true",
        "--endpos",
        endpos,
        "-f",
        "/dev/null",
    ]
    started = time.monotonic()
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, check=False)
    elapsed_s = time.monotonic() - started
    assert done.returncode == 0, f"pg_recvlogical failed: {done.stderr[-2000:]}"
    return events / elapsed_s


def _wait_ready_precisely(proc: Proc, port: int) -> float:
    """Poll /readyz every 10 ms; the monotonic time it first answered 200."""

    def ready() -> bool:
        if not proc.alive():
            raise AssertionError(f"relay exited early:\n{proc.log_tail()}")
        return http_status(f"http://127.0.0.1:{port}/readyz", timeout_s=1) == 200

    try:
        wait_until(ready, 60, "relay /readyz", interval_s=0.01)
    except AssertionError as exc:  # (what it said, and its log: the log goes with it)
        said = readyz(port) if proc.alive() else "(exited)"
        raise AssertionError(f"{exc}; /readyz: {said}\n{proc.log_tail()}") from None
    return time.monotonic()


@dataclass(frozen=True)
class _Drain:
    """One timed drain of the backlog by the relay, with its ceiling run."""

    ceiling_per_s: float
    relay_per_s: float
    cpu_pct: dict[str, float]
    rss_mb: float

    @property
    def ratio(self) -> float:
        return self.relay_per_s / self.ceiling_per_s

    @property
    def relay_per_cpu_s(self) -> float:
        """Events per CPU-second of the relay: comparable even when the machine is busy."""
        share = self.cpu_pct.get("relay", math.nan) / 100.0
        return self.relay_per_s / share if share > 0 else math.nan  # (a drain too short to meter)


def _relay_drain(cfg: RelayConfig, tmp: Path, *, slot: str, topic: str, per_tx: int) -> _Drain:
    """Start a relay on ``slot``; time it from /readyz until it acked the backlog."""
    run_cfg = replace(cfg, extra={**cfg.extra, "CDC_SLOT": slot})
    relay, port = start_relay(run_cfg, tmp, name=f"relay-{slot}", wait_ready=False)
    try:
        t_ready = _wait_ready_precisely(relay, port)
        cpu = CpuMeter(
            {"relay": relay.pid, "walsender": walsender_pid(cfg.db_dsn, slot), "kafka": kafka_pid()}
        ).start()
        drained = wait_drained(
            port,
            topic,
            events=EVENTS_PER_CASE,
            transactions=math.ceil(EVENTS_PER_CASE / per_tx),
        )
        elapsed_s = drained - t_ready
        cpu_pct = cpu.stop()
        rss_mb = peak_rss_mb(relay.pid)
        assert relay.terminate() == 0, relay.log_tail()
    finally:
        relay.close()
    return _Drain(math.nan, EVENTS_PER_CASE / elapsed_s, cpu_pct, rss_mb)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("per_tx", [1, 100], ids=["1-event-tx", "100-event-tx"])
def test_relay_drains_a_backlog_near_the_pg_recvlogical_ceiling(
    per_tx: int,
    cfg: RelayConfig,
    tmp_path: Path,
    slots_to_drop: list[str],
    summary: RelaySummary,
) -> None:
    load_at_start = load_average()
    aggregate = f"tput{per_tx}"
    topic = cfg.topic_prefix + aggregate
    relay_slots = [f"{cfg.slot}_{run}" for run in range(REPEATS)]
    ceiling_slots = [f"{slot}_ceiling" for slot in relay_slots]
    create_topics(cfg.kafka, [topic, cfg.dlq_topic], partitions=PARTITIONS)
    with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
        slots_to_drop.extend(relay_slots + ceiling_slots)
        conn.execute(
            "SELECT pg_create_logical_replication_slot(name, 'pgoutput')"
            " FROM unnest(%s::text[]) AS name",
            (relay_slots + ceiling_slots,),
        )
    insert_rate = _fill(cfg.db_dsn, aggregate, EVENTS_PER_CASE, per_tx)
    with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        endpos = row[0]
        # WAL past endpos, so pg_recvlogical sees a message beyond it and stops.
        conn.execute("SELECT pg_logical_emit_message(false, 'bench-end', '')")

    # Ceiling and relay runs interleaved, so background load hits both alike.
    runs = []
    for relay_slot, ceiling_slot in zip(relay_slots, ceiling_slots, strict=True):
        ceiling = _ceiling_events_per_s(cfg.db_dsn, ceiling_slot, endpos, EVENTS_PER_CASE)
        drain = _relay_drain(cfg, tmp_path, slot=relay_slot, topic=topic, per_tx=per_tx)
        runs.append(replace(drain, ceiling_per_s=ceiling))

    in_topic = topic_record_count(cfg.kafka, topic)
    median_ceiling = statistics.median(r.ceiling_per_s for r in runs)
    median_relay = statistics.median(r.relay_per_s for r in runs)
    ratio = median_relay / median_ceiling
    rss_mb = max(r.rss_mb for r in runs)
    case = f"{per_tx}-event tx, {_server(cfg.db_dsn)}"
    print_table(
        f"relay throughput ({_server(cfg.db_dsn)}), {EVENTS_PER_CASE:,} events in"
        f" {per_tx}-event transactions"
        f" (inserted at {insert_rate:,.0f}/s; {REPEATS} runs, each on its own slot)",
        [
            "run",
            "pg_recvlogical ev/s",
            "relay ev/s",
            "ratio",
            "relay CPU %",
            "relay ev/CPU-s",
            "walsender CPU %",
            "kafka CPU %",
            "machine CPU %",
            "relay RSS MB",
        ],
        [
            [
                str(run + 1),
                fmt(r.ceiling_per_s),
                fmt(r.relay_per_s),
                fmt(r.ratio, 2),
                fmt(r.cpu_pct.get("relay", math.nan)),
                fmt(r.relay_per_cpu_s),
                fmt(r.cpu_pct.get("walsender", math.nan)),
                fmt(r.cpu_pct.get("kafka", math.nan)),
                fmt(r.cpu_pct["machine"]),
                fmt(r.rss_mb, 1),
            ]
            for run, r in enumerate(runs)
        ]
        + [["median", fmt(median_ceiling), fmt(median_relay), fmt(ratio, 2), *[""] * 6]],
    )
    print(
        "  (relay: /readyz -> all acked by Kafka; CPU % of one core, machine = all processes,"
        " 2 cores = 200; relay ev/CPU-s = relay ev/s / relay CPU share)"
    )
    summary.throughput.append(
        [
            case,
            fmt(median_ceiling),
            fmt(median_relay),
            fmt(ratio, 2),
            f"{min(r.ratio for r in runs):.2f}-{max(r.ratio for r in runs):.2f}",
            _verdict(ratio >= TARGET_RATIO),
        ]
    )
    summary.peak_rss_mb[f"drain, {case}"] = rss_mb
    server = _server(cfg.db_dsn)
    write_figures(
        f"relay-drain-{per_tx}-pg{server.split()[-1].split('.')[0]}",
        {
            "server": server,
            "events": EVENTS_PER_CASE,
            "events_per_tx": per_tx,
            "partitions": PARTITIONS,
            "runs": [
                {
                    "pg_recvlogical_events_per_s": r.ceiling_per_s,
                    "relay_events_per_s": r.relay_per_s,
                    "ratio": r.ratio,
                    "relay_events_per_cpu_s": r.relay_per_cpu_s,
                    "cpu_pct": r.cpu_pct,
                    "relay_peak_rss_mb": r.rss_mb,
                }
                for r in runs
            ],
            "median": {
                "pg_recvlogical_events_per_s": median_ceiling,
                "relay_events_per_s": median_relay,
                "ratio": ratio,
                "relay_events_per_cpu_s": statistics.median(r.relay_per_cpu_s for r in runs),
            },
        },
        load_at_start=load_at_start,
    )
    record_goal(f"relay / pg_recvlogical, {case}", ratio, at_least=GOAL_RATIO[per_tx])
    record_goal(f"relay peak RSS MB, drain {case}", rss_mb, at_most=TARGET_RSS_MB, digits=1)
    expected = REPEATS * EVENTS_PER_CASE
    assert in_topic >= expected, f"only {in_topic} of {expected} records in Kafka"


class _Receiver(threading.Thread):
    """Consumes the topic and records (receive time - commit_ts) per latency record."""

    def __init__(self, consumer: Consumer) -> None:
        super().__init__(name="latency-receiver", daemon=True)
        self.consumer = consumer
        self.latencies_s: list[float] = []
        self.ids: set[str] = set()
        self.warmup = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                # poll(), not consume(n, timeout): a batch call waits for n
                # records or the whole timeout, which would add its own delay.
                msg = self.consumer.poll(0.05)
                received = time.time()
                if msg is None:
                    continue
                if msg.error():
                    raise RuntimeError(str(msg.error()))
                headers = headers_of(msg)
                if headers["type"] != b"BenchLatency":
                    self.warmup += 1
                    continue
                committed = datetime.fromisoformat(headers["commit_ts"].decode())
                self.latencies_s.append(received - committed.timestamp())
                self.ids.add(headers["id"].decode())
        except BaseException as exc:
            self.error = exc


def _insert_sql(event_type: str) -> str:
    return (
        "INSERT INTO outbox (aggregatetype, aggregateid, type, payload)"
        f" VALUES ('latency', %s, '{event_type}', %s)"
    )


@pytest.mark.timeout(600)
def test_relay_commit_to_ack_latency_at_a_fixed_offered_rate(
    cfg: RelayConfig,
    tmp_path: Path,
    slots_to_drop: list[str],
    summary: RelaySummary,
) -> None:
    load_at_start = load_average()
    topic = cfg.topic_prefix + "latency"
    create_topics(cfg.kafka, [topic, cfg.dlq_topic], partitions=PARTITIONS)
    slots_to_drop.append(cfg.slot)
    expect = round(LATENCY_RATE_PER_S * LATENCY_DURATION_S)
    consumer = Consumer(
        {
            "bootstrap.servers": cfg.kafka,
            "group.id": f"bench-latency-{cfg.unique}",
            "enable.auto.commit": False,
            "fetch.wait.max.ms": 5,
            "fetch.error.backoff.ms": 5,
        }
    )
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
    receiver = _Receiver(consumer)
    receiver.start()
    relay, port = start_relay(cfg, tmp_path)
    payload = '{"user_id": "00000000-0000-0000-0000-000000000000", "source": "bench"}'
    pace = Pace(0, 0.0, 0.0)
    try:
        with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
            for i in range(WARMUP_EVENTS):
                conn.execute(_insert_sql("Warmup"), (f"w{i}", payload))
            wait_until(lambda: receiver.warmup >= WARMUP_EVENTS, 60, "warm-up records")
            before = histogram_buckets(scrape(port), LATENCY_METRIC)
            cpu = CpuMeter(
                {"relay": relay.pid, "walsender": walsender_pid(cfg.db_dsn, cfg.slot)}
            ).start()
            for i in paced(LATENCY_RATE_PER_S, LATENCY_DURATION_S, pace):
                conn.execute(_insert_sql("BenchLatency"), (f"k{i % 1000}", payload))
        wait_until(lambda: len(receiver.ids) >= expect or receiver.error, 120, "latency records")
        cpu_pct = cpu.stop()
        after = histogram_buckets(scrape(port), LATENCY_METRIC)
        rss_mb = peak_rss_mb(relay.pid)
        assert relay.terminate() == 0, relay.log_tail()
    finally:
        receiver.stop.set()
        receiver.join(10)
        consumer.close()
        relay.close()
    assert receiver.error is None, receiver.error
    assert len(receiver.ids) == expect, f"{len(receiver.ids)} of {expect} events arrived"

    lat_ms = [s * 1000.0 for s in receiver.latencies_s]
    hist = bucket_diff(after, before)
    p50, p99 = percentile(lat_ms, 50), percentile(lat_ms, 99)
    print_table(
        f"relay commit->ack latency, {LATENCY_RATE_PER_S:,}/s offered"
        f" for {LATENCY_DURATION_S:.0f} s (1-event transactions)",
        ["figure", "value", "target"],
        [
            ["offered rate achieved ev/s", fmt(pace.rate_per_s), ""],
            ["writer max behind schedule ms", fmt(pace.max_behind_s * 1000, 1), ""],
            ["events received", fmt(len(lat_ms)), ""],
            ["commit->consumer receive p50 ms", fmt(p50, 1), ""],
            [
                "commit->consumer receive p99 ms",
                fmt(p99, 1),
                f"<= {TARGET_P99_MS:.0f} {_verdict(p99 <= TARGET_P99_MS)}",
            ],
            ["commit->consumer receive max ms", fmt(max(lat_ms), 1), ""],
            [
                "relay histogram commit->ack p50 ms",
                fmt(histogram_quantile(hist, 0.5) * 1000, 1),
                "",
            ],
            [
                "relay histogram commit->ack p99 ms",
                fmt(histogram_quantile(hist, 0.99) * 1000, 1),
                f"<= {TARGET_P99_MS:.0f}",
            ],
            ["relay CPU % of one core", fmt(cpu_pct["relay"]), ""],
            ["walsender CPU %", fmt(cpu_pct.get("walsender", math.nan)), ""],
            ["machine CPU % (2 cores = 200)", fmt(cpu_pct["machine"]), ""],
            ["relay peak RSS MB", fmt(rss_mb, 1), f"<= {TARGET_RSS_MB:.0f}"],
        ],
    )
    print(
        "  (consumer figures include Kafka's consume delay, fetch.wait.max.ms=5;"
        " histogram figures are interpolated inside the relay's buckets)"
    )
    summary.peak_rss_mb[f"latency, {LATENCY_RATE_PER_S:,}/s"] = rss_mb
    write_figures(
        "relay-latency",
        {
            "server": _server(cfg.db_dsn),
            "offered_events_per_s": LATENCY_RATE_PER_S,
            "achieved_events_per_s": pace.rate_per_s,
            "duration_s": LATENCY_DURATION_S,
            "events_per_tx": 1,
            "events": len(lat_ms),
            "what": "commit -> Kafka consumer receive (commit_ts header to receipt), ms",
            "percentiles_ms": {str(q): percentile(lat_ms, q) for q in (50, 90, 99, 99.9)}
            | {"max": max(lat_ms)},
            # The distribution as 201 quantiles (0, 0.5, ..., 100 %): enough to draw it.
            "quantiles_ms": [percentile(lat_ms, q / 2) for q in range(201)],
            "relay_cpu_pct": cpu_pct["relay"],
            "relay_peak_rss_mb": rss_mb,
        },
        load_at_start=load_at_start,
    )
    record_goal(
        f"commit->Kafka consumer p99 ms at {LATENCY_RATE_PER_S:,}/s",
        p99,
        at_most=TARGET_P99_MS,
        digits=1,
    )
    record_goal(
        f"relay peak RSS MB, {LATENCY_RATE_PER_S:,}/s", rss_mb, at_most=TARGET_RSS_MB, digits=1
    )
