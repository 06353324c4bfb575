"""The rows of a republishing run (:func:`cdc.repair.republish.republish`).

* the run's ids go to the server in chunks of :data:`IDS_PER_FILL` through one binary
  ``COPY`` into a temporary table of the run's connection (:func:`fill_ids`; the
  connection is the run's own and closed at its end): the run's memory does not grow
  with the number of ids;
* its rows are read in one ordered query, streamed in chunks of :data:`FETCH_ROWS`,
  bounded by :data:`READ_TIMEOUT_MS`, with :data:`READ_WORK_MEM`, one of two ways:

  - **the window's order** (:func:`window_query`), when the caller knows when the
    rows were created (the audit: its window), the server does not track commit times
    (the order is ``created_at``, then id), the ids are at least a
    :data:`WINDOW_SHARE` of the window's rows (the planner's estimate), and the server
    plans it without sorting the window (an index on ``created_at``, as the project's
    migration makes): the window is read in its index's order, each row kept when its
    id is in the run's (an index of the ids' table: one lookup per row), rows of one
    ``created_at`` ordered by id as they come. The first row comes at once - a
    10,000,000-row repair's came after 19-25 s of sorting before (the server's
    reading then ran beside the publishing, 44 s of it in all);
  - **the ids' places sorted** (:func:`republish_query`) otherwise: the server sorts
    only each row's place, then reads the rows in that order.

  (A reader thread fetching ahead of the producer was measured and dropped: 10,000,000
  rows took 196 s with it, 144 s without - the two threads contend for the GIL and the
  machine's two cores are busy with the server and the broker anyway.)
"""

from __future__ import annotations

import json
from typing import Any

import psycopg
from psycopg import sql

from cdc.records import ID_BYTES

Conn = psycopg.Connection[Any]

#: Rows per chunk of a run's read (a gap recovery's window, a repair's ids).
FETCH_ROWS = 2_000

#: The run's ids, in a temporary table of the run's connection (gone when it closes).
IDS_TABLE = "outbox_cdc_republish_ids"
_IDS_TABLE_SQL = "CREATE TEMPORARY TABLE outbox_cdc_republish_ids (id uuid NOT NULL)"
#: The ids go in with ``COPY ... (FORMAT BINARY)``: each row is its field count, the
#: field's length and the id's 16 bytes as the server stores a ``uuid`` - nothing to
#: parse (an ``INSERT`` cutting one ``bytea`` into hex texts cast to ``uuid`` took
#: 5.8 s of a 10,000,000-id run's start).
_IDS_COPY_SQL = "COPY outbox_cdc_republish_ids (id) FROM STDIN (FORMAT BINARY)"
#: COPY BINARY's signature, flags and header-extension length; its trailer.
_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + bytes(8)
_COPY_TRAILER = b"\xff\xff"
#: A row's prefix: one field (int16), of 16 bytes (int32).
_ROW_PREFIX = b"\x00\x01\x00\x00\x00\x10"
_ROW_BYTES = len(_ROW_PREFIX) + 16


def copy_rows(ids: bytes | memoryview) -> bytearray:
    """COPY BINARY rows of the 16-byte ``ids`` (concatenated): each id behind
    :data:`_ROW_PREFIX`, laid out by strided slice assignment (no Python loop per id)."""
    count = len(ids) // 16
    out = bytearray(count * _ROW_BYTES)
    for at, byte in enumerate(_ROW_PREFIX):
        if byte:
            out[at::_ROW_BYTES] = bytes((byte,)) * count
    for at in range(16):
        out[len(_ROW_PREFIX) + at :: _ROW_BYTES] = ids[at::16]
    return out


#: The rows of a republishing run, in commit order as far as the table knows it (one
#: aggregate's rows keep their order). The server sorts only each row's place - its
#: table and tuple id (``tableoid``, ``ctid``: a partitioned outbox's partitions share
#: tuple ids), order key, ``created_at`` and id - and then reads each row by its place
#: in that order (a TID scan: no index, the heap near its physical order), not the rows
#: themselves: 10,000,000 rows' first row came after 32 s, all of them after 70 s, where
#: sorting the rows whole took 80-100 s before the first and 107-128 s in all (same
#: machine, load 10-12). The read is one statement: the tuple ids are its snapshot's,
#: and the tuples they name stay while it runs. (``OFFSET 0`` keeps the sorted places
#: a subquery of their own, so the rows are read in their order - a nested loop over
#: them, the outer ``ORDER BY`` met without a sort of the rows.)
REPUBLISH_SQL = """
SELECT o.id::text, o.aggregatetype, o.aggregateid, o.type, o.payload::text,
       o.tracingspancontext, k.ts
FROM (SELECT x.tableoid AS rel, x.ctid AS tid, {when} AS ts, x.created_at AS at, x.id
      FROM {table} AS x JOIN {ids} AS m ON x.id::uuid = m.id
      ORDER BY {places}
      OFFSET 0) AS k
CROSS JOIN LATERAL (
      SELECT * FROM {table} AS y WHERE y.ctid = k.tid AND y.tableoid = k.rel OFFSET 0
) AS o
ORDER BY {rows}
"""
#: The alias of the outbox table whose rows :data:`REPUBLISH_SQL` orders ({when}'s).
ORDER_ALIAS = "x"


def republish_query(
    table: sql.Composable, when: sql.Composable, *, by_commit_time: bool
) -> sql.Composed:
    """:data:`REPUBLISH_SQL` for ``table``, ordered by ``when`` (:data:`ORDER_ALIAS`'s
    order column), then ``created_at``, then id. When ``when`` is ``created_at`` itself
    (``by_commit_time`` false) the keys are the time and the id: both ``ORDER BY`` then
    name the same keys and the server meets the outer one with the places' order (a
    second key equal to the first reads to the planner as another key: the rows
    sorted again, by groups)."""
    if by_commit_time:
        places, rows = "ts, at, x.id", "k.ts, k.at, k.id"
    else:
        places, rows = "ts, x.id", "k.ts, k.id"
    return sql.SQL(REPUBLISH_SQL).format(
        when=when,
        table=table,
        ids=sql.Identifier(IDS_TABLE),
        places=sql.SQL(places),
        rows=sql.SQL(rows),
    )


#: Ids per chunk of the COPY filling the run's id table (2.2 MB): the run's memory does
#: not grow with the number of ids (10,000,000 as one parameter peaked at 711 MB).
IDS_PER_FILL = 100_000
#: The longest the run's ordered read may take in the server (its first fetch sorts
#: the whole run: minutes at tens of millions of rows); past it the run fails.
READ_TIMEOUT_MS = 30 * 60 * 1000
#: The server's memory for the read's join and sort (``SET LOCAL``: this run only):
#: 10,000,000 rows' first row came after 67 s with the default 4 MB, 51 s with this.
READ_WORK_MEM = "256MB"

Ids = bytes | bytearray | memoryview


def fill_ids(conn: Conn, ids: Ids, *, indexed: bool = False) -> None:
    """The run's ids into its temporary table, :data:`IDS_PER_FILL` at a time through one
    ``COPY``, then analyzed (the planner joins them knowing how many there are);
    ``indexed`` (the window's order): an index of them too, and the table vacuumed (a
    lookup then reads the index alone: without, every lookup read the table's page as
    well, and 10,000,000 of them took 96 s instead of 44). ``conn`` in autocommit mode,
    outside a transaction (``VACUUM``), its session's ``temp_buffers`` set before
    (:func:`session_settings`)."""
    conn.execute(_IDS_TABLE_SQL)
    view = memoryview(ids).cast("B")
    step = IDS_PER_FILL * ID_BYTES
    with conn.cursor() as cur, cur.copy(_IDS_COPY_SQL) as copy:
        copy.write(_COPY_HEADER)
        for start in range(0, len(view), step):
            copy.write(copy_rows(view[start : start + step]))
        copy.write(_COPY_TRAILER)
    if indexed:
        conn.execute("CREATE INDEX ON outbox_cdc_republish_ids (id)")
        conn.execute("VACUUM (ANALYZE) outbox_cdc_republish_ids")
    else:
        conn.execute("ANALYZE outbox_cdc_republish_ids")


def session_settings(conn: Conn) -> None:
    """The run's connection's limits (its own connection, closed at the run's end):
    :data:`READ_TIMEOUT_MS`, and :data:`READ_WORK_MEM` for the read's sort and join, the
    ids' index build and the temporary table's buffers (set before the table exists)."""
    conn.execute(
        sql.SQL(
            "SET statement_timeout = {}; SET work_mem = {}; SET maintenance_work_mem = {};"
            " SET temp_buffers = {}"
        ).format(
            sql.Literal(READ_TIMEOUT_MS),
            sql.Literal(READ_WORK_MEM),
            sql.Literal(READ_WORK_MEM),
            sql.Literal(READ_WORK_MEM),
        )
    )


#: The window's order is taken when the ids are at least this share of the rows the
#: window holds (it reads every row of the window, and looks each one's id up).
WINDOW_SHARE = 0.5
#: ... and at least this many ids (below, sorting their places costs little).
WINDOW_MIN_IDS = 50_000
#: The rows of a republishing run in the window's order: the rows created in the
#: window, in the order of an index on ``created_at``, kept when the run's ids hold
#: theirs, then by id within one ``created_at`` (an incremental sort of each group).
_WINDOW_SQL = """
SELECT x.id::text, x.aggregatetype, x.aggregateid, x.type, x.payload::text,
       x.tracingspancontext, x.created_at AS ts
FROM {table} AS x
WHERE x.created_at >= {since} AND x.created_at < {until}
  AND EXISTS (SELECT 1 FROM {ids} AS m WHERE m.id = x.id::uuid)
ORDER BY x.created_at, x.id
"""
_WINDOW_ROWS_SQL = (
    "SELECT 1 FROM {table} AS x WHERE x.created_at >= {since} AND x.created_at < {until}"
)
#: The window's read, planned as it is meant to run: rows in the index's order, each
#: id looked up - not every id joined at once and the whole result sorted, which the
#: planner prefers by total cost and which sends nothing before its sort ends
#: (``SET LOCAL``: the read's transaction only).
WINDOW_PLAN = (
    "SET LOCAL enable_hashjoin = off; SET LOCAL enable_mergejoin = off;"
    " SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off;"
    " SET LOCAL enable_sort = off"
)


def enough_for_window(count: int) -> bool:
    """Whether ``count`` ids may be read in the window's order (:data:`WINDOW_MIN_IDS`):
    their table is then indexed (:func:`fill_ids`)."""
    return count >= WINDOW_MIN_IDS


def window_query(
    conn: Conn, table: sql.Composable, created: tuple[Any, Any], count: int
) -> sql.Composed | None:
    """:data:`_WINDOW_SQL` for ``count`` ids whose rows were created in ``created``
    (``[since, until)``), when the window's order fits (the module's first way): the
    ids are at least :data:`WINDOW_MIN_IDS` and a :data:`WINDOW_SHARE` of the rows the
    planner expects there, and :data:`WINDOW_PLAN` reads it without a sort; else None.
    ``conn`` outside a transaction (each look is one of its own)."""
    if not enough_for_window(count):
        return None
    bounds = {"table": table, "since": sql.Literal(created[0]), "until": sql.Literal(created[1])}
    expected = _plan(conn, sql.SQL(_WINDOW_ROWS_SQL).format(**bounds))["Plan Rows"]
    if count < WINDOW_SHARE * expected:
        return None
    query = sql.SQL(_WINDOW_SQL).format(ids=sql.Identifier(IDS_TABLE), **bounds)
    with conn.transaction():
        conn.execute(WINDOW_PLAN)
        plan = _plan(conn, query)
    return None if _sorts(plan) else query


def _plan(conn: Conn, query: sql.Composable) -> dict[str, Any]:
    """The server's plan of ``query`` (``EXPLAIN (FORMAT JSON)``), its top node."""
    row = conn.execute(sql.SQL("EXPLAIN (FORMAT JSON) ") + query).fetchone()
    assert row is not None
    doc = row[0] if not isinstance(row[0], str) else json.loads(row[0])
    return dict(doc[0]["Plan"])


def _sorts(node: dict[str, Any]) -> bool:
    """Whether a plan sorts a whole input (a ``Sort`` node anywhere: no index gave the
    order); an incremental sort of groups the index already ordered is not one."""
    if node.get("Node Type") == "Sort":
        return True
    return any(_sorts(child) for child in node.get("Plans", ()))


assert ID_BYTES == 16, "copy_rows lays out 16-byte ids"
