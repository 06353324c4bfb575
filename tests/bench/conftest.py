"""Load generation and process plumbing shared by the benchmarks.

Benchmarks run the real processes (relay, sink, engine stub) as
subprocesses, each with its own interpreter and GIL, against the real local
PostgreSQL and Kafka. They print figures and assert only correctness (every
event arrived, none was applied twice); no figure is ever asserted.
"""

from __future__ import annotations

import json
import os
import ssl
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from cdc.kafka.producer import PRODUCER_DEFAULTS
from tests.bench.report import GOALS, metric_sum, print_goals, scrape, write_tables
from tests.harness import Proc, env_without, free_port, wait_until
from tests.pki import Pki

API_KEY = "bench-key"
#: Offered-rate schedules start this far in the future so the first event is on time.
PACE_LEAD_S = 0.05


def create_topics(kafka: str, names: list[str], *, partitions: int) -> None:
    """Create ``names`` (broker auto-creation is off) and wait until they exist."""
    admin = AdminClient({"bootstrap.servers": kafka})
    # Each name once: a request naming a topic twice crashed the process (confluent-kafka
    # 2.x, a segmentation fault in create_topics).
    names = list(dict.fromkeys(names))
    new = [NewTopic(n, num_partitions=partitions, replication_factor=-1) for n in names]
    for future in admin.create_topics(new, request_timeout=30).values():
        try:
            future.result(timeout=30)
        except KafkaException as exc:
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise
    wait_until(lambda: all(n in admin.list_topics(timeout=10).topics for n in names), 30, "topics")


def delete_topics_naming(kafka: str, marker: str) -> None:
    """Delete every topic whose name holds ``marker`` (a run's unique id): a bench of
    millions of records leaves gigabytes behind otherwise (a full disk ended a later
    run's PostgreSQL in recovery)."""
    admin = AdminClient({"bootstrap.servers": kafka})
    names = [t for t in admin.list_topics(timeout=30).topics if marker in t]
    for future in (admin.delete_topics(names, request_timeout=60) if names else {}).values():
        future.result(timeout=60)


def topic_record_count(kafka: str, topic: str) -> int:
    """Records in ``topic`` (sum of high watermarks; the topic is never compacted)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": kafka, "group.id": "bench-count-unused"})
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return sum(
            consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts
        )
    finally:
        consumer.close()


def produce_user_events(kafka: str, topic: str, n: int) -> list[str]:
    """``n`` UserRegistered records in the contract format; their event ids."""
    producer = Producer(
        {"bootstrap.servers": kafka, "linger.ms": 20, "compression.type": "lz4", "acks": "all"}
    )
    ids = []
    for _ in range(n):
        user_id, event_id = str(uuid.uuid4()), str(uuid.uuid4())
        while True:
            try:
                producer.produce(
                    topic,
                    key=user_id.encode(),
                    value=json.dumps({"user_id": user_id}, separators=(",", ":")).encode(),
                    headers=[
                        ("id", event_id.encode()),
                        ("type", b"UserRegistered"),
                        ("aggregatetype", b"user"),
                    ],
                )
                break
            except BufferError:
                producer.poll(0.1)
        ids.append(event_id)
        producer.poll(0)
    assert producer.flush(60) == 0, "records left unacknowledged"
    return ids


# -- the engine stub as a process of its own ------------------------------------


@dataclass
class StubProc:
    """``outbox-cdc engine-stub`` in its own process, reached over HTTP."""

    proc: Proc
    port: int
    #: The client context of a TLS stub (trusts its CA, presents the client certificate).
    ssl_context: ssl.SSLContext | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self.ssl_context is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    def get(self, endpoint: str) -> Any:
        with urllib.request.urlopen(
            self.url + endpoint, timeout=30, context=self.ssl_context
        ) as resp:
            return json.loads(resp.read())

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = self.get("/_stub/stats")
        return result

    def post(self, endpoint: str, body: object) -> Any:
        request = urllib.request.Request(
            self.url + endpoint,
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=30) as resp:
            return json.loads(resp.read())

    def applied_items(self, *, since: int = 0, limit: int | None = None) -> list[dict[str, Any]]:
        query = f"?since={since}" + (f"&limit={limit}" if limit is not None else "")
        items: list[dict[str, Any]] = self.get("/_stub/applied" + query)["items"]
        return items


def start_stub(
    tmp: Path,
    *,
    latency_ms: float = 0.0,
    name: str = "stub",
    pki: Pki | None = None,
    mtls: bool = False,
) -> StubProc:
    """The stub in its own process; with ``pki`` over TLS (``mtls``: client certs required)."""
    port = free_port()
    env = env_without(os.environ, "CDC_", "KAFKA_", "SINK_", "ENGINE_", "OUTBOX_")
    env.update({"INTERNAL_API_KEY": API_KEY, "LOG_LEVEL": "WARNING"})
    context = None
    if pki is not None:
        env.update(
            {
                "ENGINE_STUB_TLS_CERT": str(pki.server_cert),
                "ENGINE_STUB_TLS_KEY": str(pki.server_key),
            }
        )
        if mtls:
            env["ENGINE_STUB_CLIENT_CA"] = str(pki.ca_cert)
        context = pki.client_context(with_client_cert=mtls)
    args = ["engine-stub", "--port", str(port), "--latency-ms", str(latency_ms)]
    proc = Proc(args, env, tmp / f"{name}.log").start()
    stub = StubProc(proc, port, context)

    def up() -> bool:
        if not proc.alive():
            raise AssertionError(f"engine stub exited:\n{proc.log_tail()}")
        try:
            return bool(stub.get("/healthz"))
        except OSError:
            return False

    wait_until(up, 30, "engine stub /healthz")
    return stub


# -- offered load ----------------------------------------------------------------


@dataclass
class Pace:
    """How well a paced writer kept its schedule."""

    events: int
    elapsed_s: float
    max_behind_s: float

    @property
    def rate_per_s(self) -> float:
        return self.events / self.elapsed_s if self.elapsed_s > 0 else 0.0


def paced(rate_per_s: float, duration_s: float, pace: Pace) -> Iterator[int]:
    """Yield ``0..rate*duration-1``, event ``i`` no earlier than ``start + i/rate``.

    An open-loop schedule: a writer that falls behind catches up without
    skipping, so the offered load is fixed; ``pace`` records how far behind it
    fell and the rate achieved.
    """
    total = round(rate_per_s * duration_s)
    start = time.monotonic() + PACE_LEAD_S
    for i in range(total):
        delay_s = start + i / rate_per_s - time.monotonic()
        if delay_s > 0:
            time.sleep(delay_s)
        else:
            pace.max_behind_s = max(pace.max_behind_s, -delay_s)
        yield i
        pace.events = i + 1
        pace.elapsed_s = time.monotonic() - start  # also right for a writer stopped early


# -- a relay's drain -------------------------------------------------------------

#: Events the relay published, per topic. Moved into the counter by the relay's status
#: updates: while the slot's confirmation waits for the ledger's first raise of its
#: confirm limit (at the start of a drain, up to a second) none go out, so the counter
#: stands still - it read a drain of 2,000 events that took 37 ms as 1.05 s.
EVENTS_METRIC = "outbox_relay_events_total"
#: WAL transactions whose every record Kafka acknowledged, counted at the acknowledgement
#: itself (the count of the relay's commit->ack histogram): what a drain is timed by.
ACKED_TX_METRIC = "outbox_relay_commit_to_ack_seconds_count"
#: Longest wait, once a drain is acknowledged, for its events in the counter above.
COUNTED_WAIT_S = 60.0


def relayed(port: int, topic: str) -> float:
    """Events the relay on ``port`` published to ``topic`` (its last status update's count)."""
    return metric_sum(scrape(port), EVENTS_METRIC, topic=topic)


def acked_transactions(port: int) -> float:
    """WAL transactions the relay on ``port`` had all records of acknowledged by Kafka."""
    return metric_sum(scrape(port), ACKED_TX_METRIC)


def wait_drained(
    port: int,
    topic: str,
    *,
    events: int,
    transactions: int,
    committed: bool = False,
    timeout_s: float = 600.0,
) -> float:
    """The monotonic time the relay on ``port`` had ``transactions`` WAL transactions
    acknowledged (``committed``: and, exactly-once, the Kafka transaction that holds
    them committed - the status update that follows each commit moves the events
    counter); then, not timed, waits until ``events`` reached ``topic``."""

    def acked() -> bool:
        text = scrape(port)
        if metric_sum(text, ACKED_TX_METRIC) < transactions:
            return False
        return not committed or metric_sum(text, EVENTS_METRIC, topic=topic) >= events

    wait_until(acked, timeout_s, f"{transactions:,} transactions acknowledged", interval_s=0.02)
    at = time.monotonic()
    wait_until(
        lambda: relayed(port, topic) >= events, COUNTED_WAIT_S, f"{events:,} events in {topic}"
    )
    return at


# -- slots -----------------------------------------------------------------------


@pytest.fixture
def slots_to_drop(db_dsn: str) -> Iterator[list[str]]:
    """Slot names a test created; dropped afterwards (once nothing streams them)."""
    names: list[str] = []
    yield names
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        for name in names:
            wait_until(partial(_slot_idle, conn, name), 30, f"slot {name} inactive")
            conn.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
                " WHERE slot_name = %s",
                (name,),
            )


def _slot_idle(conn: psycopg.Connection[tuple[object, ...]], name: str) -> bool:
    row = conn.execute(
        "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active", (name,)
    ).fetchone()
    return row is None


def walsender_pid(dsn: str, slot: str) -> int | None:
    """PID of the walsender streaming ``slot``, if any."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
    return None if row is None or row[0] is None else int(row[0])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The performance goals recorded by this session's benches, met or not; then every
    table printed, as JSON (tests/bench/report.py, write_tables)."""
    if GOALS:
        print_goals(GOALS)
    write_tables()


# -- a warm broker before the first figure ---------------------------------------

#: Records per warm-up round (2-3 s on a slow machine), and the longest warm-up
#: (BENCH_WARMUP_MAX_S=0 skips it: for a quick proof that a bench runs, not for figures).
WARMUP_RECORDS = 200_000
WARMUP_MAX_S = float(os.environ.get("BENCH_WARMUP_MAX_S", "240"))
#: Warm when the broker's JIT compiler threads took under this share of a core, in
#: each of the last two rounds.
WARMUP_JIT_SHARE = 0.05


#: The JVM's JIT compiler threads, as /proc names them.
JIT_THREADS = ("C1 CompilerThre", "C2 CompilerThre")


@pytest.fixture(scope="session", autouse=True)
def _warm_broker(kafka_bootstrap: str) -> None:
    """Rounds of the relay's kind of records through the broker, produced and read
    back, until its JIT compiler goes quiet. A broker just started spends minutes
    compiling its hot paths (the C2 compiler thread took 30 of the broker's first 68 CPU
    seconds): the first bench after ``make up`` saw the broker at 85-93% of a core
    where a warm one takes 30%, on a 2-core machine where the relay competes with it,
    and read 0.77 / 0.51 for the relay / pg_recvlogical ratios that were 0.95 / 0.79
    ten minutes later."""
    from confluent_kafka import Consumer, TopicPartition

    from tests.bench.report import cpu_seconds, kafka_pid, threads_cpu_seconds

    if WARMUP_MAX_S <= 0:
        print("\n== broker warm-up skipped (BENCH_WARMUP_MAX_S=0): figures unfit to compare")
        return
    pid = kafka_pid()
    topic = f"bench-warmup-{uuid.uuid4().hex[:8]}"
    partitions = 6
    create_topics(kafka_bootstrap, [topic], partitions=partitions)
    producer = Producer(
        {"bootstrap.servers": kafka_bootstrap, **PRODUCER_DEFAULTS, "message.timeout.ms": 60_000}
    )
    consumer = Consumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": topic, "enable.auto.commit": False}
    )
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    headers = [("id", b"0" * 36), ("type", b"UserRegistered"), ("aggregatetype", b"user")]
    value = json.dumps({"user_id": str(uuid.uuid4()), "pad": "x" * 100}).encode()
    rounds: list[tuple[float, float, float]] = []  # wall s, broker CPU s, JIT CPU s

    def spent() -> tuple[float, float]:
        """The broker's CPU seconds so far, and its JIT compiler's."""
        if pid is None:
            return 0.0, 0.0
        return cpu_seconds(pid), threads_cpu_seconds(pid, JIT_THREADS)

    try:
        warmup_ends = time.monotonic() + WARMUP_MAX_S
        while time.monotonic() < warmup_ends:
            started = time.monotonic()
            cpu0, jit0 = spent()
            for n in range(WARMUP_RECORDS):
                while True:
                    try:
                        producer.produce(topic, value, str(n % 997).encode(), headers=headers)
                        break
                    except BufferError:
                        producer.poll(0.05)
            assert producer.flush(60) == 0, "warm-up records left unacknowledged"
            read, deadline = 0, time.monotonic() + 30
            while read < WARMUP_RECORDS and time.monotonic() < deadline:
                read += len(consumer.consume(10_000, 0.5))
            cpu1, jit1 = spent()
            rounds.append((time.monotonic() - started, cpu1 - cpu0, jit1 - jit0))
            if pid is None:
                break  # not our broker: nothing to watch
            if len(rounds) >= 2 and all(j <= WARMUP_JIT_SHARE * w for w, _, j in rounds[-2:]):
                break
    finally:
        consumer.close()
        AdminClient({"bootstrap.servers": kafka_bootstrap}).delete_topics([topic])
    jit = ", ".join(f"{100 * j / w:.0f}" for w, _, j in rounds)
    broker = ", ".join(f"{100 * c / w:.0f}" for w, c, _ in rounds)
    print(
        f"\n== broker warm-up: {len(rounds)} rounds of {WARMUP_RECORDS:,} records produced and"
        f" read back, {sum(w for w, _, _ in rounds):.0f} s; broker CPU % per round: {broker};"
        f" of which its JIT compiler: {jit}"
    )
