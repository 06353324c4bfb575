"""Compact sets of event ids: 16 bytes per id, no Python object per id. Pure.

Guarantees:

* ids are the 16 bytes :func:`cdc.records.uuid_bytes` makes of an ``id`` (the
  one parser of the project: a record's id is data, never trusted to be well
  formed);
* :class:`IdBuckets` holds ids as raw bytes in :data:`BUCKETS` buckets, chosen by
  :func:`bucket_of`: up to :data:`SPILL_BYTES` of them in memory (``bytearray``\\ s,
  16 bytes per id), the rest appended to a temporary file, one chunk per bucket
  at each spill - memory does not grow with the number of ids. Only one bucket at
  a time is ever read back and turned into Python objects (:meth:`IdBuckets.ids`),
  so a comparison of a window of N ids holds ~N/256 ids at once, not N;
* :func:`bucket_of` mixes a byte that is random in version 4 and 7 uuids (byte
  15) with the two low bytes of a version 1 uuid's ``time_low`` (bytes 2 and 3:
  they change every 100 ns and 25.6 us; a coarse clock leaves the lowest bits of
  byte 3 fixed): ids of every common version spread evenly. (Version 7 uuids
  share their first bytes within a window: bucketing by the first byte would put
  a whole window in one bucket.) PostgreSQL computes the same bucket (see
  :mod:`cdc.audit.table`), so the table's ids arrive already bucketed.
"""

from __future__ import annotations

import struct
import tempfile
from array import array
from collections.abc import Iterable, Iterator
from typing import BinaryIO

from cdc.records import ID_BYTES

#: One id, as :meth:`IdBuckets.ids` splits a bucket (in C, not a slice per id).
_ID = struct.Struct(f"{ID_BYTES}s")

#: Number of buckets: a window of 1,000,000 ids is compared ~4,000 ids at a time.
BUCKETS = 256
#: Bytes of ids an :class:`IdBuckets` keeps in memory before it appends them to a
#: temporary file (262,144 ids): an audit holds a few of these per topic, whatever
#: its window (a window of 10,000,000 rows is ~160 MB of ids per side, on disk).
SPILL_BYTES = 4 * 1024 * 1024
#: :func:`bucket_of` in SQL, over ``idb`` (the id's 16 bytes; ``#`` is integer XOR).
SQL_BUCKET = "get_byte(idb, 2) # get_byte(idb, 3) # get_byte(idb, 15)"


def bucket_of(id16: bytes) -> int:
    """The bucket of a 16-byte id (see the module docstring)."""
    return id16[2] ^ id16[3] ^ id16[15]


def uuid_text(id16: bytes) -> str:
    """The canonical text of a 16-byte id."""
    h = id16.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class IdBuckets:
    """A multiset of 16-byte ids in :data:`BUCKETS` buckets (see the module docstring).

    Adding never looks at what is already there: the same id added twice is
    there twice (Kafka's duplicates are counted from it). Past ``memory_bytes`` of
    ids held in memory, every bucket's ids so far are appended to a temporary file
    of its own as one chunk per bucket (:data:`SPILL_BYTES` by default): memory holds
    at most that, the chunks' positions (two 8-byte integers per bucket and spill),
    and - while :meth:`ids` answers - one bucket.
    """

    __slots__ = ("_chunks", "_file", "_held", "_parts", "count", "memory_bytes")

    def __init__(self, memory_bytes: int = 0) -> None:
        self._parts = [bytearray() for _ in range(BUCKETS)]
        #: ids added, duplicates included
        self.count = 0
        #: bytes of ids kept in memory before they are spilled to disk
        self.memory_bytes = memory_bytes or SPILL_BYTES
        self._held = 0
        self._file: BinaryIO | None = None
        #: per bucket: (offset, length) of its chunks in the file, flattened
        self._chunks: list[array[int]] = []

    def add(self, id16: bytes) -> None:
        """Add one id of :data:`ID_BYTES` bytes (made by :func:`cdc.records.uuid_bytes`)."""
        self._parts[id16[2] ^ id16[3] ^ id16[15]] += id16
        self.count += 1
        self._held += ID_BYTES
        if self._held >= self.memory_bytes:
            self._spill()

    def add_many(self, ids: Iterable[bytes]) -> None:
        for id16 in ids:
            self.add(id16)

    def add_bucket_blob(self, bucket: int, blob: bytes) -> None:
        """Add ids already bucketed elsewhere (PostgreSQL's ``string_agg`` of one bucket)."""
        if len(blob) % ID_BYTES:
            raise ValueError(f"a blob of ids must be a multiple of {ID_BYTES} bytes")
        self._parts[bucket] += blob
        self.count += len(blob) // ID_BYTES
        self._held += len(blob)
        if self._held >= self.memory_bytes:
            self._spill()

    def _spill(self) -> None:
        """Append every bucket's ids held in memory to the file; memory holds none after."""
        if self._file is None:
            self._file = tempfile.TemporaryFile(prefix="outbox-audit-ids-")  # noqa: SIM115
            self._chunks = [array("q") for _ in range(BUCKETS)]
        out = self._file
        out.seek(0, 2)
        for bucket, part in enumerate(self._parts):
            if part:
                self._chunks[bucket].extend((out.tell(), len(part)))
                out.write(part)
                self._parts[bucket] = bytearray()
        self._held = 0

    def _blob(self, bucket: int) -> bytes:
        """One bucket's ids, its spilled chunks first."""
        if self._file is None:
            return bytes(self._parts[bucket])
        pieces = []
        chunks = self._chunks[bucket]
        for i in range(0, len(chunks), 2):
            self._file.seek(chunks[i])
            pieces.append(self._file.read(chunks[i + 1]))
        pieces.append(bytes(self._parts[bucket]))
        return b"".join(pieces)

    def ids(self, bucket: int) -> list[bytes]:
        """The ids of one bucket, as ``bytes`` objects (duplicates kept)."""
        return [id16 for (id16,) in _ID.iter_unpack(self._blob(bucket))]  # (2x slicing's pace)

    def __iter__(self) -> Iterator[bytes]:
        for bucket in range(BUCKETS):
            yield from self.ids(bucket)

    def __len__(self) -> int:
        return self.count

    @property
    def nbytes(self) -> int:
        """Bytes of ids held (16 per id), in memory and spilled."""
        return self.count * ID_BYTES

    @property
    def spilled(self) -> bool:
        """Whether some ids live in the temporary file."""
        return self._file is not None

    def close(self) -> None:
        """Drop the temporary file (also when the object is collected)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __del__(self) -> None:
        self.close()


class IdList:
    """An append-only list of 16-byte ids in one ``bytearray`` (what the audit found missing)."""

    __slots__ = ("_blob",)

    def __init__(self, ids: Iterable[bytes] = ()) -> None:
        self._blob = bytearray()
        for id16 in ids:
            self.append(id16)

    def append(self, id16: bytes) -> None:
        if len(id16) != ID_BYTES:
            raise ValueError(f"an id is {ID_BYTES} bytes")
        self._blob += id16

    def extend(self, ids: Iterable[bytes]) -> None:
        for id16 in ids:
            self.append(id16)

    def __len__(self) -> int:
        return len(self._blob) // ID_BYTES

    def __iter__(self) -> Iterator[bytes]:
        blob = bytes(self._blob)
        for i in range(0, len(blob), ID_BYTES):
            yield blob[i : i + ID_BYTES]

    def first(self, count: int) -> list[bytes]:
        """The first ``count`` ids (all of them when ``count`` is larger)."""
        end = min(len(self), max(count, 0)) * ID_BYTES
        blob = bytes(self._blob[:end])
        return [blob[i : i + ID_BYTES] for i in range(0, end, ID_BYTES)]

    def chunks(self, size: int) -> Iterator[bytes]:
        """The ids as blobs of at most ``size`` ids each (for a query parameter)."""
        step = max(size, 1) * ID_BYTES
        for start in range(0, len(self._blob), step):
            yield bytes(self._blob[start : start + step])

    def blob(self) -> bytes:
        """All ids, concatenated."""
        return bytes(self._blob)

    def view(self) -> memoryview:
        """All ids, concatenated, without a copy (read-only; the list must not grow
        while the view is in use)."""
        return memoryview(self._blob).toreadonly()
