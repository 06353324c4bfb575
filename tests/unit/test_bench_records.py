"""The record-for-record judgment of ``make bench-compare`` (tests/bench/compare/records.py)
on records built here: identical records pass, and each kind of difference is caught -
key, value bytes, a shared header, partition or offset, a header outside the contract,
an event on one side only, an event twice."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.bench.compare.records import Record, by_id, compare

RELAY_ONLY = (("lsn", b"0/1"), ("commit_ts", b"2026-12-04T10:00:00.000000Z"), ("origin", b"o"))
DBZ_ONLY = (("__debezium.context.taskId", b"0"), ("__debezium.context.connectorName", b"pg"))


def _pair(n: int) -> tuple[Record, Record]:
    common = (("id", f"id-{n}".encode()), ("type", b"UserRegistered"), ("aggregatetype", b"user"))
    relay = Record(n % 3, n // 3, f"k{n}".encode(), b'{"a": 1}', common + RELAY_ONLY, 1000 + n)
    other = Record(n % 3, n // 3, f"k{n}".encode(), b'{"a": 1}', DBZ_ONLY + common, 1500 + n)
    return relay, other


def _sides(count: int = 6) -> tuple[dict[str, Record], list[Record]]:
    pairs = [_pair(n) for n in range(count)]
    relay, total = by_id(iter([p[0] for p in pairs]))
    assert total == count
    return relay, [p[1] for p in pairs]


def test_identical_records_pass_whatever_headers_only_one_side_writes() -> None:
    relay, other = _sides()
    result = compare(relay, iter(other), relay_total=len(relay))
    assert result.ok, result.examples
    assert result.identical == 6
    assert result.timestamp_delta_ms == [500, 500]


@pytest.mark.parametrize(
    ("change", "expect"),
    [
        (lambda r: replace(r, key=b"other"), "key"),
        (lambda r: replace(r, value=b'{"a":1}'), "value"),
        (lambda r: replace(r, partition=r.partition + 1), "at "),
        (lambda r: replace(r, offset=r.offset + 1), "at "),
        (
            lambda r: replace(
                r, headers=tuple((k, b"Other" if k == "type" else v) for k, v in r.headers)
            ),
            "header type",
        ),
        (lambda r: replace(r, headers=(*r.headers, ("extra", b"x"))), "header extra"),
        (
            lambda r: replace(r, headers=tuple(h for h in r.headers if h[0] != "aggregatetype")),
            "header aggregatetype",
        ),
    ],
    ids=["key", "value", "partition", "offset", "shared-header", "unknown-header", "no-header"],
)
def test_each_kind_of_difference_is_caught(change: object, expect: str) -> None:
    relay, other = _sides()
    other[2] = change(other[2])  # type: ignore[operator]
    result = compare(relay, iter(other), relay_total=len(relay))
    assert not result.ok
    assert result.differences == 1
    assert result.identical == 5
    assert expect in result.examples[0]


def test_an_event_on_one_side_only_or_twice_is_a_difference() -> None:
    relay, other = _sides()
    assert compare(relay, iter(other[:-1])).differences == 1  # missing on the other side
    assert compare(relay, iter([*other, other[0]])).differences == 1  # twice on the other
    extra = replace(other[0], headers=(("id", b"not-in-relay"),))
    assert compare(relay, iter([*other, extra])).differences == 1  # the other side only
    assert not compare(relay, iter(other), relay_total=len(relay) + 1).ok  # twice in the relay's


def test_nothing_on_either_side_is_not_a_pass() -> None:
    assert not compare({}, iter([])).ok
