"""cdc.wal.replproto: CopyData framing of the replication stream.

Real frames come from ``data/pgoutput/vectors.json`` (``copy_frames``: what
``START_REPLICATION`` sent for the first two captured transactions, then the
keepalive answering a standby status update that requested a reply).
"""

from __future__ import annotations

import json
import struct
import time
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdc.constants import PG_EPOCH_OFFSET_US
from cdc.errors import DecodeError
from cdc.wal.replproto import (
    Keepalive,
    XLogData,
    lsn_to_str,
    parse_copy_data,
    pg_now_us,
    standby_status_update,
    str_to_lsn,
)

VECTORS = Path(__file__).parent / "data" / "pgoutput" / "vectors.json"
MAX_LSN = 2**64 - 1


@cache
def vectors() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(VECTORS.read_text())
    return data


def frames(tag: str) -> list[bytes]:
    return [bytes.fromhex(f["hex"]) for f in vectors()["copy_frames"] if f["tag"] == tag]


def xlogdata_frames() -> list[XLogData]:
    out = []
    for frame in frames("w"):
        msg = parse_copy_data(frame)
        assert isinstance(msg, XLogData)
        out.append(msg)
    return out


def capture_window_us() -> tuple[int, int]:
    txs = [tx for tx in vectors()["transactions"] if "commit_not_before_us" in tx]
    return txs[0]["commit_not_before_us"], txs[-1]["commit_not_after_us"]


# --- XLogData ------------------------------------------------------------------


def test_xlogdata_payloads_are_the_pgoutput_messages_in_stream_order() -> None:
    streamed = [bytes(m.payload) for m in xlogdata_frames()]
    peeked = [bytes.fromhex(m["hex"]) for m in vectors()["messages"][: len(streamed)]]
    assert streamed == peeked
    assert [p[:1] for p in streamed] == [b"B", b"R", b"I", b"I", b"M", b"C", b"B", b"M", b"C"]


def test_xlogdata_wal_start_is_the_write_position_and_wal_end_equals_it() -> None:
    peeked = vectors()["messages"]
    for msg, row in zip(xlogdata_frames(), peeked, strict=False):
        assert msg.wal_end == msg.wal_start
        if row["tag"] != "R":  # Relation frames carry position 0
            assert lsn_to_str(msg.wal_start) == row["lsn"]


def test_xlogdata_send_time_is_postgres_epoch_microseconds() -> None:
    lo, hi = capture_window_us()
    for msg in xlogdata_frames():
        unix_us = msg.send_time_us + PG_EPOCH_OFFSET_US
        assert lo - 60_000_000 <= unix_us <= hi + 60_000_000


def test_xlogdata_payload_is_a_view_of_the_input_not_a_copy() -> None:
    frame = frames("w")[0]
    msg = parse_copy_data(frame)
    assert isinstance(msg, XLogData)
    assert msg.payload.obj is frame
    assert msg.payload == frame[25:]


def test_xlogdata_with_empty_payload_is_accepted() -> None:
    msg = parse_copy_data(b"w" + struct.pack(">QQq", 1, 2, 3))
    assert msg == XLogData(1, 2, 3, memoryview(b""))


# --- keepalive -----------------------------------------------------------------


def test_keepalive_answering_a_reply_request_reports_wal_end_past_the_last_commit() -> None:
    last = frames("k")[-1]
    msg = parse_copy_data(last)
    assert isinstance(msg, Keepalive)
    last_commit = str_to_lsn([m for m in vectors()["messages"] if m["tag"] == "C"][1]["lsn"])
    assert msg.wal_end >= last_commit
    assert msg.reply_requested is False
    lo, hi = capture_window_us()
    assert lo - 60_000_000 <= msg.send_time_us + PG_EPOCH_OFFSET_US <= hi + 60_000_000


def test_keepalive_reply_requested_flag_is_decoded() -> None:
    frame = b"k" + struct.pack(">QqB", 0x1_0000_0010, 5, 1)
    assert parse_copy_data(frame) == Keepalive(0x1_0000_0010, 5, True)
    assert parse_copy_data(memoryview(frame)) == Keepalive(0x1_0000_0010, 5, True)


# --- malformed -----------------------------------------------------------------


def test_empty_copy_data_raises_decode_error() -> None:
    with pytest.raises(DecodeError, match="empty"):
        parse_copy_data(b"")


@pytest.mark.parametrize("tag", [b"r", b"h", b"B", b"\0"])
def test_unexpected_tag_raises_decode_error_naming_it(tag: bytes) -> None:
    with pytest.raises(DecodeError, match="unexpected CopyData message tag"):
        parse_copy_data(tag + b"\0" * 40)


@pytest.mark.parametrize("size", range(1, 25))
def test_truncated_xlogdata_header_raises_decode_error(size: int) -> None:
    with pytest.raises(DecodeError, match="truncated XLogData"):
        parse_copy_data(frames("w")[0][:size])


@pytest.mark.parametrize("size", [1, 17, 19])
def test_keepalive_of_wrong_length_raises_decode_error(size: int) -> None:
    frame = (frames("k")[-1] + b"\0")[:size]
    with pytest.raises(DecodeError, match="keepalive"):
        parse_copy_data(frame)


@given(st.binary(max_size=40))
def test_arbitrary_bytes_parse_or_raise_decode_error(data: bytes) -> None:
    try:
        msg = parse_copy_data(data)
    except DecodeError:
        return
    assert isinstance(msg, XLogData | Keepalive)


# --- standby status update -----------------------------------------------------


def test_standby_status_update_has_the_protocol_layout() -> None:
    msg = standby_status_update(0x10, 0x1_0000_0020, 0x30, 0x40, reply_requested=True)
    assert msg == bytes.fromhex(
        "72"  # 'r'
        "0000000000000010"  # written
        "0000000100000020"  # flushed
        "0000000000000030"  # applied
        "0000000000000040"  # client clock
        "01"  # reply requested
    )


def test_standby_status_update_does_not_request_a_reply_by_default() -> None:
    msg = standby_status_update(1, 1, 1, 1)
    assert len(msg) == 34
    assert msg[-1] == 0


def test_pg_now_us_is_microseconds_since_2000_01_01_utc() -> None:
    before = time.time_ns() // 1000
    now = pg_now_us()
    after = time.time_ns() // 1000
    assert before <= now + 946_684_800_000_000 <= after


# --- LSN text ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0/0"),
        (0x16B374D848, "16/B374D848"),
        (0x4402E70, "0/4402E70"),
        (MAX_LSN, "FFFFFFFF/FFFFFFFF"),
    ],
)
def test_lsn_text_matches_postgres_format(value: int, text: str) -> None:
    assert lsn_to_str(value) == text
    assert str_to_lsn(text) == value


def test_lsn_text_round_trips_every_lsn_the_server_printed() -> None:
    for row in vectors()["messages"]:
        assert lsn_to_str(str_to_lsn(row["lsn"])) == row["lsn"]


@given(st.integers(min_value=0, max_value=MAX_LSN))
def test_lsn_text_round_trips(value: int) -> None:
    assert str_to_lsn(lsn_to_str(value)) == value


def test_str_to_lsn_accepts_lowercase_and_zero_padding() -> None:
    assert str_to_lsn("16/b374d848") == 0x16B374D848
    assert str_to_lsn("00000016/0000D848") == 0x160000D848


@pytest.mark.parametrize(
    "text", ["", "0", "/0", "0/", "1/2/3", "G/0", "123456789/0", "0/-1", "0x1/0"]
)
def test_str_to_lsn_rejects_malformed_text(text: str) -> None:
    with pytest.raises(ValueError, match="not an LSN"):
        str_to_lsn(text)


@pytest.mark.parametrize("value", [-1, MAX_LSN + 1])
def test_lsn_to_str_rejects_values_outside_64_bits(value: int) -> None:
    with pytest.raises(ValueError, match="out of range"):
        lsn_to_str(value)


def test_xlog_payload_returns_the_pgoutput_bytes_of_xlogdata_only() -> None:
    from cdc.wal.replproto import xlog_payload

    frame = b"w" + struct.pack(">QQq", 5, 6, 7) + b"Bpayload"
    assert xlog_payload(frame) == b"Bpayload"
    assert xlog_payload(memoryview(frame)) == b"Bpayload"
    keepalive = b"k" + struct.pack(">QqB", 9, 10, 1)
    assert xlog_payload(keepalive) is None
    assert xlog_payload(b"w" + b"\0" * 24) is None  # no payload: parse_copy_data reports it
