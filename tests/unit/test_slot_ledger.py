"""The relay's confirm limit (cdc.relay.ledger.SlotLedger): the slot never confirms past the
recorded limit, a raise is asked for when due and done off the stream loop, a raise that
fails ends the session. The database write is replaced by a fake (the real one is exercised
by every integration test of the relay)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from cdc.errors import StreamError
from cdc.relay import ledger as ledger_mod
from cdc.relay.ledger import RAISE_IDLE_S, RAISE_MIN_S, SlotLedger
from cdc.settings import Settings
from cdc.wal.replproto import lsn_to_str


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
