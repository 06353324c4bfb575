"""Helpers for tests that run the real processes (relay, sink, engine stub).

Processes are started as ``python -m cdc.cli ...`` subprocesses so tests can
SIGTERM or SIGKILL them like an operator or a crash would.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from sinks.shared.routes import USERS_SYNC_PATH, derived_user_sync_key

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_status(url: str, timeout_s: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return None


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.1):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


@dataclass
class Proc:
    """A running ``outbox-cdc`` subcommand with its log file."""

    args: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    _log: object = field(default=None, repr=False)

    def start(self) -> Proc:
        log = self.log_path.open("ab")
        self._log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cdc.cli", *self.args],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self, timeout_s: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.alive():
            self.kill()
        if self._log is not None:
            self._log.close()  # type: ignore[attr-defined]

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class RelayConfig:
    """Per-test names so tests never see each other's slots or topics."""

    db_dsn: str
    kafka: str
    unique: str
    partitions: int = 3
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def slot(self) -> str:
        return f"slot_{self.unique}"

    @property
    def topic_prefix(self) -> str:
        return f"t{self.unique}.outbox.event."

    @property
    def dlq_topic(self) -> str:
        return f"t{self.unique}.dlq"

    def env(self, http_port: int) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("CDC_", "KAFKA_", "SINK_", "ENGINE_", "OUTBOX_"))
        }
        env.update(
            {
                "CDC_PG_DSN": self.db_dsn,
                "KAFKA_BOOTSTRAP_SERVERS": self.kafka,
                "CDC_SLOT": self.slot,
                "CDC_TOPIC_PREFIX": self.topic_prefix,
                "CDC_DLQ_TOPIC": self.dlq_topic,
                "CDC_TOPIC_PARTITIONS": str(self.partitions),
                "CDC_RELAY_HTTP_PORT": str(http_port),
                "LOG_LEVEL": "INFO",
                # A native crash (a segfault at exit was seen once, -11 after "relay
                # stopped") prints every thread's stack into the process's log.
                "PYTHONFAULTHANDLER": "1",
                # The session's database is shared: a test's first start finds other
                # tests' rows in the outbox and must not publish them (cdc.relay.gaps.gap).
                "CDC_SLOT_INIT": "now",
                # The session's database is shared by every test's slot: a periodic
                # audit would judge (and republish) the other tests' rows. Off unless
                # a test turns it on.
                "CDC_AUDIT_INTERVAL_S": "0",
            }
        )
        env.update(self.extra)
        return env


def start_relay(
    cfg: RelayConfig, tmp: Path, *, name: str = "relay", wait_ready: bool = True
) -> tuple[Proc, int]:
    port = free_port()
    proc = Proc(["relay"], cfg.env(port), tmp / f"{name}.log").start()
    if wait_ready:
        try:
            wait_for_ready(proc, port)
        except BaseException:
            proc.close()  # never leave the process and its log file behind a failed start
            raise
    return proc, port


def wait_for_ready(proc: Proc, port: int, timeout_s: float = 60.0, path: str = "/readyz") -> None:
    def ready() -> bool:
        if not proc.alive():
            raise AssertionError(f"process exited early:\n{proc.log_tail()}")
        return http_status(f"http://127.0.0.1:{port}{path}") == 200

    try:
        wait_until(ready, timeout_s, path)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{proc.log_tail()}") from None


def topics_with_prefix(kafka: str, prefix: str) -> list[str]:
    admin = AdminClient({"bootstrap.servers": kafka})
    return sorted(t for t in admin.list_topics(timeout=15).topics if t.startswith(prefix))


def read_topics(
    kafka: str,
    topics: Iterable[str],
    *,
    expect: int,
    timeout_s: float = 120.0,
    idle_s: float = 3.0,
    committed_only: bool = False,
) -> list:  # type: ignore[type-arg]
    """Every record of ``topics`` from the beginning, waiting until at least
    ``expect`` arrived (then ``idle_s`` more to catch surplus duplicates);
    ``committed_only``: what a read_committed consumer sees."""
    consumer = Consumer(
        {
            "bootstrap.servers": kafka,
            "group.id": "reader-unused",
            "enable.auto.commit": False,
            "enable.partition.eof": False,
            "isolation.level": "read_committed" if committed_only else "read_uncommitted",
        }
    )
    topics = list(topics)
    try:
        wait_until(
            lambda: all(t in consumer.list_topics(timeout=15).topics for t in topics),
            timeout_s,
            f"topics {topics}",
            interval_s=0.3,
        )
        meta = consumer.list_topics(timeout=15)
        # (OFFSET_BEGINNING: the log's start - past records deleted by retention or
        # DeleteRecords, where offset 0 would be out of range and read nothing)
        parts = [TopicPartition(t, p, -2) for t in topics for p in meta.topics[t].partitions]
        consumer.assign(parts)
        out = []
        deadline = time.monotonic() + timeout_s
        last_new = time.monotonic()
        while time.monotonic() < deadline:
            batch = consumer.consume(5000, 0.5)
            for msg in batch:
                if msg.error():
                    raise KafkaException(msg.error())
                out.append(msg)
            if batch:
                last_new = time.monotonic()
            elif len(out) >= expect and time.monotonic() - last_new >= idle_s:
                break
        return out
    finally:
        consumer.close()


def headers_of(msg) -> dict[str, bytes]:  # type: ignore[no-untyped-def]
    return dict(msg.headers() or [])


def stack(*args: str) -> None:
    """Drive the local stack (fault tests): e.g. stack('kill', 'kafka')."""
    subprocess.run(["bash", str(ROOT / "compose" / "stack.sh"), *args], check=True, timeout=300)


def env_without(env: Mapping[str, str], *prefixes: str) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith(prefixes)}


@dataclass
class SinkConfig:
    """The sink's environment for one test: same topics as the relay config."""

    relay: RelayConfig
    engine_url: str
    api_key: str = "test-key"
    admin_token: str = "test-admin-token"
    scheduler: bool = False
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def group(self) -> str:
        return f"sink-{self.relay.unique}"

    def env(self, http_port: int) -> dict[str, str]:
        env = self.relay.env(free_port())
        env.update(
            {
                "SINK_GROUP_ID": self.group,
                "SINK_HTTP_PORT": str(http_port),
                "ENGINE_BASE_URL": self.engine_url,
                "INTERNAL_API_KEY": self.api_key,
                "ADMIN_API_TOKEN": self.admin_token,
                "OUTBOX_SCHEDULER_ENABLED": "true" if self.scheduler else "false",
                "SINK_BACKOFF_MAX_S": "2",
            }
        )
        env.update(self.extra)
        return env


def start_sink(
    cfg: SinkConfig, tmp: Path, *, name: str = "sink", wait_ready: bool = True
) -> tuple[Proc, int]:
    """Start a sink; wait until /readyz (or, ``wait_ready=False``, /healthz) answers 200.

    A sink started while the engine is down may never be ready: wait for it alive.
    """
    port = free_port()
    proc = Proc(["sink"], cfg.env(port), tmp / f"{name}.log").start()
    try:
        wait_for_ready(proc, port, path="/readyz" if wait_ready else "/healthz")
    except BaseException:
        proc.close()  # never leave the process and its log file behind a failed start
        raise
    return proc, port


def drop_slot(dsn: str, slot: str) -> None:
    """Drop ``slot`` when it exists and no relay streams it (test clean-up)."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
            " WHERE slot_name = %s AND NOT active",
            (slot,),
        )


def slot_confirmed_lsn(dsn: str, slot: str) -> int:
    """The slot's ``confirmed_flush_lsn`` as an integer."""
    import psycopg

    from cdc.wal.replproto import str_to_lsn

    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
            (slot,),
        ).fetchone()
    assert row is not None, f"slot {slot} does not exist"
    return str_to_lsn(row[0])


def produce(
    kafka: str,
    topic: str,
    records: Iterable[tuple[bytes | None, bytes | None, dict[str, bytes]]],
) -> int:
    """Produce ``(key, value, headers)`` records to ``topic`` in order; how many."""
    from confluent_kafka import Producer

    producer = Producer(
        {"bootstrap.servers": kafka, "linger.ms": 20, "compression.type": "lz4", "acks": "all"}
    )
    count = 0
    for key, value, headers in records:
        while True:
            try:
                producer.produce(topic, key=key, value=value, headers=list(headers.items()))
                break
            except BufferError:
                producer.poll(0.1)
        count += 1
        producer.poll(0)
    assert producer.flush(60) == 0, "records left unacknowledged"
    return count


def create_topics(kafka: str, names: list[str], *, partitions: int) -> None:
    """Create ``names`` (broker auto-creation is off) and wait until they exist."""
    from confluent_kafka.admin import NewTopic

    admin = AdminClient({"bootstrap.servers": kafka})
    new = [NewTopic(n, num_partitions=partitions, replication_factor=-1) for n in names]
    for future in admin.create_topics(new, request_timeout=30).values():
        try:
            future.result(timeout=30)
        except KafkaException as exc:
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise
    wait_until(lambda: all(n in admin.list_topics(timeout=10).topics for n in names), 30, "topics")


def group_caught_up(kafka: str, group: str, topics: Iterable[str]) -> bool:
    """True when ``group`` committed the end offset of every partition of ``topics``."""
    consumer = Consumer({"bootstrap.servers": kafka, "group.id": group})
    try:
        parts = [
            TopicPartition(t, p)
            for t in topics
            for p in consumer.list_topics(t, timeout=10).topics[t].partitions
        ]
        committed = consumer.committed(parts, timeout=10)
        for tp in committed:
            _low, high = consumer.get_watermark_offsets(tp, timeout=10)
            if high > 0 and tp.offset != high:
                return False
        return True
    finally:
        consumer.close()


def without_derived_user_syncs(
    applied: list[dict[str, object]], event_ids: Iterable[str]
) -> list[dict[str, object]]:
    """The engine calls in ``applied`` less the user syncs the sink made for ``event_ids``.

    A quiz attempt the sink reads before its user's registration (another topic: no
    order between them) is answered "user not found"; the sink then syncs the user
    under a key derived from the attempt's id (:mod:`sinks.engine.dispatch`): an engine call
    of that event, not an extra event. Each such call must be a ``users/sync`` call.
    """
    derived = {derived_user_sync_key(i) for i in event_ids}
    syncs = [item for item in applied if item["event_id"] in derived]
    assert all(item["path"] == USERS_SYNC_PATH for item in syncs), syncs
    return [item for item in applied if item["event_id"] not in derived]
