"""Decoder of the ``pgoutput`` logical replication protocol, version 1.

Guarantees:

* :func:`decode` turns the payload of one XLogData message into exactly one
  message object (treat it as read-only), or raises :class:`~cdc.errors.DecodeError` naming
  the message kind and the problem. It never returns a partially decoded
  message and never accepts trailing bytes (which is how a protocol mismatch,
  e.g. a streaming ``xid`` prefix, is caught instead of misread).
* It is pure: no I/O, no global state; the input is never modified.
* Timestamps are converted from PostgreSQL-epoch (2000-01-01) to Unix-epoch
  microseconds (fields ending in ``_ts_us``). LSNs are unsigned 64-bit ints.
* Column values are kept as the server sent them (see :data:`TupleData`).

Message kinds (first byte): ``B`` :class:`Begin`, ``C`` :class:`Commit`, ``O``
:class:`Origin`, ``R`` :class:`Relation`, ``Y`` :class:`Type`, ``I``
:class:`Insert`, ``U`` :class:`Update`, ``D`` :class:`Delete`, ``T``
:class:`Truncate`, ``M`` :class:`Message`. Streaming and two-phase kinds
(protocol >= 2) are rejected as unknown.

:class:`RelationCache` keeps the latest :class:`Relation` per OID, as the
protocol requires (a Relation message precedes the first change of a relation
in a session and follows every schema change), and turns row tuples into
``{column: text}`` dicts.
"""

from __future__ import annotations

import enum
import importlib
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final, TypeAlias, cast

from cdc.constants import PG_EPOCH_OFFSET_US
from cdc.errors import DecodeError

__all__ = [
    "UNCHANGED_TOAST",
    "Begin",
    "Column",
    "Commit",
    "Delete",
    "Insert",
    "Message",
    "Origin",
    "PgOutputMessage",
    "Relation",
    "RelationCache",
    "Truncate",
    "TupleData",
    "Type",
    "Unchanged",
    "Update",
    "Value",
    "begin_context",
    "decode",
    "insert_text_values",
]


class Unchanged(enum.Enum):
    """Marker type of :data:`UNCHANGED_TOAST`."""

    TOAST = "u"  # an out-of-line (TOASTed) value the UPDATE did not touch; not sent

    def __repr__(self) -> str:
        return "UNCHANGED_TOAST"


#: Tuple value ``'u'``: the column is TOASTed and was not changed, so its value is
#: not in the stream (only in UPDATE new tuples). Compare with ``is``.
UNCHANGED_TOAST: Final = Unchanged.TOAST

#: One column value: ``None`` for SQL NULL (``'n'``; in a key-only old tuple also
#: "not part of the key"), :data:`UNCHANGED_TOAST` (``'u'``), or ``bytes``: the
#: text representation (``'t'``, UTF-8 for a UTF-8 database) or, only when the
#: stream was started with ``binary 'true'``, the type's binary send format
#: (``'b'``). The raw bytes are kept either way; the stream options say which.
Value: TypeAlias = bytes | Unchanged | None
#: All column values of a row, in the column order of its :class:`Relation`.
TupleData: TypeAlias = tuple[Value, ...]


@dataclass(slots=True)  # not frozen: a frozen __init__ costs 2x on the hot path
class Begin:
    """Start of a committed transaction.

    ``final_lsn`` is the LSN of the transaction's commit record (equal to
    :attr:`Commit.commit_lsn`): unique and increasing in commit order.
    """

    final_lsn: int
    commit_ts_us: int
    xid: int


@dataclass(slots=True)  # not frozen: a frozen __init__ costs 2x on the hot path
class Commit:
    """End of a transaction. ``end_lsn`` (end of the commit record) is what a
    client confirms once everything of the transaction is safely stored."""

    flags: int  # unused by the server, always 0
    commit_lsn: int
    end_lsn: int
    commit_ts_us: int


@dataclass(frozen=True, slots=True)
class Origin:
    """The transaction was replayed from a replication origin (follows Begin)."""

    commit_lsn: int  # the commit LSN on the origin server
    name: str


@dataclass(frozen=True, slots=True)
class Column:
    """One column of a :class:`Relation`."""

    flags: int  # bit 0 set: the column is part of the replica identity key
    name: str
    type_oid: int
    type_modifier: int  # atttypmod, -1 when the type has none

    @property
    def is_key(self) -> bool:
        """Whether the column belongs to the replica identity (sent in 'K' tuples)."""
        return bool(self.flags & 1)


@dataclass(frozen=True, slots=True)
class Relation:
    """Schema of a published table, sent before its first change in a session
    and again after every schema change. ``namespace`` is ``""`` for
    ``pg_catalog``. ``replica_identity`` is ``relreplident``: ``d`` default
    (primary key), ``n`` nothing, ``f`` full row, ``i`` index."""

    oid: int
    namespace: str
    name: str
    replica_identity: str
    columns: tuple[Column, ...]


@dataclass(frozen=True, slots=True)
class Type:
    """A non-built-in column type (e.g. an enum), sent before the Relation using it."""

    oid: int
    namespace: str
    name: str


@dataclass(slots=True)  # not frozen: a frozen __init__ costs 2x on the hot path
class Insert:
    """A row inserted into the relation ``relation_oid``."""

    relation_oid: int
    new: TupleData


@dataclass(frozen=True, slots=True)
class Update:
    """A row updated. ``old`` is ``None`` unless the replica identity changed
    (``'K'`` form: key columns only, other columns ``None``; ``old_key_only``)
    or the identity is FULL (``'O'`` form: the whole old row)."""

    relation_oid: int
    old: TupleData | None
    new: TupleData
    old_key_only: bool = False


@dataclass(frozen=True, slots=True)
class Delete:
    """A row deleted. pgoutput always sends ``old`` (``'K'`` key columns only,
    others ``None``, ``old_key_only`` set; or ``'O'`` the whole row)."""

    relation_oid: int
    old: TupleData | None
    old_key_only: bool = False


@dataclass(frozen=True, slots=True)
class Truncate:
    """``TRUNCATE`` of one or more relations. ``options`` bit 0: CASCADE,
    bit 1: RESTART IDENTITY."""

    options: int
    relation_oids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Message:
    """``pg_logical_emit_message``. ``lsn`` is the LSN of the *end* of the
    message's WAL record. Transactional messages arrive between Begin and
    Commit (and only if the transaction commits); non-transactional ones arrive
    on their own, outside any transaction, as soon as they are decoded."""

    transactional: bool
    lsn: int
    prefix: str
    content: bytes


PgOutputMessage: TypeAlias = (
    Begin | Commit | Origin | Relation | Type | Insert | Update | Delete | Truncate | Message
)

_BEGIN: Final = struct.Struct(">QqI")  # final_lsn, commit_ts, xid
_COMMIT: Final = struct.Struct(">BQQq")  # flags, commit_lsn, end_lsn, commit_ts
_U64: Final = struct.Struct(">Q")
_U32: Final = struct.Struct(">I")
_U16: Final = struct.Struct(">H")
_OID_KIND: Final = struct.Struct(">Ic")  # relation oid, tuple kind
_OID_NEW_NCOLS: Final = struct.Struct(">IcH")  # Insert: relation oid, 'N', ncols
_MESSAGE_HEAD: Final = struct.Struct(">BQ")  # flags, lsn
_COLUMN_TAIL: Final = struct.Struct(">Ii")  # type oid, type modifier
_TRUNCATE_HEAD: Final = struct.Struct(">IB")  # relation count, options

#: The relay's fast path reads Begin and Commit in place (no message object; one
#: of each per transaction): a message of exactly this length, read from offset 1.
BEGIN_LEN: Final = 1 + _BEGIN.size
#: ``(data, 1)`` -> final_lsn, commit timestamp (PostgreSQL epoch, us), xid.
begin_fields: Final = _BEGIN.unpack_from
COMMIT_LEN: Final = 1 + _COMMIT.size
#: ``(data, 1)`` -> flags, commit_lsn, end_lsn, commit timestamp (PostgreSQL epoch, us).
commit_fields: Final = _COMMIT.unpack_from
#: Where a Commit's ``end_lsn`` sits (tag, flags, commit_lsn before it): ``(data, at +
#: COMMIT_END_LSN_AT)`` -> ``(end_lsn,)``, the one field the relay's fast path reads (a
#: 1-tuple: unpacking all four fields cost three times as much, once per transaction).
COMMIT_END_LSN_AT: Final = 1 + 1 + 8
commit_end_lsn: Final = _U64.unpack_from

_TAG_NAMES: Final = {
    ord("B"): "Begin",
    ord("C"): "Commit",
    ord("O"): "Origin",
    ord("R"): "Relation",
    ord("Y"): "Type",
    ord("I"): "Insert",
    ord("U"): "Update",
    ord("D"): "Delete",
    ord("T"): "Truncate",
    ord("M"): "Message",
}


def _finish(data: bytes, off: int, kind: str) -> None:
    """The message must end exactly at ``off``."""
    if off != len(data):
        what = "truncated" if off > len(data) else f"{len(data) - off} trailing bytes in"
        raise DecodeError(f"{what} pgoutput {kind} message ({len(data)} bytes)")


def _cstring(data: bytes, off: int) -> tuple[str, int]:
    """A NUL-terminated UTF-8 string at ``off``; returns it and the offset after the NUL."""
    end = data.index(0, off)
    return data[off:end].decode(), end + 1


def _tuple(data: bytes, off: int) -> tuple[TupleData, int]:
    """TupleData at ``off`` (column count, then per column a kind byte and maybe a value)."""
    (ncols,) = _U16.unpack_from(data, off)
    return _columns(data, off + 2, ncols)


def _columns(data: bytes, off: int, ncols: int) -> tuple[TupleData, int]:
    values: list[Value] = []
    append = values.append
    unpack_size = _U32.unpack_from
    for _ in range(ncols):
        kind = data[off]
        if kind == 0x74 or kind == 0x62:  # noqa: PLR1714 - 't' text, 'b' binary: Int32 size, bytes
            start = off + 5
            off = start + unpack_size(data, off + 1)[0]
            append(data[start:off])
        elif kind == 0x6E:  # 'n' null
            append(None)
            off += 1
        elif kind == 0x75:  # 'u' unchanged TOAST
            append(UNCHANGED_TOAST)
            off += 1
        else:
            raise DecodeError(f"unknown tuple value kind {kind:#04x} at offset {off}")
    return tuple(values), off


def _begin(data: bytes) -> Begin:
    _finish(data, 1 + _BEGIN.size, "Begin")
    final_lsn, ts, xid = _BEGIN.unpack_from(data, 1)
    return Begin(final_lsn, ts + PG_EPOCH_OFFSET_US, xid)


def _commit(data: bytes) -> Commit:
    _finish(data, 1 + _COMMIT.size, "Commit")
    flags, commit_lsn, end_lsn, ts = _COMMIT.unpack_from(data, 1)
    return Commit(flags, commit_lsn, end_lsn, ts + PG_EPOCH_OFFSET_US)


def _origin(data: bytes) -> Origin:
    (lsn,) = _U64.unpack_from(data, 1)
    name, off = _cstring(data, 9)
    _finish(data, off, "Origin")
    return Origin(lsn, name)


def _relation(data: bytes) -> Relation:
    (oid,) = _U32.unpack_from(data, 1)
    namespace, off = _cstring(data, 5)
    name, off = _cstring(data, off)
    replica_identity = chr(data[off])
    (ncols,) = _U16.unpack_from(data, off + 1)
    off += 3
    columns = []
    for _ in range(ncols):
        flags = data[off]
        col_name, off = _cstring(data, off + 1)
        type_oid, type_modifier = _COLUMN_TAIL.unpack_from(data, off)
        off += _COLUMN_TAIL.size
        columns.append(Column(flags, col_name, type_oid, type_modifier))
    _finish(data, off, "Relation")
    return Relation(oid, namespace, name, replica_identity, tuple(columns))


def _type(data: bytes) -> Type:
    (oid,) = _U32.unpack_from(data, 1)
    namespace, off = _cstring(data, 5)
    name, off = _cstring(data, off)
    _finish(data, off, "Type")
    return Type(oid, namespace, name)


def _insert(data: bytes) -> Insert:
    oid, kind, ncols = _OID_NEW_NCOLS.unpack_from(data, 1)
    if kind != b"N":
        raise DecodeError(f"pgoutput Insert: expected new tuple 'N', got {kind!r}")
    new, off = _columns(data, 1 + _OID_NEW_NCOLS.size, ncols)
    if off != len(data):  # inlined _finish: this is the hot path
        _finish(data, off, "Insert")
    return Insert(oid, new)


_INSERT_HEAD: Final = struct.Struct(">IcH")  # relation oid, 'N', column count
_INSERT_VALUES_AT: Final = 1 + _INSERT_HEAD.size


def _insert_text_values_py(
    data: bytes | memoryview, at: int = 0
) -> tuple[int, list[bytes | None]] | None:
    """The relation OID and values of the Insert at ``data[at:]`` (to its end)
    holding only text and NULL values.

    The relay's fast path: the same OID and values :func:`decode` gives
    (``Insert.relation_oid``, ``list(Insert.new)``) without building objects,
    and without copying the message out of the CopyData message it came in
    (``at``: its offset there). Returns None for anything else (another message
    kind, a binary or unchanged value, a short message, trailing bytes);
    :func:`decode` then names the problem. :data:`insert_text_values` is this
    function, or the same in C (:mod:`cdc.wal._pgfast`) where it was built.
    """
    if at < 0:
        raise ValueError("insert_text_values: a negative offset")
    if type(data) is not bytes:
        data = bytes(data)  # (values are bytes; the C function copies only them)
    end = len(data)
    if end - at < _INSERT_VALUES_AT or data[at] != 0x49:  # 'I'
        return None
    oid, kind, ncols = _INSERT_HEAD.unpack_from(data, at + 1)
    if kind != b"N":
        return None
    values: list[bytes | None] = []
    append = values.append
    size_at = _U32.unpack_from
    off = at + _INSERT_VALUES_AT
    try:
        for _ in range(ncols):
            kind_byte = data[off]
            if kind_byte == 0x74:  # 't' text: Int32 size, bytes
                start = off + 5
                off = start + size_at(data, off + 1)[0]
                if off > end:
                    return None
                append(data[start:off])
            elif kind_byte == 0x6E:  # 'n' null
                append(None)
                off += 1
            else:
                return None
    except (IndexError, struct.error):
        return None
    return (oid, values) if off == end else None


#: ``(data, at=0)`` -> the OID and values of a text-only Insert at ``data[at:]``, or None.
InsertTextValues: TypeAlias = Callable[..., "tuple[int, list[bytes | None]] | None"]


def _begin_context_py(data: bytes | memoryview, at: int = 0) -> BeginContext | None:
    """The Begin at ``data[at:]`` (to its end) read in place, with the texts of its
    transaction's ``lsn`` and ``commit_ts`` headers: ``(final_lsn, commit time in
    Unix microseconds, b"16/B374D848", b"2026-11-29T10:00:00.123456Z")``.

    The relay's fast path (:data:`begin_context` is this function, or the same
    in C where it was built: Python's int formatting of the two texts was most
    of a 1-event transaction's own cost). None for anything else: another
    message kind, a wrong length (:func:`decode` then names the problem), or a
    commit time outside the years 1000-9999 (the caller formats it the slow way).
    """
    if at < 0:
        raise ValueError("begin_context: a negative offset")
    if type(data) is not bytes:
        data = bytes(data)
    if len(data) - at != BEGIN_LEN or data[at] != 0x42:  # 'B'
        return None
    final_lsn, pg_ts, _xid = _BEGIN.unpack_from(data, at + 1)
    ts_us = pg_ts + PG_EPOCH_OFFSET_US
    secs, micros = divmod(ts_us, 1_000_000)
    if not _FIRST_S <= secs < _PAST_LAST_S:
        return None
    head = datetime.fromtimestamp(secs, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    lsn_text = b"%X/%X" % (final_lsn >> 32, final_lsn & 0xFFFF_FFFF)
    return final_lsn, ts_us, lsn_text, b"%s.%06dZ" % (head.encode(), micros)


#: ``(final_lsn, commit time in Unix us, LSN text, ISO commit time)`` of a Begin.
BeginContext: TypeAlias = tuple[int, int, bytes, bytes]
#: The commit times :func:`_begin_context_py` formats: years 1000 to 9999.
_FIRST_S: Final = int(datetime(1000, 1, 1, tzinfo=UTC).timestamp())
_PAST_LAST_S: Final = int(datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC).timestamp()) + 1


#: Set to 1, the pure-Python functions are used even where the compiled ones exist
#: (the tests run both; a suspected defect of the C code can be ruled out with it).
PURE_PYTHON_VAR: Final = "OUTBOX_CDC_PURE_PYTHON"


def _compiled_insert_text_values() -> InsertTextValues:
    if os.environ.get(PURE_PYTHON_VAR, "").strip() in ("1", "true", "yes"):
        return _insert_text_values_py
    try:
        compiled = importlib.import_module("cdc.wal._pgfast").insert_text_values
    except ImportError:  # not built (no C compiler where it was installed)
        return _insert_text_values_py
    return cast(InsertTextValues, compiled)


def _compiled_begin_context() -> Callable[..., BeginContext | None]:
    if os.environ.get(PURE_PYTHON_VAR, "").strip() in ("1", "true", "yes"):
        return _begin_context_py
    try:
        compiled = importlib.import_module("cdc.wal._pgfast").begin_context
    except ImportError:  # not built (no C compiler where it was installed)
        return _begin_context_py
    return cast(Callable[..., BeginContext | None], compiled)


#: :func:`_insert_text_values_py`, compiled where a C compiler built :mod:`cdc.wal._pgfast`
#: (a fifth of its cost; one allocation per value and one for the result).
insert_text_values: Final = _compiled_insert_text_values()
#: :func:`_begin_context_py`, compiled where :mod:`cdc.wal._pgfast` was built.
begin_context: Final = _compiled_begin_context()
#: True when :data:`insert_text_values` (and :data:`begin_context`) are the compiled functions.
COMPILED: Final = insert_text_values is not _insert_text_values_py


def _update(data: bytes) -> Update:
    oid, kind = _OID_KIND.unpack_from(data, 1)
    old: TupleData | None = None
    old_key_only = kind == b"K"
    off = 1 + _OID_KIND.size
    if old_key_only or kind == b"O":
        old, off = _tuple(data, off)
        kind = data[off : off + 1]
        off += 1
    if kind != b"N":
        raise DecodeError(f"pgoutput Update: expected new tuple 'N', got {kind!r}")
    new, off = _tuple(data, off)
    _finish(data, off, "Update")
    return Update(oid, old, new, old_key_only)


def _delete(data: bytes) -> Delete:
    oid, kind = _OID_KIND.unpack_from(data, 1)
    if kind not in (b"K", b"O"):
        raise DecodeError(f"pgoutput Delete: expected old tuple 'K' or 'O', got {kind!r}")
    old, off = _tuple(data, 1 + _OID_KIND.size)
    _finish(data, off, "Delete")
    return Delete(oid, old, kind == b"K")


def _truncate(data: bytes) -> Truncate:
    count, options = _TRUNCATE_HEAD.unpack_from(data, 1)
    off = 1 + _TRUNCATE_HEAD.size
    _finish(data, off + 4 * count, "Truncate")
    oids = struct.unpack_from(f">{count}I", data, off)
    return Truncate(options, oids)


def _message(data: bytes) -> Message:
    flags, lsn = _MESSAGE_HEAD.unpack_from(data, 1)
    prefix, off = _cstring(data, 1 + _MESSAGE_HEAD.size)
    (size,) = _U32.unpack_from(data, off)
    off += 4
    _finish(data, off + size, "Message")
    return Message(bool(flags & 1), lsn, prefix, data[off:])


_PARSERS: Final[dict[int, Callable[[bytes], PgOutputMessage]]] = {
    ord("B"): _begin,
    ord("C"): _commit,
    ord("O"): _origin,
    ord("R"): _relation,
    ord("Y"): _type,
    ord("I"): _insert,
    ord("U"): _update,
    ord("D"): _delete,
    ord("T"): _truncate,
    ord("M"): _message,
}


def decode(buf: bytes | bytearray | memoryview) -> PgOutputMessage:
    """Decode one pgoutput v1 message (the payload of one XLogData message).

    Raises :class:`DecodeError` on an empty buffer, an unknown message tag, a
    truncated message or trailing bytes. A ``memoryview``/``bytearray`` is copied
    once; ``bytes`` values in the result are slices of that copy.
    """
    data = buf if type(buf) is bytes else bytes(buf)
    if not data:
        raise DecodeError("empty pgoutput message")
    tag = data[0]
    parser = _PARSERS.get(tag)
    if parser is None:
        raise DecodeError(
            f"unknown pgoutput message tag {chr(tag)!r} ({tag:#04x}): only protocol "
            "version 1 without streaming or two-phase is supported"
        )
    try:
        return parser(data)
    except (struct.error, IndexError, ValueError) as exc:  # short buffer, missing NUL, bad UTF-8
        raise DecodeError(
            f"truncated or malformed pgoutput {_TAG_NAMES[tag]} message ({len(data)} bytes): {exc}"
        ) from exc


class RelationCache:
    """The latest :class:`Relation` per OID seen on one replication stream.

    Guarantees: :meth:`get` and :meth:`row_dict` answer from the most recent
    Relation message for that OID, or raise :class:`DecodeError`. The cache is
    per stream (per connection): a new session re-sends every Relation.
    """

    __slots__ = ("_names", "_relations")

    def __init__(self) -> None:
        self._relations: dict[int, Relation] = {}
        self._names: dict[int, tuple[str, ...]] = {}

    def __len__(self) -> int:
        return len(self._relations)

    def __contains__(self, oid: object) -> bool:
        return oid in self._relations

    def update(self, rel: Relation) -> None:
        """Remember ``rel``, replacing an earlier description of the same OID."""
        self._relations[rel.oid] = rel
        self._names[rel.oid] = tuple(column.name for column in rel.columns)

    def get(self, oid: int) -> Relation:
        """The relation ``oid``; :class:`DecodeError` if no Relation message described it."""
        try:
            return self._relations[oid]
        except KeyError:
            raise DecodeError(_unknown_relation(oid)) from None

    def row_dict(self, change: Insert | Update) -> dict[str, str | None]:
        """The new row as ``{column name: text value or None}``.

        For text-mode streams (the default; not ``binary 'true'``) of a UTF-8
        database. Raises :class:`DecodeError` for an unknown relation, a column
        count that does not match the relation, an unchanged-TOAST value (the
        row is incomplete) or invalid UTF-8.
        """
        values = change.new
        names = self._names.get(change.relation_oid)
        if names is None:
            raise DecodeError(_unknown_relation(change.relation_oid))
        if len(names) != len(values):
            raise DecodeError(
                f"row of relation {change.relation_oid} has {len(values)} columns, "
                f"its Relation message described {len(names)}"
            )
        if UNCHANGED_TOAST in values:
            raise DecodeError(
                f"row of relation {change.relation_oid} has an unchanged TOAST value; "
                "the full row is not in the stream"
            )
        text_values = cast("tuple[bytes | None, ...]", values)  # no UNCHANGED_TOAST left
        utf8 = bytes.decode
        try:
            return {
                name: None if value is None else utf8(value)
                for name, value in zip(names, text_values, strict=True)
            }
        except UnicodeDecodeError as exc:
            raise DecodeError(
                f"row of relation {change.relation_oid} is not valid UTF-8: {exc}"
            ) from exc


def _unknown_relation(oid: int) -> str:
    return (
        f"relation oid {oid} was not described by a Relation message on this stream "
        "(a change must follow its Relation; was the cache reset mid-stream?)"
    )
