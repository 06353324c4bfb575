"""The audit's Kafka side: the window's records (ids only kept) and the group's committed offsets.

Guarantees:

* :func:`plan` finds every outbox topic (``CDC_TOPIC_PREFIX*``, never the
  exactly-once checkpoint topic, whatever its name) and the dead-letter topic,
  and for each partition the offset of the window's start
  (``offsets_for_times``: the first offset whose timestamp is at or after it;
  every later record of any timestamp - a republished one too - lies after it)
  and the end (the high watermark, read after the table's snapshot, so every
  record of a row the snapshot saw, if published, lies below it);
* :func:`plan` reads the given ``topics`` only, when the caller names them (the
  start-up check: the topics the relay's routes published to), and the
  dead-letter topic always;
* :func:`read` consumes each planned partition from its start to that end with a
  consumer of no group (nothing is committed, no group is joined) whose fetch
  queue is bounded (:data:`QUEUE_KBYTES`) and refilled within
  :data:`FETCH_QUEUE_BACKOFF_MS` of draining; a partition is done at its end event
  or once the consumer's position reaches its planned end (checked per batch).
  Every record's headers are read by :class:`cdc.records.RecordReader` and its
  ``origin`` judged by :class:`cdc.evidence.Owner` (this relay's system, timeline
  lineage and slot; no ``origin`` is never ours) - only its ``id`` and ``origin``
  headers and its timestamp are looked at, and no object is kept of it but its id:
  of a record of this relay it keeps only the 16 bytes of its ``id`` header, in
  the topic's :class:`~cdc.audit.compare.KafkaSide`, and whether it is a phantom
  candidate (its timestamp inside the window); a record of anyone else is only
  counted, by reason. The dead-letter topic's records count by their ``id``
  alone (a dead letter the relay wrote for a refused record carries nothing
  else). A record whose headers or ``id`` cannot be read is counted, never trusted;
* every broker request has a timeout; a read that makes no progress for
  :data:`READ_STALL_S` raises :class:`cdc.errors.KafkaUnavailableError`;
* :func:`expired_unprocessed` compares the group's committed offset of each
  outbox partition with the partition's log start: a commit below it means
  records were removed (retention, ``DeleteRecords``) before the group processed them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from cdc.audit.compare import KafkaSide
from cdc.audit.ids import IdBuckets
from cdc.audit.window import Window
from cdc.errors import KafkaUnavailableError
from cdc.evidence import Owner, dead_letter_rule
from cdc.kafka.log import KafkaClientEvents
from cdc.lineage import READ_BOUNDS
from cdc.records import RecordReader, Skip
from cdc.settings import Settings

#: Every broker request (metadata, offsets, watermarks, committed offsets) gives up after this.
KAFKA_TIMEOUT_S = 10.0
#: The read fails when no record and no end of partition arrived for this long.
READ_STALL_S = 60.0
#: Records asked for per consume() call. Small: each message keeps its header list
#: until its batch is dropped, and what a batch holds when the garbage collector runs
#: is traversed (100 cost ~2,400 fewer instructions per record than 1,000; callgrind).
CONSUME_BATCH = 100
#: Longest one consume() call waits.
CONSUME_WAIT_S = 0.5


@dataclass(frozen=True)
class PartitionPlan:
    """One partition of the read: from ``start`` up to (not including) ``end``."""

    topic: str
    partition: int
    low: int
    end: int
    start: int

    def as_json(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "partition": self.partition,
            "log_start": self.low,
            "start": self.start,
            "end": self.end,
        }


@dataclass
class KafkaRead:
    """What :func:`read` kept of the records."""

    topics: dict[str, KafkaSide] = field(default_factory=dict)
    dead_letters: IdBuckets = field(default_factory=IdBuckets)
    records_read: int = 0
    #: per topic: records whose headers or id could not be read
    without_id: dict[str, int] = field(default_factory=dict)
    #: what the read passed by, by reason (unreadable, no id, not this relay's)
    reader: RecordReader = field(default_factory=RecordReader)


def consumer(settings: Settings, *, group: str | None = None, client: str = "audit") -> Consumer:
    """A consumer for the audit: ``group`` only to read its committed offsets (never joined)."""
    return Consumer(
        {
            "bootstrap.servers": settings.kafka_bootstrap_servers,
            "client.id": f"outbox-cdc-{client}",
            "group.id": group or f"outbox-cdc-audit-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
            **READ_BOUNDS,
            **KafkaClientEvents(client).config(),
            **settings.kafka_config,
        }
    )


def outbox_topics(client: Consumer, settings: Settings) -> dict[str, list[int]]:
    """The outbox topics (prefix; neither the dead-letter nor the checkpoint topic) and
    their partitions."""
    try:
        meta = client.list_topics(timeout=KAFKA_TIMEOUT_S).topics
    except KafkaException as exc:
        raise KafkaUnavailableError(f"cannot list topics: {exc}") from exc
    return {
        name: sorted(meta[name].partitions)
        for name in sorted(meta)
        if settings.is_outbox_topic(name)
    }


def plan(
    client: Consumer,
    settings: Settings,
    window: Window,
    *,
    topics_only: Collection[str] | None = None,
) -> list[PartitionPlan]:
    """Where the read starts and ends in every partition (see the module docstring):
    of every outbox topic, or of ``topics_only`` (those that exist), and the dead letters."""
    topics = outbox_topics(client, settings)
    if topics_only is not None:
        topics = {t: parts for t, parts in topics.items() if t in topics_only}
    try:
        meta = client.list_topics(timeout=KAFKA_TIMEOUT_S).topics
        if settings.dlq_topic in meta:
            topics[settings.dlq_topic] = sorted(meta[settings.dlq_topic].partitions)
        wanted = [
            TopicPartition(t, p, window.since_ms) for t, parts in topics.items() for p in parts
        ]
        starts = client.offsets_for_times(wanted, timeout=KAFKA_TIMEOUT_S) if wanted else []
        plans = []
        for found in starts:
            if found.error is not None:
                raise KafkaException(found.error)
            low, high = client.get_watermark_offsets(
                TopicPartition(found.topic, found.partition), timeout=KAFKA_TIMEOUT_S
            )
            start = high if found.offset < 0 else max(found.offset, low)
            plans.append(PartitionPlan(found.topic, found.partition, low, high, start))
    except KafkaException as exc:
        raise KafkaUnavailableError(f"cannot plan the read of the outbox topics: {exc}") from exc
    return plans


def read(
    client: Consumer,
    settings: Settings,
    plans: list[PartitionPlan],
    window: Window,
    *,
    owner: Owner | None,
    phantoms_from_ms: int,
) -> KafkaRead:
    """The records of ``plans`` (see the module docstring). Records of ``owner`` whose
    timestamp is at or after ``phantoms_from_ms`` (and inside the window) are phantom
    candidates. ``owner`` None (the server's identity unknown): every record with an
    id counts, none is a phantom candidate."""
    out = KafkaRead()
    todo = {(p.topic, p.partition): p.end for p in plans if p.start < p.end}
    for p in plans:
        if p.topic != settings.dlq_topic:
            out.topics.setdefault(p.topic, KafkaSide())
    if not todo:
        return out
    client.assign([TopicPartition(p.topic, p.partition, p.start) for p in plans if p.start < p.end])
    reader = _Reader(out, settings.dlq_topic, owner, max(window.since_ms, phantoms_from_ms), window)
    last_progress = time.monotonic()
    while todo:
        # A batch call waits its whole timeout unless the batch fills: wait for the first
        # record only, then take what is ready.
        messages = client.consume(1, CONSUME_WAIT_S)
        if messages:
            messages += client.consume(CONSUME_BATCH - 1, 0)
            last_progress = time.monotonic()
            reader.take(messages, todo)
            _reached_ends(client, todo)
        elif time.monotonic() - last_progress > READ_STALL_S:
            raise KafkaUnavailableError(
                f"reading the outbox topics made no progress for {READ_STALL_S:g}s"
                f" ({len(todo)} partition(s) not read to their end)"
            )
    client.unassign()
    return out


def _reached_ends(client: Consumer, todo: dict[tuple[str, int], int]) -> None:
    """Done with every partition whose consumed position reached its planned end (once a
    batch, not per record: ``position`` is the offset after the last record handed over)."""
    try:
        positions = client.position([TopicPartition(t, p) for t, p in todo])
    except KafkaException as exc:
        raise KafkaUnavailableError(f"cannot read the consumer's positions: {exc}") from exc
    for tp in positions:
        key = (tp.topic, tp.partition)
        if tp.offset >= todo.get(key, tp.offset + 1):
            del todo[key]


class _Reader:
    """Turns records into ids (the read's hot loop: no object per record but its id).

    Per record it reads the ``id`` and ``origin`` headers through
    :meth:`cdc.records.RecordReader.id_and_origin` (one ``headers()`` call) and judges
    the ``origin`` only when it differs from the record before's (a read meets few
    distinct values, in runs: compared, never hashed); the verdict is
    :meth:`cdc.evidence.Owner.verdict`'s, counted per record."""

    def __init__(
        self, out: KafkaRead, dlq_topic: str, owner: Owner | None, from_ms: int, window: Window
    ) -> None:
        self.out = out
        self.dlq_topic = dlq_topic
        self.owner = owner
        self.until_ms = window.until_ms
        # (the server unknown: every record with an id vouches, none is a candidate)
        self.from_ms = from_ms if owner is not None else window.until_ms

    def take(self, messages: list[Any], todo: dict[tuple[str, int], int]) -> None:
        """Read ``messages``; a partition's end event takes it off ``todo``."""
        out, reader = self.out, self.out.reader
        id_and_origin, dead_letters, without_id = (
            reader.id_and_origin,
            out.dead_letters,
            out.without_id,
        )
        from_ms, until_ms = self.from_ms, self.until_ms
        last_topic: str | None = None
        side: KafkaSide | None = None
        last_origin: object = _NO_ORIGIN_YET
        verdict: Skip | None = None
        errors = 0
        for msg in messages:
            err = msg.error()
            if err is not None:
                errors += 1
                _partition_end(msg, err, todo)
                continue
            topic = msg.topic()
            if topic != last_topic:
                last_topic, side = topic, self._side(topic)
            found = id_and_origin(msg)
            if found is None:
                without_id[topic] = without_id.get(topic, 0) + 1
                continue
            id16, origin = found
            if side is None:
                if dead_letter_rule(id16):  # (cdc.evidence: a dead letter by its id)
                    dead_letters.add(id16)
                continue
            if origin != last_origin:
                last_origin, verdict = origin, self._verdict(origin)
            if verdict is not None:
                reader.skip(verdict)
                side.foreign += 1
                continue
            ts_type, ts_ms = msg.timestamp()
            in_window = from_ms <= (ts_ms if ts_type != _TIMESTAMP_NOT_AVAILABLE else 0) < until_ms
            (side.ours_in_window if in_window else side.ours_elsewhere).add(id16)
        out.records_read += len(messages) - errors

    def _side(self, topic: str) -> KafkaSide | None:
        """The ids of an outbox topic; None for the dead-letter topic."""
        if topic == self.dlq_topic:
            return None
        side = self.out.topics.get(topic)
        if side is None:
            side = self.out.topics[topic] = KafkaSide()
        return side

    def _verdict(self, origin: object) -> Skip | None:
        """None when a record of this ``origin`` header value is this relay's (any is,
        with the server unknown); else why not."""
        if self.owner is None:
            return None
        verdict = self.owner.verdict(origin if type(origin) is bytes else None)
        return verdict if type(verdict) is Skip else None


#: No record read yet (no ``origin`` value, not even None, equals it).
_NO_ORIGIN_YET = object()
#: confluent-kafka's TIMESTAMP_NOT_AVAILABLE timestamp type (a record without one counts
#: as time 0).
_TIMESTAMP_NOT_AVAILABLE = 0


def _partition_end(msg: Any, err: KafkaError, todo: dict[tuple[str, int], int]) -> None:
    """A partition's end (done with it), or a broker error (raised)."""
    if err.code() == KafkaError._PARTITION_EOF:
        todo.pop((msg.topic(), msg.partition()), None)
        return
    raise KafkaUnavailableError(f"reading {msg.topic()}[{msg.partition()}]: {err}")


@dataclass(frozen=True)
class Expired:
    """Records of a partition removed before the group processed them."""

    topic: str
    partition: int
    committed_offset: int
    log_start_offset: int

    @property
    def count(self) -> int:
        return self.log_start_offset - self.committed_offset

    def as_json(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "partition": self.partition,
            "committed_offset": self.committed_offset,
            "log_start_offset": self.log_start_offset,
            "count": self.count,
        }


@dataclass(frozen=True)
class GroupCheck:
    """The group's committed offsets against the log starts."""

    group: str
    expired: list[Expired]
    #: partitions where the group has committed an offset
    committed_partitions: int
    #: (topic, partition, log start) of partitions with records removed and no commit of
    #: the group: it may never have read them, or started after them (cannot be told)
    uncommitted: list[tuple[str, int, int]] = field(default_factory=list)
    note: str = ""


def expired_unprocessed(settings: Settings, group: str, plans: list[PartitionPlan]) -> GroupCheck:
    """Per outbox partition: a committed offset below the log start (see the module docstring)."""
    outbox = [p for p in plans if p.topic != settings.dlq_topic]
    if not outbox:
        return GroupCheck(group, [], 0, note="no outbox topic")
    client = consumer(settings, group=group, client="audit-group")
    try:
        committed = client.committed(
            [TopicPartition(p.topic, p.partition) for p in outbox], timeout=KAFKA_TIMEOUT_S
        )
        lows = {}
        for p in outbox:
            low, _high = client.get_watermark_offsets(
                TopicPartition(p.topic, p.partition), timeout=KAFKA_TIMEOUT_S
            )
            lows[(p.topic, p.partition)] = low
    except KafkaException as exc:
        raise KafkaUnavailableError(f"cannot read group {group}'s offsets: {exc}") from exc
    finally:
        client.close()
    expired, uncommitted = [], []
    for tp in committed:
        low = lows[(tp.topic, tp.partition)]
        if tp.offset < 0:
            if low > 0:
                uncommitted.append((tp.topic, tp.partition, low))
        elif tp.offset < low:
            expired.append(Expired(tp.topic, tp.partition, tp.offset, low))
    count = sum(1 for tp in committed if tp.offset >= 0)
    if not count:
        return GroupCheck(
            group, [], 0, [], f"group {group} has committed no offset of the outbox topics"
        )
    note = ""
    if uncommitted:
        where = ", ".join(f"{t}[{p}] (log start {low})" for t, p, low in uncommitted)
        note = (
            f"group {group} has no commit on {where}: records removed there before it may"
            " never have been processed by it (the audit cannot tell)"
        )
    return GroupCheck(group, expired, count, uncommitted, note)
