"""What the streaming relay writes down so that its next start trusts only evidence it owns.

Guarantees (the relay's side of :mod:`cdc.gaps`, migration 007):

* **the slot never confirms past its confirm limit**: :meth:`SlotLedger.bound`
  caps every LSN the relay confirms at the limit recorded in the row that made
  the slot; :meth:`SlotLedger.cap` raises the recorded limit (to the server's
  WAL insert position, :func:`cdc.gaps.raise_confirm_limit`) *before* the relay
  confirms past the old one. So a slot whose ``confirmed_flush_lsn`` is past the
  limit was moved by someone else (:attr:`cdc.relay.gap.GapCause.SLOT_REPLACED`).
  A raise is one ``UPDATE`` at most every :data:`RAISE_MIN_S` while the relay has
  progress to confirm, and every :data:`RAISE_IDLE_S` when the only WAL past the
  limit is the ledger's own last write (an idle outbox pins at most that);
* **the topics and forms the relay publishes are recorded before its first record
  of them** (:meth:`note_topics`, :meth:`note_form`; once per process each): the
  next start reads the tails of exactly those topics, and knows whether the
  relay ever published logical messages (which the table cannot give back);
* a raise that fails (tried twice, the second time on a new connection) ends the
  session (:class:`cdc.errors.StreamError`; the next one checks the slot again):
  a server shutting down terminates ordinary connections first, and its
  walsender waits for the relay to confirm the end of the WAL before it exits -
  which a capped relay never would; closing the replication connection lets the
  shutdown go on. At the relay's own shutdown (:meth:`settle`) a failure is only
  logged. A topic or form that cannot be recorded raises :class:`StreamError`
  too (nothing is produced to it before it is recorded).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import Any

import psycopg

from cdc import gaps
from cdc.errors import CdcError, StreamError
from cdc.settings import Settings
from cdc.wal.replproto import lsn_to_str, str_to_lsn
from cdc.wal.stream import with_connection_defaults

log = logging.getLogger("cdc.relay")

Conn = psycopg.Connection[Any]

#: Shortest time between two raises of the confirm limit while there is progress:
#: the slot's confirmation trails the acknowledged records by at most about this.
RAISE_MIN_S = 1.0
#: Time between raises when only the ledger's own last write lies past the limit
#: (a raise writes WAL: raising for it at once would write for ever on an idle server).
RAISE_IDLE_S = 10.0
#: A ledger statement taking longer than this is given up (the stream loop waits for it).
STATEMENT_TIMEOUT_MS = 5_000


class SlotLedger:
    """The relay's records of its slot (one per relay; :meth:`vouch` at each session)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._conn: Conn | None = None
        #: the history row that made the slot; None: not streaming a vouched slot
        self.maker_id: int | None = None
        #: the slot never confirms past this
        self.limit = 0
        #: where the server's WAL ended after the ledger's last raise
        self.own_end = 0
        self._raised_at = 0.0
        self._topics: set[str] = set()
        self._forms: set[str] = set()

    def vouch(self, maker_id: int, limit: str) -> None:
        """The session streams the slot made by history row ``maker_id`` (limit ``limit``)."""
        self.maker_id = maker_id
        self.limit = str_to_lsn(limit)
        self.own_end = self.limit
        self._raised_at = 0.0

    def bound(self, lsn: int) -> int:
        """``lsn`` as far as the slot may confirm it now."""
        return lsn if lsn <= self.limit or self.maker_id is None else self.limit

    def cap(self, lsn: int, now: float) -> int:
        """``lsn`` as far as the slot may confirm it, the limit raised first when due
        (:class:`StreamError` when it cannot be: see the module docstring)."""
        if lsn <= self.limit or self.maker_id is None:
            return lsn
        wait_s = RAISE_MIN_S if lsn > self.own_end else RAISE_IDLE_S
        if now - self._raised_at >= wait_s:
            self._raised_at = now
            failed = self._raise()
            if failed is not None:
                raise StreamError(
                    f"slot {self.settings.slot}: its confirm limit cannot be raised ({failed}):"
                    " closing the replication connection (a server shutting down waits for it)"
                )
        return min(lsn, self.limit)

    def settle(self) -> None:
        """Raise the limit now (at shutdown: the last confirmation goes as far as it can)."""
        if self.maker_id is None:
            return
        failed = self._raise()
        if failed is not None:
            log.warning(
                "slot %s: its confirm limit was not raised at shutdown (%s): it confirms no"
                " further than %s (those events are read again at the next start)",
                self.settings.slot,
                failed,
                lsn_to_str(self.limit),
            )

    def _raise(self) -> str | None:
        """Raise the recorded limit; None, or why it failed (after a second try on a new
        connection: the first may have been closed by the server while idle)."""
        assert self.maker_id is not None
        why = ""
        for _ in range(2):
            try:
                limit, end = gaps.raise_confirm_limit(self._connection(), self.maker_id)
            except (psycopg.Error, CdcError) as exc:
                self._drop()
                why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                continue
            self.limit = max(self.limit, str_to_lsn(limit))
            self.own_end = str_to_lsn(end)
            return None
        return why

    def note_topics(self, topics: Iterable[str]) -> None:
        """Record ``topics`` as the relay's (before its first record to them)."""
        new = sorted(set(topics) - self._topics - {self.settings.dlq_topic})
        if new:
            self._note(gaps.OUTPUT_TOPIC, new)
            self._topics.update(new)

    def note_form(self, form: str) -> None:
        """Record that the relay publishes events of ``form`` (before the first one)."""
        if form not in self._forms:
            self._note(gaps.OUTPUT_FORM, [form])
            self._forms.add(form)

    def _note(self, kind: str, names: list[str]) -> None:
        try:
            gaps.note_output(self._connection(), self.settings.slot, kind, names)
        except psycopg.Error as exc:
            self._drop()
            raise StreamError(
                f"cannot record the relay's {kind}s {', '.join(names)}: {exc}"
            ) from exc

    def _connection(self) -> Conn:
        if self._conn is None or self._conn.closed:
            dsn = with_connection_defaults(self.settings.pg_dsn.get_secret_value())
            self._conn = psycopg.connect(dsn, autocommit=True)
            self._conn.execute(f"SET statement_timeout = {STATEMENT_TIMEOUT_MS}")
        return self._conn

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):  # (already broken)
                conn.close()

    def close(self) -> None:
        self._drop()
