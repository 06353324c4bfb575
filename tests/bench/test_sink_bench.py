"""Sink benchmarks: deliveries/s to the engine stub, concurrent vs serial, and
end-to-end commit->engine latency through relay + sink + stub.

Deliveries/s: records in the contract format are produced straight into a
fresh topic, then a sink (``SINK_MAX_IN_FLIGHT`` = 64, or 1 for the serial
baseline) drains them into an engine stub running as its own process. The
rate is taken from the stub's ``applied_at`` of the first and the last event
(steady state, without the consumer-group join); the time from the sink's
``/readyz`` to the last event is printed beside it.

End-to-end: a paced writer commits registrations (``register_user``) at
1,000/s and notes each event's commit time; latency = the stub's
``applied_at`` - that commit time.

CPU per delivery against a reference client: the 0 ms concurrent case runs three
times, and before, between and after those runs aiohttp's client (third-party
code, see ``test_transport_bench``) sends the same kind of request to a stub of
its own, 64 in flight, in this process; its CPU per request is the machine's
yardstick, measured the way ``pg_recvlogical`` is for the relay (interleaved,
medians).

Why that yardstick: issue 25's goal of 10,000 deliveries per sink CPU-second
(100 us per delivery) was set on a machine where our HTTP client alone cost
~50 us per request. Side by side, aiohttp's client cost 1.5x (https) to 1.9x
(http) of that client (transport bench, before round 7), so ~75-95 us on that
machine. "A whole delivery - consume, route, HTTP, commit - for no more CPU
than aiohttp's client spends on the request alone" (ratio <= 1.0) is therefore
at least as strict as the goal was, and it holds on a machine of any speed:
this one's moved 2-4x between days, and the absolute figure with it.

Backlog drain: registrations are offered at 500/s throughout while the engine
refuses connections for 60 s; the figures are the time the sink takes to notice
the engine is back, the time to catch up and the drain rate as a multiple of
the offered rate.

Figures are printed with their targets; only correctness is asserted (every
event applied exactly once, nothing rejected).
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import psycopg
import pytest

from cdc.outbox import register_user
from tests.bench.conftest import (
    API_KEY,
    Pace,
    StubProc,
    create_topics,
    paced,
    produce_user_events,
    start_stub,
    walsender_pid,
)
from tests.bench.report import (
    CpuMeter,
    fmt,
    peak_rss_mb,
    percentile,
    print_table,
    record_goal,
)
from tests.bench.test_transport_bench import measure_client
from tests.harness import RelayConfig, SinkConfig, start_relay, start_sink, wait_until

pytestmark = [pytest.mark.bench, pytest.mark.integration]

PARTITIONS = 6
CONCURRENT = 64
TARGET_SPEEDUP = 8.0
TARGET_RATE_0MS = 5_000.0
#: Issue 25's goal as it was set: deliveries per second of sink CPU at 0 ms,
#: concurrent, on its reference machine (printed; the verdict is the ratio below).
GOAL_PER_CPU_S_0MS = 10_000.0
#: The same goal, machine-independent: sink CPU per delivery / aiohttp's client
#: CPU per request, measured beside it (see the module's docstring).
GOAL_CPU_VS_AIOHTTP = 1.0
#: Runs of the 0 ms concurrent case, the reference client measured before, between
#: and after them (each measurement the cheapest of its rounds).
REFERENCE_REPEATS = 3
REFERENCE_ROUNDS = 2
E2E_RATE_PER_S = 1_000
E2E_DURATION_S = 10.0
E2E_WARMUP = 50


@dataclass(frozen=True)
class Case:
    latency_ms: float
    max_in_flight: int
    events: int

    @property
    def mode(self) -> str:
        return "serial" if self.max_in_flight == 1 else f"concurrent ({self.max_in_flight})"


@dataclass(frozen=True)
class Outcome:
    case: Case
    rate_per_s: float  # first -> last applied
    ready_to_done_s: float
    cpu_pct: dict[str, float]
    sink_rss_mb: float


#: Sized so each case runs for seconds, not milliseconds, at the rates seen on
#: the 2-core reference machine (serial at 10 ms engine latency is ~90/s).
CASES = [
    Case(0, CONCURRENT, 50_000),
    Case(0, 1, 3_000),
    Case(10, CONCURRENT, 20_000),
    Case(10, 1, 1_000),
]


def _sink_cfg(
    db_dsn: str, kafka: str, stub: StubProc, *, max_in_flight: int = CONCURRENT
) -> SinkConfig:
    relay = RelayConfig(
        db_dsn=db_dsn,
        kafka=kafka,
        unique=uuid.uuid4().hex[:10],
        partitions=PARTITIONS,
        extra={"LOG_LEVEL": "WARNING"},
    )
    return SinkConfig(
        relay=relay,
        engine_url=stub.url,
        api_key=API_KEY,
        extra={"SINK_MAX_IN_FLIGHT": str(max_in_flight), "LOG_LEVEL": "WARNING"},
    )


def _wait_applied(stub: StubProc, n: int, timeout_s: float) -> None:
    wait_until(lambda: stub.stats()["applied"] >= n, timeout_s, f"{n} applied", interval_s=0.05)


def _assert_exactly_once(stub: StubProc, ids: list[str]) -> None:
    stats = stub.stats()
    applied = {item["event_id"] for item in stub.applied_items()}
    assert applied == set(ids), f"{len(set(ids) - applied)} events never applied"
    assert stats["applied"] == len(ids), stats
    assert stats["duplicates"] == 0, stats
    assert stats["rejected"] == 0, stats


def _aiohttp_us_per_request(tmp: Path, name: str) -> float:
    """The reference: aiohttp's client CPU per request to a 0 ms stub, best of its rounds."""
    stub = start_stub(tmp, name=f"stub-reference-{name}")
    try:
        best = math.inf
        for _ in range(REFERENCE_ROUNDS):
            cpu_s, _wall_s, n = asyncio.run(measure_client("aiohttp", stub, None))
            best = min(best, cpu_s / n * 1e6)
        return best
    finally:
        stub.proc.close()


def _run_case(case: Case, db_dsn: str, kafka: str, tmp: Path, run: int = 0) -> Outcome:
    name = f"{case.latency_ms:g}ms-{case.max_in_flight}-{run}"
    stub = start_stub(tmp, latency_ms=case.latency_ms, name=f"stub-{name}")
    try:
        cfg = _sink_cfg(db_dsn, kafka, stub, max_in_flight=case.max_in_flight)
        topic = cfg.relay.topic_prefix + "user"
        create_topics(kafka, [topic], partitions=PARTITIONS)
        ids = produce_user_events(kafka, topic, case.events)
        sink, _ = start_sink(cfg, tmp, name=f"sink-{name}")
        try:
            t_ready = time.monotonic()
            cpu = CpuMeter({"sink": sink.pid, "stub": stub.proc.pid}).start()
            _wait_applied(stub, case.events, timeout_s=300)
            ready_to_done_s = time.monotonic() - t_ready
            cpu_pct = cpu.stop()
            rss_mb = peak_rss_mb(sink.pid)
            assert sink.terminate() == 0, sink.log_tail()
        finally:
            sink.close()
        first = stub.applied_items(limit=1)[0]["applied_at"]
        last = stub.applied_items(since=case.events - 1)[0]["applied_at"]
        _assert_exactly_once(stub, ids)
    finally:
        stub.proc.close()
    rate = (case.events - 1) / (last - first)
    return Outcome(case, rate, ready_to_done_s, cpu_pct, rss_mb)


def _sink_us_per_delivery(o: Outcome) -> float:
    """Sink CPU from /readyz to the last delivery, per delivery (start-up excluded)."""
    return o.cpu_pct["sink"] / 100.0 * o.ready_to_done_s / o.case.events * 1e6


def _compare_with_the_reference(db_dsn: str, kafka: str, tmp: Path) -> Outcome:
    """The 0 ms concurrent case :data:`REFERENCE_REPEATS` times, the reference client
    measured before, between and after them; the ratio of the medians is the goal's
    figure. Returns the sink's median run."""
    case = CASES[0]
    references = [_aiohttp_us_per_request(tmp, "0")]
    runs = []
    for run in range(REFERENCE_REPEATS):
        runs.append(_run_case(case, db_dsn, kafka, tmp, run=run))
        references.append(_aiohttp_us_per_request(tmp, str(run + 1)))
    sink_us = [_sink_us_per_delivery(o) for o in runs]
    ratio = statistics.median(sink_us) / statistics.median(references)
    print_table(
        f"sink CPU per delivery against the reference client ({case.latency_ms:g} ms engine,"
        f" {case.max_in_flight} in flight; aiohttp {aiohttp.__version__} measured before, between"
        " and after the runs)",
        ["run", "sink CPU us/delivery", "aiohttp us/request before", "after", "ratio"],
        [
            [
                str(run + 1),
                fmt(us),
                fmt(references[run]),
                fmt(references[run + 1]),
                fmt(us / statistics.mean(references[run : run + 2]), 2),
            ]
            for run, us in enumerate(sink_us)
        ]
        + [
            [
                "median",
                fmt(statistics.median(sink_us)),
                fmt(statistics.median(references)),
                "",
                fmt(ratio, 2),
            ]
        ],
    )
    print(
        "  (sink: its CPU from /readyz to the last delivery / deliveries (consume, route, HTTP,"
        " commit); aiohttp: its client's CPU per request, best of"
        f" {REFERENCE_ROUNDS} rounds; goal: ratio <= {GOAL_CPU_VS_AIOHTTP:g}; load average"
        f" {os.getloadavg()[0]:.2f})"
    )
    record_goal(
        "sink CPU per delivery / aiohttp client CPU per request, 0 ms concurrent",
        ratio,
        at_most=GOAL_CPU_VS_AIOHTTP,
    )
    return sorted(runs, key=_sink_us_per_delivery)[len(runs) // 2]


@pytest.mark.timeout(1200)
def test_sink_concurrent_delivery_beats_the_serial_baseline(
    db_dsn: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    outcomes = [_compare_with_the_reference(db_dsn, kafka_bootstrap, tmp_path)]
    outcomes += [_run_case(case, db_dsn, kafka_bootstrap, tmp_path) for case in CASES[1:]]
    print_table(
        "sink deliveries/s to the engine stub (stub in its own process)",
        [
            "engine latency",
            "mode",
            "events",
            "deliveries/s",
            "ready->all s",
            "sink CPU %",
            "per sink CPU-s",
            "stub CPU %",
            "machine CPU %",
            "sink RSS MB",
        ],
        [
            [
                f"{o.case.latency_ms:g} ms",
                o.case.mode,
                fmt(o.case.events),
                fmt(o.rate_per_s),
                fmt(o.ready_to_done_s, 1),
                fmt(o.cpu_pct["sink"]),
                fmt(o.rate_per_s / (o.cpu_pct["sink"] / 100.0)),
                fmt(o.cpu_pct["stub"]),
                fmt(o.cpu_pct["machine"]),
                fmt(o.sink_rss_mb, 1),
            ]
            for o in outcomes
        ],
    )
    by = {(o.case.latency_ms, o.case.max_in_flight): o.rate_per_s for o in outcomes}
    zero = next(o for o in outcomes if o.case == CASES[0])
    print(
        f"  (0 ms concurrent: the median of the {REFERENCE_REPEATS} runs above;"
        f" {zero.rate_per_s / (zero.cpu_pct['sink'] / 100.0):,.0f} deliveries per sink CPU-s,"
        f" against the issue's {GOAL_PER_CPU_S_0MS:,.0f} set on a faster machine)"
    )
    speedup_10 = by[(10, CONCURRENT)] / by[(10, 1)]
    speedup_0 = by[(0, CONCURRENT)] / by[(0, 1)]
    print_table(
        "sink targets",
        ["figure", "value", "target"],
        [
            [
                "speed-up at 10 ms (concurrent / serial)",
                f"{speedup_10:.1f}x",
                f">= {TARGET_SPEEDUP:.0f}x {_verdict(speedup_10 >= TARGET_SPEEDUP)}",
            ],
            ["speed-up at 0 ms (concurrent / serial)", f"{speedup_0:.1f}x", ""],
            [
                "deliveries/s at 0 ms, concurrent",
                fmt(by[(0, CONCURRENT)]),
                f">= {TARGET_RATE_0MS:,.0f} {_verdict(by[(0, CONCURRENT)] >= TARGET_RATE_0MS)}",
            ],
        ],
    )
    print(
        "  (deliveries/s: first -> last applied; per sink CPU-s = deliveries/s / sink CPU share;"
        " CPU % of one core, machine = all processes, 2 cores = 200)"
    )


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


@pytest.mark.timeout(600)
def test_end_to_end_commit_to_engine_latency_at_a_fixed_offered_rate(
    db_dsn: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    stub = start_stub(tmp_path, name="stub-e2e")
    cfg = _sink_cfg(db_dsn, kafka_bootstrap, stub)
    relay_cfg = cfg.relay
    relay = sink = None
    commit_at: dict[str, float] = {}
    pace = Pace(0, 0.0, 0.0)
    try:
        # Topics exist before the sink subscribes: no wait for a metadata refresh.
        create_topics(
            kafka_bootstrap,
            [relay_cfg.topic_prefix + "user", relay_cfg.dlq_topic],
            partitions=PARTITIONS,
        )
        relay, _ = start_relay(relay_cfg, tmp_path, name="relay-e2e")
        sink, _ = start_sink(cfg, tmp_path, name="sink-e2e")
        with psycopg.connect(db_dsn) as conn:
            for _ in range(E2E_WARMUP):
                register_user(conn, email=f"{uuid.uuid4()}@bench.example", display_name="Warm")
            _wait_applied(stub, E2E_WARMUP, timeout_s=60)
            cpu = CpuMeter(
                {
                    "relay": relay.pid,
                    "sink": sink.pid,
                    "stub": stub.proc.pid,
                    "walsender": walsender_pid(db_dsn, relay_cfg.slot),
                }
            ).start()
            for _ in paced(E2E_RATE_PER_S, E2E_DURATION_S, pace):
                written = register_user(
                    conn, email=f"{uuid.uuid4()}@bench.example", display_name="Bench"
                )
                commit_at[str(written.event_id)] = time.time()
        _wait_applied(stub, E2E_WARMUP + len(commit_at), timeout_s=120)
        cpu_pct = cpu.stop()
        applied_at = {
            item["event_id"]: item["applied_at"] for item in stub.applied_items(since=E2E_WARMUP)
        }
        stats = stub.stats()
        assert sink.terminate() == 0, sink.log_tail()
        assert relay.terminate() == 0, relay.log_tail()
    finally:
        for proc in (sink, relay, stub.proc):
            if proc is not None:
                proc.close()
        with psycopg.connect(db_dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
                " WHERE slot_name = %s AND NOT active",
                (relay_cfg.slot,),
            )
    missing = set(commit_at) - set(applied_at)
    assert not missing, f"{len(missing)} events never reached the engine"
    assert stats["duplicates"] == 0, stats
    lat_ms = [(applied_at[e] - t) * 1000.0 for e, t in commit_at.items()]
    by_second: dict[int, list[float]] = {}
    start = min(commit_at.values())
    for e, t in commit_at.items():
        by_second.setdefault(int(t - start), []).append((applied_at[e] - t) * 1000.0)
    print_table(
        f"end-to-end commit->engine latency, {E2E_RATE_PER_S:,} registrations/s offered"
        f" for {E2E_DURATION_S:.0f} s (relay + sink + stub)",
        ["figure", "value", "target"],
        [
            ["offered rate achieved ev/s", fmt(pace.rate_per_s), ""],
            ["writer max behind schedule ms", fmt(pace.max_behind_s * 1000, 1), ""],
            ["events", fmt(len(lat_ms)), ""],
            ["p50 ms", fmt(percentile(lat_ms, 50), 1), ""],
            ["p90 ms", fmt(percentile(lat_ms, 90), 1), ""],
            ["p99 ms", fmt(percentile(lat_ms, 99), 1), ""],
            ["max ms", fmt(max(lat_ms), 1), ""],
            ["relay CPU %", fmt(cpu_pct["relay"]), ""],
            ["sink CPU %", fmt(cpu_pct["sink"]), ""],
            ["stub CPU %", fmt(cpu_pct["stub"]), ""],
            ["walsender CPU %", fmt(cpu_pct.get("walsender", math.nan)), ""],
            ["machine CPU % (2 cores = 200)", fmt(cpu_pct["machine"]), ""],
        ],
    )
    print(
        "  p50 ms by second of the run: "
        + " ".join(fmt(percentile(v, 50)) for _, v in sorted(by_second.items()))
    )


DRAIN_RATE_PER_S = 500
DRAIN_WARMUP_S = 10.0
DRAIN_OUTAGE_S = 60.0
DRAIN_TARGET = 3.0
#: Caught up: the backlog is down to this many events (0.1 s of the offered load).
DRAIN_CAUGHT_UP = DRAIN_RATE_PER_S // 10


def _listening(stub: StubProc) -> bool:
    """The stub serves again (while it refuses connections its own stats do too)."""
    try:
        return not stub.stats()["refusing_connections"]
    except OSError:  # connection refused: the outage window is still open
        return False


@pytest.mark.timeout(900)
def test_backlog_drain_after_an_engine_outage(
    db_dsn: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    """500 registrations/s offered throughout; the engine refuses connections for 60 s.

    Reports the backlog at the restore, how long the sink took to notice the
    engine was back (restore -> first event applied), the time from the
    restore until the backlog is down to 0.1 s of offered load, and the drain
    rate as a multiple of the offered rate.
    """
    stub = start_stub(tmp_path, name="stub-drain")
    cfg = _sink_cfg(db_dsn, kafka_bootstrap, stub)
    relay_cfg = cfg.relay
    relay = sink = None
    committed = [0]
    writer_stop = threading.Event()
    pace = Pace(0, 0.0, 0.0)

    def writer() -> None:
        with psycopg.connect(db_dsn) as conn:
            for _ in paced(DRAIN_RATE_PER_S, 3600, pace):
                if writer_stop.is_set():
                    return
                register_user(conn, email=f"{uuid.uuid4()}@bench.example", display_name="Drain")
                committed[0] += 1

    try:
        create_topics(
            kafka_bootstrap,
            [relay_cfg.topic_prefix + "user", relay_cfg.dlq_topic],
            partitions=PARTITIONS,
        )
        relay, _ = start_relay(relay_cfg, tmp_path, name="relay-drain")
        sink, _ = start_sink(cfg, tmp_path, name="sink-drain")
        load = threading.Thread(target=writer, daemon=True)
        load.start()
        time.sleep(DRAIN_WARMUP_S)
        stub.post("/_stub/faults", {"refuse_connections_s": DRAIN_OUTAGE_S})
        outage_started = time.monotonic()
        time.sleep(DRAIN_OUTAGE_S)
        wait_until(lambda: _listening(stub), 30, "the stub listens again")
        restored, restored_wall = time.monotonic(), time.time()
        backlog_at_restore = committed[0] - stub.stats()["applied"]
        applied_at_restore = stub.stats()["applied"]
        cpu = CpuMeter({"relay": relay.pid, "sink": sink.pid, "stub": stub.proc.pid}).start()

        def caught_up() -> bool:
            return committed[0] - stub.stats()["applied"] <= DRAIN_CAUGHT_UP

        wait_until(caught_up, 600, "the backlog drained", interval_s=0.05)
        drained = time.monotonic()
        cpu_pct = cpu.stop()
        applied_during = stub.stats()["applied"] - applied_at_restore
        writer_stop.set()
        load.join(10)
        first_after = next(
            item["applied_at"]
            for item in stub.applied_items(since=applied_at_restore)
            if item["applied_at"] >= restored_wall
        )
        _wait_applied(stub, committed[0], timeout_s=120)
        stats = stub.stats()
        assert sink.terminate() == 0, sink.log_tail()
        assert relay.terminate() == 0, relay.log_tail()
    finally:
        writer_stop.set()
        for proc in (sink, relay, stub.proc):
            if proc is not None:
                proc.close()
        with psycopg.connect(db_dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
                " WHERE slot_name = %s AND NOT active",
                (relay_cfg.slot,),
            )
    assert stats["applied"] == committed[0], stats
    assert stats["duplicates"] == 0, stats
    drain_s = drained - restored
    drain_rate = applied_during / drain_s if drain_s > 0 else math.inf
    multiple = drain_rate / DRAIN_RATE_PER_S
    print_table(
        f"backlog drain after a {DRAIN_OUTAGE_S:.0f} s engine outage,"
        f" {DRAIN_RATE_PER_S} registrations/s offered throughout (relay + sink + stub)",
        ["figure", "value", "target"],
        [
            ["offered rate achieved ev/s", fmt(pace.rate_per_s), ""],
            ["writer max behind schedule ms", fmt(pace.max_behind_s * 1000, 1), ""],
            ["outage s (refused connections)", fmt(restored - outage_started, 1), ""],
            ["backlog at restore, events", fmt(backlog_at_restore), ""],
            ["restore -> engine back noticed s", fmt(first_after - restored_wall, 2), ""],
            ["restore -> caught up s", fmt(drain_s, 1), ""],
            ["drain rate ev/s", fmt(drain_rate), ""],
            [
                "drain rate / offered rate",
                f"{multiple:.1f}x",
                f">= {DRAIN_TARGET:.0f}x {_verdict(multiple >= DRAIN_TARGET)}",
            ],
            ["sink CPU % while draining", fmt(cpu_pct["sink"]), ""],
            ["relay CPU %", fmt(cpu_pct["relay"]), ""],
            ["stub CPU %", fmt(cpu_pct["stub"]), ""],
            [
                "rest of the machine CPU % (PG, Kafka, writer, others)",
                fmt(cpu_pct["machine"] - cpu_pct["sink"] - cpu_pct["relay"] - cpu_pct["stub"]),
                "",
            ],
            ["machine CPU % (2 cores = 200)", fmt(cpu_pct["machine"]), ""],
            ["load average (1 min) at the end", f"{os.getloadavg()[0]:.2f}", ""],
        ],
    )
    print(
        f"  (caught up = backlog <= {DRAIN_CAUGHT_UP} events; the probe backoff is capped by"
        " SINK_BACKOFF_MAX_S, default 15 s, which bounds the time to notice)"
    )


FLOOD_EVENTS = 50_000
FLOOD_TARGET_PER_S = 5_000.0


def _produce_unknown(kafka: str, topic: str, n: int) -> None:
    """``n`` records of a type the sink has no route for (other teams' new events)."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": kafka, "linger.ms": 20, "compression.type": "lz4"})
    for i in range(n):
        user = f"u{i % 1000}"
        while True:
            try:
                producer.produce(
                    topic,
                    key=user.encode(),
                    value=f'{{"user_id":"{user}"}}'.encode(),
                    headers=[("id", str(uuid.uuid4()).encode()), ("type", b"ShinyNewEvent")],
                )
                break
            except BufferError:
                producer.poll(0.1)
        producer.poll(0)
    assert producer.flush(60) == 0


def _parked_on(db_dsn: str, topic: str) -> int:
    with psycopg.connect(db_dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM failed_sync_events WHERE kafka_topic = %s", (topic,)
        ).fetchone()
    return int(row[0]) if row else 0


@pytest.mark.timeout(600)
def test_a_flood_of_unroutable_events_drains_into_the_parking_lot(
    db_dsn: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    """50,000 records of a type without a route: parked in batches, at what rate."""
    stub = start_stub(tmp_path, name="stub-flood")
    cfg = _sink_cfg(db_dsn, kafka_bootstrap, stub)
    topic = cfg.relay.topic_prefix + "user"
    try:
        create_topics(kafka_bootstrap, [topic], partitions=PARTITIONS)
        _produce_unknown(kafka_bootstrap, topic, FLOOD_EVENTS)
        sink, _ = start_sink(cfg, tmp_path, name="sink-flood")
        try:
            started = time.monotonic()
            cpu = CpuMeter({"sink": sink.pid}).start()
            wait_until(
                lambda: _parked_on(db_dsn, topic) >= FLOOD_EVENTS,
                300,
                f"{FLOOD_EVENTS} parked",
                interval_s=0.2,
            )
            elapsed_s = time.monotonic() - started
            cpu_pct = cpu.stop()
            assert sink.terminate() == 0, sink.log_tail()
            log_lines = len(sink.log_path.read_text().splitlines())
        finally:
            sink.close()
    finally:
        stub.proc.close()
    rate = FLOOD_EVENTS / elapsed_s
    print_table(
        f"a flood of {FLOOD_EVENTS:,} events of a type without a route (sink -> parking lot)",
        ["figure", "value", "target"],
        [
            [
                "parked/s (sink ready -> all parked)",
                fmt(rate),
                (f">= {FLOOD_TARGET_PER_S:,.0f} {_verdict(rate >= FLOOD_TARGET_PER_S)}"),
            ],
            ["sink CPU %", fmt(cpu_pct["sink"]), ""],
            ["machine CPU % (2 cores = 200)", fmt(cpu_pct["machine"]), ""],
            ["sink log lines for the whole run", fmt(log_lines), ""],
            ["load average (1 min) at the end", f"{os.getloadavg()[0]:.2f}", ""],
        ],
    )
