"""Which LSN the relay may confirm to the replication slot: pure bookkeeping.

Guarantee: :attr:`LsnTracker.confirmable` never passes the end of a transaction
that is still open or has a record Kafka has not acknowledged, and never
decreases. Confirming it therefore never loses an event: after a crash the
slot resends every transaction not fully acknowledged (at-least-once).

Contract (the relay drives it; ``tx_id`` = ``Begin.final_lsn``, which increases
strictly in commit order):

``open(tx_id)``
    at Begin. ``tx_id`` must be greater than every earlier one.
``add(tx_id)``
    once per record handed to Kafka, while the transaction is open.
``ack(tx_id, count=1)``
    once per ``count`` records Kafka acknowledged (delivered, or dead-lettered
    successfully). Any order, across transactions, before or after ``close``.
    Returns the transaction's records added so far and still unacknowledged.
``close(tx_id, end_lsn)``
    at Commit, with ``Commit.end_lsn`` (>= ``tx_id``; equal only for a
    pseudo-transaction wrapping one position, e.g. a non-transactional message).
``observe_wal_end(lsn)``
    the ``wal_end`` of a keepalive (or an XLogData) message.

State of one transaction::

    open(id)                     close(id, end)                    last ack
   ─────────► OPEN(unacked=n) ─────────────────► CLOSED(unacked=n) ─────────► DONE
                 ▲ add: n+1       (n may be 0)     ack: n-1
                 └ ack: n-1 (n > 0)

``confirmable`` = the largest ``end_lsn`` of the longest prefix, in ``tx_id``
order, of DONE transactions (DONE transactions leave the tracker there), or the
start value; and when no transaction is left (none open, nothing unacked), the
maximum of that and the largest ``wal_end`` observed, so an idle outbox never
pins WAL. A ``wal_end`` observed while work is pending is remembered and
applied once the tracker drains: the server sends every transaction that
committed before a keepalive ahead of that keepalive, so by then they are all
DONE.

Errors (``ValueError``): ``open`` of a ``tx_id`` not greater than the previous
one; ``add``/``close`` of an unknown or closed transaction; ``ack`` of an unknown
transaction or beyond its adds; ``end_lsn`` below ``tx_id``.

Costs: every operation is O(1) amortised (a dict by ``tx_id`` and a deque in
``tx_id`` order; each transaction is queued and dequeued once). Memory is
proportional to the transactions not yet DONE at the head of the queue.
"""

from __future__ import annotations

from collections import deque
from typing import Any

__all__ = ["LsnTracker"]


#: One transaction the tracker still holds: ``[unacked, end_lsn, tx_id]``, ``end_lsn``
#: None while OPEN. A list, not an object: made and dropped once per transaction,
#: and a class's instance (its call, its ``__init__``) was a tenth of an empty
#: transaction's cost; the methods below index it (0 unacked, 1 end_lsn, 2 tx_id).
_Tx = list[Any]


class LsnTracker:
    """Confirmable LSN of a replication stream whose records go to Kafka.

    ``start_lsn`` is the slot's ``confirmed_flush_lsn`` when streaming starts.
    Use one tracker per replication session: after a reconnect the server
    resends unconfirmed transactions with the same ``tx_id``s.
    """

    __slots__ = ("_confirmed", "_last_tx_id", "_open", "_queue", "_txs", "_wal_end", "in_flight")

    def __init__(self, start_lsn: int) -> None:
        if start_lsn < 0:
            raise ValueError(f"start LSN must not be negative: {start_lsn}")
        self._confirmed = start_lsn
        self._wal_end = start_lsn
        self._txs: dict[int, _Tx] = {}
        self._queue: deque[_Tx] = deque()  # not yet DONE or not yet at the head, tx_id order
        #: Records added and not yet acknowledged. Read it, never write it: a plain
        #: attribute, not a property, because the relay reads it per message (a
        #: property's call was ~2% of the relay's instructions per event).
        self.in_flight = 0
        self._open = 0
        self._last_tx_id = -1

    @property
    def confirmable(self) -> int:
        """The LSN safe to report as flushed (see the module docstring)."""
        return self._confirmed

    @property
    def open_transactions(self) -> int:
        """Transactions opened and not yet closed."""
        return self._open

    @property
    def pending_transactions(self) -> int:
        """Transactions held back: open, or closed behind one that is not DONE."""
        return len(self._queue)

    @property
    def wal_end(self) -> int:
        """The largest ``wal_end`` observed (or the start LSN)."""
        return self._wal_end

    def end_lsn(self, tx_id: int) -> int | None:
        """``Commit.end_lsn`` of a transaction the tracker still holds; None while it
        is open or once it is DONE (it then left the tracker)."""
        tx = self._txs.get(tx_id)
        return None if tx is None else tx[1]

    def open(self, tx_id: int) -> None:
        """Begin of transaction ``tx_id`` (its ``Begin.final_lsn``)."""
        if tx_id <= self._last_tx_id:
            raise ValueError(
                f"transaction {tx_id} opened after {self._last_tx_id}: ids must increase "
                "(use a new tracker for a new replication session)"
            )
        tx = [0, None, tx_id]  # (unacked, end_lsn, tx_id)
        self._txs[tx_id] = tx
        self._queue.append(tx)
        self._last_tx_id = tx_id
        self._open += 1

    def add(self, tx_id: int) -> None:
        """One more record of open transaction ``tx_id`` was handed to Kafka."""
        tx = self._txs.get(tx_id)
        if tx is None or tx[1] is not None:
            state = "unknown" if tx is None else "already closed"
            raise ValueError(f"add to transaction {tx_id}: {state}")
        tx[0] += 1
        self.in_flight += 1

    def ack(self, tx_id: int, count: int = 1) -> int:
        """Kafka acknowledged ``count`` (>= 1) records of transaction ``tx_id``; returns
        how many of its records added so far are still unacknowledged."""
        tx = self._txs.get(tx_id)
        if tx is None:
            raise ValueError(f"ack for unknown transaction {tx_id} (never opened, or all acked)")
        if count < 1:
            raise ValueError(f"ack of {count} records of transaction {tx_id}")
        if count > tx[0]:
            raise ValueError(
                f"ack for transaction {tx_id} beyond its added records"
                f" ({count} acknowledged, {tx[0]} outstanding)"
            )
        left: int = tx[0] - count
        tx[0] = left
        self.in_flight -= count
        if left == 0 and tx[1] is not None and tx is self._queue[0]:
            self._drain()
        return left

    def close(self, tx_id: int, end_lsn: int) -> None:
        """Commit of transaction ``tx_id``; ``end_lsn`` is ``Commit.end_lsn``."""
        tx = self._txs.get(tx_id)
        if tx is None or tx[1] is not None:
            state = "unknown" if tx is None else "already closed"
            raise ValueError(f"close of transaction {tx_id}: {state}")
        if end_lsn < tx_id:
            raise ValueError(f"transaction {tx_id} closed with end LSN {end_lsn} below its id")
        tx[1] = end_lsn
        self._open -= 1
        if tx[0] == 0 and tx is self._queue[0]:
            self._drain()

    def observe_wal_end(self, lsn: int) -> None:
        """The server reported ``lsn`` as its WAL end (keepalive or XLogData)."""
        if lsn > self._wal_end:
            self._wal_end = lsn
            if not self._queue and lsn > self._confirmed:
                self._confirmed = lsn

    def _drain(self) -> None:
        """Drop DONE transactions from the head; advance ``confirmable`` past them."""
        # (comparisons, not max(): its call was ~750 instructions, twice per transaction)
        queue = self._queue
        confirmed = self._confirmed
        while queue:
            head = queue[0]
            unacked, end_lsn, tx_id = head
            if unacked or end_lsn is None:
                break
            queue.popleft()
            del self._txs[tx_id]
            if end_lsn > confirmed:  # noqa: PLR1730 (max() is a call: see above)
                confirmed = end_lsn
        if not queue and self._wal_end > confirmed:
            confirmed = self._wal_end
        self._confirmed = confirmed

    def __repr__(self) -> str:
        return (
            f"LsnTracker(confirmable={self._confirmed:#x}, wal_end={self._wal_end:#x}, "
            f"in_flight={self.in_flight}, open={self._open}, pending={len(self._queue)})"
        )
