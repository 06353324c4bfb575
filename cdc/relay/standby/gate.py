"""Standby-safe publishing, the decisions: which held transactions a physical standby made safe.

Guarantees (pure; no I/O - :mod:`cdc.relay.standby.safe` drives it):

* a transaction is released only once the named standby has **flushed** WAL at
  or past the end of its commit record (``Commit.end_lsn``): whatever this
  relay put into Kafka is then on the standby's disk and survives its
  promotion - no phantom events after a failover;
* an open transaction (its commit not read yet) is never released, and an
  unknown standby position (not connected, never seen) releases nothing;
* transactions are released in commit order, each whole, a later one never
  before an earlier one, so the records of one key keep their order;
* the gate holds only what the relay hands it; its records were counted in
  flight by the LSN tracker when they were added, so ``CDC_MAX_IN_FLIGHT``
  bounds the memory of everything held (back-pressure stops reading WAL).

Which mechanism guards (:func:`choose_mode`): the relay's own gate (any
supported server), or - PostgreSQL 17 and later, unless ``CDC_FAILOVER_SLOT=off``
- the server's failover slots (the slot is a failover slot, the standby's
physical slot listed in ``synchronized_standby_slots``): the walsender then
sends nothing the standby has not confirmed, and the relay's gate stands aside.
:mod:`cdc.relay.standby.safe` checks both on the server before it lets the
server guard, and again every 30 s; until then, and whenever one is missing,
the relay's gate guards.

States of one held transaction::

    hold(first record) ──► OPEN ──commit read (end_lsn known)──► COMMITTED
                                                                   │ standby flushed >= end_lsn
                                                                   ▼ and every earlier one released
                                                                RELEASED (handed to Kafka)
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from cdc.wal.slots import FAILOVER_SLOTS_MIN_VERSION as _FAILOVER_MIN

#: ``server_version_num`` from which slots can be failover slots and the server has
#: ``synchronized_standby_slots`` (PostgreSQL 17).
FAILOVER_SLOTS_MIN_VERSION = _FAILOVER_MIN

R = TypeVar("R")


class SafeMode(enum.Enum):
    OFF = "off"  # publish as soon as Kafka takes it (no standby named)
    RELAY = "relay"  # the relay holds each transaction until the standby flushed its commit
    SERVER = "server"  # PostgreSQL 17+ failover slots: the walsender waits for the standby


@dataclass(frozen=True)
class ModeChoice:
    """The mechanism chosen, and why another one was not (for one log line)."""

    mode: SafeMode
    note: str = ""


def choose_mode(standby: str, *, failover_slot: str, server_version_num: int) -> ModeChoice:
    """Which mechanism keeps Kafka free of events the standby may not have.

    ``standby`` empty: off. ``failover_slot`` (``CDC_FAILOVER_SLOT``) ``off``, or a
    server older than PostgreSQL 17: the relay's own gate (with a note when ``on``
    asked for more than the server has: never less safe than asked). Otherwise the
    server may guard: the caller still checks that the slot is a failover slot and
    that ``synchronized_standby_slots`` names the standby.
    """
    if not standby:
        return ModeChoice(SafeMode.OFF)
    if failover_slot == "off":
        return ModeChoice(SafeMode.RELAY)
    if server_version_num >= FAILOVER_SLOTS_MIN_VERSION:
        return ModeChoice(SafeMode.SERVER)
    if failover_slot == "auto":
        return ModeChoice(SafeMode.RELAY)
    return ModeChoice(
        SafeMode.RELAY,
        f"failover slots need PostgreSQL 17 (server_version_num {server_version_num}): "
        f"the relay holds each transaction until standby {standby!r} flushed it instead",
    )


def listed_in_synchronized_standby_slots(setting: str, standby: str) -> bool:
    """True when ``standby`` (a physical slot name) is in the server's
    ``synchronized_standby_slots`` value (comma-separated, optionally quoted, ``*`` for all)."""
    names = {part.strip().strip('"') for part in setting.split(",") if part.strip()}
    return standby in names or "*" in names


def releasable(flushed_lsn: int | None, commits: list[int | None]) -> int:
    """How many of the held transactions, in commit order, may go to Kafka.

    ``commits[i]`` is the commit end LSN of the ``i``-th held transaction, None
    while it is open. The answer is the length of the longest prefix whose
    commits the standby has flushed (``end_lsn <= flushed_lsn``); 0 when the
    standby's position is unknown.
    """
    if flushed_lsn is None:
        return 0
    count = 0
    for end_lsn in commits:
        if end_lsn is None or end_lsn > flushed_lsn:
            break
        count += 1
    return count


@dataclass
class HeldTx(Generic[R]):
    """The records of one transaction, held until the standby has its commit."""

    tx_id: int
    held_at_s: float
    records: list[R] = field(default_factory=list)


class StandbyGate(Generic[R]):
    """Held transactions of one streaming session, oldest first.

    ``end_lsn_of(tx_id)`` answers the commit end LSN of a transaction, None
    while open (the relay passes :meth:`cdc.wal.lsn.LsnTracker.end_lsn`).
    """

    def __init__(self) -> None:
        self._held: deque[HeldTx[R]] = deque()
        self._records = 0

    @property
    def transactions(self) -> int:
        """Transactions held."""
        return len(self._held)

    @property
    def records(self) -> int:
        """Records held."""
        return self._records

    def oldest_held_at_s(self) -> float | None:
        """When the oldest held transaction was held (monotonic seconds), None when none is."""
        return self._held[0].held_at_s if self._held else None

    def hold(self, tx_id: int, record: R, now_s: float) -> None:
        """Hold one record of transaction ``tx_id`` (transactions come in commit order)."""
        held = self._held
        if not held or held[-1].tx_id != tx_id:
            if held and tx_id < held[-1].tx_id:
                raise ValueError(f"transaction {tx_id} held after {held[-1].tx_id}")
            held.append(HeldTx(tx_id, now_s))
        held[-1].records.append(record)
        self._records += 1

    def release(
        self, flushed_lsn: int | None, end_lsn_of: Callable[[int], int | None]
    ) -> list[HeldTx[R]]:
        """Pop and return, oldest first, the transactions the standby made safe."""
        held = self._held
        out: list[HeldTx[R]] = []
        if flushed_lsn is None:
            return out
        while held:
            end_lsn = end_lsn_of(held[0].tx_id)
            if releasable(flushed_lsn, [end_lsn]) == 0:
                break
            tx = held.popleft()
            self._records -= len(tx.records)
            out.append(tx)
        return out

    def release_all_committed(self, end_lsn_of: Callable[[int], int | None]) -> list[HeldTx[R]]:
        """Every committed transaction at the head (the server guards: failover slots)."""
        return self.release(1 << 64, end_lsn_of)

    def newest_commit(self, end_lsn_of: Callable[[int], int | None]) -> int | None:
        """The commit end LSN of the newest committed held transaction (None: none is)."""
        for tx in reversed(self._held):
            end_lsn = end_lsn_of(tx.tx_id)
            if end_lsn is not None:
                return end_lsn
        return None

    def clear(self) -> None:
        """Forget everything held (the session ended; its records were never sent)."""
        self._held.clear()
        self._records = 0
