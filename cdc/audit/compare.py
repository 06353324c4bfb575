"""The audit's comparison: the window's outbox rows against the records found in Kafka. Pure.

What is compared (all sides are :class:`~cdc.audit.ids.IdBuckets`, compared one
bucket at a time, so memory holds the compact arrays plus one bucket's objects):

* :class:`TableSide` per routed topic: the ids of the rows the window *judges*
  (their time inside it) and of its *context* rows (in the margin before it:
  a record of the window may belong to one; they are never judged missing);
* :class:`KafkaSide` per topic: the ids of this relay's records (judged by
  :class:`cdc.evidence.Owner`: its system, timeline lineage and slot), split into
  those inside the window (phantom candidates) and the others; records of anyone
  else are only counted - another producer's record never vouches for a row;
* the ids in the dead-letter topic; the ids still *pending* in the slot (decoded,
  not yet confirmed: in flight, not lost), or ``None`` when that is unknown.

Guarantees of :func:`compare`, for every judged row of topic T, exactly one of:

* ``in_kafka``: a record of this relay in T carries its id (more than one: the extra ones are
  at-least-once duplicates, counted, not an error);
* ``dead_lettered``: no record of T, but the dead-letter topic has its id;
* ``in_flight``: neither, but the slot still holds it (it will be published);
* ``missing``: none of these - the event is lost between the table and Kafka.

And for the records: a phantom candidate whose id is in no row of the read
(judged or context, any topic) is a ``phantom`` when the table is meant to keep
rows (``judge_phantoms``), else ``unchecked`` (e.g. delete-after-insert or
logical-message events: the table cannot vouch for them). Records of other
relays (another origin, e.g. another shard) are never phantoms.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from cdc.audit.ids import BUCKETS, IdBuckets, IdList


@dataclass
class TableSide:
    """The rows of one routed topic read for the window."""

    judged: IdBuckets = field(default_factory=IdBuckets)
    context: IdBuckets = field(default_factory=IdBuckets)


@dataclass
class KafkaSide:
    """The records of one topic read for the window (ids only)."""

    #: this relay's records inside the window: phantom candidates
    ours_in_window: IdBuckets = field(default_factory=IdBuckets)
    #: this relay's records outside the window (or every record with an id, when the
    #: relay's identity is unknown: then nothing is a phantom candidate)
    ours_elsewhere: IdBuckets = field(default_factory=IdBuckets)
    #: records with an id of anyone else (another origin, no origin): never vouch for a row
    foreign: int = 0

    def add(self, id16: bytes, *, candidate: bool) -> None:
        (self.ours_in_window if candidate else self.ours_elsewhere).add(id16)

    @property
    def records(self) -> int:
        return self.ours_in_window.count + self.ours_elsewhere.count + self.foreign


@dataclass
class TopicCounts:
    """What the comparison found for one topic."""

    table_rows: int = 0
    in_kafka: int = 0
    dead_lettered: int = 0
    in_flight: int = 0
    missing: int = 0
    #: judged ids found more than once in the topic, and the records beyond the first
    duplicate_ids: int = 0
    duplicate_records: int = 0
    #: records of the topic read in all (any origin, any time; with an id)
    records_read: int = 0

    def as_json(self) -> dict[str, int]:
        return {
            "table_rows": self.table_rows,
            "in_kafka": self.in_kafka,
            "dead_lettered": self.dead_lettered,
            "in_flight": self.in_flight,
            "missing": self.missing,
            "duplicate_ids": self.duplicate_ids,
            "duplicate_records": self.duplicate_records,
            "records_read": self.records_read,
        }


@dataclass
class Comparison:
    """The result of :func:`compare`."""

    per_topic: dict[str, TopicCounts]
    missing: IdList
    phantoms: IdList
    #: phantom candidates not judged (the table does not keep rows)
    unchecked: int

    def total(self, attr: str) -> int:
        return sum(int(getattr(counts, attr)) for counts in self.per_topic.values())


def compare(
    table: dict[str, TableSide],
    kafka: dict[str, KafkaSide],
    *,
    dead_letters: IdBuckets,
    pending: IdBuckets | None,
    judge_phantoms: bool,
) -> Comparison:
    """Compare the window's rows with the records (see the module docstring)."""
    topics = sorted(set(table) | set(kafka))
    result = Comparison({t: TopicCounts() for t in topics}, IdList(), IdList(), 0)
    for topic in topics:
        side = kafka.get(topic)
        result.per_topic[topic].records_read = side.records if side else 0
    for bucket in range(BUCKETS):
        _compare_bucket(bucket, table, kafka, dead_letters, pending, judge_phantoms, result)
    return result


def _compare_bucket(
    bucket: int,
    table: dict[str, TableSide],
    kafka: dict[str, KafkaSide],
    dead_letters: IdBuckets,
    pending: IdBuckets | None,
    judge_phantoms: bool,
    result: Comparison,
) -> None:
    dlq = set(dead_letters.ids(bucket))
    slot = set(pending.ids(bucket)) if pending is not None else set()
    candidates = {topic: records.ours_in_window.ids(bucket) for topic, records in kafka.items()}
    rows_read: set[bytes] = set()
    for topic, side in table.items():
        judged = set(side.judged.ids(bucket))
        rows_read |= judged
        rows_read.update(side.context.ids(bucket))
        records = kafka.get(topic)
        found = candidates[topic] + records.ours_elsewhere.ids(bucket) if records else []
        _judge_rows(judged, found, dlq, slot, result.per_topic[topic], result.missing)
    for in_window in candidates.values():
        orphans = set(in_window) - rows_read
        if judge_phantoms:
            result.phantoms.extend(sorted(orphans))
        else:
            result.unchecked += len(orphans)


def _judge_rows(
    judged: set[bytes],
    found: list[bytes],
    dlq: set[bytes],
    slot: set[bytes],
    counts: TopicCounts,
    missing: IdList,
) -> None:
    """Sort one topic's judged rows of a bucket: found, dead-lettered, pending or missing."""
    if not judged:
        return
    seen = Counter(found)
    in_kafka = judged.intersection(seen)
    rest = judged - in_kafka
    dead = rest & dlq
    rest -= dead
    pending = rest & slot
    rest -= pending
    counts.table_rows += len(judged)
    counts.in_kafka += len(in_kafka)
    counts.dead_lettered += len(dead)
    counts.in_flight += len(pending)
    counts.missing += len(rest)
    if len(seen) < len(found):  # (some id twice: rare, an id at a time only then)
        for id16 in in_kafka:
            extra = seen[id16] - 1
            if extra:
                counts.duplicate_ids += 1
                counts.duplicate_records += extra
    missing.extend(sorted(rest))
