"""cdc.repair.rows.Reader: the run's rows read ahead on a thread of their own, every wait bounded.

A stand-in cursor (a pure unit: the reader's hand-over, not PostgreSQL) serves the
chunks; the run's read against a real server is in the integration suites (the audit's
repair, the start-up check, ``test_audit.py``'s repair of more ids than one fill).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from cdc.errors import CdcError
from cdc.repair import rows
from cdc.repair.rows import READ_AHEAD_CHUNKS, Reader


class _Cursor:
    def __init__(self, chunks: list[list[tuple[int]]], fail_at: int | None = None) -> None:
        self.chunks, self.fail_at, self.fetches = list(chunks), fail_at, 0
        self.blocked = threading.Event()
        self.release = threading.Event()

    def fetchmany(self, size: int) -> list[tuple[int]]:
        self.fetches += 1
        if self.fail_at is not None and self.fetches == self.fail_at:
            raise RuntimeError("server went away")
        if self.chunks:
            return self.chunks.pop(0)
        return []


class _Conn:
    def __init__(self) -> None:
        self.cancelled = 0

    def cancel_safe(self, timeout: float) -> None:
        self.cancelled += 1


def _reader(cursor: Any, conn: Any | None = None) -> Reader:
    return Reader(conn or _Conn(), cursor)


def test_every_chunk_comes_in_order_then_the_end() -> None:
    chunks = [[(n,) for n in range(k * 3, k * 3 + 3)] for k in range(10)]
    reader = _reader(_Cursor(chunks))
    try:
        assert [row for rows_ in reader for row in rows_] == [(n,) for n in range(30)]
    finally:
        reader.close()


def test_an_error_of_the_reader_is_raised_in_the_run() -> None:
    reader = _reader(_Cursor([[(1,)], [(2,)]], fail_at=2))
    try:
        got = []
        with pytest.raises(RuntimeError, match="server went away"):
            for chunk in reader:
                got.extend(chunk)
        assert got == [(1,)]
    finally:
        reader.close()


def test_the_reader_stays_at_most_its_read_ahead_in_front() -> None:
    cursor = _Cursor([[(n,)] for n in range(50)])
    reader = _reader(cursor)
    try:
        deadline = time.monotonic() + 5
        while cursor.fetches < READ_AHEAD_CHUNKS + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # (it would have read on by now)
        # the queue's room and the one chunk in the reader's hand
        assert cursor.fetches == READ_AHEAD_CHUNKS + 1
    finally:
        reader.close()


def test_closing_a_run_that_stopped_early_ends_the_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rows, "READER_CHECK_S", 0.05)
    reader = _reader(_Cursor([[(n,)] for n in range(100)]))
    next(iter(reader))  # the run fails after its first chunk, the reader's queue full
    reader.close()
    assert not reader._thread.is_alive()


def test_closing_cancels_a_fetch_under_way(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rows, "READER_CHECK_S", 0.05)

    class Slow(_Cursor):
        def fetchmany(self, size: int) -> list[tuple[int]]:
            self.blocked.set()
            self.release.wait(5)
            return []

    cursor, conn = Slow([]), _Conn()
    real_cancel = conn.cancel_safe

    def cancel(timeout: float) -> None:
        real_cancel(timeout)
        cursor.release.set()  # (the server's answer to a cancel: the fetch ends)

    conn.cancel_safe = cancel  # type: ignore[method-assign]
    reader = _reader(cursor, conn)
    assert cursor.blocked.wait(5)
    reader.close()
    assert conn.cancelled == 1
    assert not reader._thread.is_alive()


def test_a_reader_that_died_without_a_word_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rows, "READER_CHECK_S", 0.05)
    monkeypatch.setattr(Reader, "_run", lambda self: None)  # (ends, hands nothing over)
    reader = _reader(_Cursor([]))
    with pytest.raises(CdcError, match="row reader ended early"):
        list(reader)
    reader.close()
