"""Which outbox rows of a time window are not in Kafka: the table against the topics, by id.

The outbox table is the truth. :func:`missing_rows` answers one question for a
window of commit time: which rows of the table (the publication's share of it)
committed in the window have no record in the given topics? Guarantees:

* the table side: every row whose commit time - ``pg_xact_commit_timestamp``
  when ``track_commit_timestamp`` is on, else ``created_at`` (the transaction's
  start, never after its commit) - lies in ``[start, end)``; the caller leaves
  the margin (rows committed just before ``end`` may not have been published yet);
* the Kafka side: every record of every partition of ``topics`` from the first
  offset whose timestamp is at or after ``start`` (``offsets_for_times``: a
  record's timestamp is its transaction's commit time, never before its row's
  ``created_at``) to the partition's end when the read began. Records are read by
  :class:`cdc.records.RecordReader` (a record it cannot read is skipped and
  counted); with an ``owner`` only that relay's records count
  (:meth:`cdc.lineage.Owner.owns`: another producer's record cannot vouch for
  a row), except on ``trusted_topics`` (the relay's dead-letter topic, whose
  records carry only an ``id``);
* memory is bounded: Kafka's ids are held as 16-byte uuids in an :class:`IdSet`
  (open addressing in one ``bytearray``, at most 32 bytes an id), the table's
  ids are streamed and only the missing ones kept; a window of more than
  ``max_rows`` table rows is not read at all (:attr:`Verification.skipped`).

Nothing is written: :func:`cdc.relay.recovery.republish` publishes what is missing.
The relay runs it at every start over the window since its last record in Kafka
(:mod:`cdc.relay.guard`); ``outbox-cdc audit`` can stand on the same ground.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from psycopg import sql

from cdc.lineage import KAFKA_TIMEOUT_S, Owner, consumer
from cdc.records import RecordReader, Skip
from cdc.settings import Settings
from cdc.wal.stream import publication_row_filter, resolve_table

Conn = psycopg.Connection[Any]

#: Longest a read of the topics may take, per 100,000 records (at least this).
READ_TIMEOUT_S = 60.0
#: Rows per chunk of the table's streamed ids.
FETCH_ROWS = 10_000


class IdSet:
    """A set of 16-byte ids in one ``bytearray`` (open addressing, linear probing).

    Load stays at most 1/2, so an id costs at most 32 bytes however many there are;
    the table grows by doubling. Ids are hashed with Python's (salted) ``hash``, so
    ids chosen to collide cannot slow it down. The all-zero id is kept aside (zero
    marks an empty slot)."""

    __slots__ = ("_count", "_mask", "_slots", "_zero")

    WIDTH = 16
    _EMPTY = bytes(WIDTH)

    def __init__(self, capacity: int = 1024) -> None:
        size = 16
        while size < capacity * 2:
            size *= 2
        self._slots = bytearray(size * self.WIDTH)
        self._mask = size - 1
        self._count = 0
        self._zero = False

    def __len__(self) -> int:
        return self._count + self._zero

    @property
    def nbytes(self) -> int:
        return len(self._slots)

    def add(self, key: bytes) -> None:
        if len(key) != self.WIDTH:
            raise ValueError(f"an id is {self.WIDTH} bytes, not {len(key)}")
        if key == self._EMPTY:
            self._zero = True
            return
        if self._insert(self._slots, self._mask, key):
            self._count += 1
            if self._count * 2 > self._mask + 1:
                self._grow()

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, bytes | bytearray) or len(key) != self.WIDTH:
            return False
        if key == self._EMPTY:
            return self._zero
        slots, mask, w = self._slots, self._mask, self.WIDTH
        i = hash(bytes(key)) & mask
        while True:
            at = i * w
            held = slots[at : at + w]
            if held == key:
                return True
            if held == self._EMPTY:
                return False
            i = (i + 1) & mask

    @classmethod
    def _insert(cls, slots: bytearray, mask: int, key: bytes) -> bool:
        w = cls.WIDTH
        i = hash(key) & mask
        while True:
            at = i * w
            held = slots[at : at + w]
            if held == key:
                return False
            if held == cls._EMPTY:
                slots[at : at + w] = key
                return True
            i = (i + 1) & mask

    def _grow(self) -> None:
        old, w = self._slots, self.WIDTH
        size = (self._mask + 1) * 2
        self._slots = bytearray(size * w)
        self._mask = size - 1
        for at in range(0, len(old), w):
            held = bytes(old[at : at + w])
            if held != self._EMPTY:
                self._insert(self._slots, self._mask, held)


@dataclass(frozen=True)
class Window:
    """Rows committed at or after ``start`` and before ``end``."""

    start: datetime
    end: datetime


@dataclass
class Verification:
    """What :func:`missing_rows` found."""

    window: Window
    #: rows of the table in the window
    table_rows: int = 0
    #: distinct ids counted in Kafka
    kafka_ids: int = 0
    #: records read in Kafka (counted or not)
    records: int = 0
    #: rows of the window with no record in Kafka
    missing: list[uuid.UUID] = field(default_factory=list)
    #: records passed by, by reason (``reason=count, ...``)
    passed_by: str = ""
    #: why nothing was checked (the window is too large); "" when it was
    skipped: str = ""


def missing_rows(
    settings: Settings,
    window: Window,
    *,
    topics: Sequence[str],
    owner: Owner | None,
    trusted_topics: Iterable[str] = (),
    max_rows: int,
) -> Verification:
    """The rows of ``window`` that no record of ``topics`` carries (module docstring)."""
    result = Verification(window)
    with psycopg.connect(settings.pg_dsn.get_secret_value(), autocommit=True) as conn:
        source = _table_query(conn, settings, window)
        count = conn.execute(
            sql.SQL("SELECT count(*) FROM ({}) AS w").format(source), (window.start, window.end)
        ).fetchone()
        result.table_rows = int(count[0]) if count else 0
        if result.table_rows > max_rows:
            result.skipped = (
                f"{result.table_rows} rows in the window, more than {max_rows}"
                " (CDC_START_VERIFY_MAX_ROWS): not checked (`outbox-cdc audit` covers it)"
            )
            return result
        if result.table_rows == 0:
            return result
        ids = IdSet(result.table_rows)
        reader = RecordReader()
        result.records = _read_ids(
            settings, window, topics, owner, set(trusted_topics), ids, reader
        )
        result.kafka_ids = len(ids)
        result.passed_by = reader.summary()
        with conn.cursor() as cur:
            for (raw,) in cur.stream(source, (window.start, window.end), size=FETCH_ROWS):
                if bytes(raw) not in ids:
                    result.missing.append(uuid.UUID(bytes=bytes(raw)))
    return result


def _table_query(conn: Conn, settings: Settings, window: Window) -> sql.Composed:
    """The ids (16 bytes each) of the window's rows, of the publication's share."""
    row = conn.execute("SHOW track_commit_timestamp").fetchone()
    when = (
        sql.SQL("COALESCE(pg_xact_commit_timestamp(xmin), created_at)")
        if row is not None and str(row[0]).lower() == "on"
        else sql.SQL("created_at")
    )
    schema, name = resolve_table(conn, settings.outbox_table)
    where: list[sql.Composable] = [sql.SQL("{} >= %s AND {} < %s").format(when, when)]
    row_filter = publication_row_filter(conn, settings.publication, schema, name)
    if row_filter is not None:
        where.append(sql.SQL("(" + row_filter + ")"))
    return sql.SQL("SELECT uuid_send(id) FROM {} WHERE {}").format(
        sql.Identifier(schema, name), sql.SQL(" AND ").join(where)
    )


def _read_ids(
    settings: Settings,
    window: Window,
    topics: Sequence[str],
    owner: Owner | None,
    trusted: set[str],
    ids: IdSet,
    reader: RecordReader,
) -> int:
    """Add the ids of the records of ``topics`` from ``window.start`` on; records read."""
    client = consumer(settings, "verify")
    try:
        starts = _starts(client, window, topics)
        if not starts:
            return 0
        return _consume(client, starts, owner, trusted, ids, reader)
    finally:
        client.close()


def _starts(client: Consumer, window: Window, topics: Sequence[str]) -> dict[TopicPartition, int]:
    """Each partition's first offset at or after the window's start -> its end now."""
    meta = client.list_topics(timeout=KAFKA_TIMEOUT_S).topics
    since_ms = int(window.start.timestamp() * 1000)
    asked = [
        TopicPartition(t, p, since_ms)
        for t in topics
        if t in meta
        for p in sorted(meta[t].partitions)
    ]
    if not asked:
        return {}
    found = client.offsets_for_times(asked, timeout=KAFKA_TIMEOUT_S)
    out: dict[TopicPartition, int] = {}
    for tp in found:
        if tp.error is not None:
            raise KafkaException(tp.error)
        low, high = client.get_watermark_offsets(
            TopicPartition(tp.topic, tp.partition), timeout=KAFKA_TIMEOUT_S
        )
        first = tp.offset if tp.offset >= 0 else high  # (-1: no record at or after the time)
        if high > max(first, low):
            out[TopicPartition(tp.topic, tp.partition, max(first, low))] = high
    return out


def _consume(
    client: Consumer,
    starts: dict[TopicPartition, int],
    owner: Owner | None,
    trusted: set[str],
    ids: IdSet,
    reader: RecordReader,
) -> int:
    ends = {(tp.topic, tp.partition): high for tp, high in starts.items()}
    todo = set(ends)
    total = sum(high - tp.offset for tp, high in starts.items())
    deadline = time.monotonic() + READ_TIMEOUT_S * max(1.0, total / 100_000)
    client.assign(list(starts))
    records = 0
    while todo:
        if time.monotonic() > deadline:
            raise KafkaException(
                KafkaError(KafkaError._TIMED_OUT, f"{len(todo)} partition(s) not read to their end")
            )
        for msg in client.consume(1000, 0.5):
            key = (msg.topic(), msg.partition())
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    todo.discard(key)
                    continue
                raise KafkaException(err)
            if key not in todo:
                continue
            offset = int(msg.offset() or 0)
            if offset + 1 >= ends[key]:
                todo.discard(key)
            if offset >= ends[key]:
                continue
            records += 1
            _take(msg, owner, trusted, ids, reader)
    return records


def _take(
    msg: Any, owner: Owner | None, trusted: set[str], ids: IdSet, reader: RecordReader
) -> None:
    record = reader.read(msg)
    if record is None:
        return
    if owner is not None and record.topic not in trusted and owner.judge(record, reader) is None:
        return
    event_id = record.event_id_bytes()
    if event_id is None:
        reader.skip(Skip.BAD_ID)
        return
    ids.add(event_id)
