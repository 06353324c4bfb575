"""The recovery lock: one gap recovery of a slot at a time, and a lock nobody has to trust blindly.

A recovery takes minutes; the session-level advisory lock behind it lives only
as long as its connection. That connection sits idle while the recovery works
on others, so an ``idle_session_timeout``, a NAT that forgets idle mappings or
a terminated backend can take the lock away unnoticed - and a recovery that
then fails at its last step is done again, and again.

Guarantees:

* :meth:`RecoveryLock.take` takes ``pg_try_advisory_lock`` on a connection of
  :data:`cdc.pgconn.Use.HOLD` (keepalives on both ends, exempt from the server's
  idle timeouts unless the DSN says otherwise); another holder raises
  :class:`SlotInUseError` (the relay waits as a standby and records nothing);
* :meth:`RecoveryLock.ensure`, called before every step that depends on the
  lock (dropping the slot, creating it, marking the gap recovered) and before
  every use of the lock's connection (:meth:`RecoveryLock.checked`), makes a
  round trip on the lock's connection; when that connection is gone it takes
  the lock again on a new one - waiting at most :data:`RETAKE_WAIT_S`, the time
  the server needs to notice a dead client and release its lock - and sets
  :attr:`RecoveryLock.retaken`: what was done under the old lock is then
  re-checked by the caller before anything depends on it; another holder
  raises :class:`SlotInUseError`;
* :func:`recovery_in_progress` tells, without taking the lock, whether another
  process holds it (``pg_locks``): the standby's cheap look.
"""

from __future__ import annotations

import contextlib
import logging
import time
from types import TracebackType
from typing import Any

import psycopg

from cdc.errors import SlotInUseError
from cdc.pgconn import DEAD_PATH_S, Use, connect
from cdc.settings import Settings

log = logging.getLogger("cdc.relay")

Conn = psycopg.Connection[Any]

#: A lock lost with its connection is taken again within this: the server releases
#: the lock of a client it found dead (keepalives, tcp_user_timeout) within DEAD_PATH_S.
RETAKE_WAIT_S = DEAD_PATH_S + 10.0
#: Between two attempts at re-taking the lock.
RETAKE_EVERY_S = 1.0

#: ``pg_locks`` shows a bigint advisory key as its high half (classid), its low half
#: (objid) and objsubid 1, in the database it was taken in.
_HELD_SQL = """
WITH k AS (SELECT hashtext(%s)::bigint AS key)
SELECT EXISTS (
  SELECT 1 FROM pg_locks l, k
  WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
    AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
    AND l.classid = ((k.key >> 32) & 4294967295)::oid
    AND l.objid = (k.key & 4294967295)::oid
    AND l.pid <> pg_backend_pid())
"""


def lock_name(slot: str) -> str:
    """The advisory lock's name (hashed to its key by ``hashtext``): per slot."""
    return f"outbox_cdc_recovery:{slot}"


def recovery_in_progress(conn: Conn, slot: str) -> bool:
    """True when another process holds the recovery lock of ``slot`` (nothing is taken)."""
    row = conn.execute(_HELD_SQL, (lock_name(slot),)).fetchone()
    return bool(row and row[0])


class RecoveryLock:
    """The recovery lock of one slot, held on a connection of its own (a context manager)."""

    def __init__(self, settings: Settings) -> None:
        self._dsn = settings.pg_dsn.get_secret_value()
        self.slot = settings.slot
        self._conn: Conn | None = None
        #: the lock was lost with its connection and taken again since :meth:`take`
        self.retaken = False

    @property
    def conn(self) -> Conn:
        """The connection holding the lock (valid after :meth:`take` / :meth:`ensure`)."""
        assert self._conn is not None, "RecoveryLock used before take()"
        return self._conn

    def take(self) -> RecoveryLock:
        """Take the lock; :class:`SlotInUseError` when another process holds it."""
        conn = connect(self._dsn, Use.HOLD)
        if not self._try(conn):
            conn.close()
            raise SlotInUseError(f"another process is recovering slot {self.slot}")
        self._conn = conn
        return self

    def ensure(self) -> None:
        """The lock is held now (see the module docstring)."""
        try:
            self.conn.execute("SELECT 1")
            return
        except psycopg.Error as exc:
            log.warning(
                "recovery lock of slot %s lost with its connection (%s): taking it again",
                self.slot,
                str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
            )
            self.close()
        deadline = time.monotonic() + RETAKE_WAIT_S
        while True:
            try:
                self.take()
                self.retaken = True
                log.info("recovery lock of slot %s taken again", self.slot)
                return
            except (SlotInUseError, psycopg.OperationalError):
                if time.monotonic() >= deadline:
                    raise
            time.sleep(RETAKE_EVERY_S)

    def checked(self) -> Conn:
        """The lock's connection, after :meth:`ensure`: every use of it goes through here
        (a connection killed between two steps is found lost, and the lock taken again,
        rather than failing the step that used it first)."""
        self.ensure()
        return self.conn

    def _try(self, conn: Conn) -> bool:
        row = conn.execute("SELECT pg_try_advisory_lock(hashtext(%s))", (lock_name(self.slot),))
        found = row.fetchone()
        return bool(found and found[0])

    def close(self) -> None:
        """Release the lock, then its connection: released at once for every other process
        (a closed connection's lock lives on until its backend has exited - a moment in
        which another process would still see the recovery running)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):  # (a dead connection released it)
                if not conn.closed and not conn.broken:
                    conn.execute("SELECT pg_advisory_unlock(hashtext(%s))", (lock_name(self.slot),))
            with contextlib.suppress(psycopg.Error):  # (closing a dead connection)
                conn.close()

    def __enter__(self) -> RecoveryLock:
        return self.take() if self._conn is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
