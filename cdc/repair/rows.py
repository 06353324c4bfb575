"""The rows of a republishing run (:func:`cdc.repair.republish.republish`).

* the run's ids go to the server in chunks of :data:`IDS_PER_FILL` into a temporary
  table of the run's transaction (:func:`fill_ids`): the run's memory does not grow
  with the number of ids;
* its rows are read in one ordered query (:data:`REPUBLISH_SQL`) through a server-side
  cursor by a thread of their own (:class:`Reader`), at most :data:`READ_AHEAD_CHUNKS`
  chunks of :data:`FETCH_ROWS` ahead of the producer; every wait is bounded.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import psycopg

from cdc.errors import CdcError
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
#: aggregate's rows keep their order).
REPUBLISH_SQL = """
SELECT o.id::text, o.aggregatetype, o.aggregateid, o.type, o.payload::text,
       o.tracingspancontext, {when} AS ts
FROM {table} AS o JOIN {ids} AS m ON o.id::uuid = m.id
ORDER BY ts, o.created_at, o.id
"""
#: Ids per statement filling the run's id table (a 1.6 MB parameter): the run's memory
#: does not grow with the number of ids (10,000,000 as one parameter peaked at 711 MB).
IDS_PER_FILL = 100_000
#: Chunks of :data:`FETCH_ROWS` rows the reader thread keeps ready ahead of the producer.
READ_AHEAD_CHUNKS = 4
#: The longest the run's ordered read may take in the server (its first fetch sorts
#: the whole run: minutes at tens of millions of rows); past it the run fails.
READ_TIMEOUT_MS = 30 * 60 * 1000
#: The server's memory for the read's join and sort (``SET LOCAL``: this run only):
#: 10,000,000 rows' first row came after 67 s with the default 4 MB, 51 s with this.
READ_WORK_MEM = "256MB"
#: How often a wait for the reader looks whether it is still alive.
READER_CHECK_S = 1.0

Ids = bytes | bytearray | memoryview


class Reader:
    """The run's rows, read on a thread of its own :data:`READ_AHEAD_CHUNKS` chunks
    ahead of the producer: the server's sort, the network and the rows' loading overlap
    the records' making and producing (measured: a fifth of a run's time was spent
    waiting on the server). Every wait is bounded: the reader's fetches by the server's
    ``statement_timeout`` (:data:`READ_TIMEOUT_MS`), a full queue by :meth:`close`,
    which cancels a fetch under way; an error of the reader is raised in the run."""

    _END = object()

    def __init__(self, conn: Conn, cur: psycopg.ServerCursor[Any]) -> None:
        self._conn, self._cur = conn, cur
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=READ_AHEAD_CHUNKS)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="republish-read", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                rows = self._cur.fetchmany(FETCH_ROWS)
                if not rows:
                    break
                self._put(rows)
            self._put(self._END)
        except BaseException as exc:  # (raised in the run's thread, never lost)
            self._put(exc)

    def _put(self, item: object) -> None:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=READER_CHECK_S)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator[list[tuple[Any, ...]]]:
        while True:
            try:
                item = self._queue.get(timeout=READER_CHECK_S)
            except queue.Empty:
                if not self._thread.is_alive():  # (it always hands over an end or error)
                    raise CdcError("republishing: the row reader ended early") from None
                continue
            if item is self._END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        """Stop the reader: a fetch under way is cancelled; its thread is waited for."""
        self._closed.set()
        if self._thread.is_alive():
            self._conn.cancel_safe(timeout=READER_CHECK_S * 5)
            self._thread.join(READER_CHECK_S * 10)


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
