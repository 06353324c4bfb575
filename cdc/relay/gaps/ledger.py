"""What the streaming relay writes down so that its next start trusts only evidence it owns.

Guarantees (the relay's side of :mod:`cdc.gaps`, migration 007):

* **the slot never confirms past its confirm limit**: :meth:`SlotLedger.bound`
  caps every LSN the relay confirms at the limit recorded in the row that made
  the slot; :meth:`SlotLedger.cap` raises the recorded limit (to the server's
  WAL insert position, :func:`cdc.gaps.raise_confirm_limit`) *before* the relay
  confirms past the old one. So a slot whose ``confirmed_flush_lsn`` is past the
  limit was moved by someone else (:attr:`cdc.relay.gaps.gap.GapCause.SLOT_REPLACED`).
  A raise is one ``UPDATE`` at most every :data:`RAISE_MIN_S` while the relay has
  progress to confirm, and every :data:`RAISE_IDLE_S` when the only WAL past the
  limit is the ledger's own last write (an idle outbox pins at most that);
* **the topics and forms the relay publishes are recorded before its first record
  of them** (:meth:`note_topics`, :meth:`note_form`; once per process each): the
  next start reads the tails of exactly those topics, and knows whether the
  relay ever published logical messages (which the table cannot give back);
* raises run in a thread of their own (:class:`_Raiser`) on a connection of their
  own: the stream loop never waits for the database (a silent path stalls only
  the confirmation, which is then capped; the loop's silence checks go on);
* a raise that fails (tried twice, the second time on a new connection) ends the
  session: the loop's next :meth:`cap` raises :class:`cdc.errors.StreamError`
  (the next session checks the slot again). A server shutting down terminates
  ordinary connections first, and its walsender waits for the relay to confirm
  the end of the WAL before it exits - which a capped relay never would; closing
  the replication connection lets the shutdown go on. At the relay's own
  shutdown (:meth:`settle`, bounded by :data:`SETTLE_WAIT_S`) a failure is only
  logged. A topic or form that cannot be recorded raises :class:`StreamError`
  too (nothing is produced to it before it is recorded).
"""

from __future__ import annotations

import contextlib
import logging
import threading
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
#: A ledger statement taking longer than this is given up.
STATEMENT_TIMEOUT_MS = 5_000
#: Longest the relay's shutdown waits for its last raise.
SETTLE_WAIT_S = 5.0


class _Connection:
    """One lazily opened autocommit connection, dropped after an error."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._conn: Conn | None = None

    def get(self) -> Conn:
        if self._conn is None or self._conn.closed:
            dsn = with_connection_defaults(self.settings.pg_dsn.get_secret_value())
            self._conn = psycopg.connect(dsn, autocommit=True)
            self._conn.execute(f"SET statement_timeout = {STATEMENT_TIMEOUT_MS}")
        return self._conn

    def drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):  # (already broken)
                conn.close()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class _Raiser(threading.Thread):
    """Raises the recorded confirm limit when asked (:meth:`ask`), one raise at a time."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(name="slot-ledger", daemon=True)
        self._db = _Connection(settings)
        self._asked = threading.Event()
        self._done = threading.Condition()
        self._closed = False
        #: raises asked for / finished (a waiter knows its own is done)
        self.asked_n = 0
        self.done_n = 0
        #: the row to raise; the results (read by the loop: plain attribute writes)
        self.maker_id: int | None = None
        self.limit = 0
        self.own_end = 0
        #: why the last raise failed; None after a success
        self.failed: str | None = None

    def ask(self) -> int:
        """Ask for a raise (of :attr:`maker_id`); its ticket for :meth:`wait`."""
        with self._done:
            self.asked_n += 1
            ticket = self.asked_n
        self._asked.set()
        return ticket

    def wait(self, ticket: int, timeout_s: float) -> bool:
        with self._done:
            return self._done.wait_for(lambda: self.done_n >= ticket, timeout_s)

    def close(self) -> None:
        self._closed = True
        self._asked.set()

    def run(self) -> None:
        while not self._closed:
            self._asked.wait()
            self._asked.clear()
            if self._closed:
                break
            with self._done:
                ticket = self.asked_n
            maker_id = self.maker_id
            if maker_id is not None:
                self._raise(maker_id)
            with self._done:
                self.done_n = ticket
                self._done.notify_all()
        self._db.drop()

    def _raise(self, maker_id: int) -> None:
        """Two tries, the second on a new connection (the server may have closed the
        first while it was idle)."""
        why = ""
        for _ in range(2):
            try:
                limit, end = gaps.raise_confirm_limit(self._db.get(), maker_id)
            except (psycopg.Error, CdcError) as exc:
                self._db.drop()
                why = _first_line(exc)
                continue
            if maker_id == self.maker_id:  # (not vouched for another row meanwhile)
                self.limit = max(self.limit, str_to_lsn(limit))
                self.own_end = str_to_lsn(end)
            self.failed = None
            return
        self.failed = why


class SlotLedger:
    """The relay's records of its slot (one per relay; :meth:`vouch` at each session)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._notes = _Connection(settings)
        self._raiser: _Raiser | None = None
        self._raised_at = 0.0
        self._topics: set[str] = set()
        self._forms: set[str] = set()

    @property
    def maker_id(self) -> int | None:
        """The history row that made the slot; None: not streaming a vouched slot."""
        return self._raiser.maker_id if self._raiser is not None else None

    @property
    def limit(self) -> int:
        """The slot never confirms past this."""
        return self._raiser.limit if self._raiser is not None else 0

    def vouch(self, maker_id: int, limit: str) -> None:
        """The session streams the slot made by history row ``maker_id`` (limit ``limit``)."""
        raiser = self._raiser
        if raiser is None or not raiser.is_alive():
            raiser = self._raiser = _Raiser(self.settings)
            raiser.start()
        raiser.maker_id = maker_id
        raiser.limit = raiser.own_end = str_to_lsn(limit)
        raiser.failed = None
        self._raised_at = 0.0

    def bound(self, lsn: int) -> int:
        """``lsn`` as far as the slot may confirm it now."""
        raiser = self._raiser
        if raiser is None or raiser.maker_id is None or lsn <= raiser.limit:
            return lsn
        return raiser.limit

    def cap(self, lsn: int, now: float) -> int:
        """``lsn`` as far as the slot may confirm it now; a raise of the limit asked for
        when due (:class:`StreamError` after one failed: see the module docstring)."""
        raiser = self._raiser
        if raiser is None or raiser.maker_id is None or lsn <= raiser.limit:
            return lsn
        if raiser.failed is not None:
            failed, raiser.failed = raiser.failed, None
            raise StreamError(
                f"slot {self.settings.slot}: its confirm limit cannot be raised ({failed}):"
                " closing the replication connection (a server shutting down waits for it)"
            )
        wait_s = RAISE_MIN_S if lsn > raiser.own_end else RAISE_IDLE_S
        if now - self._raised_at >= wait_s:
            self._raised_at = now
            raiser.ask()
        return raiser.limit

    def settle(self) -> None:
        """Raise the limit now and wait for it (at most :data:`SETTLE_WAIT_S`): at the
        relay's shutdown, the last confirmation goes as far as it can."""
        raiser = self._raiser
        if raiser is None or raiser.maker_id is None:
            return
        done = raiser.wait(raiser.ask(), SETTLE_WAIT_S)
        if not done or raiser.failed is not None:
            log.warning(
                "slot %s: its confirm limit was not raised at shutdown (%s): it confirms no"
                " further than %s (those events are read again at the next start)",
                self.settings.slot,
                raiser.failed or f"no answer in {SETTLE_WAIT_S:g}s",
                lsn_to_str(raiser.limit),
            )

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
            gaps.note_output(self._notes.get(), self.settings.slot, kind, names)
        except psycopg.Error as exc:
            self._notes.drop()
            raise StreamError(
                f"cannot record the relay's {kind}s {', '.join(names)}: {_first_line(exc)}"
            ) from exc

    def close(self) -> None:
        self._notes.drop()
        if self._raiser is not None:
            self._raiser.close()
