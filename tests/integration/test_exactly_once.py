"""CDC_DELIVERY=exactly-once against real PostgreSQL and Kafka: every event once to read_committed.

* kill -9 of the relay ``OUTBOX_EOS_KILLS`` times (default 20, half of them during its
  start-up: fencing, the checkpoint read, the first transaction) and of the broker
  ``OUTBOX_EOS_BROKER_RESTARTS`` times (default 2) under a steady writer: a
  read_committed consumer sees every committed event exactly once, in per-key
  order; the same run at-least-once (relay kills only) shows duplicates (the test
  can see them);
* zombie: the active relay paused (SIGSTOP), a standby takes over and publishes,
  the paused one resumed: fenced, it publishes nothing, exits non-zero;
* a broker killed between produce and commit: the transaction is aborted,
  nothing of it is visible to read_committed, and it is published once after;
* hostile records: dead letters exactly once;
* records read while a commit is under way (the overlap): once, in order, through
  a SIGTERM or a Ctrl-C amid the commits.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition

from tests.conftest import IN_CI, Services
from tests.harness import (
    Proc,
    RelayConfig,
    drop_slot,
    free_port,
    headers_of,
    http_status,
    read_topics,
    stack,
    start_relay,
    wait_for_ready,
    wait_until,
)
from tests.integration.test_relay_errors import metric, readyz

pytestmark = [pytest.mark.integration, pytest.mark.fault]

#: kill -9s of the relay per run (the issue's figure; half of them during the relay's start-up)
KILLS = int(os.environ.get("OUTBOX_EOS_KILLS", "20"))
#: broker restarts (kill -9, start) among the relay's kill -9s in the exactly-once run
BROKER_RESTARTS = int(os.environ.get("OUTBOX_EOS_BROKER_RESTARTS", "2"))
#: the steady writer's events per second (one event per transaction)
WRITE_RATE = 100
KEYS = 20


@pytest.fixture(autouse=True)
def local_stack(services: Services) -> None:
    if services.origin != "local-stack":
        msg = "exactly-once fault tests stop and start services: they need the local stack"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture
def cfg(db_dsn: str, kafka_bootstrap: str, unique: str) -> Iterator[RelayConfig]:
    config = RelayConfig(
        db_dsn=db_dsn,
        kafka=kafka_bootstrap,
        unique=unique,
        partitions=4,
        extra={"CDC_DELIVERY": "exactly-once"},
    )
    yield config
    drop_slot(db_dsn, config.slot)


class Writer(threading.Thread):
    """One event per transaction, ``rate`` a second, over ``KEYS`` keys; each key's
    payload carries its own sequence number (per-key order is checked on it)."""

    def __init__(self, dsn: str, aggregate: str, rate: int = WRITE_RATE) -> None:
        super().__init__(daemon=True)
        self.dsn, self.aggregate, self.rate = dsn, aggregate, rate
        self.stop = threading.Event()
        self.written = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        seq: Counter[int] = Counter()
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                while not self.stop.is_set():
                    key = self.written % KEYS
                    seq[key] += 1
                    conn.execute(
                        "INSERT INTO outbox (aggregatetype, aggregateid, type, payload)"
                        " VALUES (%s, %s, 'Steady', jsonb_build_object('seq', %s::int))",
                        (self.aggregate, f"k{key}", seq[key]),
                    )
                    self.written += 1
                    time.sleep(1.0 / self.rate)
        except BaseException as exc:  # (reported by the test)
            self.error = exc


def _expected_ids(dsn: str, aggregate: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT id::text FROM outbox WHERE aggregatetype = %s", (aggregate,)
        ).fetchall()
    return {r[0] for r in rows}


def read_committed(
    kafka: str, topic: str, *, expect: int, timeout_s: float = 180.0, idle_s: float = 5.0
) -> list:  # type: ignore[type-arg]
    """Every record of ``topic`` a read_committed consumer sees, waiting for ``expect``
    (then ``idle_s`` more, to catch surplus records)."""
    return read_topics(
        kafka, [topic], expect=expect, timeout_s=timeout_s, idle_s=idle_s, committed_only=True
    )


def _tally(msgs: list, expected: set[str]) -> tuple[int, int]:  # type: ignore[type-arg]
    """(missing, duplicates); asserts per-key order: each key's events, first sightings,
    in the order they were written (a key lives on one partition)."""
    seen: Counter[str] = Counter()
    last: dict[bytes, int] = defaultdict(int)
    for m in msgs:
        event_id = headers_of(m)["id"].decode()
        seen[event_id] += 1
        if seen[event_id] > 1:
            continue
        seq = json.loads(m.value())["seq"]
        assert seq > last[m.key()], f"key {m.key()!r}: seq {seq} after {last[m.key()]}"
        last[m.key()] = seq
    missing = len(expected - set(seen))
    duplicates = sum(n - 1 for n in seen.values())
    return missing, duplicates


def _kill_n_times(
    cfg: RelayConfig, tmp: Path, aggregate: str, *, broker_restarts: int = 0
) -> tuple[int, int, int]:
    writer = Writer(cfg.db_dsn, aggregate)
    relay, port = start_relay(cfg, tmp, name="relay-0")
    mode = cfg.extra["CDC_DELIVERY"]
    status, body = readyz(port)  # (its first line is the state; on 17+ notes may follow)
    assert (status, body.splitlines()[0]) == (
        200,
        f"streaming ({mode})" if mode == "exactly-once" else "streaming",
    )
    writer.start()
    rng = random.Random(40)
    try:
        restart_at = {
            round((j + 1) * KILLS / (broker_restarts + 1)) for j in range(broker_restarts)
        }
        for i in range(KILLS):
            time.sleep(rng.uniform(0.5, 2.5))
            if i in restart_at:  # the broker killed -9 and started again, the relay running
                stack("kill", "kafka")
                time.sleep(rng.uniform(0.5, 2.0))
                stack("up", "kafka")
                time.sleep(rng.uniform(0.5, 2.5))
            relay.kill()
            relay.close()
            # Every other relay is killed wherever its start-up is (fencing, reading the
            # checkpoint, the first transaction), the others once they stream.
            starting = i % 2 == 0 and i + 1 < KILLS and i + 1 not in restart_at
            relay, _ = start_relay(cfg, tmp, name=f"relay-{i + 1}", wait_ready=not starting)
        time.sleep(1.0)
    finally:
        writer.stop.set()
        writer.join(30)
    assert writer.error is None, writer.error
    try:
        expected = _expected_ids(cfg.db_dsn, aggregate)
        assert len(expected) == writer.written
        msgs = read_committed(cfg.kafka, cfg.topic_prefix + aggregate, expect=len(expected))
        missing, duplicates = _tally(msgs, expected)
    finally:
        relay.close()
    print(f"\n{aggregate}: {len(expected)} events, {KILLS} kill -9s, {duplicates} duplicates")
    return len(expected), missing, duplicates


def test_kill_9_and_broker_restarts_under_a_steady_writer_every_event_once_to_read_committed(
    cfg: RelayConfig, tmp_path: Path, record_property: object
) -> None:
    total, missing, duplicates = _kill_n_times(
        cfg, tmp_path, "eos", broker_restarts=BROKER_RESTARTS
    )
    record_property("duplicates", duplicates)  # type: ignore[operator]
    assert total > 0
    assert (missing, duplicates) == (0, 0)


def test_kill_9_under_a_steady_writer_at_least_once_shows_the_duplicates(
    cfg: RelayConfig, tmp_path: Path, record_property: object
) -> None:
    cfg.extra["CDC_DELIVERY"] = "at-least-once"
    _, missing, duplicates = _kill_n_times(cfg, tmp_path, "alo")
    record_property("duplicates", duplicates)  # type: ignore[operator]
    assert missing == 0
    assert duplicates > 0, "the kill -9 test cannot see duplicates: it proves nothing"


@pytest.fixture
def short_wal_sender_timeout(db_dsn: str) -> Iterator[None]:
    """A paused relay's walsender ends after 5 s (the standby takes the slot then)."""
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET wal_sender_timeout = '5s'")
        conn.execute("SELECT pg_reload_conf()")
    yield
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM RESET wal_sender_timeout")
        conn.execute("SELECT pg_reload_conf()")


def _count_committed(kafka: str, topic: str) -> int:
    return len(read_committed(kafka, topic, expect=0, timeout_s=30, idle_s=1.0))


def test_a_paused_relay_is_fenced_by_the_standby_that_took_over_and_publishes_nothing(
    cfg: RelayConfig, tmp_path: Path, short_wal_sender_timeout: None
) -> None:
    """SIGSTOP the active relay (a Kafka transaction of its own open: CDC_TX_MAX_MS=2000),
    let the standby take the slot over and publish, SIGCONT the paused one: it is
    fenced, says so in one line, exits non-zero; every event once, none twice."""
    topic = cfg.topic_prefix + "zombie"
    active_cfg = replace(cfg, extra={**cfg.extra, "CDC_TX_MAX_MS": "2000"})
    active, _ = start_relay(active_cfg, tmp_path, name="active")
    standby_port = free_port()
    standby = Proc(["relay"], cfg.env(standby_port), tmp_path / "standby.log").start()
    writer = Writer(cfg.db_dsn, "zombie")
    try:
        wait_until(
            lambda: http_status(f"http://127.0.0.1:{standby_port}/readyz") == 503,
            60,
            "the standby waiting",
        )
        writer.start()
        wait_until(lambda: _count_committed(cfg.kafka, topic) >= 100, 60, "100 published")
        os.kill(active.pid, signal.SIGSTOP)
        try:
            wait_for_ready(standby, standby_port, timeout_s=120)  # (it took the slot over)
            at_takeover = _count_committed(cfg.kafka, topic)
            wait_until(
                lambda: _count_committed(cfg.kafka, topic) >= at_takeover + 100,
                60,
                "the standby publishing",
            )
        finally:
            os.kill(active.pid, signal.SIGCONT)
        assert active.proc is not None
        code = active.proc.wait(120)
        assert code != 0
        log = active.log_path.read_text(errors="replace")
        fenced = [line for line in log.splitlines() if "fenced" in line]
        assert fenced, active.log_tail()
        assert "Traceback" not in log
        time.sleep(2.0)
    finally:
        writer.stop.set()
        writer.join(30)
        if active.alive():
            os.kill(active.pid, signal.SIGCONT)
    try:
        expected = _expected_ids(cfg.db_dsn, "zombie")
        msgs = read_committed(cfg.kafka, topic, expect=len(expected))
        missing, duplicates = _tally(msgs, expected)
        assert (missing, duplicates) == (0, 0)
    finally:
        standby.close()
        active.close()


def _read_uncommitted_ids(kafka: str, topic: str) -> Counter[str]:
    consumer = Consumer(
        {
            "bootstrap.servers": kafka,
            "group.id": f"eos-raw-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "isolation.level": "read_uncommitted",
        }
    )
    try:
        meta = consumer.list_topics(topic, timeout=15)
        consumer.assign([TopicPartition(topic, p, 0) for p in meta.topics[topic].partitions])
        seen: Counter[str] = Counter()
        idle_since = time.monotonic()
        while time.monotonic() - idle_since < 3.0:
            batch = consumer.consume(5000, 0.5)
            for msg in batch:
                if not msg.error():
                    seen[headers_of(msg)["id"].decode()] += 1
            if batch:
                idle_since = time.monotonic()
        return seen
    finally:
        consumer.close()


def test_a_broker_killed_between_produce_and_commit_aborts_and_republishes_once(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    """Records produced into a Kafka transaction whose commit is 12 s away; Kafka is
    killed before it and stays away past the commit budget: the transaction is
    aborted (its records stay invisible to read_committed) and, once Kafka is back,
    they are published again: exactly once to read_committed."""
    cfg.extra.update({"CDC_TX_MAX_MS": "12000", "CDC_TX_TIMEOUT_MS": "30000"})
    topic = cfg.topic_prefix + "brokerkill"
    relay, port = start_relay(cfg, tmp_path)
    try:
        with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:  # the topic exists first
            conn.execute(
                "INSERT INTO outbox (aggregatetype, aggregateid, type, payload)"
                " VALUES ('brokerkill', 'k0', 'Steady', '{\"seq\": 1}')"
            )
        wait_until(lambda: _count_committed(cfg.kafka, topic) == 1, 60, "the first record")
        with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
            for i in range(2, 52):
                conn.execute(
                    "INSERT INTO outbox (aggregatetype, aggregateid, type, payload)"
                    " VALUES ('brokerkill', 'k' || (%s %% 5), 'Steady',"
                    " jsonb_build_object('seq', %s::int))",
                    (i, i),
                )
        wait_until(
            lambda: sum(_read_uncommitted_ids(cfg.kafka, topic).values()) >= 51,
            30,
            "the records produced into the open transaction",
        )
        assert _count_committed(cfg.kafka, topic) == 1  # (produced, not committed)
        stack("kill", "kafka")
        try:
            time.sleep(25.0)  # past the commit budget and the transaction timeout
        finally:
            stack("up", "kafka")
        expected = _expected_ids(cfg.db_dsn, "brokerkill")
        msgs = read_committed(cfg.kafka, topic, expect=len(expected), timeout_s=240)
        seen = Counter(headers_of(m)["id"].decode() for m in msgs)
        assert set(seen) == expected
        assert max(seen.values()) == 1
        raw = _read_uncommitted_ids(cfg.kafka, topic)
        print(f"\nread_uncommitted copies: {sum(raw.values())} of {len(expected)} events")
        assert sum(raw.values()) > len(expected), "no aborted copy: nothing was aborted"
        assert "abort" in relay.log_path.read_text(errors="replace")
        aborted = 'outcome="aborted"'
        assert metric(port, "outbox_relay_kafka_transactions_total", aborted) >= 1
        assert metric(port, "outbox_relay_kafka_transactions_total", 'outcome="committed"') >= 2
    finally:
        relay.close()


def _insert(dsn: str, aggregate: str, count: int, *, start: int = 1) -> list[str]:
    """``count`` events of ``aggregate`` over 5 keys, one transaction each; their ids."""
    ids = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        for i in range(start, start + count):
            row = conn.execute(
                "INSERT INTO outbox (aggregatetype, aggregateid, type, payload)"
                " VALUES (%s, 'k' || (%s %% 5), 'Steady', jsonb_build_object('seq', %s::int))"
                " RETURNING id::text",
                (aggregate, i, i),
            ).fetchone()
            assert row is not None
            ids.append(str(row[0]))
    return ids


def _create_topic(kafka: str, topic: str, config: dict[str, str]) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": kafka})
    new = NewTopic(topic, num_partitions=2, replication_factor=-1, config=config)
    admin.create_topics([new])[topic].result(timeout=30)


def test_dead_letters_are_written_exactly_once_through_an_aborted_transaction_and_a_kill_9(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    """Three hostile events among ordinary ones: a row the broker refuses (over the
    topic's max.message.bytes: its failed delivery aborts the Kafka transaction; read
    again, it is dead-lettered), a row the producer refuses locally (over 1 MB), a
    logical message that is not JSON. The relay is killed -9 once after them: each
    dead letter is in the dead-letter topic exactly once, every other event once."""
    topic = cfg.topic_prefix + "hostile"
    _create_topic(cfg.kafka, topic, {"max.message.bytes": "100000"})
    cfg.extra.update(
        {
            "KAFKA_CONFIG_COMPRESSION_TYPE": "none",
            "KAFKA_CONFIG_BATCH_SIZE": "16384",
            "CDC_MESSAGES": "on",  # (one hostile event is a logical message)
        }
    )
    relay, _ = start_relay(cfg, tmp_path, name="relay-0")
    try:
        ids = _insert(cfg.db_dsn, "hostile", 100)
        with psycopg.connect(cfg.db_dsn) as conn, conn.transaction():
            broker_refused = conn.execute(
                "INSERT INTO outbox (aggregatetype, aggregateid, type, payload)"
                " VALUES ('hostile', 'k1', 'Big', jsonb_build_object('blob', (SELECT"
                " string_agg(md5(i::text), '') FROM generate_series(1, 6250) AS i)))"
                " RETURNING id::text"
            ).fetchone()
            conn.execute("SELECT pg_logical_emit_message(true, 'outbox', 'not json')")
        with psycopg.connect(cfg.db_dsn) as conn, conn.transaction():
            local_refused = conn.execute(
                "INSERT INTO outbox (aggregatetype, aggregateid, type, payload)"
                " VALUES ('hostile', 'k2', 'Huge', jsonb_build_object('blob', (SELECT"
                " string_agg(md5(i::text), '') FROM generate_series(1, 40000) AS i)))"
                " RETURNING id::text"
            ).fetchone()
        assert broker_refused is not None and local_refused is not None
        ids += _insert(cfg.db_dsn, "hostile", 100, start=101)
        time.sleep(3.0)
        relay.kill()
        relay.close()
        relay, _ = start_relay(cfg, tmp_path, name="relay-1")
        ids += _insert(cfg.db_dsn, "hostile", 50, start=201)
        msgs = read_committed(cfg.kafka, topic, expect=len(ids))
        dead = read_committed(cfg.kafka, cfg.dlq_topic, expect=3)
    finally:
        relay.close()
    seen = Counter(headers_of(m)["id"].decode() for m in msgs)
    extra = [
        (headers_of(m), len(m.value()), m.partition(), m.offset())
        for m in msgs
        if headers_of(m)["id"].decode() not in ids
    ]
    assert not extra, (extra, str(broker_refused[0]), str(local_refused[0]))
    assert set(seen) == set(ids) and max(seen.values()) == 1
    dead_ids = Counter(headers_of(m)["id"].decode() for m in dead)
    assert dead_ids == Counter({str(broker_refused[0]): 1, str(local_refused[0]): 1, "": 1})


def test_gap_recovery_in_exactly_once_mode_publishes_no_id_twice(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    """The slot is dropped while the relay is stopped; the recovery's window (the last
    record minus CDC_GAP_MARGIN_S) reaches back over records already in Kafka: in
    this mode those are skipped, the stranded rows published once, marked recovered."""
    import subprocess
    import sys

    from tests.harness import ROOT

    cfg.extra["CDC_GAP_MARGIN_S"] = "30"
    relay, _ = start_relay(cfg, tmp_path, name="first")
    try:
        published = _insert(cfg.db_dsn, "gap", 50)
        read_committed(cfg.kafka, cfg.topic_prefix + "gap", expect=50, idle_s=1.0)
        assert relay.terminate() == 0
    finally:
        relay.close()
    stranded = _insert(cfg.db_dsn, "gap", 30, start=51)
    subprocess.run(
        [sys.executable, "-m", "cdc.cli", "slot", "drop", "--yes"],
        env=cfg.env(free_port()),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    relay, _ = start_relay(cfg, tmp_path, name="second")
    try:
        after = _insert(cfg.db_dsn, "gap", 20, start=81)
        expected = published + stranded + after
        msgs = read_committed(cfg.kafka, cfg.topic_prefix + "gap", expect=len(expected))
        log = relay.log_path.read_text(errors="replace")
    finally:
        relay.close()
    seen = Counter(headers_of(m)["id"].decode() for m in msgs)
    assert set(seen) == set(expected)
    assert max(seen.values()) == 1, "an id published twice"
    recovered = {headers_of(m)["id"].decode() for m in msgs if "recovered" in headers_of(m)}
    assert set(stranded) <= recovered
    assert "recovering the window" in log


def test_sigterm_commits_the_open_transaction_exits_0_and_a_restart_publishes_nothing_twice(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    """A Kafka transaction open at SIGTERM (CDC_TX_MAX_MS=20000) is committed by the
    shutdown: its records become visible, the process exits 0, and the next relay
    skips them (the checkpoint covers them) and publishes only what came after."""
    cfg.extra["CDC_TX_MAX_MS"] = "20000"
    topic = cfg.topic_prefix + "sigterm"
    relay, _ = start_relay(cfg, tmp_path, name="first")
    try:
        first = _insert(cfg.db_dsn, "sigterm", 20)
        wait_until(
            lambda: sum(_read_uncommitted_ids(cfg.kafka, topic).values()) >= 20,
            60,
            "the records produced into the open transaction",
        )
        assert relay.terminate() == 0, relay.log_tail()
    finally:
        relay.close()
    assert _count_committed(cfg.kafka, topic) == 20
    relay, _ = start_relay(cfg, tmp_path, name="second")
    try:
        later = _insert(cfg.db_dsn, "sigterm", 10, start=21)
        msgs = read_committed(cfg.kafka, topic, expect=30)
    finally:
        relay.close()
    seen = Counter(headers_of(m)["id"].decode() for m in msgs)
    assert set(seen) == set(first + later) and max(seen.values()) == 1


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_records_read_while_commits_are_under_way_are_published_once_in_order_through_a_stop(
    cfg: RelayConfig, tmp_path: Path, sig: signal.Signals
) -> None:
    """A writer as fast as it goes (one event per transaction) while the relay commits
    every CDC_TX_MAX_MS: the records read while a commit is under way are buffered and
    produced into the next transaction (the overlap counter rises); SIGTERM (or Ctrl-C)
    amid the commits exits 0; after a restart a read_committed consumer sees every
    event once, in per-key order."""
    aggregate = f"overlap{sig.name.lower()}"
    writer = Writer(cfg.db_dsn, aggregate, rate=2_000)
    overlap = "outbox_relay_kafka_commit_overlap_records_total"
    relay, port = start_relay(cfg, tmp_path, name="first")
    try:
        writer.start()
        wait_until(lambda: metric(port, overlap) > 0, 60, "records read during a commit")
        time.sleep(2.0)
        overlapped = metric(port, overlap)
        assert relay.proc is not None
        stop_at = time.monotonic()
        relay.proc.send_signal(sig)
        assert relay.proc.wait(30) == 0, relay.log_tail()
        stop_s = time.monotonic() - stop_at  # (printed: no timed assertion under load)
    finally:
        relay.close()
    relay, _ = start_relay(cfg, tmp_path, name="second")
    try:
        time.sleep(2.0)
        writer.stop.set()
        writer.join(30)
        assert writer.error is None, writer.error
        expected = _expected_ids(cfg.db_dsn, aggregate)
        msgs = read_committed(cfg.kafka, cfg.topic_prefix + aggregate, expect=len(expected))
        missing, duplicates = _tally(msgs, expected)
    finally:
        writer.stop.set()
        relay.close()
    print(
        f"\n{aggregate}: {len(expected)} events, {overlapped:.0f} read during commits,"
        f" {sig.name} to exit {stop_s:.2f}s"
    )
    assert (missing, duplicates) == (0, 0)


def test_the_audits_repair_in_exactly_once_mode_publishes_the_missing_once_in_a_transaction(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    """Rows the relay never saw (its slot advanced by hand) are repaired by
    ``outbox-cdc audit --repair`` in this mode inside a Kafka transaction: a
    read_committed consumer sees each once, marked; a second repair finds nothing."""
    import subprocess
    import sys
    from datetime import UTC, datetime

    from tests.harness import ROOT

    def audit(*args: str) -> tuple[int, dict[str, object]]:
        proc = subprocess.run(
            [sys.executable, "-m", "cdc.cli", "audit", "--json", *args],
            env=cfg.env(free_port()),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert proc.returncode in (0, 1), proc.stderr
        return proc.returncode, json.loads(proc.stdout)

    topic = cfg.topic_prefix + "audited"
    relay, _ = start_relay(cfg, tmp_path)
    try:
        since = datetime.now(UTC).isoformat()
        time.sleep(1.1)
        published = _insert(cfg.db_dsn, "audited", 10)
        read_committed(cfg.kafka, topic, expect=10, idle_s=1.0)
        assert relay.terminate() == 0
    finally:
        relay.close()
    skipped = _insert(cfg.db_dsn, "audited", 7, start=11)
    with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_replication_slot_advance(%s, pg_current_wal_lsn())", (cfg.slot,))
    time.sleep(1.1)
    until = datetime.now(UTC).isoformat()
    code, repaired = audit("--since", since, "--until", until, "--repair")
    assert code == 1 and repaired["repaired"] == 7, repaired
    msgs = read_committed(cfg.kafka, topic, expect=17)
    seen = Counter(headers_of(m)["id"].decode() for m in msgs)
    assert set(seen) == set(published + skipped) and max(seen.values()) == 1
    mark = str(repaired["repair_mark"]).encode()
    assert {
        headers_of(m)["id"].decode() for m in msgs if headers_of(m).get("recovered") == mark
    } == set(skipped)
    code, clean = audit("--since", since, "--until", until, "--repair")
    assert code == 0 and clean["repaired"] == 0, clean


# --- evidence the relay does not own ------------------------------------------------------


def _ours(msgs: list, origin: bytes) -> Counter[str]:  # type: ignore[type-arg]
    """The ids of the records of ``origin`` among ``msgs``, read defensively (a record
    whose header name is not UTF-8 must not be read with ``headers()``)."""
    from cdc.records import RecordReader

    reader, seen = RecordReader(), Counter[str]()
    for m in msgs:
        record = reader.read(m)
        if record is not None and record.header("origin") == origin:
            seen[(record.header("id") or b"").decode()] += 1
    return seen


def _publish_then_stop(cfg: RelayConfig, tmp: Path, aggregate: str) -> tuple[list[str], bytes]:
    """50 events published by a relay that is then stopped (SIGTERM); their ids and the
    relay's ``origin``."""
    relay, _ = start_relay(cfg, tmp, name="first")
    try:
        published = _insert(cfg.db_dsn, aggregate, 50)
        msgs = read_committed(cfg.kafka, cfg.topic_prefix + aggregate, expect=50, idle_s=1.0)
        assert relay.terminate() == 0, relay.log_tail()
    finally:
        relay.close()
    return published, headers_of(msgs[0])["origin"]


def test_gap_recovery_does_not_skip_a_row_whose_id_only_a_foreign_record_carries(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    """Exactly-once recovery skips the ids read_committed consumers already hold. Records
    another producer wrote into the relay's topic with the ids of stranded rows - of
    another system, of another slot of this system, without ``origin``, and one with the
    relay's very origin but a header name that is not UTF-8 (``headers()`` raised
    SystemError: issue 34's crash) - vouch for nothing: every stranded row is published
    by the recovery, once, and the unreadable record crashes nothing."""
    import subprocess
    import sys

    from tests.harness import ROOT
    from tests.records import RawProducer, RawRecord

    cfg.extra["CDC_GAP_MARGIN_S"] = "30"
    topic = cfg.topic_prefix + "foreign"
    published, origin = _publish_then_stop(cfg, tmp_path, "foreign")
    stranded = _insert(cfg.db_dsn, "foreign", 30, start=51)
    system = origin.split(b"/")[0]
    forged = {
        stranded[0]: ((b"origin", b"1234567890123456789/1/" + cfg.slot.encode()),),
        stranded[1]: ((b"origin", system + b"/1/another_slot"),),
        stranded[2]: (),
        stranded[3]: ((b"origin", origin), (b"\xff\xfe-not-utf8", b"x")),
    }
    RawProducer(cfg.kafka).send(
        topic,
        0,
        [
            RawRecord(key=b"k0", value=b"{}", headers=((b"id", i.encode()), *extra))
            for i, extra in forged.items()
        ],
    )
    subprocess.run(
        [sys.executable, "-m", "cdc.cli", "slot", "drop", "--yes"],
        env=cfg.env(free_port()),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    relay, _ = start_relay(cfg, tmp_path, name="second")
    try:
        after = _insert(cfg.db_dsn, "foreign", 20, start=81)
        expected = published + stranded + after
        msgs = read_committed(cfg.kafka, topic, expect=len(expected) + len(forged))
        log = relay.log_path.read_text(errors="replace")
        assert relay.alive(), relay.log_tail()
    finally:
        relay.close()
    assert "recovering the window" in log
    seen = _ours(msgs, origin)
    assert set(seen) == set(expected), f"lost: {sorted(set(expected) - set(seen))}"
    assert max(seen.values()) == 1, "an id published twice"
    assert (
        "reading the ids present in Kafka: 4 records passed by" in log
        and "foreign_origin=2, no_origin=1, unreadable_headers=1" in log
    ), log


def _forge_checkpoint(cfg: RelayConfig, origin: bytes, lsn: str) -> str:
    """A record under the relay's key with its ``origin`` header, in its checkpoint
    topic, outside any transaction: anyone may write one. The topic."""
    from confluent_kafka import Producer

    from cdc.settings.checkpoint_names import default_checkpoint_topic

    topic = default_checkpoint_topic(cfg.topic_prefix, cfg.slot)
    producer = Producer({"bootstrap.servers": cfg.kafka})
    producer.produce(topic, lsn.encode(), origin, headers=[("origin", origin)])
    assert producer.flush(30) == 0
    return topic


def test_a_forged_checkpoint_beyond_the_servers_wal_is_not_trusted_and_nothing_is_lost(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    """A checkpoint under the relay's key and origin whose LSN lies beyond the server's
    WAL position would make the relay skip every transaction since it stopped: it is not
    trusted (one warning), the relay starts from the slot's confirmed position, and the
    rows written while it was stopped are published once."""
    published, origin = _publish_then_stop(cfg, tmp_path, "forged")
    while_down = _insert(cfg.db_dsn, "forged", 20, start=51)
    _forge_checkpoint(cfg, origin, "FFFF/FFFFFF00")
    relay, _ = start_relay(cfg, tmp_path, name="second")
    try:
        later = _insert(cfg.db_dsn, "forged", 10, start=71)
        expected = published + while_down + later
        msgs = read_committed(cfg.kafka, cfg.topic_prefix + "forged", expect=len(expected))
        log = relay.log_path.read_text(errors="replace")
    finally:
        relay.close()
    assert "not trusted: its LSN FFFF/FFFFFF00 lies beyond the server's WAL position" in log
    seen = Counter(headers_of(m)["id"].decode() for m in msgs)
    assert set(seen) == set(expected), f"lost: {sorted(set(expected) - set(seen))}"
    assert max(seen.values()) == 1


def test_a_forged_checkpoint_ahead_of_the_truth_counts_only_as_far_as_the_relays_records(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    """A forged checkpoint within the server's WAL (its current position) passes every
    check a record can; behind it, written while the relay was stopped, 20 rows and a
    transactional logical message (the audit could never republish a message). The
    checkpoint counts only as far as the relay's own records in Kafka reach (the 50
    published before): the rows and the message are streamed again, once each -
    nothing skipped, nothing repaired."""
    cfg.extra["CDC_GAP_MARGIN_S"] = "1"
    cfg.extra["CDC_MESSAGES"] = "on"  # (the relay decodes the logical message behind it)
    published, origin = _publish_then_stop(cfg, tmp_path, "ahead")
    while_down = _insert(cfg.db_dsn, "ahead", 20, start=51)
    message = json.dumps(
        {
            "id": str(uuid.uuid4()),
            "aggregatetype": "ahead",
            "aggregateid": "k1",
            "type": "Noted",
            "payload": {"seq": 999},
        }
    )
    with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_logical_emit_message(true, 'outbox', %s)", (message,))
        row = conn.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()
    assert row is not None
    _forge_checkpoint(cfg, origin, str(row[0]))
    time.sleep(2.5)
    relay, _ = start_relay(cfg, tmp_path, name="second")
    try:
        later = _insert(cfg.db_dsn, "ahead", 10, start=71)
        expected = [*published, *while_down, json.loads(message)["id"], *later]
        msgs = read_committed(cfg.kafka, cfg.topic_prefix + "ahead", expect=len(expected))
        log = relay.log_path.read_text(errors="replace")
    finally:
        relay.close()
    assert f"checkpoint {row[0]} of {origin.decode()} counts up to" in log, log[-3000:]
    seen = Counter(headers_of(m)["id"].decode() for m in msgs)
    assert set(seen) == set(expected), f"lost: {sorted(set(expected) - set(seen))}"
    assert max(seen.values()) == 1
    assert not [m for m in msgs if headers_of(m).get("recovered")], "streamed, not repaired"


def test_standby_safe_with_exactly_once_is_refused_at_start_in_one_line(
    cfg: RelayConfig, tmp_path: Path, db_dsn: str
) -> None:
    """CDC_STANDBY_SAFE holds records back until a standby has the WAL, past the end of
    their WAL transaction: a Kafka commit could then carry a checkpoint past records not
    in it. The combination is refused before the relay touches the slot or Kafka."""
    refused = replace(cfg, extra={**cfg.extra, "CDC_STANDBY_SAFE": "a_standby_slot"})
    relay = Proc(["relay"], refused.env(free_port()), tmp_path / "relay.log").start()
    try:
        assert relay.proc is not None
        code = relay.proc.wait(120)
    finally:
        relay.close()
    log = relay.log_path.read_text(errors="replace")
    assert code == 2, log
    errors = [line for line in log.splitlines() if "does not combine" in line]
    assert len(errors) == 1, log
    assert "CDC_STANDBY_SAFE" in errors[0] and "CDC_DELIVERY=exactly-once" in errors[0]
    assert "Traceback" not in log
    with psycopg.connect(db_dsn) as conn:
        slots = conn.execute(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", (cfg.slot,)
        ).fetchone()
    assert slots == (0,), "the refused relay made its slot"
