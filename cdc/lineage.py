"""The relay's memory is Kafka: its own records, told apart from all others by their ``origin``.

Guarantees:

* every record the relay publishes carries ``origin`` =
  ``<system_identifier>/<timeline>/<slot>`` (:func:`origin_value`), constant per
  session; records made from a logical message also carry ``form: message``
  (:data:`cdc.constants.HEADER_FORM`), rows of the table carry no ``form``;
* a record is the relay's own only by the gap-detection rule of
  :mod:`cdc.evidence` (:func:`cdc.evidence.gap_rule`: this server's system, a
  timeline of its lineage, this slot); the other decisions' rules are there too;
* every record is read by :class:`cdc.records.RecordReader`: a record whose
  headers cannot be read is skipped and counted, never fatal;
* :func:`read_tails` is bounded: it reads only the topics given (those the
  relay's routes published to, :func:`relay_topics`), from the end of each
  partition back, ``CDC_GAP_TAIL_RECORDS`` first and 8 times more each round
  while a partition's tail holds no streamed record of the relay's own and more
  lies before it, up to ``CDC_GAP_TAIL_MAX_RECORDS``. It returns the relay's
  newest record by commit time (:class:`LastRecord`), or None when none is in
  any tail. When none was found at all but some partition holds more than the
  bound, it raises :class:`TailTooDeepError` (one line naming the partition and
  the setting): it cannot tell "nothing published" from "buried";
* the ids, commit times, timelines and commit LSNs of the relay's newest *row*
  records (not logical messages) ride along (:class:`RowRef`), so a gap can check
  them against the table, and tell a row deleted after insert from one a failover
  took back (published from WAL past the point where its timeline ended);
* its memory is bounded whatever the partition count and the depth read: of the
  records of the relay's own it meets, it keeps only the newest one and the
  :data:`NEWEST_IDS` newest row records (:class:`Newest`, heaps of at most that
  size: ~``NEWEST_IDS`` x 400 bytes), plus one small entry per partition and the
  names of the topics that held one - never a list of every record read (before:
  ~380 bytes per record of its own, up to ``CDC_GAP_TAIL_MAX_RECORDS`` per
  partition: ~0.9 GB at 24 partitions after a large recovery); its consumer's
  fetch queue is bounded too (:data:`READ_BOUNDS`: 4 MB, not librdkafka's 64 MB).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NamedTuple

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from cdc import constants as c
from cdc import gaps
from cdc.errors import CdcError
from cdc.evidence import Origin, Owner
from cdc.kafka.log import KafkaClientEvents
from cdc.records import Record, RecordReader
from cdc.settings import Settings
from cdc.wal.replproto import str_to_lsn

log = logging.getLogger("cdc.lineage")

#: Kafka requests of the tail read give up after this.
KAFKA_TIMEOUT_S = 10.0
#: Ids of the newest row records kept in :class:`LastRecord` (checked against the table).
NEWEST_IDS = 20
#: A partition's tail read grows this many times per round while it holds none of ours.
TAIL_GROWTH = 8
#: Longest wait for one round of tail reads, per 10,000 records asked for (at least this).
ROUND_TIMEOUT_S = 30.0
#: A reading consumer's fetch queue, in KB (librdkafka's default is 64 MB: the tail
#: read after a large recovery and the audit each held it full).
QUEUE_KBYTES = 4_096
#: Messages librdkafka prefetches per partition (its default, 100,000, holds whole
#: partitions of a window in memory).
QUEUE_MESSAGES = 2_000
#: Bytes of one fetch response (librdkafka's default is 52 MB).
FETCH_MAX_BYTES = 8 * 1024 * 1024
#: The broker answers a fetch at a partition's end after this (librdkafka's 500 ms
#: default held the read's last round trip).
FETCH_WAIT_MS = 50
#: How long librdkafka waits before fetching again once the bounded queue is full
#: (``fetch.queue.backoff.ms``; its default, 1,000 ms, stalled every partition a
#: second each time the reader caught up: a 200,000-record read spent 2 of its 3.5 s
#: waiting). The queue drains in tens of milliseconds at the reader's pace.
FETCH_QUEUE_BACKOFF_MS = 10
#: The fetch bounds of every reading consumer of the relay's topics (the tail read, the
#: audit): what librdkafka holds for it stays a few MB whatever the partitions read.
READ_BOUNDS: dict[str, int] = {
    "queued.max.messages.kbytes": QUEUE_KBYTES,
    "queued.min.messages": QUEUE_MESSAGES,
    "fetch.max.bytes": FETCH_MAX_BYTES,
    "fetch.wait.max.ms": FETCH_WAIT_MS,
    "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS,
}


class TailTooDeepError(CdcError):
    """The relay's newest record may lie deeper than ``CDC_GAP_TAIL_MAX_RECORDS``."""

    retriable = True


class RowRef(NamedTuple):
    """One of the relay's newest row records: the event id, its commit time (µs), the
    timeline of its ``origin`` and its ``lsn`` header (the commit's LSN; 0 without)."""

    id: str
    commit_ts_us: int
    timeline: int = 0
    commit_lsn: int = 0


@dataclass(frozen=True)
class LastRecord:
    """The newest record of the relay's own found in Kafka."""

    commit_ts_us: int
    origin: Origin | None
    topic: str
    partition: int
    offset: int
    #: the newest *row* records of ours seen (newest first): logical messages
    #: excluded, the table never held them
    newest_rows: tuple[RowRef, ...] = ()
    #: a record of ours made from a logical message was seen in the tails
    saw_messages: bool = False
    #: the highest ``lsn`` header among our records seen that the stream itself wrote
    #: (rows and messages; not ``recovered`` ones, whose ``lsn`` is a recovery's
    #: position): how far the relay's own publishing reached (exactly-once's evidence)
    streamed_lsn: int = 0

    @property
    def commit_ts(self) -> datetime:
        return datetime.fromtimestamp(self.commit_ts_us / 1_000_000, UTC)

    @property
    def newest_ids(self) -> tuple[str, ...]:
        return tuple(r.id for r in self.newest_rows)


def commit_lsn(record: Record) -> int:
    """A record's ``lsn`` header as a 64-bit LSN; 0 without one or when it does not parse."""
    raw = record.header(c.HEADER_LSN)
    if not raw or len(raw) > 17:
        return 0
    try:
        return str_to_lsn(raw.decode())
    except (UnicodeDecodeError, ValueError):
        return 0


def commit_ts_us(record: Record) -> int:
    """A record's commit time: its ``commit_ts`` header, else its timestamp (0 without)."""
    raw = record.header(c.HEADER_COMMIT_TS)
    if raw:
        try:
            parsed = datetime.fromisoformat(raw.decode().replace("Z", "+00:00"))
            if parsed.tzinfo is not None:
                return int(parsed.timestamp() * 1_000_000)
        except (UnicodeDecodeError, ValueError):
            pass
    return (record.timestamp_ms or 0) * 1000


@dataclass(frozen=True)
class _Seen:
    commit_ts_us: int
    origin: Origin
    topic: str
    partition: int
    offset: int
    event_id: str
    message: bool
    recovered: bool
    commit_lsn: int = 0


#: A kept record: (commit time, offset, -arrival, the record) - unique before the record.
_Entry = tuple[int, int, int, "_Seen"]


class Newest:
    """The newest record seen and the :data:`NEWEST_IDS` newest row records (by commit time,
    then offset; among equals the first seen), kept in heaps of bounded size: memory does
    not grow with the records offered (see the module docstring)."""

    def __init__(self, rows: int = NEWEST_IDS) -> None:
        self._rows = rows
        self._order = itertools.count()
        #: min-heaps of (commit time, offset, -arrival, record): the root is the oldest kept
        self._top: list[_Entry] = []
        self._newest_rows: list[_Entry] = []
        self.saw_messages = False
        #: the highest commit LSN of a record the stream wrote (not ``recovered``), of all
        #: offered: :attr:`LastRecord.streamed_lsn` (the kept records are only the newest)
        self.streamed_lsn = 0
        self.topics: set[str] = set()
        #: records offered
        self.offered = 0

    def add(self, seen: _Seen) -> None:
        self.offered += 1
        self.topics.add(seen.topic)
        self.saw_messages = self.saw_messages or seen.message
        if not seen.recovered:
            self.streamed_lsn = max(self.streamed_lsn, seen.commit_lsn)
        entry = (seen.commit_ts_us, seen.offset, -next(self._order), seen)
        _keep(self._top, entry, 1)
        if not seen.message and seen.event_id:
            _keep(self._newest_rows, entry, self._rows)

    def __len__(self) -> int:
        """Records held now (never more than ``NEWEST_IDS`` + 1)."""
        return len(self._top) + len(self._newest_rows)

    def last(self) -> LastRecord | None:
        kept = {e[2]: e for e in self._top + self._newest_rows}  # (one record in both)
        return newest_of(
            [e[3] for e in sorted(kept.values(), reverse=True)],
            saw_messages=self.saw_messages,
            streamed_lsn=self.streamed_lsn,
        )


def _keep(heap: list[_Entry], entry: _Entry, size: int) -> None:
    """Keep the ``size`` largest entries in the min-heap ``heap``."""
    if len(heap) < size:
        heapq.heappush(heap, entry)
    elif entry[:3] > heap[0][:3]:
        heapq.heapreplace(heap, entry)


def newest_of(
    seen: Iterable[_Seen], *, saw_messages: bool = False, streamed_lsn: int = 0
) -> LastRecord | None:
    """The newest of the records seen (commit time, then offset), with the newest row ids."""
    ordered = sorted(seen, key=lambda s: (s.commit_ts_us, s.offset), reverse=True)
    if not ordered:
        return None
    top = ordered[0]
    rows = [s for s in ordered if not s.message and s.event_id]
    return LastRecord(
        commit_ts_us=top.commit_ts_us,
        origin=top.origin,
        topic=top.topic,
        partition=top.partition,
        offset=top.offset,
        newest_rows=tuple(
            RowRef(s.event_id, s.commit_ts_us, s.origin.timeline, s.commit_lsn)
            for s in rows[:NEWEST_IDS]
        ),
        saw_messages=saw_messages or any(s.message for s in ordered),
        streamed_lsn=max(
            streamed_lsn, max((s.commit_lsn for s in ordered if not s.recovered), default=0)
        ),
    )


@dataclass
class TailRead:
    """What :func:`read_tails` found: the newest record of ours and what it passed by."""

    last: LastRecord | None
    reader: RecordReader = field(default_factory=RecordReader)
    #: records read, over every partition and round
    records: int = 0
    topics: tuple[str, ...] = ()
    #: topics whose tails hold records of ours
    topics_with_ours: tuple[str, ...] = ()


def relay_topics(conn: Any, settings: Settings, listed: Iterable[str]) -> tuple[list[str], bool]:
    """The topics whose tails hold the relay's memory: those its routes published to
    (recorded in ``outbox_cdc_slot_output``) that exist; with none recorded (a relay
    from before migration 007), every listed topic of ``CDC_TOPIC_PREFIX`` but the
    dead-letter topic; the exactly-once checkpoint topic never. The second value: True
    when they came from the record."""
    existing = set(listed)
    recorded = gaps.outputs(conn, settings.slot, gaps.OUTPUT_TOPIC)
    if recorded:
        # (a checkpoint topic holds no event, whatever its name)
        return [t for t in recorded if t in existing and not settings.is_checkpoint_topic(t)], True
    return sorted(t for t in existing if settings.is_outbox_topic(t)), False


def consumer(settings: Settings, purpose: str) -> Consumer:
    """A group-less reading consumer (nothing committed) of the relay's settings."""
    return Consumer(
        {
            "bootstrap.servers": settings.kafka_bootstrap_servers,
            "client.id": f"outbox-cdc-{purpose}",
            "group.id": f"outbox-cdc-{purpose}-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            **READ_BOUNDS,
            **KafkaClientEvents(purpose).config(),
            **settings.kafka_config,
        }
    )


def list_topics(settings: Settings) -> list[str]:
    """Every topic name the brokers list."""
    client = consumer(settings, "lineage")
    try:
        return sorted(client.list_topics(timeout=KAFKA_TIMEOUT_S).topics)
    finally:
        client.close()


def read_tails(
    settings: Settings, owner: Owner, topics: Sequence[str], *, tail: int | None = None
) -> TailRead:
    """The newest record of ``owner`` in the tails of ``topics`` (see the module docstring)."""
    settings.require("kafka_bootstrap_servers")
    first = max(1, tail if tail is not None else settings.gap_tail_records)
    bound = max(first, settings.gap_tail_max_records)
    client = consumer(settings, "lineage")
    try:
        return _Tails(client, owner, first, bound).read(topics)
    finally:
        client.close()


@dataclass
class _Part:
    """One partition's tail read: the offsets read so far, [start, high)."""

    tp: TopicPartition
    low: int
    high: int
    start: int
    #: a streamed (not re-published) record of ours was seen: no need to read deeper
    settled: bool = False


class _Tails:
    def __init__(self, client: Consumer, owner: Owner, first: int, bound: int) -> None:
        self.client = client
        self.owner = owner
        self.first = first
        self.bound = bound
        self.result = TailRead(last=None)
        self.newest = Newest()

    def read(self, topics: Sequence[str]) -> TailRead:
        parts = self._partitions(topics)
        self.result.topics = tuple(topics)
        depth = self.first
        round_ = [(p, max(p.low, p.high - depth), p.high) for p in parts]
        while round_:
            self._read_round(round_)
            if depth >= self.bound:
                break
            depth = min(depth * TAIL_GROWTH, self.bound)
            round_ = []
            for p in parts:
                if p.settled or p.start <= p.low:
                    continue
                begin = max(p.low, p.high - depth)
                round_.append((p, begin, p.start))
                p.start = begin
        self.result.last = self.newest.last()
        self.result.topics_with_ours = tuple(sorted(self.newest.topics))
        buried = [p for p in parts if not p.settled and p.start > p.low]
        if buried and self.result.last is None:
            p = buried[0]
            raise TailTooDeepError(
                f"no record of slot {self.owner.slot} in the last {self.bound} records of"
                f" {p.tp.topic}[{p.tp.partition}] ({len(buried)} partition(s) like it): its"
                " newest record may lie deeper; raise CDC_GAP_TAIL_MAX_RECORDS (other producers"
                " write to the relay's topics)"
            )
        return self.result

    def _partitions(self, topics: Sequence[str]) -> list[_Part]:
        if not topics:
            return []
        meta = self.client.list_topics(timeout=KAFKA_TIMEOUT_S).topics
        parts = []
        for name in topics:
            if name not in meta:
                continue
            for part in sorted(meta[name].partitions):
                tp = TopicPartition(name, part)
                low, high = self.client.get_watermark_offsets(tp, timeout=KAFKA_TIMEOUT_S)
                if high > low:
                    start = max(low, high - self.first)
                    parts.append(_Part(tp, low, high, start))
        return parts

    def _read_round(self, ranges: list[tuple[_Part, int, int]]) -> None:
        """Read [begin, end) of each partition; a partition's part is done at ``end``."""
        todo = {(p.tp.topic, p.tp.partition): (p, end) for p, begin, end in ranges if end > begin}
        if not todo:
            return
        self.client.assign(
            [TopicPartition(p.tp.topic, p.tp.partition, begin) for p, begin, _ in ranges]
        )
        asked = sum(end - begin for _, begin, end in ranges)
        deadline = time.monotonic() + ROUND_TIMEOUT_S * max(1.0, asked / 10_000)
        try:
            while todo:
                if time.monotonic() > deadline:
                    raise KafkaException(
                        KafkaError(
                            KafkaError._TIMED_OUT, f"tails of {len(todo)} partition(s) not read"
                        )
                    )
                for msg in self.client.consume(500, 0.5):
                    self._take(msg, todo)
        finally:
            self.client.unassign()

    def _take(self, msg: Any, todo: dict[tuple[str, int], tuple[_Part, int]]) -> None:
        key = (msg.topic(), msg.partition())
        entry = todo.get(key)
        err = msg.error()
        if err is not None:
            if err.code() == KafkaError._PARTITION_EOF:
                todo.pop(key, None)
                return
            raise KafkaException(err)
        if entry is None:
            return
        part, end = entry
        if msg.offset() >= end:
            todo.pop(key, None)
            return
        if msg.offset() + 1 >= end:
            todo.pop(key, None)
        self.result.records += 1
        reader = self.result.reader
        record = reader.read(msg)
        if record is None:
            return
        origin = self.owner.judge(record, reader)
        if origin is None:
            return
        recovered = record.header(c.HEADER_RECOVERED) is not None
        if not recovered:
            part.settled = True
        self.newest.add(
            _Seen(
                commit_ts_us=commit_ts_us(record),
                origin=origin,
                topic=record.topic,
                partition=record.partition,
                offset=record.offset,
                event_id=(record.header(c.HEADER_ID) or b"").decode(errors="replace"),
                message=record.header(c.HEADER_FORM) == c.FORM_MESSAGE,
                recovered=recovered,
                commit_lsn=commit_lsn(record),
            )
        )
