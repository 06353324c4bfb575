"""Who may take the slot: the relay's seat decision, the hot standby's cheap wait, the takeback.

Guarantees:

* before a session reads anything else (the gap check reads the tails of the
  outbox topics), :meth:`StandbyWait.claim_slot` asks who holds the slot
  (:func:`seat_of`, one catalog query): a slot another relay streams, or
  whose gap another process is recovering (its recovery lock is held), makes
  this relay a hot standby (DESIGN, relay invariant 4) - no gap check, no tail
  read, no gap recorded;
* a slot held by the relay's **own** previous walsender - the one its last
  replication connection opened, matched by pid *and* by the client address and
  port of that connection's socket (:meth:`cdc.wal.stream.Walsender.same_as`),
  never by the slot's name alone - is taken back at once: that walsender is
  ended and the slot is free within :data:`cdc.wal.stream.TAKE_BACK_WAIT_S`
  (behind a dead path with ``wal_sender_timeout`` 0 the server would keep it
  for ever); counted in ``outbox_relay_slot_takebacks_total``;
* the standby (:meth:`StandbyWait.wait`) waits cheaply: one catalog query
  every :data:`cdc.constants.STANDBY_RETRY_S` on one connection, and it leaves
  the wait only when the slot is free to take (or its own orphan holds it, or
  that query fails: the session loop then reports it and backs off); it keeps
  serving a producer kept from an earlier session;
* the standby is quiet and steady: one INFO line when the relay becomes a standby
  (``relay starting -> standby: waiting as hot standby (<who holds the slot>)``), one
  when it takes over (``relay standby -> streaming``), none in between; ``/readyz``
  answers ``standby: <who holds the slot>`` the whole time (the session loop keeps the
  state between looks: no ``starting`` flip) and ``outbox_relay_state{state="standby"}``
  is 1.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

from cdc import constants as c
from cdc.errors import SlotInUseError
from cdc.health import Liveness
from cdc.pgconn import connect
from cdc.relay.health.metrics import RelayMetrics
from cdc.relay.health.state import RelayState
from cdc.repair.lock import recovery_in_progress
from cdc.settings import Settings
from cdc.wal.stream import SlotHolder, Walsender, slot_holder, take_back

log = logging.getLogger("cdc.relay")

Conn = psycopg.Connection[Any]


class Seat(enum.Enum):
    FREE = "free"  # nobody streams or recovers the slot (or it is missing): start a session
    OWN_ORPHAN = "own_orphan"  # the relay's own previous walsender holds it: take it back
    TAKEN = "taken"  # another relay streams it, or recovers its gap: wait as a standby


def seat_of(
    slot: str, holder: SlotHolder, own: Walsender | None, *, recovering: bool
) -> tuple[Seat, str]:
    """Whether this relay may take ``slot`` now, and why not (for the log and /readyz).

    ``own``: the walsender of the relay's last replication connection (None before
    its first); ``recovering``: another process holds the slot's recovery lock.
    """
    walsender = holder.walsender
    if walsender is not None and own is not None and walsender.same_as(own):
        return Seat.OWN_ORPHAN, f"slot {slot} is held by this relay's own previous {walsender}"
    if walsender is not None:
        return Seat.TAKEN, f"slot {slot} is active for {walsender}"
    if recovering:
        return Seat.TAKEN, f"another process is recovering slot {slot}"
    return Seat.FREE, ""


class StandbyWait:
    """The seat decision and the standby's wait (a collaborator of
    :class:`~cdc.relay.stream.loop.Relay`)."""

    def __init__(
        self,
        settings: Settings,
        metrics: RelayMetrics,
        liveness: Liveness,
        stop: threading.Event,
        *,
        set_state: Callable[[RelayState, str], None],
        serve_kept_producer: Callable[[], bool],
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.liveness = liveness
        self._stop = stop
        self._set_state = set_state
        #: serves a producer kept from an earlier session; False: leave the wait
        self._serve_kept_producer = serve_kept_producer
        #: the walsender of the relay's last replication connection (its own orphan,
        #: if a dead path left it holding the slot); set by the loop
        self.own_walsender: Walsender | None = None

    def _seat(self, conn: Conn) -> tuple[Seat, str]:
        slot = self.settings.slot
        holder = slot_holder(conn, slot)
        recovering = holder.walsender is None and recovery_in_progress(conn, slot)
        return seat_of(slot, holder, self.own_walsender, recovering=recovering)

    def claim_slot(self, conn: Conn) -> None:
        """Return when the session may go on; raise :class:`SlotInUseError` (wait as a
        standby) when another relay holds the slot; take it back from our own orphan."""
        seat, why = self._seat(conn)
        if seat is Seat.OWN_ORPHAN and not self._take_back(conn, why):
            seat, why = self._seat(conn)
            if seat is Seat.OWN_ORPHAN:
                raise SlotInUseError(f"{why}, and it did not end within the wait")
        if seat is Seat.TAKEN:
            raise SlotInUseError(why)

    def _take_back(self, conn: Conn, why: str) -> bool:
        """End our own orphaned walsender; whether the slot is free now."""
        orphan = self.own_walsender
        assert orphan is not None
        log.warning("%s (left behind by a dead path): ending it to take the slot back", why)
        freed = take_back(conn, self.settings.slot, orphan)
        if freed:
            self.metrics.slot_takebacks.inc()
            log.info("slot %s taken back from %s", self.settings.slot, orphan)
            self.own_walsender = None
        return freed

    def wait(self, reason: str) -> None:
        """Wait as a hot standby until the slot is free to take (see the module docstring)."""
        self._set_state(RelayState.STANDBY, reason)  # (its one line: "-> standby: waiting ...")
        conn: Conn | None = None
        next_look = time.monotonic() + c.STANDBY_RETRY_S
        try:
            while not self._stop.is_set():
                self.liveness.tick()
                if not self._serve_kept_producer():
                    return
                if time.monotonic() >= next_look:
                    if conn is None:
                        conn = connect(self.settings.pg_dsn.get_secret_value())
                    seat, why = self._seat(conn)
                    if seat is Seat.OWN_ORPHAN and self._take_back(conn, why):
                        return
                    if seat is Seat.FREE:
                        return
                    self._set_state(RelayState.STANDBY, why)
                    next_look = time.monotonic() + c.STANDBY_RETRY_S
                self._stop.wait(0.2)
        except psycopg.Error as exc:
            log.debug("standby: reading slot %s: %s", self.settings.slot, exc)
        finally:
            if conn is not None:
                conn.close()
