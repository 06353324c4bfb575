"""The relay's confirm limit (cdc.relay.gaps.ledger.SlotLedger): the slot never confirms past the
recorded limit, a raise is asked for when due and done off the stream loop, a raise that
fails ends the session. The database write is replaced by a fake (the real one is exercised
by every integration test of the relay)."""

from __future__ import annotations

import inspect
import struct
import threading
from typing import Any

import pytest

from cdc.errors import StreamError
from cdc.relay.gaps import ledger as ledger_mod
from cdc.relay.gaps.ledger import RAISE_IDLE_S, RAISE_MIN_S, SlotLedger
from cdc.settings import Settings
from cdc.wal.replproto import lsn_to_str
from cdc.wal.stream import UNLIMITED, ReplicationStream


class FakeDb:
    """raise_confirm_limit's stand-in: the server's WAL insert position, and failures."""

    def __init__(self) -> None:
        self.insert_lsn = 1_000
        self.raises = 0
        self.fail = False
        self.gate = threading.Event()
        self.gate.set()

    def raise_confirm_limit(self, conn: Any, row_id: int) -> tuple[str, str]:
        self.gate.wait(30)
        if self.fail:
            raise ledger_mod.CdcError("the database system is shutting down")
        self.raises += 1
        limit = self.insert_lsn
        self.insert_lsn += 100  # (the raise writes WAL of its own)
        return lsn_to_str(limit), lsn_to_str(self.insert_lsn)


@pytest.fixture
def db(monkeypatch: pytest.MonkeyPatch) -> FakeDb:
    fake = FakeDb()
    monkeypatch.setattr(ledger_mod.gaps, "raise_confirm_limit", fake.raise_confirm_limit)
    monkeypatch.setattr(ledger_mod._Connection, "get", lambda self: object())
    return fake


def _ledger() -> SlotLedger:
    ledger = SlotLedger(Settings(pg_dsn="dbname=x", slot="s"))
    ledger.vouch(7, lsn_to_str(500))
    return ledger


def _settled(ledger: SlotLedger) -> None:
    raiser = ledger._raiser
    assert raiser is not None
    assert raiser.wait(raiser.asked_n, 10)


def test_the_slot_never_confirms_past_the_limit_until_a_raise_recorded_a_higher_one(
    db: FakeDb,
) -> None:
    ledger = _ledger()
    assert ledger.cap(400, 0.0) == 400  # below the limit: as it is
    assert ledger.cap(900, 100.0) == 500  # past it: capped, a raise asked for
    _settled(ledger)
    assert db.raises == 1 and ledger.limit == 1_000
    assert ledger.cap(900, 100.1) == 900 and ledger.bound(1_050) == 1_000
    ledger.close()


def test_raises_are_spaced_and_the_ledgers_own_wal_waits_longer(db: FakeDb) -> None:
    ledger = _ledger()
    ledger.cap(900, 100.0)
    _settled(ledger)  # limit 1000, own write ends at 1100
    ledger.cap(1_050, 100.0 + RAISE_MIN_S / 2)  # progress, but too soon
    ledger.cap(1_100, 100.0 + RAISE_MIN_S)  # only the ledger's own write past the limit
    assert ledger._raiser is not None and ledger._raiser.asked_n == 1
    ledger.cap(1_100, 100.0 + RAISE_IDLE_S)
    _settled(ledger)
    assert db.raises == 2 and ledger.limit == 1_100
    ledger.close()


def test_a_raise_that_fails_ends_the_session_and_a_slow_one_never_blocks_the_loop(
    db: FakeDb,
) -> None:
    ledger = _ledger()
    db.gate.clear()  # the database does not answer
    assert ledger.cap(900, 100.0) == 500  # returns at once: the loop goes on, capped
    db.fail = True
    db.gate.set()
    _settled(ledger)
    with pytest.raises(StreamError, match="confirm limit cannot be raised"):
        ledger.cap(900, 100.0 + RAISE_MIN_S)
    ledger.vouch(7, lsn_to_str(500))  # (the next session)
    assert ledger.cap(400, 200.0) == 400
    ledger.close()


def test_an_unvouched_ledger_caps_nothing() -> None:
    ledger = SlotLedger(Settings(pg_dsn="dbname=x", slot="s"))
    assert ledger.cap(10**9, 0.0) == 10**9 and ledger.bound(10**9) == 10**9


class _Wire:
    """The replication connection's libpq side: the status messages put on it."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def put_copy_data(self, data: bytes) -> int:
        self.sent.append(bytes(data))
        return 1

    def flush(self) -> int:
        return 0


def _stream(limit: SlotLedger) -> tuple[ReplicationStream, _Wire]:
    """A stream with its limit, on a fake wire (the real one: every relay integration test)."""
    stream = ReplicationStream.__new__(ReplicationStream)
    wire = _Wire()
    stream._pg = wire  # type: ignore[assignment]
    stream.limit = limit
    return stream, wire


def _flushed(message: bytes) -> int:
    """The flushed position of a standby status update ('r', written, flushed, applied, ...)."""
    assert message[:1] == b"r"
    return int(struct.unpack_from(">Q", message, 9)[0])


def test_the_stream_sends_no_status_past_its_confirm_limit_whoever_sends_it(db: FakeDb) -> None:
    """Edge: every way of sending a status - the loop's (asking a raise), an error path's
    and the last-chance reply request after a silence (asking nothing) - goes through the
    limit the stream was constructed with: a position past it goes out as the limit."""
    ledger = _ledger()  # limit 500
    stream, wire = _stream(ledger)
    assert stream.send_status(400) == 400  # below the limit: as it is
    assert stream.send_status(900, reply_requested=True, ask_raise=False) == 500
    assert db.raises == 0  # (an error path's status asks for nothing)
    assert stream.send_status(900) == 500  # the loop's: capped, a raise asked for
    _settled(ledger)
    assert db.raises == 1
    assert [_flushed(m) for m in wire.sent] == [400, 500, 500]
    assert stream.send_status(900) == 900  # the limit was raised to 1,000
    assert _flushed(wire.sent[-1]) == 900
    ledger.close()


def test_a_stream_without_a_limit_must_say_so() -> None:
    """The constructor takes no default limit: a tool's stream names UNLIMITED."""
    params = inspect.signature(ReplicationStream.__init__).parameters
    assert params["limit"].default is inspect.Parameter.empty
    assert params["limit"].kind is inspect.Parameter.KEYWORD_ONLY
    assert UNLIMITED.cap(10**12, 0.0) == 10**12 and UNLIMITED.bound(7) == 7
