"""The rows of a republishing run (:func:`cdc.repair.republish.republish`).

* the run's ids go to the server in chunks of :data:`IDS_PER_FILL` into a temporary
  table of the run's transaction (:func:`fill_ids`): the run's memory does not grow
  with the number of ids;
* its rows are read in one ordered query (:func:`republish_query`: the server sorts the
  rows' places, not the rows, then reads the rows in that order), streamed in chunks of
  :data:`FETCH_ROWS`, bounded by :data:`READ_TIMEOUT_MS`, with :data:`READ_WORK_MEM`.
  (A reader thread fetching ahead of the producer was measured and dropped: 10,000,000
  rows took 196 s with it, 144 s without - the two threads contend for the GIL and the
  machine's two cores are busy with the server and the broker anyway.)
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from cdc.records import ID_BYTES

Conn = psycopg.Connection[Any]

#: Rows per chunk of a run's read (a gap recovery's window, a repair's ids).
FETCH_ROWS = 2_000

#: The run's ids, in a temporary table of the run's transaction (gone at its end).
IDS_TABLE = "outbox_cdc_republish_ids"
_IDS_TABLE_SQL = "CREATE TEMPORARY TABLE outbox_cdc_republish_ids (id uuid NOT NULL) ON COMMIT DROP"
#: One chunk of ids into the table: one binary ``bytea`` of 16-byte ids, cut up by the server.
_IDS_FILL_SQL = """
INSERT INTO outbox_cdc_republish_ids
SELECT encode(substring(%(ids)b::bytea FROM g * 16 + 1 FOR 16), 'hex')::uuid  -- ID_BYTES
FROM generate_series(0, %(count)s - 1) AS g
"""
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


#: Ids per statement filling the run's id table (a 1.6 MB parameter): the run's memory
#: does not grow with the number of ids (10,000,000 as one parameter peaked at 711 MB).
IDS_PER_FILL = 100_000
#: The longest the run's ordered read may take in the server (its first fetch sorts
#: the whole run: minutes at tens of millions of rows); past it the run fails.
READ_TIMEOUT_MS = 30 * 60 * 1000
#: The server's memory for the read's join and sort (``SET LOCAL``: this run only):
#: 10,000,000 rows' first row came after 67 s with the default 4 MB, 51 s with this.
READ_WORK_MEM = "256MB"

Ids = bytes | bytearray | memoryview


def fill_ids(conn: Conn, ids: Ids) -> None:
    """The run's ids into its temporary table, :data:`IDS_PER_FILL` at a time (then
    analyzed: the planner joins them knowing how many there are)."""
    conn.execute(_IDS_TABLE_SQL)
    view = memoryview(ids).cast("B")
    step = IDS_PER_FILL * ID_BYTES
    for start in range(0, len(view), step):
        part = view[start : start + step]
        conn.execute(_IDS_FILL_SQL, {"ids": bytes(part), "count": len(part) // ID_BYTES})
    conn.execute("ANALYZE outbox_cdc_republish_ids")


assert ID_BYTES == 16, "_IDS_FILL_SQL cuts 16-byte ids"
