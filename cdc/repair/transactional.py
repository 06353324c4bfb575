"""Exactly-once mode outside the stream: gap recovery, the start-up check and the audit's repair.

Guarantees (``CDC_DELIVERY=exactly-once`` only; at-least-once publishing is unchanged):

* :func:`present_ids` reads, with ``isolation.level=read_committed``, the
  records of the relay's outbox topics (never the checkpoint topic) and its
  dead-letter topic from the first offset whose timestamp is at or after
  ``since_ms`` to the end of each partition (a row's records carry its commit
  time: every record of a row committed since then lies there, republished ones
  included); bounded by :data:`READ_STALL_S` without progress. Every record is
  read by :class:`cdc.records.RecordReader` (a record whose headers cannot be
  read is passed by, never fatal) and only evidence the relay owns counts
  (what is present is *skipped*: a record wrongly counted is a row lost): the
  ``id`` of a record of an outbox topic only when :class:`cdc.evidence.Owner`
  judges it the relay's own (this system, timeline lineage and slot); a dead
  letter by its ``id`` alone (as the audit counts it). Everything passed by is
  counted by reason and logged once per read. Ids are kept as their 16 bytes
  (:class:`PresentIds`: no Python object per id);
* a publisher (:class:`cdc.repair.publisher.Publisher`) given a
  :class:`Transactions` skips every row whose id is present, and publishes the rest
  inside Kafka transactions of its own ``transactional.id`` (the relay's plus
  ``.recovery`` or ``.repair``: a second run of the same kind fences the first;
  the streaming relay's id is never taken), each committed once Kafka
  acknowledged its records (:meth:`Transactions.commit`): a read_committed
  consumer sees a republished row once, or - after a failure - not at all, and
  the next run publishes it;
* **every transaction is bounded** (:meth:`Transactions.full`): at most
  ``CDC_REPUBLISH_TX_MAX_RECORDS`` records, and open at most :data:`TX_TIMEOUT_SHARE` of
  ``CDC_TX_TIMEOUT_MS`` (then the publisher commits it and opens the next): a
  window of any size never makes one transaction that could outlive the
  transaction timeout, and never holds a partition's last stable offset -
  read_committed consumers' view of the streamed records - for longer than one
  bounded transaction.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from cdc.errors import KafkaUnavailableError
from cdc.evidence import Owner, dead_letter_rule
from cdc.kafka.log import KafkaClientEvents
from cdc.kafka.producer import producer_config
from cdc.records import ID_BYTES, RecordReader, Skip, uuid_bytes
from cdc.settings import Settings

log = logging.getLogger("cdc.relay")

#: Kafka requests (metadata, offsets) of the read give up after this.
KAFKA_TIMEOUT_S = 15.0
#: A read of the present ids that makes no progress this long fails.
READ_STALL_S = 60.0
#: init_transactions / commit_transaction / abort_transaction wait at most this long.
TX_CALL_TIMEOUT_S = 30.0
#: :class:`PresentIds` spreads ids over this many sorted blobs (a lookup bisects one).
ID_BUCKETS = 256
#: A republishing transaction is committed once it has been open this share of
#: CDC_TX_TIMEOUT_MS (or holds CDC_REPUBLISH_TX_MAX_RECORDS records): its commit - the
#: acknowledgements of its records, then EndTxn - fits in the rest.
TX_TIMEOUT_SHARE = 0.25
#: :class:`PresentIds`' bitmap: at least this many bits per id (an absent id finds its
#: bit set - and needs the binary search - about once in this many lookups) ...
MAP_BITS_PER_ID = 8
#: ... within these bounds (16 MiB at most: past 16,000,000 ids the share grows).
MAP_MIN_BITS = 1 << 16
MAP_MAX_BITS = 1 << 27


class PresentIds:
    """A set of 16-byte ids in :data:`ID_BUCKETS` sorted blobs: 16 bytes per id, no
    Python object per id (a window can hold millions). Add, then :meth:`freeze`, then
    look up (``in``). A lookup asks a bitmap of the ids' last four bytes first (random
    in uuids of versions 4 and 7; at least :data:`MAP_BITS_PER_ID` bits per id, at most
    :data:`MAP_MAX_BITS`): an id that is not there - a republishing run's usual case - is
    answered without the binary search of its blob; an empty set answers at once. The
    bitmap only ever says "not there" for certain: "maybe" goes to the search."""

    __slots__ = ("_map", "_mask", "_parts", "_sorted", "count")

    def __init__(self) -> None:
        self._parts = [bytearray() for _ in range(ID_BUCKETS)]
        self._sorted: list[bytes] | None = None
        self._map = b""
        self._mask = 0
        #: ids added (duplicates included)
        self.count = 0

    @classmethod
    def of(cls, ids: Iterable[bytes]) -> PresentIds:
        """The ids given (16 bytes each), frozen."""
        present = cls()
        for id16 in ids:
            present.add(id16)
        return present.freeze()

    def add(self, id16: bytes) -> None:
        """Add one id of :data:`~cdc.records.ID_BYTES` bytes (before :meth:`freeze`)."""
        if self._sorted is not None:
            raise RuntimeError("PresentIds is frozen")
        self._parts[id16[2] ^ id16[3] ^ id16[15]] += id16  # (cdc.audit.ids.bucket_of)
        self.count += 1

    def freeze(self) -> PresentIds:
        """Sort each blob (one bucket's ids as objects at a time) and draw the bitmap;
        no more adds."""
        if self._sorted is None:
            bits = MAP_MIN_BITS
            while bits < self.count * MAP_BITS_PER_ID and bits < MAP_MAX_BITS:
                bits *= 2
            bitmap = bytearray(bits // 8)
            mask = bits - 1
            out = []
            for part in self._parts:
                blob = bytes(part)
                ids = sorted({blob[i : i + ID_BYTES] for i in range(0, len(blob), ID_BYTES)})
                for id16 in ids:
                    at = int.from_bytes(id16[12:16]) & mask
                    bitmap[at >> 3] |= 1 << (at & 7)
                out.append(b"".join(ids))
            self._sorted, self._parts = out, []
            self._map, self._mask = bytes(bitmap) if self.count else b"", mask
        return self

    def __contains__(self, id16: object) -> bool:
        if not isinstance(id16, bytes) or len(id16) != ID_BYTES:
            return False
        if self._sorted is None:
            self.freeze()
        if not self._map:  # (empty)
            return False
        at = int.from_bytes(id16[12:16]) & self._mask
        if not self._map[at >> 3] >> (at & 7) & 1:
            return False
        blob = self._sorted[id16[2] ^ id16[3] ^ id16[15]]  # type: ignore[index]
        lo, hi = 0, len(blob) // ID_BYTES
        while lo < hi:
            mid = (lo + hi) // 2
            at16 = blob[mid * ID_BYTES : (mid + 1) * ID_BYTES]
            if at16 == id16:
                return True
            if at16 < id16:
                lo = mid + 1
            else:
                hi = mid
        return False

    def __len__(self) -> int:
        """Distinct ids (after :meth:`freeze`)."""
        return sum(len(b) for b in self.freeze()._sorted or ()) // ID_BYTES


def exactly_once(settings: Settings) -> bool:
    return settings.delivery == "exactly-once"


def transactional_id(settings: Settings, system_id: str, purpose: str) -> str:
    """The id of the relay's publishing of ``purpose`` (recovery, repair)."""
    base = settings.transactional_id or f"outbox-cdc.{system_id}.{settings.slot}"
    return f"{base}.{purpose}"


class Transactions:
    """A transactional producer publishing outside the stream, and the ids to skip."""

    def __init__(self, settings: Settings, *, system_id: str, purpose: str) -> None:
        config: dict[str, Any] = dict(
            producer_config(settings.kafka_bootstrap_servers, settings.kafka_config)
        )
        config.update(KafkaClientEvents(f"{purpose}-producer").config())
        config["delivery.report.only.error"] = True
        config["transactional.id"] = transactional_id(settings, system_id, purpose)
        config["transaction.timeout.ms"] = settings.tx_timeout_ms
        config["message.timeout.ms"] = settings.tx_timeout_ms
        self._config = config
        self.producer = Producer(config)
        self.present = PresentIds()
        self.skipped = 0
        #: the bounds of one transaction: records, and seconds open
        self.max_records = settings.republish_tx_max_records
        self.max_open_s = settings.tx_timeout_ms * TX_TIMEOUT_SHARE / 1000
        #: transactions committed
        self.committed = 0
        self._open = False
        self._opened_at = 0.0
        _call("init_transactions", lambda: self.producer.init_transactions(TX_CALL_TIMEOUT_S))

    def skip(self, event_id: str) -> bool:
        """Whether ``event_id`` is in Kafka already (counted)."""
        present = self.present
        if present.count and uuid_bytes(event_id.encode()) in present:
            self.skipped += 1
            return True
        return False

    def begin(self) -> None:
        """Open a transaction unless one is open."""
        if not self._open:
            _call("begin_transaction", self.producer.begin_transaction)
            self._open = True
            self._opened_at = time.monotonic()

    def full(self, records: int) -> bool:
        """Whether the open transaction, holding ``records``, is at a bound: commit it."""
        return self._open and (
            records >= self.max_records or time.monotonic() - self._opened_at >= self.max_open_s
        )

    def commit(self) -> None:
        """Commit the open transaction (its records are all acknowledged)."""
        if self._open:
            _call("commit_transaction", lambda: self.producer.commit_transaction(TX_CALL_TIMEOUT_S))
            self._open = False
            self.committed += 1

    def renew(self) -> Producer:
        """After a failed transaction: abort it (a failure only logged), then a new
        producer of the same ``transactional.id`` in place of this one - its
        ``init_transactions`` fences the old one and aborts whatever it left open. A
        producer whose transaction failed on a record Kafka refused answered the next
        transaction with ``OUT_OF_ORDER_SEQUENCE_NUMBER`` (its sequence numbers skipped:
        "requires epoch bump") and refused every record after it (``_STATE``)."""
        self.abort()
        old = self.producer
        old.purge()
        old.flush(0)  # (the purged records' reports: ignored by the run)
        self.producer = Producer(self._config)
        _call("init_transactions", lambda: self.producer.init_transactions(TX_CALL_TIMEOUT_S))
        return self.producer

    def abort(self, *, strict: bool = False) -> None:
        """Abort an open transaction (after a failure); its failure is logged only, or
        (``strict``: the transaction is to be redone) raised."""
        if self._open:
            self._open = False
            try:
                self.producer.abort_transaction(TX_CALL_TIMEOUT_S)
            except KafkaException as exc:
                if strict:
                    raise KafkaUnavailableError(f"abort_transaction failed: {exc}") from exc
                log.warning("abort of a republishing transaction failed: %s", exc)


def _call(what: str, call: Callable[[], None]) -> None:
    """A transactional call; its failure as KafkaUnavailableError (the run fails: the
    broker, or the next run's init_transactions, aborts what it left open)."""
    try:
        call()
    except KafkaException as exc:
        raise KafkaUnavailableError(f"{what} failed: {exc}") from exc


def _consumer(settings: Settings) -> Consumer:
    return Consumer(
        {
            "bootstrap.servers": settings.kafka_bootstrap_servers,
            "client.id": "outbox-cdc-present-ids",
            "group.id": f"outbox-cdc-present-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            **KafkaClientEvents("present-ids").config(),
            **settings.kafka_config,
            "isolation.level": "read_committed",
        }
    )


def present_ids(
    settings: Settings, since_ms: int, owner: Owner, topics: Iterable[str] | None = None
) -> PresentIds:
    """The ids read_committed consumers see in the relay's topics from ``since_ms`` on,
    in records of ``owner`` (and dead letters): see the module docstring."""
    client = _consumer(settings)
    try:
        meta = client.list_topics(timeout=KAFKA_TIMEOUT_S).topics
        names = (
            [t for t in topics if t in meta and not settings.is_checkpoint_topic(t)]
            if topics is not None
            else [t for t in meta if settings.is_outbox_topic(t)]
        )
        if settings.dlq_topic in meta and settings.dlq_topic not in names:
            names.append(settings.dlq_topic)
        wanted = [TopicPartition(t, p, since_ms) for t in names for p in meta[t].partitions]
        starts = client.offsets_for_times(wanted, timeout=KAFKA_TIMEOUT_S) if wanted else []
        todo: dict[tuple[str, int], int] = {}
        assign = []
        for found in starts:
            _, high = client.get_watermark_offsets(
                TopicPartition(found.topic, found.partition), timeout=KAFKA_TIMEOUT_S
            )
            if 0 <= found.offset < high:
                todo[(found.topic, found.partition)] = high
                assign.append(TopicPartition(found.topic, found.partition, found.offset))
        ids = _Ids(owner, settings.dlq_topic)
        _read(client, assign, todo, ids)
    except KafkaException as exc:
        raise KafkaUnavailableError(f"reading the ids present in Kafka: {exc}") from exc
    finally:
        client.close()
    if ids.reader.skipped:
        log.info(
            "reading the ids present in Kafka: %d records passed by (not this relay's, or"
            " unreadable; their ids do not count as published): %s",
            sum(ids.reader.skipped.values()),
            ids.reader.summary(),
        )
    return ids.present.freeze()


class _Ids:
    """What a read keeps: the ids of the relay's own records and of dead letters."""

    def __init__(self, owner: Owner, dlq_topic: str) -> None:
        self.owner = owner
        self.dlq_topic = dlq_topic
        self.reader = RecordReader()
        self.present = PresentIds()

    def take(self, msg: Any) -> None:
        """One consumed record (not an error event): its id kept when it counts."""
        reader = self.reader
        record = reader.read(msg)  # (the only read of its headers)
        if record is None:
            return
        id16 = record.event_id_bytes()
        if id16 is None:
            reader.skip(Skip.BAD_ID)
            return
        if record.topic == self.dlq_topic:
            if dead_letter_rule(id16):  # (cdc.evidence: a dead letter by its id)
                self.present.add(id16)
            return
        if self.owner.judge(record, reader) is not None:  # (the recovery rule's owner)
            self.present.add(id16)


def _read(
    client: Consumer, assign: list[TopicPartition], todo: dict[tuple[str, int], int], ids: _Ids
) -> None:
    if not todo:
        return
    client.assign(assign)
    last_progress = time.monotonic()
    while todo:
        messages = client.consume(5000, 0.5)
        if messages:
            last_progress = time.monotonic()
        elif time.monotonic() - last_progress > READ_STALL_S:
            raise KafkaUnavailableError(
                f"reading the ids present in Kafka made no progress for {READ_STALL_S:g}s"
            )
        for msg in messages:
            _take(msg, ids, todo)


def _take(msg: Any, ids: _Ids, todo: dict[tuple[str, int], int]) -> None:
    """One consumed message: its id kept (when it counts); its partition done at the
    end or EOF."""
    err = msg.error()
    where = (msg.topic(), msg.partition())
    if err is not None:
        if err.code() == KafkaError._PARTITION_EOF:
            todo.pop(where, None)
        else:
            ids.reader.skip(Skip.BROKER_ERROR)
        return
    ids.take(msg)
    if msg.offset() + 1 >= todo.get(where, 0):
        todo.pop(where, None)
