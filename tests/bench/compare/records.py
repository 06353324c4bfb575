"""Record for record: another publisher's topic against the relay's.

Two publishers of one outbox, each from a slot created at the same LSN, into topics of
the same partition count: every event (by its ``id`` header) must have the same key,
the same value bytes, the same headers both publishers write (``id``, ``type``,
``aggregatetype``), the same partition and the same offset in it (so the same order
and no duplicate), and neither may hold an event the other lacks.

Headers only one side writes are documented differences, not failures
(docs/record-contract.md, "Side by side with Debezium's outbox event router"):
the relay's ``lsn``, ``commit_ts``, ``origin`` (and ``traceparent`` when the row has a
span context), Debezium's ``__debezium.context.*``. Any other header on either side is a
difference. The record timestamp is compared apart (Debezium stamps its processing
time, the relay the commit time): its spread is reported, never judged.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaException, TopicPartition

#: Headers both the relay and Debezium's outbox router (configured as in
#: bench/debezium/connector*.properties) write, byte for byte.
COMMON_HEADERS = ("id", "type", "aggregatetype")
#: Headers only the relay writes.
RELAY_ONLY = frozenset({"lsn", "commit_ts", "origin", "traceparent"})
#: Header prefix only Debezium writes.
DEBEZIUM_ONLY_PREFIX = "__debezium.context."
#: Differences kept for the report (the count is always exact).
KEEP = 20


@dataclass(frozen=True)
class Record:
    """What is compared of one record."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]
    timestamp_ms: int

    def header(self, name: str) -> bytes | None:
        found = [v for k, v in self.headers if k == name]
        return found[-1] if found else None


@dataclass
class Comparison:
    """The outcome of comparing another publisher's records with the relay's."""

    relay_records: int = 0
    other_records: int = 0
    identical: int = 0
    differences: int = 0
    examples: list[str] = field(default_factory=list)
    #: other timestamp - relay timestamp, ms: min and max over identical records.
    timestamp_delta_ms: list[int] = field(default_factory=list)

    def differ(self, what: str) -> None:
        self.differences += 1
        if len(self.examples) < KEEP:
            self.examples.append(what)

    @property
    def ok(self) -> bool:
        return self.differences == 0 and self.identical == self.relay_records > 0

    def summary(self) -> dict[str, object]:
        return {
            "relay_records": self.relay_records,
            "other_records": self.other_records,
            "identical": self.identical,
            "different": self.differences,
            "examples": self.examples,
            "timestamp_delta_ms_min_max": self.timestamp_delta_ms,
        }


def _unexpected_headers(rec: Record, *, relay: bool) -> list[str]:
    names = [k for k, _ in rec.headers]
    if relay:
        return [n for n in names if n not in COMMON_HEADERS and n not in RELAY_ONLY]
    return [n for n in names if n not in COMMON_HEADERS and not n.startswith(DEBEZIUM_ONLY_PREFIX)]


def compare_one(event_id: str, relay: Record, other: Record, out: Comparison) -> None:
    """Compare one event's two records, counting it identical or different."""
    problems = []
    if (relay.partition, relay.offset) != (other.partition, other.offset):
        problems.append(
            f"at {other.partition}/{other.offset}, relay at {relay.partition}/{relay.offset}"
        )
    if relay.key != other.key:
        problems.append(f"key {other.key!r} != relay {relay.key!r}")
    if relay.value != other.value:
        problems.append(f"value {other.value!r:.120} != relay {relay.value!r:.120}")
    for name in COMMON_HEADERS:
        if relay.header(name) != other.header(name):
            problems.append(f"header {name} {other.header(name)!r} != {relay.header(name)!r}")
    for name in _unexpected_headers(relay, relay=True):
        problems.append(f"relay header {name} not in the contract")
    for name in _unexpected_headers(other, relay=False):
        problems.append(f"header {name} the relay does not write")
    if problems:
        out.differ(f"{event_id}: " + "; ".join(problems))
        return
    out.identical += 1
    delta = other.timestamp_ms - relay.timestamp_ms
    if not out.timestamp_delta_ms:
        out.timestamp_delta_ms = [delta, delta]
    else:
        out.timestamp_delta_ms = [
            min(out.timestamp_delta_ms[0], delta),
            max(out.timestamp_delta_ms[1], delta),
        ]


def compare(
    relay: dict[str, Record], other: Iterator[Record], *, relay_total: int | None = None
) -> Comparison:
    """Every record of ``other`` against the relay's record of the same event id; an
    event on one side only, or twice on either (``relay_total``: the relay's records
    read, duplicates included), is a difference."""
    out = Comparison(relay_records=len(relay))
    if relay_total is not None and relay_total != len(relay):
        out.differ(f"the relay published {relay_total - len(relay)} records twice")
    seen: set[str] = set()
    for rec in other:
        out.other_records += 1
        raw = rec.header("id")
        event_id = raw.decode(errors="replace") if raw is not None else "<no id>"
        if event_id in seen:
            out.differ(f"{event_id}: twice (again at {rec.partition}/{rec.offset})")
            continue
        seen.add(event_id)
        mine = relay.get(event_id)
        if mine is None:
            out.differ(f"{event_id}: not published by the relay")
            continue
        compare_one(event_id, mine, rec, out)
    for event_id in relay.keys() - seen:
        out.differ(f"{event_id}: published by the relay only")
    return out


def read(
    kafka: str, topics: list[str], *, expect: int, timeout_s: float = 300.0
) -> Iterator[Record]:
    """Every record of ``topics`` from the beginning until ``expect`` were read (and no
    more arrive for a second), as :class:`Record`."""
    consumer = Consumer(
        {
            "bootstrap.servers": kafka,
            "group.id": "bench-compare-unused",
            "enable.auto.commit": False,
            "enable.partition.eof": False,
            "fetch.max.bytes": 64 * 1024 * 1024,
        }
    )
    try:
        meta = consumer.list_topics(timeout=15)
        parts = [TopicPartition(t, p, 0) for t in topics for p in meta.topics[t].partitions]
        consumer.assign(parts)
        read_n, deadline, idle_until = 0, time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            batch = consumer.consume(10_000, 0.5)
            for msg in batch:
                if msg.error():
                    raise KafkaException(msg.error())
                read_n += 1
                yield Record(
                    msg.partition(),
                    msg.offset(),
                    msg.key(),
                    msg.value(),
                    tuple(msg.headers() or ()),
                    msg.timestamp()[1],
                )
            if read_n >= expect:
                if batch:
                    idle_until = time.monotonic() + 1.0
                elif idle_until is None or time.monotonic() >= idle_until:
                    return
    finally:
        consumer.close()


def by_id(records: Iterator[Record]) -> tuple[dict[str, Record], int]:
    """The relay's records by event id, and how many were read (more than the ids: some
    published twice; the first of an id is kept)."""
    out: dict[str, Record] = {}
    total = 0
    for rec in records:
        total += 1
        raw = rec.header("id")
        out.setdefault(raw.decode(errors="replace") if raw is not None else "<no id>", rec)
    return out, total
