"""The relay's memory is Kafka: the lineage header of its records, and the newest one it published.

Guarantees:

* every record the relay publishes carries ``origin`` =
  ``<system_identifier>/<timeline>/<slot>`` (:func:`origin_value`), constant per
  session, so the relay can tell after a restart which cluster, which timeline
  and which slot its last records came from;
* :func:`last_published` is a bounded read: the last ``tail`` records of each
  partition of the outbox topics (``CDC_TOPIC_PREFIX*``), never the whole log.
  Among the records of ``slot`` (by their ``origin``; a record without
  ``origin`` - from a relay before this header - counts as ours) it returns the
  newest by commit time, with the ids of the newest records seen (to check
  whether the table still holds them). ``None`` when no record of ours is in
  any tail: for the relay, a first start.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from cdc import constants as c
from cdc.kafkalog import KafkaClientEvents
from cdc.settings import Settings
from cdc.wal.slots import ServerIdentity

#: Kafka requests of the tail read give up after this.
KAFKA_TIMEOUT_S = 10.0
#: Ids of the newest records kept in :class:`LastRecord` (checked against the table).
NEWEST_IDS = 20


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
        if len(parts) != 3 or not parts[1].isdigit():
            return None
        return cls(system_id=parts[0], timeline=int(parts[1]), slot=parts[2])

    def __str__(self) -> str:
        return f"{self.system_id}/{self.timeline}/{self.slot}"


def origin_value(identity: ServerIdentity, slot: str) -> str:
    """The ``origin`` header of the records a session on ``slot`` publishes."""
    return str(Origin(identity.system_id, identity.timeline, slot))


@dataclass(frozen=True)
class LastRecord:
    """The newest record of ours found in Kafka."""

    commit_ts_us: int
    origin: Origin | None
    topic: str
    partition: int
    offset: int
    #: ids of the newest records of ours seen in the tails (newest first)
    newest_ids: tuple[str, ...]

    @property
    def commit_ts(self) -> datetime:
        return datetime.fromtimestamp(self.commit_ts_us / 1_000_000, UTC)


def _commit_ts_us(headers: dict[str, bytes], timestamp_ms: int) -> int:
    raw = headers.get(c.HEADER_COMMIT_TS)
    if raw:
        try:
            parsed = datetime.fromisoformat(raw.decode().replace("Z", "+00:00"))
            return int(parsed.timestamp() * 1_000_000)
        except ValueError:
            pass
    return timestamp_ms * 1000


@dataclass(frozen=True)
class _Seen:
    commit_ts_us: int
    origin: Origin | None
    topic: str
    partition: int
    offset: int
    event_id: str


def newest_of(seen: list[_Seen]) -> LastRecord | None:
    """The newest of the records seen (commit time, then offset), with the newest ids."""
    if not seen:
        return None
    ordered = sorted(seen, key=lambda s: (s.commit_ts_us, s.offset), reverse=True)
    top = ordered[0]
    return LastRecord(
        commit_ts_us=top.commit_ts_us,
        origin=top.origin,
        topic=top.topic,
        partition=top.partition,
        offset=top.offset,
        newest_ids=tuple(s.event_id for s in ordered[:NEWEST_IDS] if s.event_id),
    )


def last_published(settings: Settings, *, tail: int | None = None) -> LastRecord | None:
    """The newest record of ``settings.slot`` in the tails of the outbox topics."""
    settings.require("kafka_bootstrap_servers")
    depth = max(1, tail if tail is not None else settings.gap_tail_records)
    consumer = Consumer(
        {
            "bootstrap.servers": settings.kafka_bootstrap_servers,
            "client.id": "outbox-cdc-lineage",
            "group.id": f"outbox-cdc-lineage-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            **KafkaClientEvents("lineage").config(),
            **settings.kafka_config,
        }
    )
    try:
        return newest_of(_read_tails(consumer, settings, depth))
    finally:
        consumer.close()


def _read_tails(consumer: Consumer, settings: Settings, depth: int) -> list[_Seen]:
    topics = consumer.list_topics(timeout=KAFKA_TIMEOUT_S).topics
    starts: list[TopicPartition] = []
    for name in sorted(topics):
        if not name.startswith(settings.topic_prefix) or name == settings.dlq_topic:
            continue
        for part in sorted(topics[name].partitions):
            low, high = consumer.get_watermark_offsets(
                TopicPartition(name, part), timeout=KAFKA_TIMEOUT_S
            )
            if high > low:
                starts.append(TopicPartition(name, part, max(low, high - depth)))
    if not starts:
        return []
    return _consume_to_end(consumer, starts, settings.slot)


def _consume_to_end(consumer: Consumer, starts: list[TopicPartition], slot: str) -> list[_Seen]:
    seen: list[_Seen] = []
    pending = {(tp.topic, tp.partition) for tp in starts}
    consumer.assign(starts)
    deadline = time.monotonic() + KAFKA_TIMEOUT_S * 3
    while pending:
        if time.monotonic() > deadline:
            raise KafkaException(
                KafkaError(KafkaError._TIMED_OUT, f"tails of {len(pending)} partition(s) not read")
            )
        for msg in consumer.consume(500, 0.5):
            _take(msg, seen, pending, slot)
    return seen


def _take(msg: Any, seen: list[_Seen], pending: set[tuple[str, int]], slot: str) -> None:
    err = msg.error()
    if err is not None:
        if err.code() == KafkaError._PARTITION_EOF:
            pending.discard((msg.topic(), msg.partition()))
            return
        raise KafkaException(err)
    headers = dict(msg.headers() or [])
    raw_origin = headers.get(c.HEADER_ORIGIN)
    origin = Origin.parse(raw_origin) if raw_origin else None
    if origin is not None and origin.slot != slot:
        return  # another relay (a shard) publishing to the same topics
    seen.append(
        _Seen(
            commit_ts_us=_commit_ts_us(headers, int(msg.timestamp()[1])),
            origin=origin,
            topic=str(msg.topic()),
            partition=int(msg.partition()),
            offset=int(msg.offset()),
            event_id=(headers.get(c.HEADER_ID) or b"").decode(errors="replace"),
        )
    )
