"""cdc.wal.pgoutput against real pgoutput v1 bytes captured from PostgreSQL.

The vectors (``data/pgoutput/vectors.json``, made by ``data/pgoutput/capture.py``)
carry expectations taken from the server (catalog, RETURNING, clock), not from
the decoder, so these tests compare the decoder with PostgreSQL itself.
"""

from __future__ import annotations

import importlib
import json
import os
import struct
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdc.errors import DecodeError
from cdc.router import TxContext
from cdc.wal import pgoutput
from cdc.wal.pgoutput import (
    UNCHANGED_TOAST,
    Begin,
    Commit,
    Delete,
    Insert,
    Message,
    Origin,
    PgOutputMessage,
    Relation,
    RelationCache,
    Truncate,
    TupleData,
    Type,
    Update,
    Value,
    decode,
)
from cdc.wal.replproto import lsn_to_str
from tests.conftest import IN_CI
from tests.unit.conftest import COMPILED_INSERT_PARSER, INSERT_PARSERS, InsertTextValues

VECTORS = Path(__file__).parent / "data" / "pgoutput" / "vectors.json"
FRAMING_TAGS = frozenset("BCRYO")  # checked by their own tests, not as "changes"


@cache
def vectors() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(VECTORS.read_text())
    return data


def lsn(text: str) -> int:
    hi, lo = text.split("/")
    return (int(hi, 16) << 32) | int(lo, 16)


def raw(entry: dict[str, Any]) -> bytes:
    return bytes.fromhex(entry["hex"])


def messages(tag: str | None = None, xid: int | None = None) -> list[dict[str, Any]]:
    return [
        m
        for m in vectors()["messages"]
        if (tag is None or m["tag"] == tag) and (xid is None or m["xid"] == xid)
    ]


def transactions() -> list[dict[str, Any]]:
    return [tx for tx in vectors()["transactions"] if "xid" in tx]


def tx_named(name: str) -> dict[str, Any]:
    return next(tx for tx in vectors()["transactions"] if tx["name"] == name)


def relation_oid(name: str) -> int:
    oid: int = vectors()["catalog"]["relations"][name]["oid"]
    return oid


def expected_tuple(values: list[Any] | None) -> TupleData | None:
    if values is None:
        return None
    out: list[Value] = []
    for value in values:
        if value is None:
            out.append(None)
        elif value == "unchanged-toast":
            out.append(UNCHANGED_TOAST)
        elif "text" in value:
            out.append(value["text"].encode())
        else:
            out.append(bytes.fromhex(value["binary"]))
    return tuple(out)


def expected_message(change: dict[str, Any]) -> PgOutputMessage | None:
    """The decoded object a change of the JSON must equal (Message lsn checked apart)."""
    kind = change["kind"]
    if kind == "Insert":
        new = expected_tuple(change["new"])
        assert new is not None
        return Insert(relation_oid(change["relation"]), new)
    if kind == "Update":
        new = expected_tuple(change["new"])
        assert new is not None
        old = expected_tuple(change["old"])
        return Update(relation_oid(change["relation"]), old, new, change["old_form"] == "K")
    if kind == "Delete":
        old = expected_tuple(change["old"])
        return Delete(relation_oid(change["relation"]), old, change["old_form"] == "K")
    if kind == "Truncate":
        oids = tuple(relation_oid(name) for name in change["relations"])
        return Truncate(change["options"], oids)
    return None


def decoded_changes(xid: int) -> list[tuple[dict[str, Any], PgOutputMessage]]:
    return [(m, decode(raw(m))) for m in messages(xid=xid) if m["tag"] not in FRAMING_TAGS]


# --- transaction framing -------------------------------------------------------


@pytest.mark.parametrize("tx", transactions(), ids=lambda tx: tx["name"])
def test_begin_and_commit_frame_the_transaction_with_matching_lsns_and_unix_time(
    tx: dict[str, Any],
) -> None:
    (begin_row,) = messages("B", tx["xid"])
    (commit_row,) = messages("C", tx["xid"])
    begin = decode(raw(begin_row))
    commit = decode(raw(commit_row))
    assert isinstance(begin, Begin)
    assert isinstance(commit, Commit)
    assert begin.xid == tx["xid"]
    assert begin.final_lsn == commit.commit_lsn  # both: LSN of the commit record
    assert commit.end_lsn == lsn(commit_row["lsn"])  # what the server reports for it
    assert commit.commit_lsn < commit.end_lsn
    assert commit.flags == 0
    assert begin.commit_ts_us == commit.commit_ts_us
    if "origin" in tx:  # a replayed transaction keeps its origin's commit time
        assert commit.commit_ts_us == tx["origin"]["commit_ts_us"]
    else:
        assert tx["commit_not_before_us"] <= commit.commit_ts_us <= tx["commit_not_after_us"]


def test_begin_final_lsn_increases_in_commit_order() -> None:
    finals = [decode(raw(m)) for m in messages("B")]
    ids = [b.final_lsn for b in finals if isinstance(b, Begin)]
    assert len(ids) == len(transactions())
    assert ids == sorted(set(ids))


def test_origin_names_the_replication_origin_and_its_commit_lsn() -> None:
    tx = tx_named("under_replication_origin")
    (origin_row,) = messages("O", tx["xid"])
    assert decode(raw(origin_row)) == Origin(tx["origin"]["commit_lsn"], tx["origin"]["name"])


# --- schema messages -------------------------------------------------------------


@pytest.mark.parametrize("row", messages("R"), ids=lambda m: f"{m['lsn']}-{m['xid']}")
def test_relation_describes_the_table_as_the_catalog_does(row: dict[str, Any]) -> None:
    rel = decode(raw(row))
    assert isinstance(rel, Relation)
    (name,) = [n for n, r in vectors()["catalog"]["relations"].items() if r["oid"] == rel.oid]
    want = vectors()["catalog"]["relations"][name]
    assert (rel.namespace, rel.name, rel.replica_identity) == (
        want["namespace"],
        name,
        want["replica_identity"],
    )
    got_cols = [(c.name, c.type_oid, c.type_modifier, c.is_key) for c in rel.columns]
    want_cols = [(c["name"], c["type_oid"], c["type_modifier"], c["key"]) for c in want["columns"]]
    assert got_cols == want_cols


def test_type_message_describes_the_enum_column_type() -> None:
    mood = vectors()["catalog"]["types"]["mood"]
    decoded = {decode(raw(m)) for m in messages("Y")}
    assert decoded == {Type(mood["oid"], mood["namespace"], "mood")}


def test_type_message_precedes_the_relation_that_uses_it() -> None:
    tags = [m["tag"] for m in messages(xid=tx_named("profile_insert")["xid"])]
    assert tags == ["B", "Y", "R", "I", "C"]


# --- row changes and messages ----------------------------------------------------


@pytest.mark.parametrize(
    "tx", [t for t in vectors()["transactions"] if "changes" in t], ids=lambda tx: tx["name"]
)
def test_changes_decode_to_exactly_what_the_transaction_wrote(tx: dict[str, Any]) -> None:
    got = decoded_changes(tx.get("xid", 0))
    assert len(got) == len(tx["changes"])
    for (row, decoded), change in zip(got, tx["changes"], strict=True):
        if change["kind"] == "Message":
            assert decoded == Message(
                change["transactional"],
                lsn(row["lsn"]),
                change["prefix"],
                change["content"].encode(),
            )
        else:
            assert decoded == expected_message(change)


def test_transactional_message_lsn_is_the_end_of_its_record_inside_the_transaction() -> None:
    tx = tx_named("message_only")
    (row,) = messages("M", tx["xid"])
    msg = decode(raw(row))
    begin = decode(raw(messages("B", tx["xid"])[0]))
    commit = decode(raw(messages("C", tx["xid"])[0]))
    assert isinstance(msg, Message)
    assert isinstance(begin, Begin)
    assert isinstance(commit, Commit)
    assert msg.transactional
    assert msg.lsn <= begin.final_lsn < commit.end_lsn


def test_non_transactional_message_arrives_outside_any_transaction() -> None:
    (row,) = messages("M", 0)
    msg = decode(raw(row))
    assert isinstance(msg, Message)
    assert not msg.transactional
    assert (msg.prefix, msg.content) == ("heartbeat", b"tick")


def test_update_keeps_unchanged_toast_values_as_the_sentinel() -> None:
    tx = tx_named("profile_update_no_key_change")
    ((_, update),) = decoded_changes(tx["xid"])
    assert isinstance(update, Update)
    assert update.old is None
    assert update.new[3] is UNCHANGED_TOAST


def test_binary_mode_values_are_the_raw_send_format() -> None:
    rows = vectors()["binary_messages"]
    rel = decode(raw(next(r for r in rows if r["tag"] == "R")))
    insert = decode(raw(next(r for r in rows if r["tag"] == "I")))
    assert isinstance(rel, Relation)
    assert insert == expected_message(tx_named("profile_insert")["binary_changes"][0])


def test_decode_accepts_memoryview_and_bytearray_alike() -> None:
    for row in messages():
        data = raw(row)
        assert decode(memoryview(b"pad" + data)[3:]) == decode(bytearray(data)) == decode(data)


# --- relation cache --------------------------------------------------------------


def outbox_cache() -> RelationCache:
    cache = RelationCache()
    for row in messages("R"):
        rel = decode(raw(row))
        assert isinstance(rel, Relation)
        cache.update(rel)
    return cache


def test_row_dict_maps_outbox_columns_to_text_values() -> None:
    cache = outbox_cache()
    tx = tx_named("outbox_two_inserts_and_message")
    names = [c["name"] for c in vectors()["catalog"]["relations"]["outbox"]["columns"]]
    inserts = [d for _, d in decoded_changes(tx["xid"]) if isinstance(d, Insert)]
    changes = [c for c in tx["changes"] if c["kind"] == "Insert"]
    for insert, change in zip(inserts, changes, strict=True):
        want = {
            n: None if v is None else v["text"] for n, v in zip(names, change["new"], strict=True)
        }
        assert cache.row_dict(insert) == want
    assert cache.row_dict(inserts[0])["tracingspancontext"] is None
    assert cache.row_dict(inserts[1])["aggregatetype"] == "user"


def test_relation_cache_get_returns_the_latest_description() -> None:
    cache = RelationCache()
    old = Relation(1, "public", "t", "d", ())
    new = Relation(1, "public", "t2", "f", ())
    cache.update(old)
    cache.update(new)
    assert cache.get(1) is new
    assert 1 in cache
    assert len(cache) == 1


def test_relation_cache_rejects_unknown_relation_oid() -> None:
    cache = RelationCache()
    with pytest.raises(DecodeError, match="relation oid 42"):
        cache.get(42)
    with pytest.raises(DecodeError, match="relation oid 42"):
        cache.row_dict(Insert(42, (b"x",)))


def test_row_dict_rejects_a_row_whose_width_differs_from_its_relation() -> None:
    cache = outbox_cache()
    with pytest.raises(DecodeError, match="columns"):
        cache.row_dict(Insert(relation_oid("outbox"), (b"x",)))


def test_row_dict_rejects_a_row_with_unchanged_toast() -> None:
    cache = outbox_cache()
    tx = tx_named("profile_update_no_key_change")
    ((_, update),) = decoded_changes(tx["xid"])
    assert isinstance(update, Update)
    with pytest.raises(DecodeError, match="TOAST"):
        cache.row_dict(update)


def test_row_dict_rejects_invalid_utf8() -> None:
    cache = RelationCache()
    cache.update(decode_relation_with_one_text_column())
    with pytest.raises(DecodeError, match="UTF-8"):
        cache.row_dict(Insert(7, (b"\xff\xfe",)))


def decode_relation_with_one_text_column() -> Relation:
    data = b"R" + (7).to_bytes(4, "big") + b"public\0t\0d" + (1).to_bytes(2, "big")
    data += b"\x01v\0" + (25).to_bytes(4, "big") + (-1).to_bytes(4, "big", signed=True)
    rel = decode(data)
    assert isinstance(rel, Relation)
    return rel


# --- malformed input -------------------------------------------------------------


@pytest.mark.parametrize("row", messages(), ids=lambda m: f"{m['tag']}-{m['lsn']}")
def test_every_truncation_of_a_real_message_raises_decode_error(row: dict[str, Any]) -> None:
    data = raw(row)
    for cut in range(len(data)):
        with pytest.raises(DecodeError):
            decode(data[:cut])


@pytest.mark.parametrize("row", messages(), ids=lambda m: f"{m['tag']}-{m['lsn']}")
def test_trailing_bytes_after_a_real_message_raise_decode_error(row: dict[str, Any]) -> None:
    with pytest.raises(DecodeError, match="trailing"):
        decode(raw(row) + b"\0")


def test_empty_buffer_raises_decode_error() -> None:
    with pytest.raises(DecodeError, match="empty"):
        decode(b"")


@pytest.mark.parametrize("tag", [b"S", b"E", b"c", b"A", b"b", b"P", b"K", b"r", b"p", b"w"])
def test_tags_outside_protocol_v1_raise_decode_error_naming_the_tag(tag: bytes) -> None:
    with pytest.raises(DecodeError, match=f"unknown pgoutput message tag '{tag.decode()}'"):
        decode(tag + b"\0" * 20)


def test_unknown_tuple_value_kind_raises_decode_error() -> None:
    data = b"I" + (7).to_bytes(4, "big") + b"N" + (1).to_bytes(2, "big") + b"x"
    with pytest.raises(DecodeError, match="tuple value kind"):
        decode(data)


def test_insert_without_new_tuple_marker_raises_decode_error() -> None:
    data = b"I" + (7).to_bytes(4, "big") + b"K" + (1).to_bytes(2, "big") + b"n"
    with pytest.raises(DecodeError, match="'N'"):
        decode(data)


def test_delete_without_old_tuple_raises_decode_error() -> None:
    data = b"D" + (7).to_bytes(4, "big") + b"N" + (1).to_bytes(2, "big") + b"n"
    with pytest.raises(DecodeError, match="'K' or 'O'"):
        decode(data)


def test_invalid_utf8_in_a_name_raises_decode_error() -> None:
    data = b"Y" + (7).to_bytes(4, "big") + b"public\0\xff\0"
    with pytest.raises(DecodeError, match="Type"):
        decode(data)


MESSAGE_TYPES = (Begin, Commit, Origin, Relation, Type, Insert, Update, Delete, Truncate, Message)


def assert_decodes_or_raises_decode_error(data: bytes) -> None:
    try:
        msg = decode(data)
    except DecodeError:
        return
    assert isinstance(msg, MESSAGE_TYPES)


@given(st.binary(max_size=64))
def test_arbitrary_bytes_decode_or_raise_decode_error(data: bytes) -> None:
    assert_decodes_or_raises_decode_error(data)


@given(st.sampled_from(sorted("BCORYIUDTM")), st.binary(max_size=64))
def test_arbitrary_bodies_of_known_kinds_decode_or_raise_decode_error(
    tag: str, body: bytes
) -> None:
    assert_decodes_or_raises_decode_error(tag.encode() + body)


# --- the relay's fast path ------------------------------------------------------

COMPILED = COMPILED_INSERT_PARSER
# The same tests run against both Insert parsers: each must give decode's answers
# or decline, never a wrong one.
each_implementation = pytest.mark.parametrize("parse", INSERT_PARSERS)


def test_the_compiled_hot_path_is_built_where_the_tests_run() -> None:
    """make venv builds cdc.wal._pgfast (gcc and the Python headers are on the CI machine)."""
    if COMPILED is None:
        message = "cdc.wal._pgfast is not built: only the pure-Python parser was tested"
        if IN_CI:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    expected = os.environ.get(pgoutput.PURE_PYTHON_VAR, "").strip() not in ("1", "true", "yes")
    assert pgoutput.COMPILED is expected


@pytest.mark.parametrize(("value", "compiled"), [("1", False), ("0", True), ("", True)])
def test_the_pure_python_switch_selects_the_parser(value: str, compiled: bool) -> None:
    """OUTBOX_CDC_PURE_PYTHON=1 makes the relay use the Python parser even where C is built."""
    env = {**os.environ, pgoutput.PURE_PYTHON_VAR: value}
    probe = "from cdc.wal import pgoutput as p; print(p.COMPILED, p.insert_text_values.__module__)"
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    expected = compiled and COMPILED is not None
    assert out == (["True", "cdc.wal._pgfast"] if expected else ["False", "cdc.wal.pgoutput"])


def assert_fast_path_agrees_with_decode(parse: InsertTextValues, data: bytes) -> None:
    """insert_text_values gives decode's OID and values, or None (never a wrong answer)."""
    found = parse(data)
    if found is None:
        return
    msg = decode(data)
    assert isinstance(msg, Insert)
    assert found == (msg.relation_oid, list(msg.new))


@each_implementation
def test_fast_path_reads_every_captured_text_insert_like_decode(parse: InsertTextValues) -> None:
    inserts = [raw(m) for m in messages("I")]
    assert inserts
    taken = 0
    for data in inserts:
        assert_fast_path_agrees_with_decode(parse, data)
        taken += parse(data) is not None
    assert taken == len(inserts)  # text-mode inserts all take the fast path


@each_implementation
def test_fast_path_declines_binary_values_other_kinds_and_malformed_inserts(
    parse: InsertTextValues,
) -> None:
    binary_insert = next(
        data
        for data in (bytes.fromhex(m["hex"]) for m in vectors()["binary_messages"])
        if data[:1] == b"I"
    )
    insert = raw(messages("I")[0])
    for data in (
        binary_insert,  # 'b' values: decode keeps them as raw send-format bytes
        raw(messages("B")[0]),
        insert[:-1],  # truncated value
        insert + b"\x00",  # trailing byte
        insert[:5],  # short header
        insert[:8],  # a header promising columns, none there
        b"",
    ):
        assert parse(data) is None


@each_implementation
@given(st.binary(max_size=64))
def test_fast_path_on_arbitrary_insert_bodies_agrees_with_decode_or_declines(
    parse: InsertTextValues, body: bytes
) -> None:
    assert_fast_path_agrees_with_decode(parse, b"I" + body)


_column = st.one_of(
    st.binary(max_size=12).map(lambda v: b"t" + len(v).to_bytes(4, "big") + v),
    st.binary(max_size=12).map(lambda v: b"b" + len(v).to_bytes(4, "big") + v),
    st.just(b"n"),
    st.just(b"u"),
    st.binary(min_size=1, max_size=3),  # a bad kind or a lying size
)


@each_implementation
@given(
    st.integers(min_value=0, max_value=2**32 - 1),
    st.lists(_column, max_size=8),
    st.integers(min_value=-2, max_value=2),
    st.sampled_from([b"N", b"K"]),
    st.integers(min_value=-3, max_value=2),
    st.binary(max_size=30),
)
def test_fast_path_on_generated_inserts_agrees_with_decode_or_declines(
    parse: InsertTextValues,
    oid: int,
    columns: list[bytes],
    ncols_skew: int,
    kind: bytes,
    cut: int,
    before: bytes,
) -> None:
    ncols = max(0, len(columns) + ncols_skew)
    data = b"I" + oid.to_bytes(4, "big") + kind + ncols.to_bytes(2, "big") + b"".join(columns)
    data = data[:cut] if cut < 0 else data + b"\x00" * cut
    assert_fast_path_agrees_with_decode(parse, data)
    # read in place: the same message after other bytes of a memoryview (the relay
    # passes the CopyData message and the offset of its payload) reads the same
    in_place = parse(memoryview(before + data), len(before))
    assert in_place == parse(data)
    assert in_place is None or all(type(v) is bytes or v is None for v in in_place[1])
    if COMPILED is not None:  # the two parsers agree on every input, declines included
        assert COMPILED(data) == pgoutput._insert_text_values_py(data)
        at = len(before)
        buffer = before + data
        assert COMPILED(buffer, at) == pgoutput._insert_text_values_py(buffer, at)


@each_implementation
def test_an_offset_at_or_past_the_end_declines_and_a_negative_one_raises(
    parse: InsertTextValues,
) -> None:
    insert = raw(messages("I")[0])
    assert parse(insert, 0) is not None
    assert parse(insert, len(insert)) is None
    assert parse(insert, len(insert) + 5) is None
    with pytest.raises(ValueError, match="negative offset"):
        parse(insert, -1)


# --- Begin read in place, with its header texts ---------------------------------

COMPILED_BEGIN = (
    importlib.import_module("cdc.wal._pgfast").begin_context if COMPILED is not None else None
)
#: The pure-Python Begin reader and the compiled one (where built).
BEGIN_PARSERS = [pytest.param(pgoutput._begin_context_py, id="python-parser")] + (
    [pytest.param(COMPILED_BEGIN, id="c-parser")] if COMPILED_BEGIN is not None else []
)
each_begin_parser = pytest.mark.parametrize("parse", BEGIN_PARSERS)
_PG_EPOCH_US = 946_684_800_000_000
_YEAR_1000_US = -30_610_224_000_000_000  # 1000-01-01T00:00:00Z
_YEAR_10000_US = 253_402_300_800_000_000  # 10000-01-01T00:00:00Z


def _begin_message(final_lsn: int, unix_us: int, xid: int = 7) -> bytes:
    return b"B" + struct.pack(">QqI", final_lsn, unix_us - _PG_EPOCH_US, xid)


def _reference(final_lsn: int, unix_us: int) -> tuple[int, int, bytes, bytes]:
    """What the relay's headers read for this Begin (cdc.router.TxContext)."""
    tx = TxContext(lsn_to_str(final_lsn), unix_us)
    return final_lsn, unix_us, tx.lsn_header[1], tx.ts_header[1]


@each_begin_parser
def test_every_captured_begin_reads_as_decode_with_the_headers_texts(parse: Any) -> None:
    begins = [raw(m) for m in messages("B")]
    assert begins
    for data in begins:
        msg = decode(data)
        assert isinstance(msg, Begin)
        assert parse(data) == _reference(msg.final_lsn, msg.commit_ts_us)


@each_begin_parser
@pytest.mark.parametrize(
    ("unix_us", "formatted"),
    [
        (_YEAR_1000_US, b"1000-01-01T00:00:00.000000Z"),
        (_YEAR_1000_US - 1, None),
        (_YEAR_10000_US - 1, b"9999-12-31T23:59:59.999999Z"),
        (_YEAR_10000_US, None),
        (0, b"1970-01-01T00:00:00.000000Z"),
        (-1, b"1969-12-31T23:59:59.999999Z"),
        (951_782_400_000_001, b"2000-02-29T00:00:00.000001Z"),
        (1_795_000_000_123_456, b"2026-11-18T11:06:40.123456Z"),
    ],
)
def test_the_commit_time_is_formatted_for_the_years_1000_to_9999_only(
    parse: Any, unix_us: int, formatted: bytes | None
) -> None:
    found = parse(_begin_message(0x16B374D848, unix_us))
    assert (found[3] if found else None) == formatted
    if found:
        assert found == _reference(0x16B374D848, unix_us)


@each_begin_parser
def test_a_begin_that_is_not_one_declines_and_a_negative_offset_raises(parse: Any) -> None:
    data = _begin_message(1, 0)
    for wrong in (data[:-1], data + b"\0", b"C" + data[1:], b""):
        assert parse(wrong) is None
    assert parse(data, len(data)) is None
    with pytest.raises(ValueError, match="negative offset"):
        parse(data, -1)


@each_begin_parser
@given(
    st.integers(min_value=0, max_value=2**64 - 1),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.binary(max_size=30),
)
def test_generated_begins_read_as_the_reference_or_decline_alike(
    parse: Any, final_lsn: int, pg_ts: int, before: bytes
) -> None:
    data = b"B" + struct.pack(">QqI", final_lsn, pg_ts, 7)
    found = parse(data)
    assert parse(memoryview(before + data), len(before)) == found  # read in place
    unix_us = pg_ts + _PG_EPOCH_US
    assert (found is not None) is (_YEAR_1000_US <= unix_us < _YEAR_10000_US)
    if found is not None:
        assert found == _reference(final_lsn, unix_us)
    if COMPILED_BEGIN is not None:  # the two agree on every input
        assert COMPILED_BEGIN(before + data, len(before)) == pgoutput._begin_context_py(data)


@given(st.integers(min_value=_YEAR_1000_US, max_value=_YEAR_10000_US - 1))
def test_the_compiled_and_python_commit_times_agree_across_the_years(unix_us: int) -> None:
    data = _begin_message(0, unix_us)
    expected = _reference(0, unix_us)
    assert pgoutput._begin_context_py(data) == expected
    if COMPILED_BEGIN is not None:
        assert COMPILED_BEGIN(data) == expected
