"""The streaming replication CopyData sub-protocol, without I/O.

Guarantees:

* :func:`parse_copy_data` turns one CopyData payload received after
  ``START_REPLICATION`` into :class:`XLogData` (``'w'``) or :class:`Keepalive`
  (``'k'``), or raises :class:`~cdc.errors.DecodeError`; nothing else is
  accepted. The XLogData payload is a zero-copy ``memoryview`` of the input.
* :func:`standby_status_update` builds the ``'r'`` message the client sends
  back; positions are reported exactly as given (the caller decides what is
  safe to confirm, see :mod:`cdc.wal.lsn`).
* Clock values on the wire are PostgreSQL-epoch (2000-01-01) microseconds; the
  ``send_time_us`` fields are left in that epoch, :func:`pg_now_us` gives the
  current time in it.
* :func:`lsn_to_str` / :func:`str_to_lsn` convert between 64-bit LSNs and
  PostgreSQL's ``X/X`` text form (upper-case hex, as ``pg_lsn`` prints it).
"""

from __future__ import annotations

import re
import struct
import time
from dataclasses import dataclass
from typing import Final, TypeAlias

from cdc.constants import PG_EPOCH_OFFSET_US
from cdc.errors import DecodeError

__all__ = [
    "CopyDataMessage",
    "Keepalive",
    "XLogData",
    "lsn_to_str",
    "parse_copy_data",
    "pg_now_us",
    "standby_status_update",
    "str_to_lsn",
]


@dataclass(slots=True)  # not frozen: a frozen __init__ costs 2x on the hot path
class XLogData:
    """``'w'``: one pgoutput message. For logical replication ``wal_start`` is the
    LSN the output plugin wrote the message at (``Commit``: the transaction's
    end LSN) and ``wal_end`` equals it; both may be 0 for ``Relation``/``Type``."""

    wal_start: int
    wal_end: int
    send_time_us: int  # PostgreSQL epoch
    payload: memoryview


@dataclass(frozen=True, slots=True)
class Keepalive:
    """``'k'``: the server's WAL position. ``reply_requested``: answer now with a
    standby status update or be disconnected after ``wal_sender_timeout``."""

    wal_end: int
    send_time_us: int  # PostgreSQL epoch
    reply_requested: bool


CopyDataMessage: TypeAlias = XLogData | Keepalive

_XLOG_HEAD: Final = struct.Struct(">QQq")  # wal_start, wal_end, send_time
_KEEPALIVE: Final = struct.Struct(">QqB")  # wal_end, send_time, reply_requested
_STATUS: Final = struct.Struct(">cQQQqB")  # 'r', written, flushed, applied, now, reply
_XLOG_PAYLOAD_OFFSET: Final = 1 + _XLOG_HEAD.size
_KEEPALIVE_SIZE: Final = 1 + _KEEPALIVE.size
_LSN_TEXT: Final = re.compile(r"([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})")
_MAX_LSN: Final = 0xFFFF_FFFF_FFFF_FFFF


def xlog_payload(buf: bytes | bytearray | memoryview) -> bytes | None:
    """The pgoutput payload of an XLogData message as ``bytes``; None for anything else.

    The relay's fast path: no :class:`XLogData` object for the (ignored) header.
    Hand what returns None to :func:`parse_copy_data`, which also reports errors.
    """
    if len(buf) > _XLOG_PAYLOAD_OFFSET and buf[0] == 0x77:  # 'w'
        return bytes(buf[_XLOG_PAYLOAD_OFFSET:])
    return None


def parse_copy_data(buf: bytes | bytearray | memoryview) -> CopyDataMessage:
    """Parse one CopyData payload of the replication stream.

    Raises :class:`DecodeError` for an empty or short message, a keepalive of
    the wrong length, or any tag other than ``'w'`` and ``'k'``.
    """
    view = memoryview(buf)
    if not view:
        raise DecodeError("empty CopyData message on the replication stream")
    tag = view[0]
    if tag == 0x77:  # 'w'
        if len(view) < _XLOG_PAYLOAD_OFFSET:
            raise DecodeError(f"truncated XLogData message ({len(view)} bytes)")
        wal_start, wal_end, send_time = _XLOG_HEAD.unpack_from(view, 1)
        return XLogData(wal_start, wal_end, send_time, view[_XLOG_PAYLOAD_OFFSET:])
    if tag == 0x6B:  # 'k'
        if len(view) != _KEEPALIVE_SIZE:
            raise DecodeError(
                f"keepalive message has {len(view)} bytes, expected {_KEEPALIVE_SIZE}"
            )
        wal_end, send_time, reply = _KEEPALIVE.unpack_from(view, 1)
        return Keepalive(wal_end, send_time, bool(reply))
    raise DecodeError(
        f"unexpected CopyData message tag {chr(tag)!r} ({tag:#04x}) on the replication "
        "stream: expected 'w' (XLogData) or 'k' (keepalive)"
    )


def standby_status_update(
    written_lsn: int,
    flushed_lsn: int,
    applied_lsn: int,
    now_us: int,
    reply_requested: bool = False,
) -> bytes:
    """The ``'r'`` message: positions written/flushed/applied, ``now_us`` in the
    PostgreSQL epoch (see :func:`pg_now_us`). For a logical slot the server
    moves ``confirmed_flush_lsn`` to ``flushed_lsn``; 0 means "unknown"."""
    return _STATUS.pack(b"r", written_lsn, flushed_lsn, applied_lsn, now_us, reply_requested)


def pg_now_us() -> int:
    """Now, in microseconds since 2000-01-01 UTC (the replication protocol's clock)."""
    return time.time_ns() // 1000 - PG_EPOCH_OFFSET_US


def lsn_to_str(lsn: int) -> str:
    """``0x16B374D848`` -> ``"16/B374D848"`` (PostgreSQL's ``%X/%X``, no padding)."""
    if not 0 <= lsn <= _MAX_LSN:
        raise ValueError(f"LSN out of range: {lsn}")
    return f"{lsn >> 32:X}/{lsn & 0xFFFF_FFFF:X}"


def str_to_lsn(text: str) -> int:
    """``"16/B374D848"`` -> ``0x16B374D848``; ``ValueError`` unless ``X/X`` with 1-8 hex digits
    on each side (either case, zero padding allowed)."""
    match = _LSN_TEXT.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"not an LSN: {text!r} (expected hex 'X/X', e.g. '16/B374D848')")
    return (int(match[1], 16) << 32) | int(match[2], 16)
