"""The start-up check's compact id set (cdc.verify.IdSet) and the one record reader."""

from __future__ import annotations

import uuid

from hypothesis import given
from hypothesis import strategies as st

from cdc.records import RecordReader, Skip, uuid_bytes
from cdc.verify import IdSet


@given(st.lists(st.binary(min_size=16, max_size=16), max_size=400), st.data())
def test_the_id_set_holds_exactly_what_was_added(ids: list[bytes], data: st.DataObject) -> None:
    held = IdSet(capacity=4)  # (grows many times)
    for i in ids:
        held.add(i)
    assert len(held) == len(set(ids))
    assert all(i in held for i in ids)
    other = data.draw(st.binary(min_size=16, max_size=16))
    assert (other in held) == (other in set(ids))
    assert bytes(16) in held if bytes(16) in ids else bytes(16) not in held


def test_the_id_set_costs_at_most_32_bytes_an_id() -> None:
    held = IdSet()
    for _ in range(50_000):
        held.add(uuid.uuid4().bytes)
    assert len(held) == 50_000
    assert held.nbytes <= 50_000 * 32 * 2  # (just after doubling: at most twice the bound)
    assert b"short" not in held and "text" not in held


def test_ids_are_read_as_the_uuids_16_bytes_and_anything_else_is_none() -> None:
    value = uuid.uuid4()
    assert uuid_bytes(str(value).encode()) == value.bytes
    assert uuid_bytes(str(value).upper().encode()) == value.bytes
    for raw in (None, b"", b"not-a-uuid", b"\xff" * 36, b"0" * 100):
        assert uuid_bytes(raw) is None


class _Message:
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
    broken = _Message(None, broken=True)
    assert reader.read(broken) is None
    assert reader.skipped == {Skip.UNREADABLE_HEADERS: 1} and broken.calls == 1
    fine = _Message([("id", b"a"), ("id", b"b"), ("x", None)])
    record = reader.read(fine)
    assert record is not None and fine.calls == 1
    assert record.headers == {"id": b"b", "x": b""}  # (the last of duplicates wins)
    assert (record.topic, record.partition, record.offset) == ("t", 2, 9)
    assert reader.summary() == "unreadable_headers=1"
