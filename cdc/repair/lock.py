"""The slot's locks: one gap recovery (one repairing audit) of a slot at a time, locks nobody
has to trust blindly.

A recovery takes minutes; the session-level advisory lock behind it lives only
as long as its connection. That connection sits idle while the recovery works
on others, so an ``idle_session_timeout``, a NAT that forgets idle mappings or
a terminated backend can take the lock away unnoticed - and a recovery that
then fails at its last step is done again, and again.

One lock type, :class:`SlotLock`, for both: :class:`RecoveryLock` (gap recovery) and
:class:`AuditLock` (an audit that may repair, the relay's start-up check:
:mod:`cdc.relay.gaps.start_check`) are the same lock under another name and busy error
(:class:`AuditBusyError` for the audit lock). Guarantees:

* :meth:`SlotLock.take` takes ``pg_try_advisory_lock`` on a connection of
  :data:`cdc.pgconn.Use.HOLD` (keepalives on both ends, exempt from the server's
  idle timeouts unless the DSN says otherwise); another holder raises the lock's
  busy error (:class:`SlotInUseError` for recovery: the relay waits as a standby
  and records nothing);
* :meth:`SlotLock.ensure`, called before every step that depends on the
  lock (dropping the slot, creating it, marking the gap recovered) and before
  every use of the lock's connection (:meth:`SlotLock.checked`), makes a
  round trip on the lock's connection; when that connection is gone it takes
  the lock again on a new one - waiting at most :data:`RETAKE_WAIT_S`, the time
  the server needs to notice a dead client and release its lock - and sets
  :attr:`SlotLock.retaken`: what was done under the old lock is then
  re-checked by the caller before anything depends on it; another holder
  raises the busy error;
* :func:`recovery_in_progress` tells, without taking the lock, whether another
  process holds it (``pg_locks``): the standby's cheap look.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Self

import psycopg

from cdc.errors import CdcError, SlotInUseError
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


def lock_name(slot: str, purpose: str = "recovery") -> str:
    """The advisory lock's name (hashed to its key by ``hashtext``): per slot and purpose."""
    return f"outbox_cdc_{purpose}:{slot}"


def recovery_in_progress(conn: Conn, slot: str) -> bool:
    """True when another process holds the recovery lock of ``slot`` (nothing is taken)."""
    row = conn.execute(_HELD_SQL, (lock_name(slot),)).fetchone()
    return bool(row and row[0])


class SlotLock:
    """A lock of one slot, held on a connection of its own (a context manager); the
    subclasses name its purpose and the error another holder raises."""

    #: what the lock is for: its name is ``outbox_cdc_<purpose>:<slot>``
    purpose = "recovery"

    def __init__(self, settings: Settings) -> None:
        self._dsn = settings.pg_dsn.get_secret_value()
        self.slot = settings.slot
        self._conn: Conn | None = None
        #: the lock was lost with its connection and taken again since :meth:`take`
        self.retaken = False

    @property
    def name(self) -> str:
        return lock_name(self.slot, self.purpose)

    def busy(self) -> CdcError:
        """The error when another process holds the lock."""
        return SlotInUseError(f"another process holds the {self.purpose} lock of slot {self.slot}")

    @property
    def conn(self) -> Conn:
        """The connection holding the lock (valid after :meth:`take` / :meth:`ensure`)."""
        assert self._conn is not None, "RecoveryLock used before take()"
        return self._conn

    def take(self) -> Self:
        """Take the lock; :meth:`busy`'s error when another process holds it."""
        conn = connect(self._dsn, Use.HOLD)
        try:
            taken = self._try(conn)
        except BaseException:
            conn.close()
            raise
        if not taken:
            conn.close()
            raise self.busy()
        self._conn = conn
        return self

    def ensure(self) -> None:
        """The lock is held now (see the module docstring)."""
        try:
            self.conn.execute("SELECT 1")
            return
        except psycopg.Error as exc:
            log.warning(
                "%s lock of slot %s lost with its connection (%s): taking it again",
                self.purpose,
                self.slot,
                str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
            )
            self.close()
        deadline = time.monotonic() + RETAKE_WAIT_S
        while True:
            try:
                self.take()
                self.retaken = True
                log.info("%s lock of slot %s taken again", self.purpose, self.slot)
                return
            except (CdcError, psycopg.OperationalError):
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
        row = conn.execute("SELECT pg_try_advisory_lock(hashtext(%s))", (self.name,))
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
                    conn.execute("SELECT pg_advisory_unlock(hashtext(%s))", (self.name,))
            with contextlib.suppress(psycopg.Error):  # (closing a dead connection)
                conn.close()

    def __enter__(self) -> Self:
        return self.take() if self._conn is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class RecoveryLock(SlotLock):
    """The recovery lock of one slot: one gap recovery at a time (two relays, or a relay
    and ``slot recover``); another holder raises :class:`SlotInUseError`."""

    purpose = "recovery"

    def busy(self) -> CdcError:
        return SlotInUseError(f"another process is recovering slot {self.slot}")


class AuditBusyError(CdcError):
    """Another audit that may repair (or the start-up check) runs on the same slot."""

    retriable = True


class AuditLock(SlotLock):
    """The slot's audit lock (``outbox_cdc_audit:<slot>``): the recovery lock's type
    (:class:`SlotLock`); another holder raises
    :class:`AuditBusyError`."""

    purpose = "audit"

    def busy(self) -> CdcError:
        return AuditBusyError(f"another audit of slot {self.slot} is running")


@contextmanager
def audit_lock(settings: Settings) -> Iterator[AuditLock]:
    """Hold the slot's audit lock or raise :class:`AuditBusyError` (released on exit)."""
    with AuditLock(settings) as lock:
        yield lock
