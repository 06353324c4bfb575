"""The gap check's tail read holds bounded memory (issue 49, item 4). Pure.

* :class:`cdc.lineage.Newest` answers what sorting every record of the relay's own
  answered (:func:`cdc.lineage.newest_of`), on any sequence (hypothesis), while holding
  at most ``NEWEST_IDS`` + 1 records;
* the tail read's per-record step (``_Tails._take``) over 24 partitions x 2,000 records
  of the relay's own - the shape after a large recovery - holds under a fixed bound,
  measured with tracemalloc: before, it kept ~380 bytes per record (~18 MB here, ~0.9 GB
  at the default CDC_GAP_TAIL_MAX_RECORDS), now the same whatever the count.
"""

from __future__ import annotations

import tracemalloc
from datetime import UTC, datetime
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from cdc import constants as c
from cdc.evidence import Origin, Owner
from cdc.lineage import NEWEST_IDS, Newest, _Seen, _Tails, newest_of

ORIGIN = Origin("7301", 1, "slot")
OWNER = Owner("7301", frozenset({1}), "slot")

#: Peak bytes the tail read may allocate for its records, whatever their count: the
#: kept records (NEWEST_IDS + 1 of ~400 bytes), their heaps and one partition entry each;
#: a per-record leak of even 8 bytes over the 48,000 records below passes it.
TAIL_BOUND_BYTES = 256 * 1024


def seen(ts: int, offset: int, *, message: bool = False, event_id: str = "id") -> _Seen:
    return _Seen(
        commit_ts_us=ts,
        origin=ORIGIN,
        topic="t",
        partition=0,
        offset=offset,
        event_id=event_id,
        message=message,
        recovered=False,
    )


records = st.lists(
    st.builds(
        seen,
        st.integers(0, 20),
        st.integers(0, 20),
        message=st.booleans(),
        event_id=st.sampled_from(["", "a", "b", "c"]),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(records)
def test_the_bounded_keeper_answers_what_sorting_every_record_answered(
    offered: list[_Seen],
) -> None:
    newest = Newest()
    for one in offered:
        newest.add(one)
        assert len(newest) <= NEWEST_IDS + 1
    assert newest.last() == newest_of(offered)
    assert newest.offered == len(offered)


class Msg:
    """A consumed record of the relay's own (what ``_Tails._take`` reads)."""

    __slots__ = ("_headers", "_offset", "_partition")

    def __init__(self, partition: int, offset: int) -> None:
        self._partition, self._offset = partition, offset
        stamp = datetime.fromtimestamp(1_800_000_000 + offset, UTC).isoformat().encode()
        self._headers = [
            (c.HEADER_ID, f"00000000-0000-4000-8000-{offset:012d}".encode()),
            (c.HEADER_ORIGIN, str(ORIGIN).encode()),
            (c.HEADER_COMMIT_TS, stamp),
            (c.HEADER_LSN, b"0/16B3748"),
        ]

    def error(self) -> None:
        return None

    def headers(self) -> list[tuple[str, bytes]]:
        return self._headers

    def topic(self) -> str:
        return "outbox.event.t"

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def timestamp(self) -> tuple[int, int]:
        return 1, 1_700_000_000_000

    def key(self) -> bytes:
        return b"k"

    def value(self) -> bytes:
        return b"{}"


class _Part:
    settled = False


def test_the_tail_reads_memory_does_not_grow_with_the_records_of_its_own() -> None:
    tails = _Tails(client=None, owner=OWNER, first=20, bound=100_000)  # type: ignore[arg-type]
    parts = 24
    per_part = 2_000
    todo: dict[tuple[str, int], Any] = {
        ("outbox.event.t", p): (_Part(), per_part + 1) for p in range(parts)
    }
    tails._take(Msg(0, 0), todo)  # (warm: the origin's verdict, the first heap entries)
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        for offset in range(1, per_part):
            for p in range(parts):
                tails._take(Msg(p, offset), todo)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    held = peak - base
    print(
        f"\ntail read of {parts} x {per_part} records of its own: peak {held / 1024:.0f} KiB"
        f" above the start (bound {TAIL_BOUND_BYTES // 1024} KiB; before issue 49 every"
        " record was kept, ~380 bytes each)"
    )
    assert tails.result.records == parts * per_part - parts + 1
    assert tails.newest.offered == parts * per_part - parts + 1
    assert len(tails.newest) <= NEWEST_IDS + 1
    assert held < TAIL_BOUND_BYTES, f"{held} bytes held for {parts * per_part} records"
    last = tails.newest.last()
    assert last is not None and last.offset == per_part - 1
    assert len(last.newest_rows) == NEWEST_IDS
