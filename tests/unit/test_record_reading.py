"""Every record is data: :func:`read_headers` / :meth:`Envelope.from_kafka` over any bytes.

confluent-kafka decodes header names as UTF-8 inside ``Message.headers()``; a
name that is not UTF-8 raises ``SystemError`` (its cause the
``UnicodeDecodeError``) and leaves a broken list cached in the message that
crashes the process (SIGSEGV) on the next access. The fake message below does
what confluent-kafka does for any record of :func:`tests.records.kafka_records`:
a readable record gives its headers, an unreadable one raises as confluent-kafka
does - and fails the test if read a second time.
"""

from __future__ import annotations

import uuid
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from cdc.evidence import Owner
from cdc.records import RecordReader, Skip, uuid_bytes
from sinks.core.delivery import UNREADABLE_HEADERS, Envelope, read_headers
from sinks.idempotent import BadEvent, event_id_of
from sinks.shared.routes import Unroutable, route_envelope
from tests.records import RawRecord, kafka_records


class FakeMessage:
    """A consumed record as confluent-kafka 2.16 hands it over (headers readable once)."""

    def __init__(self, record: RawRecord) -> None:
        self._record = record
        self.header_calls = 0

    def headers(self) -> list[tuple[str, bytes | None]] | None:
        self.header_calls += 1
        assert self.header_calls == 1, "headers() read twice: SIGSEGV in confluent-kafka"
        out = []
        for name, value in self._record.headers:
            try:
                out.append((name.split(b"\x00")[0].decode("utf-8"), value))  # a C string
            except UnicodeDecodeError as exc:
                raise SystemError(
                    "<method 'headers'> returned a result with an exception set"
                ) from exc
        return out or None

    def topic(self) -> str:
        return "t"

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return 3

    def key(self) -> bytes | None:
        return self._record.key

    def value(self) -> bytes | None:
        return self._record.value

    def timestamp(self) -> tuple[int, int]:
        return (1, 1_700_000_000_000)


def _readable(record: RawRecord) -> bool:
    try:
        for name, _ in record.headers:
            name.split(b"\x00")[0].decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(record=kafka_records())
def test_any_record_becomes_an_envelope_and_headers_are_read_once(record: RawRecord) -> None:
    message = FakeMessage(record)
    env = Envelope.from_kafka(message)
    assert message.header_calls == 1
    assert (env.key, env.value) == (record.key, record.value)
    if _readable(record):
        assert env.unreadable == ""
        assert [v for _, v in env.header_list] == [v for _, v in record.headers]
    else:
        assert env.unreadable.startswith(f"{UNREADABLE_HEADERS}: a header name is not UTF-8")
        assert env.header_list == ()
    # whatever it holds, the record is routed or refused with a reason, never a crash
    try:
        route_envelope(env)
    except Unroutable as exc:
        assert exc.reason
    try:
        event_id_of(env)
    except BadEvent as exc:
        assert exc.reason


def test_an_unreadable_record_is_refused_by_the_sink_and_the_toolkit_with_the_reason() -> None:
    record = RawRecord(b"k", b"{}", ((b"id\xff", b"x"), (b"type", b"UserRegistered")))
    env = Envelope.from_kafka(FakeMessage(record))
    assert env.unreadable == f"{UNREADABLE_HEADERS}: a header name is not UTF-8 (byte 0xff at 2)"
    assert (env.event_id, env.event_type, env.headers) == ("", "", {})
    try:
        route_envelope(env)
        raise AssertionError("routed")
    except Unroutable as exc:
        assert UNREADABLE_HEADERS in exc.reason
    try:
        event_id_of(env)
        raise AssertionError("accepted")
    except BadEvent as exc:
        assert exc.reason.startswith(UNREADABLE_HEADERS)


def test_duplicate_names_keep_every_header_in_order_and_the_last_wins_by_name() -> None:
    env = Envelope.from_kafka(
        FakeMessage(RawRecord(b"k", None, ((b"id", b"a"), (b"x", None), (b"id", b"b"))))
    )
    assert env.header_list == (("id", b"a"), ("x", None), ("id", b"b"))
    assert (env.raw_id, env.headers["x"]) == ("b", b"")


class _Odd:
    def headers(self) -> Any:
        return [("id", b"1", "extra")]


def test_headers_of_an_unexpected_shape_are_unreadable_not_a_crash() -> None:
    assert read_headers(_Odd()).problem.startswith(UNREADABLE_HEADERS)


@given(st.binary(max_size=64))
def test_an_id_header_of_any_bytes_is_an_id_or_bad_input(raw: bytes) -> None:
    env = Envelope(topic="t", partition=0, offset=1, key=None, value=None, headers={"id": raw})
    try:
        event_id = event_id_of(env)
    except BadEvent:
        return
    assert event_id and event_id.isprintable() and "\x00" not in event_id


# -- the relay's side of the one reader (cdc.records.RecordReader) --------------------------


def test_ids_are_read_as_the_uuids_16_bytes_and_anything_else_is_none() -> None:
    value = uuid.uuid4()
    assert uuid_bytes(str(value).encode()) == value.bytes
    assert uuid_bytes(str(value).upper().encode()) == value.bytes
    for raw in (None, b"", b"not-a-uuid", b"\xff" * 36, b"0" * 100):
        assert uuid_bytes(raw) is None


class _OnceMessage:
    """A consumed record whose headers() raises as confluent-kafka does for a non-UTF-8 name."""

    def __init__(
        self, headers: list[tuple[str, bytes | None]] | None, broken: bool = False
    ) -> None:
        self._headers = headers
        self._broken = broken
        self.calls = 0

    def headers(self) -> list[tuple[str, bytes | None]] | None:
        self.calls += 1
        assert self.calls == 1, "headers() read twice: SIGSEGV in confluent-kafka"
        if self._broken:
            try:
                b"\xff".decode()
            except UnicodeDecodeError as exc:
                raise SystemError("returned a result with an exception set") from exc
        return self._headers

    def timestamp(self) -> tuple[int, int]:
        return (1, 1_700_000_000_000)

    def topic(self) -> str:
        return "t"

    def partition(self) -> int:
        return 2

    def offset(self) -> int:
        return 9


def test_the_reader_skips_an_unreadable_record_counting_why_and_reads_headers_once() -> None:
    reader = RecordReader()
    broken = _OnceMessage(None, broken=True)
    assert reader.read(broken) is None
    assert reader.skipped == {Skip.UNREADABLE_HEADERS: 1} and broken.calls == 1
    fine = _OnceMessage([("id", b"a"), ("id", b"b"), ("x", None)])
    record = reader.read(fine)
    assert record is not None and fine.calls == 1
    assert record.headers == {"id": b"b", "x": b""}  # (the last of duplicates wins)
    assert (record.topic, record.partition, record.offset) == ("t", 2, 9)
    assert reader.summary() == "unreadable_headers=1"


@settings(max_examples=300, deadline=None)
@given(record=kafka_records())
def test_the_relays_reader_and_the_sinks_agree_on_every_record(record: RawRecord) -> None:
    """One reader: what RecordReader reads of a record is what read_headers reads of it
    (readable or not; by name, the last of duplicates winning, null as b"")."""
    shown = read_headers(FakeMessage(record))
    reader = RecordReader()
    message = FakeMessage(record)
    got = reader.read(message)
    assert message.header_calls == 1
    if shown.problem:
        assert got is None and reader.skipped == {Skip.UNREADABLE_HEADERS: 1}
        return
    assert got is not None
    by_name = {name: value or b"" for name, value in shown.headers}
    assert got.headers == by_name
    assert all(got.header(name) == value for name, value in by_name.items())


class _Typed:
    def __init__(self, headers: Any) -> None:
        self._headers = headers

    def headers(self) -> Any:
        return self._headers

    def timestamp(self) -> tuple[int, int]:
        return (0, 0)  # (no timestamp)

    def topic(self) -> str:
        return "t"

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return 1


def test_the_relays_reader_skips_what_is_no_pair_and_never_returns_a_value_not_bytes() -> None:
    reader = RecordReader()
    assert reader.read(_Typed(["not a pair"])) is None
    assert reader.read(_Typed([("id", b"1", "extra")])) is None
    assert reader.skipped == {Skip.UNREADABLE_HEADERS: 2}
    odd = reader.read(_Typed([("id", "text"), ("origin", 7), ("x", None), (b"raw", b"v")]))
    assert odd is not None and odd.timestamp_ms is None
    assert (odd.header("id"), odd.header("origin"), odd.header("x")) == (None, None, b"")
    assert odd.event_id_bytes() is None and odd.headers == {"x": b""}


@settings(max_examples=300, deadline=None)
@given(record=kafka_records())
def test_the_id_readers_fast_path_reads_what_the_record_reader_reads(record: RawRecord) -> None:
    """The audit's hot path (:meth:`RecordReader.id_and_origin`, no Record per record)
    reads the same id and the same verdict on ``origin`` as :meth:`RecordReader.read`
    + :meth:`Record.event_id_bytes` + :meth:`Owner.judge`, and counts the same skips
    (unreadable headers, no uuid id) - for any record, headers read once."""
    owner = Owner("42", frozenset({1}), "slot")
    fast, slow = RecordReader(), RecordReader()
    message = FakeMessage(record)
    found = fast.id_and_origin(message)
    assert message.header_calls == 1
    got = slow.read(FakeMessage(record))
    id16 = got.event_id_bytes() if got is not None else None
    if id16 is None:
        if got is not None:
            slow.skip(Skip.BAD_ID)
        assert found is None
    else:
        assert found is not None and found[0] == id16
        origin = found[1]
        assert owner.verdict(origin if type(origin) is bytes else None) == owner.verdict(
            got.header("origin") if got is not None else None
        )
    assert fast.skipped == slow.skipped


def test_the_id_reader_takes_the_last_of_duplicate_ids_and_origins() -> None:
    first, last = uuid.uuid4(), uuid.uuid4()
    reader = RecordReader()
    got = reader.id_and_origin(
        _Typed(
            [
                ("id", str(first).encode()),
                ("origin", b"42/1/slot"),
                ("id", last.hex.encode()),
                ("origin", b"99/1/slot"),
            ]
        )
    )
    assert got == (last.bytes, b"99/1/slot")  # (Kafka's lastHeader)
    assert reader.id_and_origin(_Typed(None)) is None  # no headers at all: no id
    assert reader.id_and_origin(_Typed([("id", None)])) is None  # a null id
    assert reader.skipped == {Skip.BAD_ID: 2}
