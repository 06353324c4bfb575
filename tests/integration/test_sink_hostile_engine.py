"""The sink against an engine that rate-limits, trickles or hangs, and a parking lot that is away.

Real Kafka, real PostgreSQL, the engine stub over real HTTP. Records are
produced straight into the outbox topics in the record contract's format (the
relay's own tests cover the WAL side), so a backlog is there at once:

* a token-bucket engine answering 429 + ``Retry-After`` for a minute: nothing
  parked, no attempt spent, every event applied, the delivered rate within
  20 % of the engine's limit (measured on the stub's own applied timestamps);
* an engine dripping its answers a few bytes at a time: the request deadline
  ends each request as engine-wide trouble; once the drip ends, everything is
  applied, nothing parked, no attempt spent;
* Kafka stopped with work waiting: ``/readyz`` says ``stalled: ...`` after
  ``SINK_STALL_AFTER_S`` (not before) and ``running`` again once Kafka is back;
* PostgreSQL stopped under a flood of unroutable events: the records held stay
  bounded, every partition pauses, the RSS stays bounded; PostgreSQL back:
  every record parked or delivered.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import httpx
import psycopg
import pytest

from sinks.kafka.worker import CONSUME_BATCH, HANDOFF_MAX_RECORDS
from sinks.runtime.sink import MAX_BUFFERED
from sinks.stub.server import StubServer
from tests.harness import (
    RelayConfig,
    SinkConfig,
    create_topics,
    produce,
    stack,
    start_sink,
    wait_until,
)
from tests.integration.conftest import API_KEY
from tests.integration.test_sink import _wait_applied

pytestmark = [pytest.mark.integration, pytest.mark.fault]

PARTITIONS = 4
#: The engine's limit in the rate-limit test, and how long the backlog lasts at it.
RATE_PER_S = 100
RATE_LIMITED_FOR_S = 60
#: The issue's tolerance on the delivered rate.
RATE_TOLERANCE = 0.2

Record = tuple[bytes, bytes, dict[str, bytes]]


@pytest.fixture
def topics(db_dsn: str, kafka_bootstrap: str, unique: str) -> RelayConfig:
    cfg = RelayConfig(db_dsn=db_dsn, kafka=kafka_bootstrap, unique=unique, partitions=PARTITIONS)
    create_topics(kafka_bootstrap, [cfg.topic_prefix + "user"], partitions=PARTITIONS)
    return cfg


def _record(event_type: str, user: str) -> Record:
    headers = {
        "id": str(uuid.uuid4()).encode(),
        "type": event_type.encode(),
        "aggregatetype": b"user",
    }
    return user.encode(), json.dumps({"user_id": user}).encode(), headers


def _users(n: int) -> list[Record]:
    return [_record("UserRegistered", str(uuid.uuid4())) for _ in range(n)]


def _ids(records: list[Record]) -> set[str]:
    return {headers["id"].decode() for _, _, headers in records}


def _metric(port: int, line_start: str) -> float:
    """The sample's value (0 when absent); a busy sink is given a few tries."""
    for attempt in range(5):
        try:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            break
        except httpx.HTTPError:
            if attempt == 4:
                raise
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _parked_count(dsn: str, topic: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM failed_sync_events WHERE kafka_topic = %s", (topic,)
        ).fetchone()
    assert row is not None
    return int(row[0])


def _readyz(port: int) -> tuple[int, str]:
    try:
        answer = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2)
    except httpx.HTTPError as exc:
        return 0, repr(exc)
    return answer.status_code, answer.text


def _sink_cfg(topics: RelayConfig, stub: StubServer, **extra: str) -> SinkConfig:
    return SinkConfig(relay=topics, engine_url=stub.url, api_key=API_KEY, extra=dict(extra))


def test_a_rate_limited_engine_gets_what_it_admits_nothing_parked_no_attempt_spent(
    topics: RelayConfig, stub: StubServer, tmp_path: Path
) -> None:
    topic = topics.topic_prefix + "user"
    backlog = _users(RATE_PER_S * RATE_LIMITED_FOR_S)
    produce(topics.kafka, topic, backlog)
    stub.add_faults({"rate_limit": {"rate_per_s": RATE_PER_S, "burst": RATE_PER_S}})
    sink, port = start_sink(_sink_cfg(topics, stub), tmp_path)
    try:
        wait_until(  # the stats, not the whole applied list, while the backlog drains
            lambda: sink.alive() and stub.stats()["applied"] >= len(backlog),
            RATE_LIMITED_FOR_S * 4,
            "the backlog applied",
            interval_s=1.0,
        )
        spent = _metric(port, 'outbox_sink_retried_total{kind="record"}')
        throttled = _metric(port, "outbox_sink_throttled_total")
    finally:
        sink.close()
    limited = stub.control("GET", "/_stub/faults")["rate_limit"]["limited"]
    assert limited > 0 and throttled > 0, "the engine never had to refuse: no rate limit was hit"
    assert spent == 0, "a 429 spent an attempt"
    assert _parked_count(topics.db_dsn, topic) == 0
    ids = _ids(backlog)
    applied = [i for i in stub.applied()["items"] if i["event_id"] in ids]
    assert len(applied) == len(backlog)
    times = sorted(i["applied_at"] for i in applied)
    # The bucket starts full: the first `burst` events are free; the rest come at the rate.
    steady = times[RATE_PER_S:]
    rate = (len(steady) - 1) / (steady[-1] - steady[0])
    assert abs(rate / RATE_PER_S - 1) <= RATE_TOLERANCE, (
        f"delivered {rate:.1f}/s against a limit of {RATE_PER_S}/s"
    )


def test_an_engine_dripping_its_answers_hits_the_deadline_as_engine_wide_trouble(
    topics: RelayConfig, stub: StubServer, tmp_path: Path
) -> None:
    """4 bytes a second never trips the 3 s read timeout; the 2 s deadline ends the request."""
    topic = topics.topic_prefix + "user"
    first, during = _users(20), _users(200)
    cfg = _sink_cfg(topics, stub, ENGINE_REQUEST_DEADLINE_S="2", ENGINE_READ_TIMEOUT_S="3")
    sink, port = start_sink(cfg, tmp_path)
    try:
        produce(topics.kafka, topic, first)
        _wait_applied(stub, _ids(first), 60, sink)
        stub.add_faults({"drip": {"bytes": 4, "interval_s": 1.0, "for_s": 12}})
        produce(topics.kafka, topic, during)
        wait_until(lambda: "RequestDeadline" in sink.log_path.read_text(), 60, "a request deadline")
        _wait_applied(stub, _ids(first + during), 120, sink)
        spent = _metric(port, 'outbox_sink_retried_total{kind="record"}')
        engine_wide = _metric(port, 'outbox_sink_retried_total{kind="engine"}')
    finally:
        sink.close()
    assert engine_wide > 0, "the expired deadlines were not engine-wide trouble"
    assert spent == 0, "an expired deadline spent an attempt"
    assert _parked_count(topics.db_dsn, topic) == 0


def test_kafka_away_with_work_waiting_shows_a_stall_after_the_threshold_and_recovers(
    topics: RelayConfig, stub: StubServer, tmp_path: Path
) -> None:
    topic = topics.topic_prefix + "user"
    before, records = _users(20), _users(300)
    cfg = _sink_cfg(topics, stub, SINK_STALL_AFTER_S="6")
    sink, port = start_sink(cfg, tmp_path)
    try:
        produce(topics.kafka, topic, before)
        _wait_applied(stub, _ids(before), 60, sink)
        stub.add_faults({"latency_ms": 50})  # deliveries take a while: work waits
        produce(topics.kafka, topic, records)
        wait_until(lambda: len(stub.applied()["items"]) >= 40, 60, "deliveries under way")
        stack("kill", "kafka")
        killed_at = time.monotonic()
        try:
            early: list[tuple[int, str]] = []
            while time.monotonic() < killed_at + 3:  # half the threshold: no stall yet
                early.append(_readyz(port))
                time.sleep(0.3)
            status, text = wait_until(
                lambda: (s := _readyz(port))[0] == 503 and "stalled:" in s[1] and s, 60, "stall"
            )
            stalled_gauge = _metric(port, "outbox_sink_stalled ")
        finally:
            stack("up", "kafka")
        wait_until(lambda: _readyz(port)[0] == 200, 120, "ready again after Kafka is back")
        _wait_applied(stub, _ids(before + records), 120, sink)
        recovered_gauge = _metric(port, "outbox_sink_stalled ")
    finally:
        sink.close()
    assert all(s == 200 for s, _ in early), f"a stall shown before the threshold: {early}"
    assert (status, stalled_gauge) == (503, 1.0), text
    assert "nothing delivered, parked or committed for over 6 s" in text
    assert recovered_gauge == 0.0
    assert _parked_count(topics.db_dsn, topic) == 0


#: RSS samples (0.5 s apart) while the sink is paused: the first quarter lets the allocator settle.
RSS_SAMPLES = 40
#: The most the RSS floor may rise between the second and the last quarter of the samples.
RSS_FLOOR_RISE_KIB = 8 * 1024


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _wait_held_settled(port: int) -> None:
    """Until the held-records gauge reads the same twice a second apart (bounded)."""
    last = [-1.0]

    def settled() -> bool:
        now = _metric(port, "outbox_sink_held_records")
        same, last[0] = now == last[0], now
        return same

    wait_until(settled, 60, "the held records to settle", interval_s=1.0)


def test_postgres_away_under_a_flood_of_unroutable_events_keeps_memory_bounded_and_pauses(
    topics: RelayConfig, stub: StubServer, tmp_path: Path
) -> None:
    topic = topics.topic_prefix + "user"
    flood = [_record("NoSuchType", str(uuid.uuid4())) for _ in range(MAX_BUFFERED + 10_000)]
    good = _users(50)
    sink, port = start_sink(_sink_cfg(topics, stub), tmp_path)
    try:
        produce(topics.kafka, topic, good[:10])
        _wait_applied(stub, _ids(good[:10]), 60, sink)
        stack("down", "pg")
        try:
            produce(topics.kafka, topic, flood + good[10:])
            wait_until(
                lambda: _metric(port, "outbox_sink_paused_partitions") == PARTITIONS,
                120,
                "every partition paused",
            )
            _wait_held_settled(port)  # (records fetched before the pause are taken in first)
            held, rss = [], []
            for _ in range(RSS_SAMPLES):  # paused: what is held, and the memory, stop growing
                held.append(_metric(port, "outbox_sink_held_records"))
                rss.append(_rss_kib(sink.pid))
                time.sleep(0.5)
            paused = _metric(port, "outbox_sink_paused_partitions")
        finally:
            stack("up", "pg")
        wait_until(
            lambda: _parked_count(topics.db_dsn, topic) == len(flood), 120, "the flood parked"
        )
        _wait_applied(stub, _ids(good), 60, sink)
    finally:
        sink.close()
    assert paused == PARTITIONS
    bound = MAX_BUFFERED + CONSUME_BATCH + HANDOFF_MAX_RECORDS
    assert max(held) <= bound, f"{max(held)} records held, bound {bound}"
    # Growth is a rising floor (a leak lifts the lowest reading; garbage freed later
    # does not lower it much: the allocator keeps its pages), judged from the second
    # quarter on, once the first retries have run. What lifted it in CI (159 -> 195 MiB
    # in these 20 s, 150 -> 282 MiB over 5 minutes) was every failed park's batch kept
    # in a reference cycle until the cyclic GC ran (sinks/parking/lot.py); with each
    # batch freed as it fails the floor moved by 8-40 KiB (9 runs, load 11-14; the old
    # lot in the same test: +11.2, +13.0 MiB, and +4 KiB once: no retry round in the window).
    # The bound is below one retry round's batches kept (~46 x 250 KiB).
    quarter = RSS_SAMPLES // 4
    floor_rise = min(rss[3 * quarter :]) - min(rss[quarter : 2 * quarter])
    print(f"\nRSS while paused (KiB): {rss}; the floor rose {floor_rise} KiB")
    assert floor_rise < RSS_FLOOR_RISE_KIB, f"RSS grew while paused: {rss} KiB"
