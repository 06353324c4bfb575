"""The audit's pure core: compact id sets, the window, and the comparison against a naive model."""

from __future__ import annotations

import os
import tracemalloc
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
from confluent_kafka import TopicPartition
from hypothesis import given
from hypothesis import strategies as st

from cdc.audit.compare import KafkaSide, TableSide, compare
from cdc.audit.ids import BUCKETS, SPILL_BYTES, IdBuckets, IdList, bucket_of, uuid_text
from cdc.audit.kafka import KafkaRead, _reached_ends, _Reader
from cdc.audit.window import (
    BeforeFirstStartError,
    Window,
    WindowError,
    from_first_start,
    parse_duration_s,
    parse_when,
    window_for,
)
from cdc.evidence import MAX_ORIGINS, Owner
from cdc.records import RecordReader, Skip, uuid_bytes
from cdc.wal.slots import ServerIdentity

NOW = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


# --- ids -------------------------------------------------------------------------------------


def test_a_uuid_in_any_usual_spelling_is_its_16_bytes() -> None:
    value = uuid.uuid4()
    for text in (str(value), str(value).upper(), value.hex):
        assert uuid_bytes(text.encode()) == value.bytes
    assert uuid_text(value.bytes) == str(value)


@pytest.mark.parametrize(
    "raw",
    [
        None,
        b"",
        b"42",
        b"not-a-uuid-at-all-not-a-uuid-at-all!",
        b"g" * 32,
        b"12345678+1234-1234-1234-123456789012",
    ],
)
def test_anything_else_is_no_id(raw: bytes | None) -> None:
    assert uuid_bytes(raw) is None


def test_ids_of_every_uuid_version_spread_over_the_buckets() -> None:
    """Version 7 ids of one window share their first bytes: bucketing must not use them."""
    v7 = [_uuid7(ms).bytes for ms in range(1_700_000_000_000, 1_700_000_000_000 + 4096)]
    v1 = [uuid.uuid1().bytes for _ in range(4096)]
    v4 = [uuid.uuid4().bytes for _ in range(4096)]
    for ids in (v7, v1, v4):
        counts = Counter(bucket_of(i) for i in ids)
        assert len(counts) > BUCKETS * 0.9
        assert max(counts.values()) < 16 * len(ids) / BUCKETS


def _uuid7(ms: int) -> uuid.UUID:
    raw = bytearray(ms.to_bytes(6, "big") + uuid.uuid4().bytes[6:])
    raw[6] = (raw[6] & 0x0F) | 0x70
    return uuid.UUID(bytes=bytes(raw))


def test_id_buckets_keep_every_id_with_its_duplicates() -> None:
    ids = [uuid.uuid4().bytes for _ in range(500)]
    buckets = IdBuckets()
    buckets.add_many(ids + ids[:10])
    assert buckets.count == 510
    assert Counter(buckets) == Counter(ids + ids[:10])


def test_a_million_ids_cost_no_more_memory_than_the_spill_budget() -> None:
    tracemalloc.start()
    try:
        buckets = IdBuckets()
        for _ in range(1_000_000 // 1000):
            buckets.add_bucket_blob(0, os.urandom(16 * 1000))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert buckets.count == 1_000_000 and buckets.spilled
    assert peak < 3 * SPILL_BYTES  # (16 MB of ids: on disk past the budget)
    assert len(buckets.ids(0)) == 1_000_000


def test_an_id_list_hands_out_chunks_and_firsts() -> None:
    ids = [uuid.uuid4().bytes for _ in range(25)]
    listed = IdList(ids)
    assert len(listed) == 25
    assert list(listed) == ids
    assert listed.first(3) == ids[:3]
    assert b"".join(listed.chunks(10)) == b"".join(ids)
    with pytest.raises(ValueError):
        listed.append(b"short")


# --- the window ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"), [("90s", 90), ("15m", 900), ("2h", 7200), ("1d", 86400), ("1h30m", 5400)]
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration_s(text) == seconds


def test_a_time_without_offset_is_utc_and_a_duration_is_back_from_now() -> None:
    assert parse_when("2026-01-01T10:00:00", now=NOW, option="--since") == datetime(
        2026, 1, 1, 10, tzinfo=UTC
    )
    assert parse_when("2026-01-01T10:00:00Z", now=NOW, option="--since").tzinfo is not None
    assert parse_when("2h", now=NOW, option="--since") == NOW - timedelta(hours=2)


def test_a_bad_window_names_the_option_and_the_forms() -> None:
    with pytest.raises(WindowError, match=r"--since 'yesterday'.*90s.*ISO-8601"):
        window_for(now=NOW, settle_s=60, width_s=3600, since="yesterday")
    with pytest.raises(WindowError, match="empty"):
        window_for(now=NOW, settle_s=60, width_s=3600, since="1h", until="2h")


def test_the_default_window_ends_settle_ago_and_is_as_wide_as_configured() -> None:
    window = window_for(now=NOW, settle_s=60, width_s=3600)
    assert window.until == NOW - timedelta(seconds=60)
    assert window.width_s == 3600
    assert window == Window.between(window.since, window.until)


def test_a_window_never_starts_before_the_first_start_that_chose_not_to_publish() -> None:
    """Edge: `slot init --from now` (or an empty-outbox first start) 10 minutes ago, the
    audit window an hour wide: it starts at the first start (the rows before it were not
    the relay's to publish); a window after it, or no boundary at all, is left as it is;
    a window that ends at or before it is refused (nothing in it to judge)."""
    first = NOW - timedelta(minutes=10)
    hour = window_for(now=NOW, settle_s=60, width_s=3600)
    moved = from_first_start(hour, first, slot="s")
    assert (moved.since, moved.until) == (first, hour.until)
    later = Window.between(first + timedelta(seconds=1), NOW)
    assert from_first_start(later, first, slot="s") is later
    assert from_first_start(hour, None, slot="s") is hour
    for end in (first, first - timedelta(minutes=1)):
        with pytest.raises(BeforeFirstStartError, match="ends before slot s's first start"):
            from_first_start(Window.between(end - timedelta(hours=1), end), first, slot="s")
    assert issubclass(BeforeFirstStartError, WindowError)  # (the CLI: a usage error, exit 2)


# --- the comparison against a naive model ------------------------------------------------------

TOPICS = ("t.user", "t.quiz")
_ids = st.lists(st.integers(0, 59), max_size=60)


@st.composite
def scenes(draw: st.DrawFn) -> dict[str, object]:
    """Rows (topic, judged) and records (topic or dlq, candidate) over a small id space."""
    pool = [uuid.UUID(int=(i * 0x9E3779B97F4A7C15 << 32) % (1 << 128)).bytes for i in range(60)]
    rows = {}
    for i in draw(st.sets(st.integers(0, 59), max_size=40)):
        rows[pool[i]] = (draw(st.sampled_from(TOPICS)), draw(st.booleans()))
    records = [
        (pool[i], draw(st.sampled_from((*TOPICS, "dlq"))), draw(st.booleans())) for i in draw(_ids)
    ]
    pending = {pool[i] for i in draw(st.sets(st.integers(0, 59), max_size=10))}
    return {"rows": rows, "records": records, "pending": pending, "keep": draw(st.booleans())}


@given(scenes())
def test_every_judged_row_is_found_dead_lettered_in_flight_or_missing_as_the_naive_model_says(
    scene: dict[str, object],
) -> None:
    rows: dict[bytes, tuple[str, bool]] = scene["rows"]  # type: ignore[assignment]
    records: list[tuple[bytes, str, bool]] = scene["records"]  # type: ignore[assignment]
    pending: set[bytes] = scene["pending"]  # type: ignore[assignment]
    table: dict[str, TableSide] = {}
    for id16, (topic, judged) in rows.items():
        side = table.setdefault(topic, TableSide())
        (side.judged if judged else side.context).add(id16)
    kafka: dict[str, KafkaSide] = {}
    dlq = IdBuckets()
    for id16, topic, candidate in records:
        if topic == "dlq":
            dlq.add(id16)
        else:
            kafka.setdefault(topic, KafkaSide()).add(id16, candidate=candidate)
    slot = IdBuckets()
    slot.add_many(pending)
    got = compare(table, kafka, dead_letters=dlq, pending=slot, judge_phantoms=scene["keep"])  # type: ignore[arg-type]

    in_topic = Counter((i, t) for i, t, _ in records if t != "dlq")
    dead = {i for i, t, _ in records if t == "dlq"}
    expect_missing = set()
    for topic in TOPICS:
        judged = {i for i, (t, j) in rows.items() if t == topic and j}
        found = {i for i in judged if in_topic[(i, topic)]}
        counts = got.per_topic.get(topic)
        if counts is None:
            assert not judged
            continue
        assert counts.table_rows == len(judged)
        assert counts.in_kafka == len(found)
        assert counts.dead_lettered == len((judged - found) & dead)
        assert counts.in_flight == len((judged - found - dead) & pending)
        assert counts.missing == len(judged - found - dead - pending)
        assert counts.duplicate_records == sum(in_topic[(i, topic)] - 1 for i in found)
        assert counts.duplicate_ids == sum(1 for i in found if in_topic[(i, topic)] > 1)
        expect_missing |= judged - found - dead - pending
    assert set(got.missing) == expect_missing and len(got.missing) == len(expect_missing)
    orphans = {i for i, t, c in records if t != "dlq" and c and i not in rows}
    if scene["keep"]:
        assert set(got.phantoms) == orphans and got.unchecked == 0
    else:
        assert not len(got.phantoms)
        assert got.unchecked == sum(
            len({i for i, t, c in records if t == topic and c and i not in rows})
            for topic in TOPICS
        )


def test_an_unknown_slot_excuses_nothing() -> None:
    row = uuid.uuid4().bytes
    table = {"t.user": TableSide()}
    table["t.user"].judged.add(row)
    got = compare(table, {}, dead_letters=IdBuckets(), pending=None, judge_phantoms=True)
    assert list(got.missing) == [row]
    assert got.per_topic["t.user"].in_flight == 0


def test_a_record_in_another_topic_does_not_account_for_a_row() -> None:
    row = uuid.uuid4().bytes
    table = {"t.user": TableSide()}
    table["t.user"].judged.add(row)
    kafka = {"t.quiz": KafkaSide()}
    kafka["t.quiz"].add(row, candidate=True)
    got = compare(table, kafka, dead_letters=IdBuckets(), pending=IdBuckets(), judge_phantoms=True)
    assert list(got.missing) == [row]
    assert not len(got.phantoms)  # it has a row: not a phantom either


# --- records read defensively, judged by the one owner -------------------------------------


class _Message:
    """A consumed record as confluent-kafka hands it over (duck-typed)."""

    def __init__(self, topic: str, headers: object, *, ts_ms: int = 1_000, offset: int = 0) -> None:
        self._topic, self._headers, self._ts, self._offset = topic, headers, ts_ms, offset

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset

    def error(self) -> None:
        return None

    def timestamp(self) -> tuple[int, int]:
        return (1, self._ts)

    def headers(self) -> object:
        if isinstance(self._headers, BaseException):
            raise self._headers
        return self._headers


#: This relay: system 42, promoted from timeline 1 to 2 (its records on 1 are its own).
SERVER = ServerIdentity("42", 2, ((1, 0x3000060),))
OURS = b"42/1/slot"


def _read(messages: list[_Message], owner: Owner | None = None) -> KafkaRead:
    out = KafkaRead()
    owner = Owner.of(SERVER, "slot") if owner is None else owner
    _Reader(out, "dlq", owner, 0, Window(0, 5_000)).take(messages, {})  # type: ignore[arg-type]
    return out


def test_a_record_without_a_readable_id_is_counted_not_trusted() -> None:
    good, ancestor = uuid.uuid4(), uuid.uuid4()
    out = _read(
        [
            _Message("t.user", [("id", str(good).encode()), ("origin", b"42/2/slot")]),
            _Message("t.user", [("id", str(ancestor).encode()), ("origin", OURS)]),
            _Message("t.user", [("id", b"not-an-id"), ("origin", OURS)]),
            _Message("t.user", SystemError("broken header name")),
            _Message("t.user", ["not a pair"]),
            _Message("dlq", [("id", str(good).encode())]),  # (a dead letter carries only its id)
        ]
    )
    assert out.records_read == 6
    assert out.without_id == {"t.user": 3}
    assert out.reader.skipped == {Skip.BAD_ID: 1, Skip.UNREADABLE_HEADERS: 2}
    side = out.topics["t.user"]
    assert sorted(side.ours_in_window) == sorted([good.bytes, ancestor.bytes])  # (ancestor tli)
    assert list(out.dead_letters) == [good.bytes]


@pytest.mark.parametrize(
    ("origin", "reason"),
    [
        (b"99/1/slot", Skip.FOREIGN_ORIGIN),  # another cluster's relay with the same slot name
        (b"42/3/slot", Skip.FOREIGN_ORIGIN),  # a sibling branch of this server's history
        (b"42/2/shard_b", Skip.FOREIGN_ORIGIN),  # another relay (slot) of this cluster
        (None, Skip.NO_ORIGIN),  # Debezium, another team's producer, an old relay
        (b"garbage", Skip.BAD_ORIGIN),
    ],
)
def test_a_foreign_record_never_accounts_for_a_row_nor_is_a_phantom(
    origin: bytes | None, reason: Skip
) -> None:
    """Edge (issue 34 item 2 for the audit and the start-up check, one comparison): a record
    that is not this relay's, carrying the id of a row of the window, does not make the
    row found - the row is missing and is republished - and is not a phantom candidate."""
    row = uuid.uuid4()
    headers = [("id", str(row).encode())] + ([("origin", origin)] if origin else [])
    out = _read([_Message("t.user", headers)])
    assert out.reader.skipped == {reason: 1}
    side = out.topics["t.user"]
    assert side.foreign == 1 and not len(side.ours_in_window) and not len(side.ours_elsewhere)
    table = {"t.user": TableSide()}
    table["t.user"].judged.add(row.bytes)
    got = compare(
        table, out.topics, dead_letters=IdBuckets(), pending=IdBuckets(), judge_phantoms=True
    )
    assert list(got.missing) == [row.bytes]
    assert not len(got.phantoms)


def test_with_the_server_unknown_any_record_vouches_and_none_is_a_phantom_candidate() -> None:
    row = uuid.uuid4()
    out = KafkaRead()
    _Reader(out, "dlq", None, 0, Window(0, 5_000)).take(  # type: ignore[arg-type]
        [_Message("t.user", [("id", str(row).encode())])], {}
    )
    side = out.topics["t.user"]
    assert list(side.ours_elsewhere) == [row.bytes] and not len(side.ours_in_window)


def test_an_owners_remembered_verdicts_stay_bounded_and_count_every_record() -> None:
    owner = Owner.of(SERVER, "slot")
    reader = RecordReader()
    for i in range(MAX_ORIGINS + 10):
        record = reader.read(_Message("t", [("id", b"x"), ("origin", f"9{i}0/1/slot".encode())]))
        assert record is not None and owner.judge(record, reader) is None
    big = reader.read(_Message("t", [("origin", b"4" * 300 + b"/1/slot")]))
    assert big is not None and owner.judge(big, reader) is None
    assert reader.skipped == {Skip.FOREIGN_ORIGIN: MAX_ORIGINS + 11}
    assert len(owner._verdicts) == MAX_ORIGINS


#: ``origin`` values a read meets, in any order: this relay's (its timeline and an
#: ancestor's), another cluster's, another slot's, none, garbage, a null header.
_ORIGINS = [OURS, b"42/2/slot", b"99/1/slot", b"42/2/shard_b", None, b"garbage", "null"]


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["t.user", "t.order", "dlq"]),
            st.sampled_from(_ORIGINS),
            st.integers(0, 6_000),  # the timestamp: inside the window [0, 5000) or after it
            st.sampled_from(["uuid", "hex", "bad", "none"]),
            st.booleans(),  # a second (foreign) origin header before the real one
        ),
        max_size=40,
    )
)
def test_the_hot_loop_judges_each_record_as_the_record_reader_and_owner_do(
    records: list[tuple[str, bytes | str | None, int, str, bool]],
) -> None:
    """Edge: the reader judges an ``origin`` only when it differs from the record
    before's (runs of one value). Against the naive model - every record read by
    RecordReader.read and judged by Owner.judge - whatever the order of origins,
    topics, ids and duplicate headers: the same ids kept where they belong (in or out
    of the window, dead letters), the same foreign counts and skip reasons."""
    owner = Owner.of(SERVER, "slot")
    messages, model_reader = [], RecordReader()
    model = {"t.user": KafkaSide(), "t.order": KafkaSide()}
    model_dead, model_without = IdBuckets(), Counter[str]()
    for i, (topic, origin, ts_ms, id_form, doubled) in enumerate(records):
        event = uuid.uuid4()
        raw_id = {"uuid": str(event).encode(), "hex": event.hex.encode(), "bad": b"x" * 36}
        headers: list[tuple[str, bytes | None]] = []
        if id_form != "none":
            headers.append(("id", raw_id[id_form]))
        if doubled:
            headers.append(("origin", b"99/1/slot"))  # (the last of duplicates wins)
        if origin == "null":
            headers.append(("origin", None))
        elif isinstance(origin, bytes):
            headers.append(("origin", origin))
        messages.append(_Message(topic, headers, ts_ms=ts_ms, offset=i))
        record = model_reader.read(_Message(topic, headers, ts_ms=ts_ms, offset=i))
        assert record is not None
        id16 = record.event_id_bytes()
        if id16 is None:
            model_reader.skip(Skip.BAD_ID)
            model_without[topic] += 1
        elif topic == "dlq":
            model_dead.add(id16)
        elif owner.judge(record, model_reader) is None:
            model[topic].foreign += 1
        else:
            model[topic].add(id16, candidate=ts_ms < 5_000)
    out = _read(messages)
    assert out.records_read == len(records)
    assert out.reader.skipped == model_reader.skipped
    assert out.without_id == dict(model_without)
    assert sorted(out.dead_letters) == sorted(model_dead)
    for topic, want in model.items():
        got = out.topics.get(topic, KafkaSide())
        assert got.foreign == want.foreign, topic
        assert sorted(got.ours_in_window) == sorted(want.ours_in_window), topic
        assert sorted(got.ours_elsewhere) == sorted(want.ours_elsewhere), topic


class _Positions:
    """A consumer's ``position()`` (the offset after the last record handed over)."""

    def __init__(self, offsets: dict[tuple[str, int], int]) -> None:
        self.offsets = offsets

    def position(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        return [
            TopicPartition(
                tp.topic, tp.partition, self.offsets.get((tp.topic, tp.partition), -1001)
            )
            for tp in partitions
        ]


def test_a_partition_is_done_once_its_position_reaches_the_planned_end_and_not_before() -> None:
    """Edge: the ends are checked once a batch from the consumer's positions (not per
    record); a partition read up to just below its end, or not read at all yet
    (position invalid), stays to be read; one read past its end (records appended
    after the plan) is done."""
    todo = {("t", 0): 10, ("t", 1): 10, ("t", 2): 10, ("t", 3): 10}
    client = _Positions({("t", 0): 10, ("t", 1): 9, ("t", 3): 12})
    _reached_ends(client, todo)  # type: ignore[arg-type]
    assert todo == {("t", 1): 10, ("t", 2): 10}
