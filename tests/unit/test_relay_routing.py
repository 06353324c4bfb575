"""The relay's routing of outbox inserts, fast path against the reference router.

``Relay._on_insert`` routes the common row straight from the pgoutput bytes;
anything unusual falls back to full decoding and :func:`cdc.router.route_fields`.
These tests feed both kinds of rows through the relay (a recording producer in
place of Kafka; pure) and check that every record equals what ``route_fields``
makes of the same row, that declined rows are dead-lettered with their reason,
and that delivery reports drive the LSN tracker.
"""

from __future__ import annotations

import re
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from confluent_kafka import KafkaError, Producer

from cdc.errors import DecodeError
from cdc.relay.health.state import Session
from cdc.relay.stream import loop as relay_mod
from cdc.relay.stream.loop import Relay
from cdc.router import DeadLetterCode, TxContext, route_fields
from cdc.settings import Settings
from cdc.wal import pgoutput
from cdc.wal.lsn import LsnTracker

# Every test runs with the pure-Python Insert parser and the compiled one.
pytestmark = pytest.mark.usefixtures("insert_parser")

OID = 16_400
COLUMNS = ("id", "aggregatetype", "aggregateid", "type", "payload", "created_at")
PREFIX = "outbox.event."
COMMIT_TS_US = 1_795_000_000_123_456
PG_EPOCH_US = 946_684_800_000_000


def cstr(text: str) -> bytes:
    return text.encode() + b"\0"


def relation(columns: tuple[str, ...] = (*COLUMNS, "tracingspancontext")) -> bytes:
    body = b"".join(b"\0" + cstr(name) + struct.pack(">Ii", 25, -1) for name in columns)
    return (
        b"R"
        + struct.pack(">I", OID)
        + cstr("public")
        + cstr("outbox")
        + b"d"
        + struct.pack(">H", len(columns))
        + body
    )


def insert(values: list[bytes | None]) -> bytes:
    out = b"I" + struct.pack(">IcH", OID, b"N", len(values))
    for value in values:
        out += b"n" if value is None else b"t" + struct.pack(">I", len(value)) + value
    return out


def begin(final_lsn: int) -> bytes:
    return b"B" + struct.pack(">QqI", final_lsn, COMMIT_TS_US - PG_EPOCH_US, 7)


def commit(final_lsn: int) -> bytes:
    ts = COMMIT_TS_US - PG_EPOCH_US
    return b"C" + struct.pack(">BQQq", 0, final_lsn, final_lsn + 40, ts)


def row(
    event_id: str = "0b9f6f2e-5d1c-4f7e-9a53-0e6f3c1d2a10",
    aggregatetype: bytes | None = b"user",
    aggregateid: bytes | None = b"u-1",
    event_type: bytes | None = b"UserRegistered",
    payload: bytes | None = b'{"user_id": "u-1", "email": "a@example.org", "n": [1, 2]}',
    trace: bytes | None = None,
) -> list[bytes | None]:
    created_at = b"2026-11-29 10:00:00.123456+00"
    return [event_id.encode(), aggregatetype, aggregateid, event_type, payload, created_at, trace]


@dataclass
class Produced:
    topic: str
    value: bytes
    key: bytes
    timestamp: int
    headers: list[tuple[str, bytes]]
    callback: Any


class DeliveredMsg:
    """What a delivery callback reads of a record."""

    def __init__(self, produced: Produced) -> None:
        self._p = produced

    def topic(self) -> str:
        return self._p.topic

    def key(self) -> bytes:
        return self._p.key

    def value(self) -> bytes:
        return self._p.value

    def timestamp(self) -> tuple[int, int]:
        return (1, self._p.timestamp)


@dataclass
class RecordingProducer:
    """``confluent_kafka.Producer.produce``'s signature, recorded; ``poll`` acks all."""

    produced: list[Produced] = field(default_factory=list)
    pending: list[Produced] = field(default_factory=list)

    def produce(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        partition: int = -1,
        callback: Any = None,
        on_delivery: Any = None,
        timestamp: int = 0,
        headers: Any = None,
    ) -> None:
        assert partition == -1
        cb = callback or on_delivery
        assert cb is not None, "every record needs a delivery callback"
        assert value is not None and key is not None
        produced = Produced(topic, value, key, timestamp, list(headers or []), cb)
        self.produced.append(produced)
        self.pending.append(produced)

    def poll(self, timeout: float = 0) -> int:
        pending, self.pending = self.pending, []
        for produced in pending:
            produced.callback(None, DeliveredMsg(produced))
            produced.callback = None  # (confluent-kafka lets go of it once reported)
        return len(pending)


class FakeTopics:
    def __init__(self) -> None:
        self.known: set[str] = set()
        self.ensured: list[str] = []

    def ensure(self, topics: list[str]) -> None:
        for topic in topics:
            if topic not in self.known:
                self.ensured.append(topic)
                self.known.add(topic)


class FakeStream:
    wal_sender_timeout_ms = 60_000

    def send_status(
        self, lsn: int, *, reply_requested: bool = False, ask_raise: bool = True
    ) -> int:
        return lsn  # (a stream without a limit)


@pytest.fixture
def relay(monkeypatch: pytest.MonkeyPatch) -> Iterator[Relay]:
    monkeypatch.setattr(relay_mod, "TopicManager", lambda **_: FakeTopics())
    r = Relay(
        Settings(pg_dsn="postgresql://x", kafka_bootstrap_servers="127.0.0.1:9"),
        serve_http=False,
    )
    r._producer = RecordingProducer()  # type: ignore[assignment]
    r.decoder.utf8 = True
    yield r


@pytest.fixture
def decoded_calls(relay: Relay, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the inserts that took the full-decoding path."""
    calls: list[int] = []
    original = relay.decoder._on_insert_decoded

    def spy(sess: Session, ins: Any) -> None:
        calls.append(1)
        original(sess, ins)

    monkeypatch.setattr(relay.decoder, "_on_insert_decoded", spy)
    return calls


def new_session() -> Session:
    return Session(stream=FakeStream(), tracker=LsnTracker(0))  # type: ignore[arg-type]


def run_tx(relay: Relay, sess: Session, rows: list[list[bytes | None]], final_lsn: int) -> None:
    relay.decoder.on_change(sess, begin(final_lsn))
    for values in rows:
        relay.decoder.on_change(sess, insert(values))
    relay.decoder.on_change(sess, commit(final_lsn))


def reference(values: list[bytes | None], final_lsn: int) -> Produced:
    """What the reference router makes of the row."""
    text = [None if v is None else v.decode() for v in values]
    record = route_fields(
        *text[:5], text[6], TxContext(relay_mod.lsn_to_str(final_lsn), COMMIT_TS_US), PREFIX
    )
    return Produced(
        record.topic, record.value, record.key, record.timestamp_ms, record.headers, None
    )


def shape(p: Produced) -> tuple[object, ...]:
    return (p.topic, p.value, p.key, p.timestamp, p.headers)


def producer_of(relay: Relay) -> RecordingProducer:
    producer = relay._producer
    assert isinstance(producer, RecordingProducer)
    return producer


def test_fast_path_records_equal_the_reference_router(
    relay: Relay, decoded_calls: list[int]
) -> None:
    sess = new_session()
    relay.decoder.on_change(sess, relation())
    rows = [
        row(),
        row(event_id="1c0e8e0a-0d55-4b44-8d1e-7f6f8f1a2b3c", trace=b"00-abc-def-01"),
        row(event_id="2c0e8e0a-0d55-4b44-8d1e-7f6f8f1a2b3c", payload=b'{"n": 1.5e400, "m": {}}'),
        row(event_id="3c0e8e0a-0d55-4b44-8d1e-7f6f8f1a2b3c", aggregateid="ключ-ü".encode()),
        row(event_id="4c0e8e0a-0d55-4b44-8d1e-7f6f8f1a2b3c", trace=b""),
    ]
    run_tx(relay, sess, rows, final_lsn=0x1000)

    produced = producer_of(relay).produced
    assert [shape(p) for p in produced] == [shape(reference(v, 0x1000)) for v in rows]
    # The first row of a topic checks and creates it (slow path); the rest go fast,
    # but for a number beyond a double, which the exact check (slow path) accepts.
    assert len(decoded_calls) == 2
    assert produced[2].value == b'{"n": 1.5e400, "m": {}}', "never re-encoded"
    assert relay._topics.known == {"outbox.event.user"}
    assert produced[1].headers[-1] == ("traceparent", b"00-abc-def-01")


def test_acks_confirm_the_transaction_and_count_per_topic(relay: Relay) -> None:
    sess = new_session()
    relay.decoder.on_change(sess, relation())
    run_tx(relay, sess, [row(), row(event_id="5c0e8e0a-0d55-4b44-8d1e-7f6f8f1a2b3c")], 0x2000)
    assert sess.tracker.in_flight == 2
    assert sess.tracker.confirmable == 0

    assert producer_of(relay).poll() == 2

    assert sess.tracker.in_flight == 0
    assert sess.tracker.confirmable == 0x2000 + 40
    assert sess.acked == {"outbox.event.user": 2}


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (row(aggregateid=b""), "outbox row lacks aggregateid"),
        (row(event_type=None), "outbox row lacks type"),
        (row(payload=b"{not json"), "payload is not JSON"),
        (row(payload=b'"just a string"'), "payload is not a JSON object"),
        (row(payload=b'{"n": NaN}'), "payload is not JSON"),
        (row(aggregatetype=b"user events"), "makes an invalid topic name"),
    ],
    ids=["empty-key", "null-type", "bad-json", "not-object", "nan", "bad-topic"],
)
def test_rows_the_fast_path_declines_are_dead_lettered_and_the_rest_flow(
    relay: Relay, bad: list[bytes | None], reason: str
) -> None:
    sess = new_session()
    relay.decoder.on_change(sess, relation())
    good = [row(), row(event_id="6c0e8e0a-0d55-4b44-8d1e-7f6f8f1a2b3c")]
    run_tx(relay, sess, [good[0], bad, good[1]], final_lsn=0x3000)

    assert [shape(p) for p in producer_of(relay).produced] == [
        shape(reference(v, 0x3000)) for v in good
    ]
    assert len(sess.pending_dlq) == 1
    assert reason in sess.pending_dlq[0].reason
    relay.dead_letters.drain(sess)
    dlq = producer_of(relay).produced[-1]
    assert dlq.topic == relay.settings.dlq_topic
    assert dict(dlq.headers)["id"] == b"0b9f6f2e-5d1c-4f7e-9a53-0e6f3c1d2a10"
    assert reason in dict(dlq.headers)["dlq.reason"].decode()


def test_a_database_that_is_not_utf8_routes_through_the_checking_path(
    relay: Relay, decoded_calls: list[int]
) -> None:
    relay.decoder.utf8 = False
    sess = new_session()
    relay.decoder.on_change(sess, relation())
    good = row()
    run_tx(relay, sess, [good, good, row(aggregateid=b"\xff\xfe")], final_lsn=0x4000)

    assert len(decoded_calls) == 3
    assert [shape(p) for p in producer_of(relay).produced] == [shape(reference(good, 0x4000))] * 2
    assert len(sess.pending_dlq) == 1
    assert "not valid UTF-8" in sess.pending_dlq[0].reason


def test_a_known_poison_event_goes_to_the_dead_letter_queue(relay: Relay) -> None:
    sess = new_session()
    relay.decoder.on_change(sess, relation())
    run_tx(relay, sess, [row()], final_lsn=0x5000)  # warms the topic cache
    poison_id = "7c0e8e0a-0d55-4b44-8d1e-7f6f8f1a2b3c"
    relay.poison.remember(
        poison_id.encode(), DeadLetterCode.TOO_LARGE, "Broker: Message size too large"
    )
    run_tx(relay, sess, [row(event_id=poison_id)], final_lsn=0x6000)

    assert len(producer_of(relay).produced) == 1
    assert [item.reason for item in sess.pending_dlq] == ["Broker: Message size too large"]
    assert sess.tracker.in_flight == 2  # added, acked once the dead letter is delivered


def test_a_schema_with_columns_in_another_order_routes_the_same(relay: Relay) -> None:
    sess = new_session()
    reordered = ("payload", "created_at", "type", "id", "aggregateid", "aggregatetype")
    relay.decoder.on_change(sess, relation(reordered))
    values = row()
    by_name = dict(zip((*COLUMNS, "tracingspancontext"), values, strict=True))
    run_tx(relay, sess, [[by_name[n] for n in reordered]] * 2, final_lsn=0x7000)

    assert [shape(p) for p in producer_of(relay).produced] == [shape(reference(values, 0x7000))] * 2


def test_the_real_producer_hands_every_fast_path_record_to_its_callback(relay: Relay) -> None:
    """confluent-kafka reads the delivery callback from one positional slot only;
    a record produced without it would never be acknowledged. No broker is
    needed: purging the local queue delivers a report per record."""
    producer = Producer({"bootstrap.servers": "127.0.0.1:9", "log_level": 0})
    relay._producer = producer
    sess = new_session()
    relay.decoder.on_change(sess, relation())
    relay._topics.known.add("outbox.event.user")
    relay.decoder.topic_of[b"user"] = "outbox.event.user"
    ids = [f"{n}c0e8e0a-0d55-4b44-8d1e-7f6f8f1a2b3c" for n in range(3)]
    run_tx(relay, sess, [row(event_id=i) for i in ids], final_lsn=0x8000)

    producer.purge(in_queue=True, in_flight=True)

    def purged() -> float:
        value = relay.registry.get_sample_value(
            "outbox_relay_kafka_errors_total", {"code": "_PURGE_QUEUE"}
        )
        return value or 0.0

    deadline = time.monotonic() + 10
    while purged() < 3 and time.monotonic() < deadline:
        producer.poll(0.05)
    assert purged() == 3  # one delivery report per record, each through the relay
    assert sess.fatal is not None
    assert sess.fatal.code() == KafkaError._PURGE_QUEUE
    assert sess.tracker.in_flight == 3  # purged records are never acked


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (begin(0x3000)[:-1], "truncated pgoutput Begin message (20 bytes)"),
        (begin(0x3000) + b"\0", "1 trailing bytes in pgoutput Begin message (22 bytes)"),
        (commit(0x3000)[:10], "truncated pgoutput Commit message (10 bytes)"),
    ],
)
def test_malformed_begin_and_commit_read_in_place_raise_decode_errors(
    relay: Relay, message: bytes, reason: str
) -> None:
    """Begin and Commit are read in place, not decoded; a malformed one still names its fault."""
    sess = new_session()
    if message[:1] == b"C":
        relay.decoder.on_change(sess, begin(0x3000))
    with pytest.raises(DecodeError, match=re.escape(reason)):
        relay.decoder.on_change(sess, message)
    assert sess.tracker.confirmable == 0


def test_a_commit_outside_a_transaction_is_a_decode_error(relay: Relay) -> None:
    with pytest.raises(DecodeError, match="Commit outside a transaction"):
        relay.decoder.on_change(new_session(), commit(0x3000))


def test_begin_read_in_place_gives_the_transactions_lsn_and_commit_time(relay: Relay) -> None:
    """Begin is read in place; its context is made at the transaction's first record
    (none for a transaction without one) and equals the one TxContext itself makes."""
    sess = new_session()
    sess.origin = ("origin", b"7412345678901234567/1/outbox_slot")
    relay.decoder.on_change(sess, begin(0x3000))
    assert sess.tx is None  # lazy: no record yet
    assert sess.tx_id == 0x3000
    relay.decoder.on_change(sess, relation())
    relay.decoder.on_change(sess, insert(row()))
    assert sess.tx is not None
    expected = TxContext(relay_mod.lsn_to_str(0x3000), COMMIT_TS_US, sess.origin)
    assert (sess.tx.commit_lsn, sess.tx.commit_ts_us, sess.tx.headers, sess.tx.timestamp_ms) == (
        expected.commit_lsn,
        expected.commit_ts_us,
        expected.headers,
        expected.timestamp_ms,
    )
    relay.decoder.on_change(sess, commit(0x3000))
    assert sess.tx is None and sess.begin is None
    empty = new_session()
    relay.decoder.on_change(empty, begin(0x4000))
    relay.decoder.on_change(empty, commit(0x4000))
    assert empty.tracker.confirmable == 0x4000 + 40  # a transaction without a record


def test_a_commit_time_the_fast_parser_does_not_format_is_formatted_the_slow_way(
    relay: Relay,
) -> None:
    """begin_context declines a commit time outside the years 1000-9999; the relay
    then formats it as TxContext does, and the record carries it."""
    sess = new_session()
    relay.decoder.on_change(sess, relation())
    year_999_us = -30_641_760_000_000_000  # 0999-01-01 in Unix microseconds
    early = b"B" + struct.pack(">QqI", 0x5000, year_999_us - PG_EPOCH_US, 7)
    assert pgoutput.begin_context(early) is None
    relay.decoder.on_change(sess, early)
    relay.decoder.on_change(sess, insert(row()))
    assert sess.tx is not None
    assert sess.tx.headers == TxContext("0/5000", year_999_us).headers
    assert producer_of(relay).produced[-1].timestamp == year_999_us // 1000


class CopyDataStream(FakeStream):
    """The stream as the loop reads it: CopyData messages as psycopg hands them over
    (memoryviews), XLogData wrapped around each pgoutput message."""

    def __init__(self, messages: list[bytes]) -> None:
        self._left = [
            memoryview(b"w" + struct.pack(">QQq", 0x10, 0x10, 0) + message) for message in messages
        ]

    def get_nowait(self) -> tuple[int, memoryview | None]:
        if not self._left:
            return 0, None
        data = self._left.pop(0)
        return len(data), data

    def read(self, timeout_s: float) -> memoryview | None:
        return self.get_nowait()[1]


def test_the_loop_reads_each_xlogdata_in_place_as_the_message_alone_reads(relay: Relay) -> None:
    """_read_batch hands the CopyData message and the payload's offset (no copy):
    the records are those of the same messages handed over alone, and a malformed
    message read in place names its fault as it does alone."""
    rows = [row(), row(event_id="9c0e8e0a-0d55-4b44-8d1e-7f6f8f1a2b3c", trace=b"00-a-b-01")]
    messages = [relation(), begin(0x9000), *map(insert, rows), commit(0x9000)]
    sess = Session(stream=CopyDataStream(messages), tracker=LsnTracker(0))  # type: ignore[arg-type]
    relay.decoder.read_batch(sess)
    in_place = [shape(p) for p in producer_of(relay).produced]
    assert in_place == [shape(reference(v, 0x9000)) for v in rows]
    assert sess.tracker.open_transactions == 0

    alone = new_session()
    producer_of(relay).produced.clear()
    for message in messages:
        relay.decoder.on_change(alone, message)
    assert [shape(p) for p in producer_of(relay).produced] == in_place

    broken = Session(stream=CopyDataStream([begin(0xA000)[:-1]]), tracker=LsnTracker(0))  # type: ignore[arg-type]
    with pytest.raises(DecodeError, match=re.escape("truncated pgoutput Begin message (20 bytes)")):
        relay.decoder.read_batch(broken)
