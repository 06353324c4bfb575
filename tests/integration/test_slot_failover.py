"""Slot lifetime: no event is lost when the slot is invalidated or left behind by a
failover, and none is published that a failover takes back (standby-safe mode).

Against a primary and a streaming standby of the tests' own (:mod:`tests.clusters`,
built once per session; the standby is re-cloned only after a test promoted it),
the shared Kafka and real relay processes on the multi-host DSN
(``target_session_attrs=read-write``), with writers committing events throughout:

* invalidation - the relay stopped, ``max_slot_wal_keep_size`` small, WAL pushed
  past it until ``wal_status = 'lost'``, writers going on, the relay restarted:
  every committed event is in Kafka, those of the gap marked ``recovered``
  (edge: slot lifetime; combined with a relay restart and live writers);
* failover - the relay paused (SIGSTOP: its walsender stops being read) while
  writers go on, the primary crashed (``stop -m immediate``), the standby
  promoted, the relay resumed: every event present on the new primary is in
  Kafka (edge: slot lifetime; combined with a paused process and live writers);
* standby-safe mode - the standby's WAL link held back, events committed that
  it never receives, a relay without the mode publishes them, one with the mode
  holds them (``/readyz`` 503 naming the standby once it waited too long); after
  the failover (and a new standby) nothing the safe relay published is missing
  from the new primary, and everything on it is published; the relay without the
  mode, whose newest records the failover took back, recovers on its own (they are
  phantoms, not rows deleted after insert) and names them (edge: slot lifetime and
  evidence from a timeline that ended; combined with a half-open replication link).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from tests.bench.report import metric_sum, scrape
from tests.clusters import STANDBY_SLOT, ClusterPair
from tests.harness import (
    Proc,
    RelayConfig,
    headers_of,
    start_relay,
    wait_for_ready,
    wait_until,
)
from tests.integration.test_relay_errors import readyz

pytestmark = [pytest.mark.integration, pytest.mark.fault]

#: Header the recovery adds to records re-published from the outbox table.
RECOVERED = "recovered"
#: Events committed in each phase of a test (enough to span transactions, cheap to read).
PHASE_EVENTS = 40
#: A topic read ends once every expected id arrived and nothing came for this long.
QUIET_S = 2.0


@dataclass
class Writer:
    """Commits one outbox event per transaction on the multi-host DSN until stopped,
    reconnecting through failures (a failover); ``ids`` are those whose commit returned."""

    dsn: str
    aggregate: str
    interval_s: float = 0.01
    ids: list[str] = field(default_factory=list)
    failures: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Writer:
        self._thread = threading.Thread(target=self._run, name="writer", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def mark(self) -> int:
        return len(self.ids)

    def wait_for(self, count: int, timeout_s: float = 120.0) -> int:
        """Wait until ``count`` more events committed; the mark after them."""
        target = self.mark() + count
        wait_until(lambda: self.mark() >= target, timeout_s, f"{count} more events written")
        return self.mark()

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            try:
                with psycopg.connect(self.dsn, autocommit=True) as conn:
                    while not self._stop.is_set():
                        row = conn.execute(
                            "INSERT INTO outbox (aggregatetype, aggregateid, type, payload)"
                            " VALUES (%s, %s, 'Written', jsonb_build_object('n', %s::int))"
                            " RETURNING id::text",
                            (self.aggregate, f"k{n % 7}", n),
                        ).fetchone()
                        assert row is not None
                        self.ids.append(row[0])
                        n += 1
                        self._stop.wait(self.interval_s)
            except psycopg.Error:
                self.failures += 1
                self._stop.wait(0.2)


@pytest.fixture
def writers() -> Iterator[list[Writer]]:
    made: list[Writer] = []
    yield made
    for writer in made:
        writer.stop()


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    made: list[Proc] = []
    yield made
    for proc in made:
        if proc.alive():
            os.kill(proc.pid, signal.SIGCONT)  # a paused relay must be able to die
        proc.close()


def _cfg(dsn: str, kafka: str, unique: str, **extra: str) -> RelayConfig:
    return RelayConfig(
        db_dsn=dsn,
        kafka=kafka,
        unique=unique,
        partitions=2,
        extra={"CDC_GAP_MARGIN_S": "30", **extra},
    )


def _start(cfg: RelayConfig, tmp: Path, procs: list[Proc], name: str) -> tuple[Proc, int]:
    proc, port = start_relay(cfg, tmp, name=name, wait_ready=False)
    procs.append(proc)
    wait_for_ready(proc, port, timeout_s=120)
    return proc, port


def _table_ids(dsn: str, aggregate: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT id::text FROM outbox WHERE aggregatetype = %s", (aggregate,)
        ).fetchall()
    return {r[0] for r in rows}


def _kafka(
    cfg: RelayConfig, aggregate: str, until: set[str], timeout_s: float = 180.0
) -> tuple[set[str], set[str]]:
    """Ids in the aggregate's topic - read until every id of ``until`` arrived (or the
    timeout), then until the topic is quiet - and those of them published as recovered."""
    topic = cfg.topic_prefix + aggregate
    consumer = Consumer(
        {
            "bootstrap.servers": cfg.kafka,
            "group.id": f"reader-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    ids: set[str] = set()
    recovered: set[str] = set()
    try:
        wait_until(lambda: topic in consumer.list_topics(timeout=10).topics, 120, topic)
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        deadline = time.monotonic() + timeout_s
        quiet_since = time.monotonic()
        while time.monotonic() < deadline:
            batch = consumer.consume(1000, 0.5)
            for msg in batch:
                assert msg.error() is None, msg.error()
                headers = headers_of(msg)
                event_id = headers["id"].decode()
                ids.add(event_id)
                if RECOVERED in headers:
                    recovered.add(event_id)
            if batch:
                quiet_since = time.monotonic()
            elif until <= ids and time.monotonic() - quiet_since >= QUIET_S:
                break
    finally:
        consumer.close()
    return ids, recovered


def _relayed(port: int, aggregate: str, cfg: RelayConfig) -> float:
    return metric_sum(scrape(port), "outbox_relay_events_total", topic=cfg.topic_prefix + aggregate)


@pytest.mark.timeout(600)
def test_an_invalidated_slot_loses_no_event_while_writers_go_on(
    pair: ClusterPair,
    pair_db: str,
    kafka_bootstrap: str,
    unique: str,
    tmp_path: Path,
    writers: list[Writer],
    procs: list[Proc],
) -> None:
    aggregate = "inval"
    cfg = _cfg(pair_db, kafka_bootstrap, unique)
    relay, port = _start(cfg, tmp_path, procs, "relay-before")
    writer = Writer(pair_db, aggregate).start()
    writers.append(writer)
    wait_until(lambda: _relayed(port, aggregate, cfg) >= PHASE_EVENTS, 120, "events relayed")
    assert relay.terminate() == 0, relay.log_tail()
    down_from = writer.mark()

    pair.primary.set_slot_keep("4MB")
    try:
        rounds = pair.primary.push_wal_until_lost(cfg.slot)
    finally:
        pair.primary.set_slot_keep("-1")
    down_to = writer.wait_for(PHASE_EVENTS)  # the writers go on while the slot is lost

    relay2, _ = _start(cfg, tmp_path, procs, "relay-after")
    assert relay2.alive()
    writer.wait_for(PHASE_EVENTS)
    writer.stop()
    expected = _table_ids(pair_db, aggregate)
    ids, recovered = _kafka(cfg, aggregate, expected)
    assert expected - ids == set(), f"{len(expected - ids)} committed events missing from Kafka"
    gap = set(writer.ids[down_from:down_to])
    assert gap <= recovered, f"{len(gap - recovered)} events of the gap not marked recovered"
    assert pair.primary.wal_status(cfg.slot) in {"reserved", "extended"}
    assert "slot gap" in relay2.log_path.read_text(), "the lost slot was not reported as a gap"
    print(f"slot lost after {rounds} WAL rounds; {len(gap)} events in the gap, all recovered")


@pytest.mark.timeout(600)
def test_a_failover_with_the_relay_behind_loses_no_event_the_new_primary_has(
    pair: ClusterPair,
    pair_db: str,
    kafka_bootstrap: str,
    unique: str,
    tmp_path: Path,
    writers: list[Writer],
    procs: list[Proc],
) -> None:
    aggregate = "failover"
    cfg = _cfg(pair_db, kafka_bootstrap, unique)
    relay, port = _start(cfg, tmp_path, procs, "relay")
    writer = Writer(pair_db, aggregate).start()
    writers.append(writer)
    wait_until(lambda: _relayed(port, aggregate, cfg) >= PHASE_EVENTS, 120, "events relayed")

    os.kill(relay.pid, signal.SIGSTOP)  # the relay falls behind: its walsender is not read
    behind_from = writer.mark()
    behind_to = writer.wait_for(PHASE_EVENTS)
    wait_until(pair.standby_caught_up, 60, "standby caught up")
    pair.fail_over()
    os.kill(relay.pid, signal.SIGCONT)
    writer.wait_for(PHASE_EVENTS)  # writers found the new primary
    wait_for_ready(relay, port, timeout_s=120)
    writer.stop()

    on_new_primary = _table_ids(pair_db, aggregate)
    ids, recovered = _kafka(cfg, aggregate, on_new_primary)
    missing = on_new_primary - ids
    assert missing == set(), f"{len(missing)} events of the new primary missing from Kafka"
    behind = set(writer.ids[behind_from:behind_to])
    assert behind <= on_new_primary  # the standby had caught up: none of them was lost
    assert behind <= recovered, f"{len(behind - recovered)} events behind not marked recovered"
    assert "slot gap" in relay.log_path.read_text(), "the failover was not reported as a gap"


def _held(port: int) -> float:
    return metric_sum(scrape(port), "outbox_relay_standby_held_transactions")


@pytest.mark.timeout(600)
def test_with_standby_safe_mode_no_event_in_kafka_is_missing_after_a_failover(
    pair: ClusterPair,
    pair_db: str,
    kafka_bootstrap: str,
    tmp_path: Path,
    procs: list[Proc],
) -> None:
    aggregate = "safe"
    safe = _cfg(
        pair_db,
        kafka_bootstrap,
        uuid.uuid4().hex[:10],
        CDC_STANDBY_SAFE=STANDBY_SLOT,
        CDC_STANDBY_SAFE_MAX_WAIT_S="1",
    )
    plain = _cfg(pair_db, kafka_bootstrap, uuid.uuid4().hex[:10])
    safe_relay, safe_port = _start(safe, tmp_path, procs, "relay-safe")
    plain_relay, plain_port = _start(plain, tmp_path, procs, "relay-plain")
    dsn = pair_db

    def write(n: int) -> set[str]:
        with psycopg.connect(dsn, autocommit=True) as conn:
            return {
                conn.execute(
                    "INSERT INTO outbox (aggregatetype, aggregateid, type, payload)"
                    " VALUES (%s, %s, 'Written', '{}') RETURNING id::text",
                    (aggregate, f"k{i % 5}"),
                ).fetchone()[0]  # type: ignore[index]
                for i in range(n)
            }

    before = write(PHASE_EVENTS)
    for port, cfg in ((safe_port, safe), (plain_port, plain)):
        wait_until(lambda: _relayed(port, aggregate, cfg) >= PHASE_EVENTS, 120, "events relayed")  # noqa: B023

    pair.wal_link.silence(new_connections=True)  # the standby receives nothing more
    unseen = write(PHASE_EVENTS)  # committed on the primary only
    wait_until(
        lambda: _relayed(plain_port, aggregate, plain) >= 2 * PHASE_EVENTS, 120, "plain relay"
    )
    wait_until(lambda: _held(safe_port) > 0, 60, "the safe relay holding transactions")
    _, body = wait_until(
        lambda: (answer := readyz(safe_port))[0] == 503 and answer, 60, "/readyz names the standby"
    )
    assert body.startswith("held: waiting") and repr(STANDBY_SLOT) in body, body
    assert _relayed(safe_port, aggregate, safe) == PHASE_EVENTS
    pair.fail_over()  # what the standby never received is gone

    pair.heal()  # a new standby (same physical slot name) for the new primary
    after = write(PHASE_EVENTS)
    wait_for_ready(safe_relay, safe_port, timeout_s=120)
    # the plain relay's newest records are phantoms: taken back, not "deleted after
    # insert" - it recovers on its own (no accept-gap) and names them
    wait_for_ready(plain_relay, plain_port, timeout_s=120)
    on_new_primary = _table_ids(dsn, aggregate)
    assert before | after <= on_new_primary
    lost = unseen - on_new_primary  # what the failover took back
    safe_ids, _ = _kafka(safe, aggregate, on_new_primary)
    plain_ids, _ = _kafka(plain, aggregate, on_new_primary | unseen)
    assert lost, "the standby received events committed after its link was paused"
    assert plain_ids >= lost, "the scenario must make phantoms without the mode"
    assert safe_ids - on_new_primary == set(), "phantoms published with standby-safe mode on"
    assert on_new_primary - safe_ids == set(), "events of the new primary missing from Kafka"
    assert on_new_primary - plain_ids == set(), "the plain relay's recovery missed events"
    plain_log = plain_relay.log_path.read_text()
    assert "published from WAL the failover took back" in plain_log, plain_relay.log_tail()
    assert "rows deleted after insert" not in plain_log, plain_relay.log_tail()
