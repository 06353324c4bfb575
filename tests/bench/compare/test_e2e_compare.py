"""``make bench-compare``, end to end: the outbox to an HTTP endpoint, our pipeline beside
Debezium Server, at 0 ms and 10 ms of engine latency (issue 52).

* ``outbox-cdc``: the relay (WAL -> Kafka) and the sink (Kafka consumer group -> HTTP,
  64 requests in flight, one per key at a time), Kafka in between;
* ``debezium-server``: Debezium Server 3.6 (``bench/debezium/fetch.sh server``) with the
  PostgreSQL connector, the Outbox Event Router and its HTTP sink
  (``bench/debezium/server-application.properties``), straight to the endpoint - no
  Kafka, so no record to replay from.

Each drains one backlog (BENCH_E2E_EVENTS, 50,000 by default, at 0 ms;
BENCH_E2E_EVENTS_10MS, 5,000, at 10 ms: Debezium Server's sink posts one event at a time,
so 10 ms each) of 1-event transactions, written after its slot was copied from one slot
(the same LSN), into a fresh endpoint (``endpoint.py``: the same server for both; why not
the engine stub is said there) that waits the latency before each answer.

Per contender: events/s at the endpoint (its first answer to its last), events per CPU
second of the contender's processes (``/proc/<pid>/stat``: relay + sink; Debezium Server's
JVM) from the first event out of the source (the relay's first record in Kafka; Debezium
Server's first POST) to the last answer (the broker's CPU beside ours, as it is part of
our path), peak RSS
(``VmHWM``; relay + sink summed), start-up (the spawn of the relay / the JVM to the first
answer; the sink was started and ready before the relay) and that every event arrived:
the endpoint's keys are the backlog's outbox ids, each once. Figures are printed and
written as JSON (``compare-e2e-<latency>ms.json``), never asserted.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import psycopg
import pytest

from tests.bench.compare.conftest import PARTITIONS
from tests.bench.compare.contenders import (
    DEBEZIUM_DIR,
    TopicCount,
    copy_slots,
    properties,
    stop_process,
)
from tests.bench.conftest import API_KEY, create_topics
from tests.bench.report import (
    cpu_seconds,
    fmt,
    kafka_pid,
    load_average,
    peak_rss_mb,
    print_table,
    write_figures,
)
from tests.bench.test_relay_bench import _fill, _server
from tests.harness import ROOT, RelayConfig, SinkConfig, free_port, start_relay, start_sink

pytestmark = [pytest.mark.bench, pytest.mark.integration]

#: BENCH_E2E_EVENTS / BENCH_E2E_EVENTS_10MS: the backlog at 0 ms / at 10 ms.
EVENTS = {
    0: int(os.environ.get("BENCH_E2E_EVENTS", "50000")),
    10: int(os.environ.get("BENCH_E2E_EVENTS_10MS", "5000")),
}
ORDER = ("outbox-cdc", "debezium-server")
#: BENCH_E2E_ONLY=debezium-server: one of the two.
ONLY = [c for c in os.environ.get("BENCH_E2E_ONLY", ",".join(ORDER)).split(",") if c]
DEBEZIUM_VERSION = "3.6.1.Final"
#: Debezium Server 3.6 is built for Java 21 (class files of version 65).
SERVER_JAVA_MIN = 21
POLL_S = 0.02
DRAIN_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Run:
    """One contender's drain to the endpoint."""

    name: str
    events: int
    startup_s: float
    #: First answer -> last answer at the endpoint.
    drain_s: float
    #: The contender's processes' CPU over the drain (relay + sink / the JVM).
    cpu_s: float
    #: The broker's CPU over the same time (our path only; NaN for Debezium Server).
    broker_cpu_s: float
    #: The endpoint's CPU over the same time (the same server for both; in neither figure).
    endpoint_cpu_s: float
    peak_rss_mb: float
    arrived: int
    duplicates: int
    bad_requests: int
    missing: int
    unexpected: int
    #: The first request as the endpoint received it.
    sample: dict[str, Any]
    #: ``cpu_s`` per process (relay and sink; the JVM).
    cpu_by_process: dict[str, float] = field(default_factory=dict)
    #: Each process's CPU from its spawn to the last answer (start-up included).
    cpu_total_by_process: dict[str, float] = field(default_factory=dict)

    @property
    def cpu_total_s(self) -> float:
        return sum(self.cpu_total_by_process.values())

    @property
    def events_per_s(self) -> float:
        return (self.events - 1) / self.drain_s if self.drain_s > 0 else math.nan

    @property
    def events_per_cpu_s(self) -> float:
        return self.events / self.cpu_s if self.cpu_s > 0 else math.nan

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "events": self.events,
            "startup_s": self.startup_s,
            "drain_s": self.drain_s,
            "events_per_s": self.events_per_s,
            "events_per_cpu_s": self.events_per_cpu_s,
            "cpu_s": self.cpu_s,
            "broker_cpu_s": self.broker_cpu_s,
            "endpoint_cpu_s": self.endpoint_cpu_s,
            "peak_rss_mb": self.peak_rss_mb,
            "arrived": self.arrived,
            "duplicates": self.duplicates,
            "bad_requests": self.bad_requests,
            "missing": self.missing,
            "unexpected": self.unexpected,
            "cpu_by_process_s": self.cpu_by_process,
            "cpu_total_s": self.cpu_total_s,
            "cpu_total_by_process_s": self.cpu_total_by_process,
            "first_request": self.sample,
        }


# -- the endpoint -------------------------------------------------------------------


class Endpoint:
    """``endpoint.py`` in a process of its own."""

    def __init__(self, tmp: Path, name: str, latency_ms: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = (tmp / f"{name}.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.bench.compare.endpoint", "--port", str(self.port),
             "--latency-ms", f"{latency_ms:g}"],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            try:
                self.stats()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise AssertionError(f"endpoint did not start: {tmp / f'{name}.log'}") from None
                time.sleep(0.05)

    def _get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=30) as resp:
            return json.loads(resp.read())

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = self._get("/_bench/stats")
        return result

    def arrived_keys(self) -> list[str]:
        result: list[str] = self._get("/_bench/keys")
        return result

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


class Drained(NamedTuple):
    """A drain as :func:`_follow` saw it."""

    startup_s: float
    drain_s: float
    #: CPU seconds over the drain: the contender's processes, the broker, the endpoint.
    cpu_s: float
    broker_cpu_s: float
    endpoint_cpu_s: float
    cpu_by_process: dict[str, float]
    #: Each process's CPU from its spawn to the last answer (start-up included).
    cpu_total_by_process: dict[str, float]


def _follow(
    name: str,
    endpoint: Endpoint,
    *,
    pids: dict[str, int],
    events: int,
    spawned: float,
    alive: Any,
    log: Path,
    source_out: Callable[[], int] | None = None,
) -> Drained:
    """Poll the endpoint from the spawn (``spawned``: ``time.time()``, the endpoint's clock)
    until ``events`` arrived. CPU is read from the first event out of the source to the last
    answer: ``source_out`` counts what the source sent (our relay: records in Kafka; its CPU
    from there, not from the endpoint's first answer, when the sink may not even have its
    partitions yet); without it, the endpoint's first answer (Debezium Server posts each
    event as it reads it)."""
    broker = kafka_pid()

    def cpu() -> dict[str, float]:
        return {name: cpu_seconds(pid) for name, pid in pids.items()} | {
            " broker": cpu_seconds(broker) if broker else math.nan,
            " endpoint": cpu_seconds(endpoint.proc.pid),
        }

    first: dict[str, float] | None = None
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        if first is None and source_out is not None and source_out() > 0:
            first = cpu()
        stats = endpoint.stats()
        if first is None and source_out is None and stats["events"] > 0:
            first = cpu()
        if stats["events"] >= events:
            last = cpu()
            break
        if not alive():
            raise AssertionError(f"{name} exited after {stats['events']:,} events:\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{name}: {stats['events']:,} of {events:,} after the timeout")
        time.sleep(POLL_S)
    assert first is not None
    spent = {name: last[name] - first[name] for name in first}
    return Drained(
        stats["first_at"] - spawned,
        stats["last_at"] - stats["first_at"],
        sum(spent[name] for name in pids),
        spent[" broker"],
        spent[" endpoint"],
        {name: spent[name] for name in pids},
        {name: last[name] for name in pids},
    )


def _tail(log: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _arrivals(endpoint: Endpoint, expected: set[str]) -> dict[str, Any]:
    """What arrived against the backlog's ids. Debezium Server's header values arrive as
    JSON strings (quotes included: its header formats give no plain string)."""
    stats = endpoint.stats()
    keys = [json.loads(k) if k.startswith('"') else k for k in endpoint.arrived_keys()]
    got = set(keys)
    return {
        "arrived": len(keys),
        "duplicates": stats["duplicates"],
        "bad_requests": stats["bad"],
        "missing": len(expected - got),
        "unexpected": len(got - expected),
        "sample": stats["sample"],
    }


# -- contender A: relay -> Kafka -> sink --------------------------------------------


def run_outbox_cdc(
    cfg: RelayConfig, tmp: Path, *, slot: str, aggregate: str, latency_ms: float, events: int,
    expected: set[str],
) -> Run:  # fmt: skip
    run_cfg = replace(cfg, unique=f"{cfg.unique}{aggregate}", extra={**cfg.extra, "CDC_SLOT": slot})
    create_topics(
        cfg.kafka, [run_cfg.topic_prefix + aggregate, run_cfg.dlq_topic], partitions=PARTITIONS
    )
    endpoint = Endpoint(tmp, f"endpoint-outbox-cdc-{latency_ms:g}", latency_ms)
    in_kafka = TopicCount(cfg.kafka, [run_cfg.topic_prefix + aggregate])
    relay = sink = None
    try:
        sink_cfg = SinkConfig(
            relay=run_cfg,
            engine_url=endpoint.url,
            api_key=API_KEY,
            extra={"SINK_MAX_IN_FLIGHT": "64", "LOG_LEVEL": "WARNING"},
        )
        sink, _ = start_sink(sink_cfg, tmp, name=f"sink-e2e-{latency_ms:g}")
        spawned = time.time()
        relay, _ = start_relay(run_cfg, tmp, name=f"relay-e2e-{latency_ms:g}", wait_ready=False)
        procs = (relay, sink)
        drained = _follow(
            "outbox-cdc", endpoint, pids={"relay": relay.pid, "sink": sink.pid}, events=events,
            spawned=spawned, alive=lambda: all(p.alive() for p in procs), log=relay.log_path,
            source_out=in_kafka,
        )  # fmt: skip
        rss = peak_rss_mb(relay.pid) + peak_rss_mb(sink.pid)
        arrivals = _arrivals(endpoint, expected)
        assert sink.terminate() == 0, sink.log_tail()
        assert relay.terminate() == 0, relay.log_tail()
    finally:
        for proc in (sink, relay):
            if proc is not None:
                proc.close()
        endpoint.close()
        in_kafka.close()
    return Run("outbox-cdc", events, **drained._asdict(), peak_rss_mb=rss, **arrivals)


# -- contender B: Debezium Server ---------------------------------------------------


def debezium_server() -> Path:
    """Debezium Server's folder (fetched and unpacked once by ``fetch.sh server``)."""
    done = subprocess.run(
        ["bash", str(DEBEZIUM_DIR / "fetch.sh"), "server"],
        capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"bench/debezium/fetch.sh server failed:\n{done.stderr[-3000:]}"
    return Path(done.stdout.strip().splitlines()[-1])


def _java_major(java: str) -> int:
    try:
        out = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        ).stderr
    except OSError:
        return 0
    found = re.search(r'version "(\d+)', out)
    return int(found.group(1)) if found else 0


def server_java() -> str:
    """A Java of at least :data:`SERVER_JAVA_MIN`: DEBEZIUM_SERVER_JAVA, else JAVA_HOME's,
    else ``java``, else the newest under /usr/lib/jvm (Debian 12's OpenJDK is 17; this
    machine has a Temurin 25 beside it)."""
    candidates = [os.environ.get("DEBEZIUM_SERVER_JAVA", "")]
    if os.environ.get("JAVA_HOME"):
        candidates.append(os.path.join(os.environ["JAVA_HOME"], "bin", "java"))
    candidates.append("java")
    candidates += sorted(glob.glob("/usr/lib/jvm/*/bin/java"), reverse=True)
    best = max(((_java_major(c), c) for c in candidates if c), default=(0, ""))
    if best[0] < SERVER_JAVA_MIN:
        pytest.fail(
            f"Debezium Server {DEBEZIUM_VERSION} needs Java {SERVER_JAVA_MIN}+; none found"
            " (set DEBEZIUM_SERVER_JAVA to its java binary)"
        )
    return best[1]


def run_debezium_server(
    cfg: RelayConfig, tmp: Path, *, slot: str, latency_ms: float, events: int,
    expected: set[str], server: Path, java: str,
) -> Run:  # fmt: skip
    info = psycopg.conninfo.conninfo_to_dict(cfg.db_dsn)
    run_dir = tmp / f"debezium-server-{latency_ms:g}"
    (run_dir / "config").mkdir(parents=True)
    endpoint = Endpoint(tmp, f"endpoint-debezium-server-{latency_ms:g}", latency_ms)
    (run_dir / "config" / "application.properties").write_text(
        properties(
            DEBEZIUM_DIR / "server-application.properties",
            {
                "debezium.source.database.hostname": str(info.get("host", "127.0.0.1")),
                "debezium.source.database.port": str(info.get("port", "5432")),
                "debezium.source.database.user": str(info.get("user", "postgres")),
                "debezium.source.database.password": str(info.get("password", "")),
                "debezium.source.database.dbname": str(info["dbname"]),
                "debezium.source.slot.name": slot,
                "debezium.source.offset.storage.file.filename": str(run_dir / "offsets.dat"),
                "debezium.sink.http.url": endpoint.url + "/api/internal/users/sync",
                "quarkus.http.port": str(free_port()),
            },
        )
    )
    # run.sh's command (its class path and main class), with the Kafka Connect comparison's
    # JVM options; --add-opens: Quarkus's thread pool asks for it on Java 24 and later.
    runner = next(server.glob("debezium-server-dist-*-runner.jar"))
    args = [
        java, f"@{DEBEZIUM_DIR / 'jvm.options'}", "--add-opens", "java.base/java.lang=ALL-UNNAMED",
        "-cp", f"{runner}:{server / 'lib'}/*", "io.debezium.server.Main",
    ]  # fmt: skip
    log = run_dir / "debezium-server.log"
    with log.open("wb") as log_file:
        spawned = time.time()
        # cwd: Debezium Server reads config/application.properties from there.
        proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, cwd=run_dir)
        try:
            drained = _follow(
                "debezium-server", endpoint, pids={"debezium-server": proc.pid}, events=events,
                spawned=spawned, alive=lambda: proc.poll() is None, log=log,
            )  # fmt: skip
            rss = peak_rss_mb(proc.pid)
            arrivals = _arrivals(endpoint, expected)
            stop_process(proc, grace_s=60)
        finally:
            stop_process(proc, grace_s=0)
            endpoint.close()
    drained = drained._replace(broker_cpu_s=math.nan)  # not on its path
    return Run("debezium-server", events, **drained._asdict(), peak_rss_mb=rss, **arrivals)


# -- the test -----------------------------------------------------------------------


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("latency_ms", [0, 10], ids=["0ms", "10ms"])
def test_outbox_to_endpoint_our_pipeline_beside_debezium_server(
    latency_ms: int, cfg: RelayConfig, tmp_path: Path, slots_to_drop: list[str]
) -> None:
    unknown = set(ONLY) - set(ORDER)
    assert not unknown, f"BENCH_E2E_ONLY: unknown contenders {unknown}"
    events = EVENTS[latency_ms]
    load_at_start = load_average()
    names = [c for c in ORDER if c in ONLY]
    server = java = None
    if "debezium-server" in names:
        server, java = debezium_server(), server_java()
    slots = {name: f"{cfg.slot}_e2e_{name.replace('-', '_')}" for name in names}
    slots_to_drop.extend(slots.values())
    lsn = copy_slots(cfg.db_dsn, slots[names[0]], [slots[n] for n in names[1:]])
    # The backlog: UserRegistered events (the sink routes them to users/sync) in 1-event
    # transactions, as the application writes them, under an aggregate of this case's own.
    aggregate = f"e2e{latency_ms}"
    select_ids = "SELECT id FROM outbox WHERE aggregatetype = %s"
    with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
        assert not conn.execute(select_ids, (aggregate,)).fetchall(), f"{aggregate}: not new"
    insert_rate = _fill(cfg.db_dsn, aggregate, events, 1)
    with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
        expected = {str(r[0]) for r in conn.execute(select_ids, (aggregate,)).fetchall()}
    assert len(expected) == events
    runs: list[Run] = []
    for name in names:
        if name == "outbox-cdc":
            runs.append(
                run_outbox_cdc(
                    cfg,
                    tmp_path,
                    slot=slots[name],
                    aggregate=aggregate,
                    latency_ms=latency_ms,
                    events=events,
                    expected=expected,
                )
            )
        else:
            assert server is not None and java is not None
            runs.append(
                run_debezium_server(
                    cfg,
                    tmp_path,
                    slot=slots[name],
                    latency_ms=latency_ms,
                    events=events,
                    expected=expected,
                    server=server,
                    java=java,
                )
            )

    db = _server(cfg.db_dsn)
    java_version = f"Java {_java_major(java)}" if java else ""
    print_table(
        f"make bench-compare, end to end: {events:,} events (1-event transactions, inserted at"
        f" {insert_rate:,.0f}/s) to an HTTP endpoint answering after {latency_ms} ms ({db};"
        f" Debezium Server {DEBEZIUM_VERSION} on {java_version}; slots copied at {lsn};"
        f" load {load_at_start} -> {load_average()})",
        [
            "contender",
            "Kafka between",
            "ev/s at endpoint",
            "ev per CPU-s",
            "CPU-s from spawn",
            "broker CPU-s",
            "endpoint CPU-s",
            "peak RSS MB",
            "start-up s",
            "arrived",
            "missing",
            "duplicates",
        ],
        [
            [
                r.name,
                "yes" if r.name == "outbox-cdc" else "no",
                fmt(r.events_per_s),
                fmt(r.events_per_cpu_s),
                fmt(r.cpu_total_s, 1),
                fmt(r.broker_cpu_s, 1),
                fmt(r.endpoint_cpu_s, 1),
                fmt(r.peak_rss_mb, 1),
                fmt(r.startup_s, 2),
                fmt(r.arrived),
                fmt(r.missing),
                fmt(r.duplicates),
            ]
            for r in runs
        ],
    )
    print(
        "  (ev/s: the endpoint's first answer -> its last; CPU: relay + sink processes /"
        " Debezium Server's JVM, all threads, from the first event out of the source (the"
        " relay's first record in Kafka / the first POST) to the last answer - the broker's"
        " and the endpoint's CPU-s beside them, in neither; CPU-s from spawn: the same"
        " processes from their spawn (start-up included) to the last answer; peak RSS:"
        " VmHWM, relay + sink summed; start-up: spawn of the relay / the JVM -> first"
        " answer. Debezium Server has no"
        " Kafka in between: nothing to replay from, one request at a time)"
    )
    write_figures(
        f"compare-e2e-{latency_ms}ms",
        {
            "server": db,
            "debezium": DEBEZIUM_VERSION,
            "debezium_java": java_version,
            "events": events,
            "events_per_tx": 1,
            "engine_latency_ms": latency_ms,
            "partitions": PARTITIONS,
            "slot_lsn": lsn,
            "insert_events_per_s": insert_rate,
            "contenders": [r.as_json() for r in runs],
        },
        load_at_start=load_at_start,
    )
    for r in runs:
        assert r.missing == 0 and r.unexpected == 0 and r.arrived == events, (
            f"{r.name}: {r.arrived:,} of {events:,} events arrived, {r.missing:,} missing,"
            f" {r.unexpected:,} not of the backlog"
        )
