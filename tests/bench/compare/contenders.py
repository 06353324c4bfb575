"""The contenders of ``make bench-compare``, each run as its own process on a slot of
its own, and what is measured of each:

* the relay (``outbox-cdc relay``), into Kafka;
* ``pg_recvlogical``, the decoding limit: the same slot type and pgoutput options, the
  stream written to a file, nothing sent to Kafka;
* Debezium's PostgreSQL connector with the Outbox Event Router in Kafka Connect
  standalone (``bench/debezium``), as it comes and tuned, into Kafka.

For each: start-up to the first record (from the process's spawn to the first record
in Kafka, or the first byte in ``pg_recvlogical``'s file), the drain rate (the backlog's
events over the time from the first record to the last), the process's CPU seconds over
that drain (``/proc/<pid>/stat`` utime + stime, all threads; ``wait4`` for
``pg_recvlogical``, which has exited by then) and its peak RSS (``VmHWM``). Records in
Kafka are counted from the topics' high watermarks every 20 ms, the same way for every
contender that writes to Kafka.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import psycopg
from confluent_kafka import Consumer, TopicPartition

from tests.bench.report import cpu_seconds, peak_rss_mb
from tests.harness import ROOT, RelayConfig, start_relay

DEBEZIUM_DIR = ROOT / "bench" / "debezium"
#: Debezium's two configurations: (worker, connector) files under bench/debezium.
DEBEZIUM_VARIANTS = {
    "debezium": ("worker.properties", "connector.properties"),
    "debezium-tuned": ("worker-tuned.properties", "connector-tuned.properties"),
}
POLL_S = 0.02
#: The longest a contender may take to drain a backlog.
DRAIN_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Figures:
    """What one contender did with one backlog."""

    name: str
    events: int
    #: Spawn -> first record (in Kafka; in the file for pg_recvlogical).
    startup_s: float
    #: First record -> last record.
    drain_s: float
    #: The contender's process CPU over the drain, and from its spawn to the last record.
    cpu_drain_s: float
    cpu_total_s: float
    peak_rss_mb: float
    #: The second half of the backlog alone (its middle record -> its last): the drain
    #: with the start of it left out, where a JVM is still compiling its hot code. NaN
    #: for pg_recvlogical (its file is not counted in records).
    late_drain_s: float = math.nan
    late_cpu_s: float = math.nan

    @property
    def late_events(self) -> int:
        return self.events - self.events // 2

    @property
    def late_events_per_s(self) -> float:
        return self.late_events / self.late_drain_s if self.late_drain_s > 0 else math.nan

    @property
    def late_events_per_cpu_s(self) -> float:
        return self.late_events / self.late_cpu_s if self.late_cpu_s > 0 else math.nan

    @property
    def events_per_s(self) -> float:
        return self.events / self.drain_s if self.drain_s > 0 else float("nan")

    @property
    def events_per_cpu_s(self) -> float:
        return self.events / self.cpu_drain_s if self.cpu_drain_s > 0 else float("nan")

    def as_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "events": self.events,
            "startup_s": self.startup_s,
            "drain_s": self.drain_s,
            "events_per_s": self.events_per_s,
            "events_per_cpu_s": self.events_per_cpu_s,
            "cpu_drain_s": self.cpu_drain_s,
            "cpu_total_s": self.cpu_total_s,
            "peak_rss_mb": self.peak_rss_mb,
            "late_events_per_s": self.late_events_per_s,
            "late_events_per_cpu_s": self.late_events_per_cpu_s,
        }


class TopicCount:
    """Records in a set of topics: the sum of their high watermarks (empty at the start)."""

    def __init__(self, kafka: str, topics: list[str]) -> None:
        self._consumer = Consumer({"bootstrap.servers": kafka, "group.id": "bench-compare-count"})
        meta = self._consumer.list_topics(timeout=15)
        self._parts = [
            TopicPartition(t, p) for t in topics for p in sorted(meta.topics[t].partitions)
        ]

    def __call__(self) -> int:
        return sum(
            self._consumer.get_watermark_offsets(tp, timeout=10, cached=False)[1]
            for tp in self._parts
        )

    def close(self) -> None:
        self._consumer.close()


def follow(
    name: str,
    *,
    pid: int,
    spawned: float,
    count: Callable[[], int],
    alive: Callable[[], bool],
    events: int,
    log: Path,
) -> Figures:
    """Watch ``count`` from the spawn until it reaches ``events``; the figures of ``pid``."""
    first_at = cpu_first = half_at = cpu_half = None
    deadline = spawned + DRAIN_TIMEOUT_S
    while True:
        n = count()
        now = time.monotonic()
        if n > 0 and first_at is None:
            first_at, cpu_first = now, cpu_seconds(pid)
        if n >= events // 2 and half_at is None:
            half_at, cpu_half = now, cpu_seconds(pid)
        if n >= events:
            cpu_last = cpu_seconds(pid)
            rss = peak_rss_mb(pid)
            break
        if not alive():
            raise AssertionError(f"{name} exited after {n:,} of {events:,} records:\n{_tail(log)}")
        if now > deadline:
            raise AssertionError(f"{name}: {n:,} of {events:,} records after {DRAIN_TIMEOUT_S} s")
        time.sleep(POLL_S)
    assert first_at is not None and cpu_first is not None
    assert half_at is not None and cpu_half is not None
    return Figures(
        name,
        events,
        first_at - spawned,
        now - first_at,
        cpu_last - cpu_first,
        cpu_last,
        rss,
        late_drain_s=now - half_at,
        late_cpu_s=cpu_last - cpu_half,
    )


def _nan_to_zero(value: float) -> float:
    return 0.0 if math.isnan(value) else value  # NaN: not readable (it has exited)


def _tail(log: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# -- the relay ---------------------------------------------------------------------


def run_relay(cfg: RelayConfig, tmp: Path, *, slot: str, topics: list[str], events: int) -> Figures:
    """The relay on ``slot`` (publishing under ``cfg.topic_prefix``) until ``topics`` hold
    ``events`` records; then SIGTERM (it must exit 0)."""
    count = TopicCount(cfg.kafka, topics)
    run_cfg = replace(cfg, extra={**cfg.extra, "CDC_SLOT": slot})
    spawned = time.monotonic()
    relay, _port = start_relay(run_cfg, tmp, name=f"relay-{slot}", wait_ready=False)
    try:
        figures = follow(
            "relay",
            pid=relay.pid,
            spawned=spawned,
            count=count,
            alive=relay.alive,
            events=events,
            log=relay.log_path,
        )
        assert relay.terminate() == 0, relay.log_tail()
    finally:
        relay.close()
        count.close()
    return figures


# -- pg_recvlogical ----------------------------------------------------------------


def run_pg_recvlogical(
    binary: str, dsn: str, tmp: Path, *, slot: str, endpos: str, events: int
) -> Figures:
    """``pg_recvlogical`` on ``slot`` to ``endpos`` (pgoutput, the relay's options), the
    stream written to a file: start-up is its first byte there, the drain ends when it
    exits at ``endpos``."""
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    password = str(info.pop("password", "") or "")
    out = tmp / f"{slot}.pgoutput"
    log = tmp / f"{slot}.log"
    args = [
        binary,
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
        str(out),
    ]
    with log.open("wb") as log_file:
        spawned = time.monotonic()
        proc = subprocess.Popen(
            args, env=dict(os.environ, PGPASSWORD=password), stdout=log_file, stderr=log_file
        )
        first_at = cpu_first = None
        rss = 0.0
        try:
            # Exited? Asked without reaping it (WNOWAIT): wait4 below reaps it and reads
            # its CPU. Its peak RSS is VmHWM read while it runs (wait4's ru_maxrss would
            # count this Python process's memory, which the child had before its exec).
            while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                if first_at is None and out.exists() and out.stat().st_size > 0:
                    first_at, cpu_first = time.monotonic(), cpu_seconds(proc.pid)
                rss = max(rss, _nan_to_zero(peak_rss_mb(proc.pid)))
                time.sleep(0.002 if first_at is None else POLL_S)
            _pid, status, usage = os.wait4(proc.pid, 0)
            ended = time.monotonic()
            proc.returncode = os.waitstatus_to_exitcode(status)
        finally:
            if proc.returncode is None:
                proc.kill()
                proc.wait(10)
    assert proc.returncode == 0, f"pg_recvlogical failed:\n{_tail(log)}"
    if first_at is None:  # it wrote and exited between two looks
        first_at, cpu_first = ended, 0.0
    cpu_total = usage.ru_utime + usage.ru_stime
    return Figures(
        "pg_recvlogical",
        events,
        first_at - spawned,
        ended - first_at,
        cpu_total - (cpu_first or 0.0),
        cpu_total,
        rss or float("nan"),
    )


# -- Debezium (Kafka Connect standalone) --------------------------------------------


def debezium_libs() -> Path:
    """The jars of bench/debezium/pom.xml (resolved once into .dev/debezium/libs)."""
    done = subprocess.run(
        ["bash", str(DEBEZIUM_DIR / "fetch.sh")],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, f"bench/debezium/fetch.sh failed:\n{done.stderr[-3000:]}"
    return Path(done.stdout.strip().splitlines()[-1])


def properties(source: Path, overrides: dict[str, str]) -> str:
    """``source``'s lines with ``overrides`` set (replaced in place, else appended)."""
    lines, done = [], set()
    for line in source.read_text().splitlines():
        key = line.split("=", 1)[0].strip()
        if not line.lstrip().startswith("#") and "=" in line and key in overrides:
            lines.append(f"{key}={overrides[key]}")
            done.add(key)
        else:
            lines.append(line)
    lines += [f"{k}={v}" for k, v in overrides.items() if k not in done]
    return "\n".join(lines) + "\n"


def run_debezium(
    variant: str,
    libs: Path,
    tmp: Path,
    *,
    kafka: str,
    dsn: str,
    slot: str,
    topic_prefix: str,
    topics: list[str],
    events: int,
    rest_port: int,
) -> Figures:
    """Debezium ``variant`` (a key of :data:`DEBEZIUM_VARIANTS`) in Connect standalone on
    ``slot``, routing to ``topic_prefix`` + aggregatetype, until ``topics`` hold
    ``events`` records; then SIGTERM (Connect stops its task and flushes offsets)."""
    worker_file, connector_file = DEBEZIUM_VARIANTS[variant]
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    run_dir = tmp / variant
    run_dir.mkdir(parents=True)
    worker = run_dir / "worker.properties"
    connector = run_dir / "connector.properties"
    worker.write_text(
        properties(
            DEBEZIUM_DIR / worker_file,
            {
                "bootstrap.servers": kafka,
                "offset.storage.file.filename": str(run_dir / "connect.offsets"),
                "listeners": f"http://127.0.0.1:{rest_port}",
            },
        )
    )
    connector.write_text(
        properties(
            DEBEZIUM_DIR / connector_file,
            {
                "database.hostname": str(info.get("host", "127.0.0.1")),
                "database.port": str(info.get("port", "5432")),
                "database.user": str(info.get("user", "postgres")),
                "database.password": str(info.get("password", "")),
                "database.dbname": str(info["dbname"]),
                "slot.name": slot,
                "topic.prefix": f"bench_{slot}",
                "transforms.outbox.route.topic.replacement": topic_prefix + "${routedByValue}",
            },
        )
    )
    args = [
        "java",
        f"@{DEBEZIUM_DIR / 'jvm.options'}",
        f"-Dlog4j2.configurationFile={DEBEZIUM_DIR / 'log4j2.properties'}",
        "-cp",
        f"{libs}/*",
        "org.apache.kafka.connect.cli.ConnectStandalone",
        str(worker),
        str(connector),
    ]
    log = run_dir / "connect.log"
    count = TopicCount(kafka, topics)
    with log.open("wb") as log_file:
        spawned = time.monotonic()
        proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, cwd=run_dir)
        try:
            figures = follow(
                variant,
                pid=proc.pid,
                spawned=spawned,
                count=count,
                alive=lambda: proc.poll() is None,
                events=events,
                log=log,
            )
            stop_process(proc, grace_s=60)
        finally:
            stop_process(proc, grace_s=0)
            count.close()
    return figures


def stop_process(proc: subprocess.Popen[bytes], *, grace_s: float) -> None:
    """End a contender: SIGTERM and ``grace_s`` to exit, then SIGKILL (0: SIGKILL at
    once); one already gone: nothing."""
    if proc.poll() is not None:
        return
    if grace_s > 0:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
            return
        except subprocess.TimeoutExpired:
            pass
    proc.kill()
    proc.wait(10)


def copy_slots(dsn: str, source: str, targets: list[str]) -> str:
    """``source`` (a new pgoutput slot) and copies of it named ``targets``: every slot at
    the same LSN, to the byte. Returns that LSN."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput')", (source,)
        ).fetchone()
        assert row is not None
        for target in targets:
            conn.execute("SELECT pg_copy_logical_replication_slot(%s, %s)", (source, target))
        rows = conn.execute(
            "SELECT DISTINCT confirmed_flush_lsn::text FROM pg_replication_slots"
            " WHERE slot_name = ANY(%s)",
            ([source, *targets],),
        ).fetchall()
    assert len(rows) == 1, f"slots at different LSNs: {rows}"
    return str(row[0])
