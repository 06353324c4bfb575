"""Capture real pgoutput (protocol v1) bytes as test vectors for ``cdc.wal.pgoutput``.

What it guarantees: ``vectors.json`` next to this file holds bytes produced by a
real PostgreSQL walsender/decoder, each with expectations derived *independently
of the decoder under test* (from the catalog, from ``RETURNING`` and from the
server clock), so the unit tests compare the decoder against the server, not
against itself.

Run it (re-runnable; it cleans up after itself, even on failure)::

    source .dev/env            # gives CDC_PG_DSN (superuser, wal_level=logical)
    .venv/bin/python tests/unit/data/pgoutput/capture.py

It is not a test module (no ``test_`` prefix, so pytest never collects it).

Steps:

1. create a throw-away database ``capture_<random>`` with an enum type, a copy of
   the outbox table, a default-replica-identity table (``profile``: 'K' forms,
   unchanged TOAST) and a REPLICA IDENTITY FULL table (``audit``: 'O' forms);
   a publication over the three and a ``pgoutput`` slot;
2. run transactions covering every message kind: outbox inserts plus a
   transactional ``pg_logical_emit_message(true, 'outbox', ...)``, a
   message-only transaction, a non-transactional message, insert/update/delete
   in both identity forms, a TRUNCATE of two tables with CASCADE and RESTART
   IDENTITY, and a transaction replayed under a replication origin (Origin
   message); the enum column makes the server send a Type message;
3. read them with ``pg_logical_slot_peek_binary_changes`` (text values), and the
   ``profile`` insert once more with ``binary 'true'`` (binary 'b' values);
4. stream the slot once over a real replication connection
   (``START_REPLICATION``) to keep raw CopyData frames: XLogData ('w') and a
   keepalive ('k') answered to a standby status update with reply requested;
5. drop the slot, the replication origin and the database.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import struct
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from psycopg import pq, sql
from psycopg.pq.abc import PGconn

OUT = Path(__file__).with_name("vectors.json")
SLOT = "capture_slot"
PUB = "capture_pub"
ORIGIN = "capture_origin"
ORIGIN_LSN = "0/ABCDEF"
#: bio longer than TOAST_TUPLE_THRESHOLD (~2 kB) with STORAGE EXTERNAL: stored
#: out of line, so an UPDATE that leaves it alone sends 'u' (unchanged TOAST).
BIO = "toasted-" * 400
PG_EPOCH_OFFSET_US = 946_684_800_000_000
STREAM_TIMEOUT_S = 20

SCHEMA = """
CREATE TYPE mood AS ENUM ('calm', 'excited');
CREATE TABLE outbox (
    id                 uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    aggregatetype      text        NOT NULL,
    aggregateid        text        NOT NULL,
    type               text        NOT NULL,
    payload            jsonb       NOT NULL,
    created_at         timestamptz NOT NULL DEFAULT now(),
    tracingspancontext text        NULL
);
CREATE TABLE profile (id int PRIMARY KEY, name text NOT NULL, mood mood NOT NULL,
                      bio text, blob bytea);
ALTER TABLE profile ALTER COLUMN bio SET STORAGE EXTERNAL;
CREATE TABLE audit (id int PRIMARY KEY, note text);
ALTER TABLE audit REPLICA IDENTITY FULL;
CREATE PUBLICATION capture_pub FOR TABLE outbox, profile, audit;
"""

PEEK = """
SELECT lsn::text, xid::text::bigint, data FROM pg_logical_slot_peek_binary_changes(
    %s, NULL, NULL, 'proto_version', '1', 'publication_names', %s,
    'messages', 'true', 'binary', %s)
"""


def now_us(cur: psycopg.Cursor[Any]) -> int:
    """Server wall clock, Unix-epoch microseconds."""
    row = cur.execute("SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint").fetchone()
    assert row is not None
    return int(row[0])


def text(value: str) -> dict[str, str]:
    return {"text": value}


def lsn_int(lsn: str) -> int:
    hi, lo = lsn.split("/")
    return (int(hi, 16) << 32) | int(lo, 16)


class Recorder:
    """Runs the scenario and remembers what each transaction should decode to."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.txs: list[dict[str, Any]] = []

    @contextmanager
    def tx(self, name: str) -> Iterator[tuple[psycopg.Cursor[Any], dict[str, Any]]]:
        cur = self.conn.cursor()
        cur.execute("BEGIN")
        info: dict[str, Any] = {"name": name, "xid": self.xid(cur)}
        yield cur, info
        info["commit_not_before_us"] = now_us(cur)
        cur.execute("COMMIT")
        info["commit_not_after_us"] = now_us(cur)
        self.txs.append(info)

    def xid(self, cur: psycopg.Cursor[Any]) -> int:
        row = cur.execute("SELECT txid_current() % 4294967296").fetchone()
        assert row is not None
        return int(row[0])


def outbox_insert(cur: psycopg.Cursor[Any], trace: str | None) -> list[Any]:
    row = cur.execute(
        """INSERT INTO outbox (aggregatetype, aggregateid, type, payload, tracingspancontext)
           VALUES ('user', gen_random_uuid()::text, 'UserRegistered',
                   jsonb_build_object('user_id', gen_random_uuid(), 'email', 'ada@example.org',
                                      'display_name', 'Ada Lovelace', 'registered_at', now()),
                   %s)
           RETURNING id::text, aggregatetype, aggregateid, type, payload::text,
                     created_at::text, tracingspancontext""",
        (trace,),
    ).fetchone()
    assert row is not None
    return [None if v is None else text(v) for v in row]


def ins(relation: str, new: list[Any]) -> dict[str, Any]:
    return {"kind": "Insert", "relation": relation, "new": new}


def upd(relation: str, form: str | None, old: list[Any] | None, new: list[Any]) -> dict[str, Any]:
    return {"kind": "Update", "relation": relation, "old_form": form, "old": old, "new": new}


def dele(relation: str, form: str, old: list[Any]) -> dict[str, Any]:
    return {"kind": "Delete", "relation": relation, "old_form": form, "old": old}


def msg(transactional: bool, prefix: str, content: str) -> dict[str, Any]:
    return {"kind": "Message", "transactional": transactional, "prefix": prefix, "content": content}


def run_scenario(rec: Recorder) -> None:
    """Each transaction becomes one entry of ``transactions`` in the JSON.

    ``changes`` lists, in stream order, the messages the transaction must decode
    to (Begin, Commit, Relation, Type and Origin are checked separately).
    Tuple values: ``{"text": s}``, ``{"binary": hex}``, ``null`` (SQL NULL, or a
    column absent from a key-only old tuple) or ``"unchanged-toast"``.
    """
    message = json.dumps({"id": "6f1d0000-0000-4000-8000-000000000001", "type": "Ping"})
    with rec.tx("outbox_two_inserts_and_message") as (cur, info):
        trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        info["changes"] = [
            ins("outbox", outbox_insert(cur, None)),
            ins("outbox", outbox_insert(cur, trace)),
        ]
        cur.execute("SELECT pg_logical_emit_message(true, 'outbox', %s)", (message,))
        info["changes"].append(msg(True, "outbox", message))
    with rec.tx("message_only") as (cur, info):
        cur.execute("SELECT pg_logical_emit_message(true, 'outbox', %s)", ('{"n": 2}',))
        info["changes"] = [msg(True, "outbox", '{"n": 2}')]
    rec.conn.execute("SELECT pg_logical_emit_message(false, 'heartbeat', 'tick')")
    rec.txs.append(
        {"name": "non_transactional_message", "changes": [msg(False, "heartbeat", "tick")]}
    )
    run_row_changes(rec)
    run_origin(rec)


def run_row_changes(rec: Recorder) -> None:
    t = text
    u = "unchanged-toast"
    blob = t("\\xdeadbeef")
    with rec.tx("profile_insert") as (cur, info):
        cur.execute(
            "INSERT INTO profile VALUES (1, 'Ada', 'calm', %s, '\\xdeadbeef'::bytea)", (BIO,)
        )
        info["changes"] = [ins("profile", [t("1"), t("Ada"), t("calm"), t(BIO), blob])]
        info["binary_changes"] = [
            ins(
                "profile",
                [
                    {"binary": "00000001"},
                    {"binary": b"Ada".hex()},
                    {"binary": b"calm".hex()},
                    {"binary": BIO.encode().hex()},
                    {"binary": "deadbeef"},
                ],
            )
        ]
    with rec.tx("profile_update_no_key_change") as (cur, info):
        cur.execute("UPDATE profile SET mood = 'excited' WHERE id = 1")
        new = [t("1"), t("Ada"), t("excited"), u, blob]
        info["changes"] = [upd("profile", None, None, new)]
    with rec.tx("profile_update_key_change") as (cur, info):
        cur.execute("UPDATE profile SET id = 2, name = 'Ada L.' WHERE id = 1")
        old = [t("1"), None, None, None, None]
        new = [t("2"), t("Ada L."), t("excited"), u, blob]
        info["changes"] = [upd("profile", "K", old, new)]
    with rec.tx("profile_delete") as (cur, info):
        cur.execute("DELETE FROM profile WHERE id = 2")
        info["changes"] = [dele("profile", "K", [t("2"), None, None, None, None])]
    with rec.tx("audit_full_identity") as (cur, info):
        cur.execute("INSERT INTO audit VALUES (1, 'first'), (2, NULL)")
        cur.execute("UPDATE audit SET note = 'second' WHERE id = 1")
        cur.execute("DELETE FROM audit WHERE id = 1")
        info["changes"] = [
            ins("audit", [t("1"), t("first")]),
            ins("audit", [t("2"), None]),
            upd("audit", "O", [t("1"), t("first")], [t("1"), t("second")]),
            dele("audit", "O", [t("1"), t("second")]),
        ]
    with rec.tx("truncate_two_tables") as (cur, info):
        cur.execute("INSERT INTO profile VALUES (3, 'Bob', 'calm', NULL, NULL)")
        cur.execute("TRUNCATE audit, profile RESTART IDENTITY CASCADE")
        info["changes"] = [
            ins("profile", [t("3"), t("Bob"), t("calm"), None, None]),
            # options: 1 = CASCADE, 2 = RESTART IDENTITY
            {"kind": "Truncate", "options": 3, "relations": ["audit", "profile"]},
        ]


def run_origin(rec: Recorder) -> None:
    rec.conn.execute("SELECT pg_replication_origin_create(%s)", (ORIGIN,))
    rec.conn.execute("SELECT pg_replication_origin_session_setup(%s)", (ORIGIN,))
    try:
        with rec.tx("under_replication_origin") as (cur, info):
            cur.execute("SELECT pg_replication_origin_xact_setup(%s, now())", (ORIGIN_LSN,))
            info["changes"] = [ins("outbox", outbox_insert(cur, None))]
            # The origin's timestamp (here: now()) becomes the commit timestamp.
            row = cur.execute("SELECT (extract(epoch FROM now()) * 1000000)::bigint").fetchone()
            assert row is not None
            info["origin"] = {
                "name": ORIGIN,
                "commit_lsn": lsn_int(ORIGIN_LSN),
                "commit_ts_us": int(row[0]),
            }
    finally:
        rec.conn.execute("SELECT pg_replication_origin_session_reset()")


def catalog(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """Relations and types as the catalog knows them (what Relation/Type must say)."""
    rels: dict[str, Any] = {}
    for table in ("outbox", "profile", "audit"):
        row = conn.execute(
            "SELECT c.oid::int, n.nspname, c.relreplident FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relname = %s",
            (table,),
        ).fetchone()
        assert row is not None
        cols = conn.execute(
            """SELECT a.attname, a.atttypid::int, a.atttypmod,
                      coalesce(a.attnum = ANY(i.indkey), false)
               FROM pg_attribute a
               LEFT JOIN pg_index i ON i.indrelid = a.attrelid AND i.indisprimary
               WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped
               ORDER BY a.attnum""",
            (row[0],),
        ).fetchall()
        full = row[2] == "f"
        rels[table] = {
            "oid": row[0],
            "namespace": row[1],
            "replica_identity": row[2],
            "columns": [
                {"name": c[0], "type_oid": c[1], "type_modifier": c[2], "key": bool(c[3]) or full}
                for c in cols
            ],
        }
    mood = conn.execute(
        "SELECT t.oid::int, n.nspname FROM pg_type t JOIN pg_namespace n "
        "ON n.oid = t.typnamespace WHERE t.typname = 'mood'"
    ).fetchone()
    assert mood is not None
    return {"relations": rels, "types": {"mood": {"oid": mood[0], "namespace": mood[1]}}}


def peek(conn: psycopg.Connection[Any], *, binary: bool) -> list[dict[str, Any]]:
    flag = "true" if binary else "false"
    rows = conn.execute(PEEK, (SLOT, PUB, flag)).fetchall()
    return [
        {"lsn": lsn, "xid": xid, "tag": bytes(data[:1]).decode(), "hex": bytes(data).hex()}
        for lsn, xid, data in rows
    ]


def stream_frames(dsn: str, stop_lsn: str) -> list[dict[str, Any]]:
    """Raw CopyData frames from START_REPLICATION, up to the commit at ``stop_lsn``.

    Then one standby status update asking for a reply, and the keepalive answer.
    Nothing is confirmed (flush position 0), so the slot does not move.
    """
    conninfo = psycopg.conninfo.make_conninfo(dsn, replication="database")
    pgconn = pq.PGconn.connect(conninfo.encode())
    assert pgconn.status == pq.ConnStatus.OK, pgconn.get_error_message()
    cmd = (
        f"START_REPLICATION SLOT {SLOT} LOGICAL 0/0 "
        f"(proto_version '1', publication_names '{PUB}', messages 'true')"
    )
    pgconn.send_query(cmd.encode())
    res = pgconn.get_result()
    assert res is not None and res.status == pq.ExecStatus.COPY_BOTH, pgconn.get_error_message()
    frames: list[dict[str, Any]] = []
    try:
        while True:
            _, data = pgconn.get_copy_data(0)
            frame = bytes(data)
            if frame[:1] == b"w":
                frames.append({"tag": "w", "hex": frame.hex()})
                (wal_start,) = struct.unpack_from(">Q", frame, 1)
                if frame[25:26] == b"C" and wal_start == lsn_int(stop_lsn):
                    break
            else:
                frames.append({"tag": frame[:1].decode(), "hex": frame.hex()})
        ask_for_reply(pgconn)
        while True:
            _, data = pgconn.get_copy_data(0)
            frame = bytes(data)
            if frame[:1] == b"k":
                frames.append({"tag": "k", "hex": frame.hex(), "answer_to_reply_request": True})
                break
    finally:
        pgconn.finish()
    return frames


def ask_for_reply(pgconn: PGconn) -> None:
    """Standby status update 'r': write/flush/apply positions 0, reply requested."""
    pg_now = time.time_ns() // 1000 - PG_EPOCH_OFFSET_US
    msg = struct.pack(">cQQQqB", b"r", 0, 0, 0, pg_now, 1)
    assert pgconn.put_copy_data(msg) == 1
    assert pgconn.flush() == 0


def capture(server_dsn: str, db_dsn: str) -> dict[str, Any]:
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (SLOT,))
        rec = Recorder(conn)
        run_scenario(rec)
        version = conn.execute("SHOW server_version").fetchone()
        text_msgs = peek(conn, binary=False)
        binary_msgs = peek(conn, binary=True)
        cat = catalog(conn)
    commits = [m["lsn"] for m in text_msgs if m["tag"] == "C"]
    binary_xid = next(tx["xid"] for tx in rec.txs if tx["name"] == "profile_insert")
    frames = stream_frames(db_dsn, commits[1])
    return {
        "about": "Real pgoutput v1 bytes from PostgreSQL; regenerate with capture.py.",
        "server_version": version[0] if version else None,
        "catalog": cat,
        "transactions": rec.txs,
        "bio": BIO,
        "messages": text_msgs,
        "binary_messages": [m for m in binary_msgs if m["xid"] == binary_xid and m["tag"] in "IR"],
        "copy_frames": frames,
    }


def db_dsn_for(server_dsn: str, dbname: str) -> str:
    params = psycopg.conninfo.conninfo_to_dict(server_dsn)
    params["dbname"] = dbname
    return psycopg.conninfo.make_conninfo("", **params)


def cleanup(server_dsn: str, dbname: str) -> None:
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE slot_name = %s AND database = %s",
            (SLOT, dbname),
        )
        conn.execute(
            "SELECT pg_replication_origin_drop(roname) FROM pg_replication_origin "
            "WHERE roname = %s",
            (ORIGIN,),
        )
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(dbname)))


def main() -> int:
    server_dsn = os.environ.get("CDC_PG_DSN")
    if not server_dsn:
        print("CDC_PG_DSN is not set: run `source .dev/env` first", file=sys.stderr)
        return 2
    dbname = f"capture_{secrets.token_hex(4)}"
    signal.alarm(STREAM_TIMEOUT_S * 3)  # never hang on a stream that went quiet
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    try:
        result = capture(server_dsn, db_dsn_for(server_dsn, dbname))
    finally:
        cleanup(server_dsn, dbname)
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {len(result['messages'])} messages to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
