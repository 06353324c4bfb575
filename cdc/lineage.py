"""The relay's memory is Kafka: its own records, told apart from all others by their ``origin``.

Guarantees:

* every record the relay publishes carries ``origin`` =
  ``<system_identifier>/<timeline>/<slot>`` (:func:`origin_value`), constant per
  session; records made from a logical message also carry ``form: message``
  (:data:`cdc.constants.HEADER_FORM`), rows of the table carry no ``form``;
* a record is the relay's own (:meth:`Owner.owns`) only when its ``origin``
  names this server's system identifier, a timeline of its lineage (the current
  one or an ancestor: a promoted standby's records before the promotion are on
  the parent timeline) and this slot. A record without ``origin`` (another
  producer, a relay from before the header), with one that does not parse, or
  of another system, timeline branch or slot never counts. :meth:`Owner.judge`
  is the one judgement of the project: the tail read here, the audit and the
  relay's start-up check (:mod:`cdc.audit`) all ask it;
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
  took back (published from WAL past the point where its timeline ended).
"""

from __future__ import annotations

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
from cdc.kafkalog import KafkaClientEvents
from cdc.records import Record, RecordReader, Skip
from cdc.settings import Settings
from cdc.wal.replproto import str_to_lsn
from cdc.wal.slots import ServerIdentity

log = logging.getLogger("cdc.lineage")

#: Kafka requests of the tail read give up after this.
KAFKA_TIMEOUT_S = 10.0
#: Ids of the newest row records kept in :class:`LastRecord` (checked against the table).
NEWEST_IDS = 20
#: A partition's tail read grows this many times per round while it holds none of ours.
TAIL_GROWTH = 8
#: Longest wait for one round of tail reads, per 10,000 records asked for (at least this).
ROUND_TIMEOUT_S = 30.0
#: Distinct ``origin`` values whose verdict an :class:`Owner` remembers (there are few:
#: one per relay session's system, timeline and slot), and the longest remembered.
MAX_ORIGINS = 1_024
MAX_ORIGIN_BYTES = 256


class TailTooDeepError(CdcError):
    """The relay's newest record may lie deeper than ``CDC_GAP_TAIL_MAX_RECORDS``."""

    retriable = True


@dataclass(frozen=True)
class Origin:
    """The parsed ``origin`` header."""

    system_id: str
    timeline: int
    slot: str

    @classmethod
    def parse(cls, value: bytes | str) -> Origin | None:
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        parts = text.split("/", 2)
        if len(parts) != 3 or not parts[0] or not parts[1].isdigit() or not parts[2]:
            return None
        return cls(system_id=parts[0], timeline=int(parts[1]), slot=parts[2])

    def __str__(self) -> str:
        return f"{self.system_id}/{self.timeline}/{self.slot}"


def origin_value(identity: ServerIdentity, slot: str) -> str:
    """The ``origin`` header of the records a session on ``slot`` publishes."""
    return str(Origin(identity.system_id, identity.timeline, slot))


@dataclass(frozen=True)
class Owner:
    """Whose records count as the relay's own: its system, timeline lineage and slot.

    The one judgement of "is this record ours" (the tail read, the audit, the
    start-up check). Verdicts are remembered per ``origin`` value (a read meets few
    distinct ones): at most :data:`MAX_ORIGINS` values of at most
    :data:`MAX_ORIGIN_BYTES` bytes each."""

    system_id: str
    timelines: frozenset[int]
    slot: str
    _verdicts: dict[bytes, Origin | Skip] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    @classmethod
    def of(cls, server: ServerIdentity, slot: str) -> Owner:
        return cls(server.system_id, server.lineage, slot)

    def owns(self, origin: Origin) -> bool:
        return (
            origin.slot == self.slot
            and origin.system_id == self.system_id
            and origin.timeline in self.timelines
        )

    def verdict(self, raw: bytes | None) -> Origin | Skip:
        """The origin of a record whose ``origin`` header is ``raw`` when it is ours,
        else why not (:attr:`Skip.NO_ORIGIN`, :attr:`Skip.BAD_ORIGIN`,
        :attr:`Skip.FOREIGN_ORIGIN`)."""
        if not raw:
            return Skip.NO_ORIGIN
        known = self._verdicts.get(raw)
        if known is None:
            origin = Origin.parse(raw)
            if origin is None:
                known = Skip.BAD_ORIGIN
            else:
                known = origin if self.owns(origin) else Skip.FOREIGN_ORIGIN
            if len(self._verdicts) < MAX_ORIGINS and len(raw) <= MAX_ORIGIN_BYTES:
                self._verdicts[raw] = known
        return known

    def judge(self, record: Record, reader: RecordReader) -> Origin | None:
        """The record's origin when it is ours; else None, the reason counted in ``reader``."""
        raw = record.header(c.HEADER_ORIGIN)
        verdict = (raw and self._verdicts.get(raw)) or self.verdict(raw)  # (the memo first)
        if isinstance(verdict, Skip):
            reader.skip(verdict)
            return None
        return verdict


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


def newest_of(seen: Iterable[_Seen]) -> LastRecord | None:
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
        saw_messages=any(s.message for s in ordered),
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
        checkpoints = settings.checkpoint_topic_name  # (holds no event, whatever its name)
        return [t for t in recorded if t in existing and t != checkpoints], True
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
        self.seen: list[_Seen] = []

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
        self.result.last = newest_of(self.seen)
        self.result.topics_with_ours = tuple(sorted({s.topic for s in self.seen}))
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
        self.seen.append(
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
