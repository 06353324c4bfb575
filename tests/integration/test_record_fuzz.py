"""Record fuzz: hostile bytes among good events, against the real broker, PostgreSQL and stub.

A raw producer (:mod:`tests.records`: a hand-built Produce request, so header
names that are not UTF-8 reach the broker - no client library writes them)
puts a few thousand records of random keys, values and headers - invalid UTF-8
header names, duplicate names, empty names and values, null values,
tombstones, null and empty keys, huge header sets, a missing or non-uuid ``id``
- between good events on the sink's topics and on a topic read by
:class:`sinks.idempotent.IdempotentConsumer`. Both stay up; every good event
is delivered (handled) exactly once, in order per key; every other record is
parked with its reason (or, for the toolkit, handled or skipped when it
happens to carry a usable id); every partition's committed offset reaches its
end. Before issue 22 the first record with a non-UTF-8 header name killed
both (``SystemError`` in ``msg.headers()``, a crash loop; a second read of the
message's headers: SIGSEGV).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from cdc.migrate import migrate
from sinks.core.delivery import Envelope
from sinks.idempotent import ConsumerOptions, IdempotentConsumer, Outcome
from sinks.stub.server import StubServer
from sinks.trace.model import murmur2_partition
from tests.conftest import create_database, drop_database
from tests.harness import (
    ROOT,
    RelayConfig,
    SinkConfig,
    create_topics,
    group_caught_up,
    start_sink,
    wait_until,
    without_derived_user_syncs,
)
from tests.integration.conftest import API_KEY
from tests.records import RawProducer, RawRecord, kafka_records, random_record, sample

pytestmark = pytest.mark.integration

PARTITIONS = 3
#: Good events: per user a registration and ATTEMPTS quiz attempts (sink); per key, N (toolkit).
USERS = 100
ATTEMPTS = 3
TOOLKIT_KEYS = 60
TOOLKIT_PER_KEY = 5
#: Hostile records per consumer: from a seeded rng, plus some drawn by hypothesis.
RANDOM_RECORDS = 1_200
HYPOTHESIS_RECORDS = 100
SEED = 22

Conn = psycopg.Connection[Any]


@dataclass
class Written:
    """What the raw producer wrote: good event ids per key in order, random positions."""

    good: dict[bytes, list[str]] = field(default_factory=lambda: defaultdict(list))
    random: dict[tuple[str, int, int], RawRecord] = field(default_factory=dict)
    ends: dict[tuple[str, int], int] = field(default_factory=dict)

    @property
    def good_ids(self) -> set[str]:
        return {i for ids in self.good.values() for i in ids}


def _event(event_type: str, aggregate: str, key: str, payload: dict[str, Any]) -> RawRecord:
    event_id = str(uuid.uuid4())
    headers = ((b"id", event_id.encode()), (b"type", event_type.encode()))
    headers += ((b"aggregatetype", aggregate.encode()),)
    return RawRecord(key.encode(), json.dumps(payload).encode(), headers, label=event_id)


def hostile(rng: random.Random, count: int, drawn: list[RawRecord]) -> list[RawRecord]:
    """``count`` random records, then ``drawn`` (hypothesis'), shuffled."""
    records = [random_record(rng, huge_headers=200) for _ in range(count)] + drawn
    rng.shuffle(records)
    return records


def write_mixed(
    producer: RawProducer,
    good_by_topic: dict[str, list[RawRecord]],
    bad: list[RawRecord],
    rng: random.Random,
) -> Written:
    """Good records to their key's partition (murmur2), bad ones anywhere, interleaved."""
    lanes: dict[tuple[str, int], list[RawRecord]] = defaultdict(list)
    for topic, records in good_by_topic.items():
        for record in records:
            lanes[(topic, murmur2_partition(record.key or b"", PARTITIONS))].append(record)
    targets = sorted(lanes)
    for record in bad:  # each lands at a random place between the good ones
        lane = lanes[rng.choice(targets)]
        lane.insert(rng.randint(0, len(lane)), record)
    written = Written()
    for (topic, partition), records in sorted(lanes.items()):
        offsets = producer.send_all(topic, partition, records, batch=100)
        for record, offset in zip(records, offsets, strict=True):
            if record.label == "random":
                written.random[(topic, partition, offset)] = record
            else:
                written.good[record.key or b""].append(record.label)
        written.ends[(topic, partition)] = offsets[-1] + 1 if offsets else 0
    return written


def sink_events(users: list[str]) -> dict[str, list[RawRecord]]:
    return {
        "user": [_event("UserRegistered", "user", u, {"user_id": u}) for u in users],
        "quiz_attempt": [
            _event(
                "QuizAttemptSubmitted",
                "quiz_attempt",
                u,
                {"attempt_id": str(uuid.uuid4()), "user_id": u, "quiz_id": "q", "score": s},
            )
            for s in range(ATTEMPTS)
            for u in users
        ],
    }


# --- the sink ----------------------------------------------------------------------------


@pytest.fixture
def fuzz_db_dsn(pg_server: str) -> Iterator[str]:
    """A migrated database of its own: the ~1,300 rows this test parks stay out of the
    session's parking lot, where later tests list and count rows."""
    dsn = create_database(pg_server, "cdc_fuzz")
    migrate(dsn)
    yield dsn
    drop_database(pg_server, dsn)


@pytest.fixture
def sink_topics(fuzz_db_dsn: str, kafka_bootstrap: str, unique: str) -> RelayConfig:
    cfg = RelayConfig(
        db_dsn=fuzz_db_dsn, kafka=kafka_bootstrap, unique=unique, partitions=PARTITIONS
    )
    create_topics(
        kafka_bootstrap,
        [cfg.topic_prefix + "user", cfg.topic_prefix + "quiz_attempt"],
        partitions=PARTITIONS,
    )
    return cfg


@pytest.fixture(scope="module")
def drawn() -> list[RawRecord]:
    """Records drawn by hypothesis' own search (smaller huge sets: it is slow with 300)."""
    return sample(kafka_records(huge_headers=40), 2 * HYPOTHESIS_RECORDS)


def _parked(dsn: str, topic_prefix: str) -> list[tuple[str, int, int, str | None, str]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT kafka_topic, kafka_partition, kafka_offset, outbox_event_id::text, last_error"
            " FROM failed_sync_events WHERE kafka_topic LIKE %s",
            (topic_prefix + "%",),
        ).fetchall()
    return [(r[0], r[1], r[2], r[3], r[4]) for r in rows]


def _uuid_id(record: RawRecord) -> str | None:
    """The uuid the sink would key a parked row by (last ``id`` header), if any."""
    ids = [v for n, v in record.headers if n == b"id"]
    try:
        return str(uuid.UUID((ids[-1] or b"").decode())) if ids else None
    except (ValueError, UnicodeDecodeError):
        return None


def test_the_sink_parks_every_hostile_record_and_delivers_every_good_event_once_in_order(
    sink_topics: RelayConfig,
    stub: StubServer,
    tmp_path: Path,
    drawn: list[RawRecord],
) -> None:
    rng = random.Random(SEED)
    users = [str(uuid.uuid4()) for _ in range(USERS)]
    events = sink_events(users)
    good = {sink_topics.topic_prefix + t: records for t, records in events.items()}
    bad = hostile(rng, RANDOM_RECORDS, drawn[:HYPOTHESIS_RECORDS])
    assert sum(any(b"\xff" in n for n, _ in r.headers) for r in bad) > 100, "non-UTF-8 names"
    written = write_mixed(RawProducer(sink_topics.kafka), good, bad, rng)
    cfg = SinkConfig(
        relay=sink_topics,
        engine_url=stub.url,
        api_key=API_KEY,
        extra={"PYTHONFAULTHANDLER": "1"},  # a native crash prints its stack in the log
    )
    sink, _port = start_sink(cfg, tmp_path)
    try:
        try:
            wait_until(
                lambda: sink.alive() and group_caught_up(sink_topics.kafka, cfg.group, list(good)),
                120,
                "the sink to commit every partition's end",
                interval_s=1.0,
            )
        except AssertionError as exc:
            code = sink.proc.poll() if sink.proc else None
            raise AssertionError(f"{exc}; exit code {code}\n{sink.log_tail(40)}") from None
        assert sink.alive(), sink.log_tail()
        applied = stub.applied(limit=100_000)["items"]
    finally:
        sink.close()
    assert "Traceback" not in sink.log_path.read_text(errors="replace")
    # (the user syncs made for attempts read before their registration: seen in CI)
    applied = without_derived_user_syncs(applied, written.good_ids)
    counts = Counter(item["event_id"] for item in applied)
    assert set(counts) == written.good_ids, "every good event applied, nothing else"
    assert max(counts.values()) == 1, "each applied once"
    scores: dict[str, list[int]] = defaultdict(list)
    for item in applied:
        if item["path"].endswith("quiz-attempts/sync"):
            scores[item["user_id"]].append(item["body"]["score"])
    assert scores == {u: list(range(ATTEMPTS)) for u in users}, "in order per key"
    parked = _parked(sink_topics.db_dsn, sink_topics.topic_prefix)
    assert all(reason for *_, reason in parked), "every parked row says why"
    by_position = {(t, p, o) for t, p, o, _, _ in parked}
    by_id = {i for *_, i, _ in parked if i}
    missing = [
        pos
        for pos, record in written.random.items()
        if pos not in by_position and _uuid_id(record) not in by_id
    ]
    assert not missing, f"{len(missing)} hostile records neither parked nor merged by id"
    reasons = " ".join(reason for *_, reason in parked)
    assert "unreadable_headers: a header name is not UTF-8" in reasons


# --- the toolkit ----------------------------------------------------------------------------


@pytest.fixture
def consumer_dsn(empty_db_dsn: str) -> str:
    with psycopg.connect(empty_db_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE handled (event_id text, record_key bytea, n int)")
    return empty_db_dsn


def _handler(conn: Conn, record: Envelope) -> None:
    n = None
    if record.event_type == "OrderPlaced":
        n = json.loads(record.value or b"{}")["n"]
    conn.execute(
        "INSERT INTO handled (event_id, record_key, n) VALUES (%s, %s, %s)",
        (record.event_id, record.key, n),
    )


def _toolkit_events() -> list[RawRecord]:
    return [
        _event("OrderPlaced", "order", f"order-{k}", {"n": n})
        for n in range(TOOLKIT_PER_KEY)
        for k in range(TOOLKIT_KEYS)
    ]


@pytest.fixture
def toolkit(
    consumer_dsn: str, kafka_bootstrap: str, unique: str
) -> Iterator[tuple[IdempotentConsumer, str]]:
    topic = f"fuzz-toolkit-{unique}"
    create_topics(kafka_bootstrap, [topic], partitions=PARTITIONS)
    with (
        psycopg.connect(consumer_dsn) as conn,
        IdempotentConsumer(
            conn,
            _handler,
            kafka_config={"bootstrap.servers": kafka_bootstrap, "group.id": f"g-{unique}"},
            topics=[topic],
            options=ConsumerOptions(name="fuzz", retry_backoff_s=0.1),
        ) as consumer,
    ):
        yield consumer, topic


def test_the_idempotent_consumer_parks_every_hostile_record_and_handles_good_ones_once_in_order(
    toolkit: tuple[IdempotentConsumer, str],
    consumer_dsn: str,
    kafka_bootstrap: str,
    drawn: list[RawRecord],
) -> None:
    consumer, topic = toolkit
    rng = random.Random(SEED + 1)
    bad = hostile(rng, RANDOM_RECORDS, drawn[HYPOTHESIS_RECORDS:])
    written = write_mixed(RawProducer(kafka_bootstrap), {topic: _toolkit_events()}, bad, rng)
    total = sum(written.ends.values())
    outcomes: Counter[Outcome] = Counter()
    seen: set[tuple[str, int, int]] = set()
    wait_until(
        lambda: _poll_into(consumer, outcomes, seen) and len(seen) == total,
        120,
        f"{total} records processed",
        interval_s=0,
    )
    assert outcomes[Outcome.RETRY] == 0, "nothing a handler could not take was retried"
    with psycopg.connect(consumer_dsn) as conn:
        handled = conn.execute("SELECT event_id, record_key, n FROM handled").fetchall()
        parked = conn.execute(
            'SELECT "partition", "offset", reason FROM idempotent_parked_events'
        ).fetchall()
        ledger = dict(conn.execute("SELECT event_id, outcome FROM processed_events").fetchall())
    good_rows = [(k, n) for _, k, n in handled if n is not None]
    per_key: dict[bytes, list[int]] = defaultdict(list)
    for key, n in good_rows:
        per_key[bytes(key)].append(n)
    assert per_key == {
        f"order-{k}".encode(): list(range(TOOLKIT_PER_KEY)) for k in range(TOOLKIT_KEYS)
    }, "every good event handled once, in order per key"
    assert all(ledger[i] == "handled" for i in written.good_ids)
    assert all(reason for *_, reason in parked), "every parked row says why"
    parked_at = {(topic, p, o) for p, o, _ in parked}
    for position in written.random:
        assert position in parked_at or _id_text(written.random[position]) in ledger, position
    assert outcomes[Outcome.PARKED] == len(parked) > len(written.random) // 2
    assert any("unreadable_headers" in reason for *_, reason in parked)


def _id_text(record: RawRecord) -> str | None:
    ids = [v for n, v in record.headers if n == b"id"]
    if not ids or ids[-1] is None:
        return None
    try:
        text = ids[-1].decode().strip()
        return str(uuid.UUID(text))
    except ValueError:
        return text
    except UnicodeDecodeError:
        return None


def _poll_into(
    consumer: IdempotentConsumer, outcomes: Counter[Outcome], seen: set[tuple[str, int, int]]
) -> bool:
    done = consumer.poll_once(0.2)
    if done is not None and done.outcome is not Outcome.STALE:
        outcomes[done.outcome] += 1
        seen.add(done.record.position)
    return True


_HOT_LOOP = """
import sys
from confluent_kafka import Consumer, TopicPartition
from sinks.core.delivery import read_headers
bootstrap, topic, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "unused"})
consumer.assign([TopicPartition(topic, 0, 0)])
unreadable = seen = 0
while seen < n:
    for msg in consumer.consume(500, 5):
        if msg.error() is None:
            seen += 1
            unreadable += bool(read_headers(msg).problem)
consumer.close()
print(seen, unreadable)
"""


def test_reading_headers_on_a_hot_call_site_reports_every_non_utf8_name_and_never_crashes(
    kafka_bootstrap: str, unique: str, tmp_path: Path
) -> None:
    """CPython 3.11+ specialises a hot ``msg.headers()`` call site and then skips the
    check that turns confluent-kafka's broken result into SystemError: the broken
    list came back and the next unpacking was a SIGSEGV. Run in a child, so a
    crash is an exit code here, not the end of the test session."""
    topic = f"fuzz-hot-{unique}"
    create_topics(kafka_bootstrap, [topic], partitions=1)
    bad = RawRecord(b"k", b"v", ((b"id\xff", b"x"), (b"", None), (b"\xc3\x28", b"y")))
    fine = RawRecord(b"k", b"v", ((b"id", b"1"),))
    RawProducer(kafka_bootstrap).send(topic, 0, [bad, fine] * 200)
    script = tmp_path / "hot_loop.py"
    script.write_text(_HOT_LOOP)
    done = subprocess.run(
        [sys.executable, "-X", "faulthandler", str(script), kafka_bootstrap, topic, "400"],
        capture_output=True,
        check=False,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-2000:]}"
    assert done.stdout.split() == ["400", "200"]
