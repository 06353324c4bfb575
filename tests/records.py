"""Any Kafka record, written raw: bytes no client library would let a producer write.

confluent-kafka's ``Producer`` (and Kafka's Java producer) take header *names* as
text and encode them as UTF-8, so neither can write a record whose header name
is not valid UTF-8 - yet the Kafka protocol carries names as bytes and the
broker stores whatever it is sent. Other teams' producers (another language's
client, a proxy, a bug) can and do. This module writes such records itself:

* :func:`encode_batch` - a Kafka record batch (magic 2, uncompressed, no
  producer id) of :class:`RawRecord` s, CRC32C included;
* :class:`RawProducer` - a Produce request (API 0, v3) per partition to that
  partition's leader, found through confluent-kafka's metadata; raises on any
  error code, so a test knows every record it meant to write was written;
* :func:`kafka_records` - a hypothesis strategy for "any Kafka record": random
  keys, values, tombstones, header names and values of any bytes (invalid
  UTF-8, empty, NUL, duplicates, huge sets). Later tests reuse it;
  :func:`sample` draws a list of them outside ``@given``, and
  :func:`random_record` makes the same shapes from a seeded ``random.Random``
  when thousands are needed fast.

Only for tests: no retries, no batching across calls, one connection per call.
"""

from __future__ import annotations

import random
import socket
import struct
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from confluent_kafka.admin import AdminClient
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

#: Kafka's Produce API key and the (non-flexible) version written here.
_PRODUCE_API_KEY = 0
_PRODUCE_VERSION = 3
#: Record batch magic byte of the v2 format (headers exist since v2).
_MAGIC_V2 = 2
#: Bytes of the batch header after the batch length, before the records
#: (partitionLeaderEpoch 4, magic 1, crc 4, attributes 2, lastOffsetDelta 4,
#: baseTimestamp 8, maxTimestamp 8, producerId 8, producerEpoch 2,
#: baseSequence 4, recordCount 4).
_BATCH_HEADER = struct.Struct(">ibIhiqqqhii")
#: The CRC32C covers everything after the crc field.
_CRC_START = (
    4 + 1 + 4
)  # after partitionLeaderEpoch, magic, crc (offsets into the part after length)


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC32C = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as Kafka's record batch v2 carries it."""
    crc = 0xFFFFFFFF
    table = _CRC32C
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _varint(value: int) -> bytes:
    """A zig-zag varint (Kafka's record fields)."""
    zigzag = (value << 1) ^ (value >> 63)
    out = bytearray()
    while True:
        byte = zigzag & 0x7F
        zigzag >>= 7
        if zigzag:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _varbytes(data: bytes | None) -> bytes:
    return _varint(-1) if data is None else _varint(len(data)) + data


@dataclass(frozen=True)
class RawRecord:
    """One record as bytes: ``headers`` names are bytes too (any bytes)."""

    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[bytes, bytes | None], ...] = ()
    #: Creation time; None: the time of writing.
    timestamp_ms: int | None = None
    #: Free-form label for the test (what kind of record this is); not written.
    label: str = field(default="", compare=False)


def _encode_record(record: RawRecord, offset_delta: int, timestamp_delta: int) -> bytes:
    body = bytearray(b"\x00")  # attributes
    body += _varint(timestamp_delta)
    body += _varint(offset_delta)
    body += _varbytes(record.key)
    body += _varbytes(record.value)
    body += _varint(len(record.headers))
    for name, value in record.headers:
        body += _varbytes(name)
        body += _varbytes(value)
    return _varint(len(body)) + bytes(body)


def encode_batch(records: Sequence[RawRecord], *, now_ms: int | None = None) -> bytes:
    """One uncompressed v2 record batch holding ``records`` in order."""
    if not records:
        raise ValueError("a batch holds at least one record")
    now = int(time.time() * 1000) if now_ms is None else now_ms
    stamps = [now if r.timestamp_ms is None else r.timestamp_ms for r in records]
    base_ts = stamps[0]
    encoded = b"".join(
        _encode_record(r, i, ts - base_ts)
        for i, (r, ts) in enumerate(zip(records, stamps, strict=True))
    )
    header = _BATCH_HEADER.pack(
        -1,  # partitionLeaderEpoch
        _MAGIC_V2,
        0,  # crc, filled in below
        0,  # attributes: no compression, create time, not transactional
        len(records) - 1,  # lastOffsetDelta
        base_ts,
        max(stamps),
        -1,  # producerId
        -1,  # producerEpoch
        -1,  # baseSequence
        len(records),
    )
    after_length = bytearray(header + encoded)
    crc = crc32c(bytes(after_length[_CRC_START:]))
    struct.pack_into(">I", after_length, 5, crc)
    return struct.pack(">qi", 0, len(after_length)) + bytes(after_length)


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack(">h", len(data)) + data


def _produce_request(topic: str, partition: int, batch: bytes, correlation_id: int) -> bytes:
    body = struct.pack(">hhi", _PRODUCE_API_KEY, _PRODUCE_VERSION, correlation_id)
    body += _string("tests.records")
    body += struct.pack(">hhi", -1, -1, 30_000)  # transactional_id null, acks=all, timeout
    body += struct.pack(">i", 1) + _string(topic)
    body += struct.pack(">iii", 1, partition, len(batch)) + batch
    return struct.pack(">i", len(body)) + body


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            raise ConnectionError("broker closed the connection")
        chunks += chunk
    return bytes(chunks)


def _produce_error(response: bytes) -> tuple[int, int]:
    """(error code, base offset) of a one-topic, one-partition Produce v3 response."""
    pos = 4  # correlation id
    (topics,) = struct.unpack_from(">i", response, pos)
    pos += 4
    assert topics == 1, topics
    (name_len,) = struct.unpack_from(">h", response, pos)
    pos += 2 + name_len
    (partitions,) = struct.unpack_from(">i", response, pos)
    pos += 4
    assert partitions == 1, partitions
    _partition, error, base_offset = struct.unpack_from(">ihq", response, pos)
    return error, base_offset


class RawProducer:
    """Writes :class:`RawRecord` s as they are, to a chosen partition, acks=all."""

    def __init__(self, bootstrap: str) -> None:
        self._admin = AdminClient({"bootstrap.servers": bootstrap})
        self._correlation = 0

    def leader(self, topic: str, partition: int) -> tuple[str, int]:
        meta = self._admin.list_topics(topic, timeout=10)
        leader_id = meta.topics[topic].partitions[partition].leader
        broker = meta.brokers[leader_id]
        return broker.host, broker.port

    def send(self, topic: str, partition: int, records: Sequence[RawRecord]) -> int:
        """Write ``records`` in one batch; returns the offset of the first one."""
        self._correlation += 1
        request = _produce_request(topic, partition, encode_batch(records), self._correlation)
        with socket.create_connection(self.leader(topic, partition), timeout=30) as sock:
            sock.sendall(request)
            (size,) = struct.unpack(">i", _recv_exact(sock, 4))
            response = _recv_exact(sock, size)
        error, base_offset = _produce_error(response)
        if error:
            raise RuntimeError(f"produce to {topic}[{partition}] failed: Kafka error {error}")
        return base_offset

    def send_all(
        self, topic: str, partition: int, records: Iterable[RawRecord], *, batch: int = 500
    ) -> list[int]:
        """Write ``records`` in order, ``batch`` per request; the offset of each."""
        offsets: list[int] = []
        chunk: list[RawRecord] = []
        for record in records:
            chunk.append(record)
            if len(chunk) == batch:
                first = self.send(topic, partition, chunk)
                offsets += range(first, first + len(chunk))
                chunk = []
        if chunk:
            first = self.send(topic, partition, chunk)
            offsets += range(first, first + len(chunk))
        return offsets


# --- hypothesis: any Kafka record ----------------------------------------------------------

#: Header names a producer may send: any bytes, with the hostile ones made likely.
HOSTILE_NAMES = (b"\xff", b"id\xff", b"\xc3\x28", b"", b"\x00", b"id", b"type", b"\xed\xa0\x80")


#: Names a well-behaved producer writes (duplicates of them are likely in a record).
READABLE_NAMES = (b"id", b"type", b"aggregatetype", b"lsn", b"traceparent", b"x-app", b"")


def header_names() -> st.SearchStrategy[bytes]:
    """A header name: well-known names, invalid UTF-8, empty, or any bytes."""
    return st.one_of(
        st.sampled_from(HOSTILE_NAMES),
        st.binary(max_size=12),
        st.text(max_size=12).map(str.encode),
    )


def header_values() -> st.SearchStrategy[bytes | None]:
    """A header value: None (a null header), empty, invalid UTF-8, a uuid, or any bytes."""
    return st.one_of(
        st.none(),
        st.just(b""),
        st.binary(max_size=40),
        st.uuids().map(lambda u: str(u).encode()),
        st.just(b"\xff\xfe"),
    )


def kafka_records(*, max_headers: int = 8, huge_headers: int = 300) -> st.SearchStrategy[RawRecord]:
    """Any Kafka record: random key, value (or tombstone) and headers (1 in 20: a huge set)."""
    header = st.tuples(header_names(), header_values())
    few = st.lists(header, max_size=max_headers)
    huge = st.lists(header, min_size=huge_headers, max_size=huge_headers)
    headers = st.integers(0, 19).flatmap(lambda i: huge if i == 0 else few).map(tuple)
    return st.builds(
        RawRecord,
        key=st.one_of(st.none(), st.binary(max_size=24)),
        value=st.one_of(st.none(), st.binary(max_size=200)),
        headers=headers,
        label=st.just("random"),
    )


def sample(strategy: st.SearchStrategy[RawRecord], count: int) -> list[RawRecord]:
    """``count`` records drawn from ``strategy`` (hypothesis' own search, outside a test's
    ``@given``: for tests that write thousands of records at once)."""
    drawn: list[RawRecord] = []

    @settings(
        max_examples=count,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def draw(record: RawRecord) -> None:
        drawn.append(record)

    draw()
    return drawn[:count]


def _random_bytes(rng: random.Random, max_size: int) -> bytes:
    return rng.randbytes(rng.randint(0, max_size))


def random_record(rng: random.Random, *, huge_headers: int = 300) -> RawRecord:
    """One record of the same shapes as :func:`kafka_records`, from a seeded ``rng``:
    thousands in milliseconds (hypothesis takes ~25 ms a record with huge sets)."""

    def name() -> bytes:
        pick = rng.random()
        if pick < 0.08:
            return rng.choice(HOSTILE_NAMES)  # invalid UTF-8, empty, NUL, the known names
        if pick < 0.12:
            return _random_bytes(rng, 12)  # any bytes: mostly not UTF-8
        return rng.choice(READABLE_NAMES)

    def value() -> bytes | None:
        return rng.choice(
            [None, b"", _random_bytes(rng, 40), str(uuid.UUID(int=rng.getrandbits(128))).encode()]
        )

    count = huge_headers if rng.random() < 0.05 else rng.randint(0, 8)
    return RawRecord(
        key=rng.choice([None, b"", _random_bytes(rng, 24)]),
        value=rng.choice([None, b"", b"{}", _random_bytes(rng, 200)]),
        headers=tuple((name(), value()) for _ in range(count)),
        label="random",
    )
