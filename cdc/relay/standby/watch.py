"""The relay's look at its standbys' copies of the failover slot, for ``/readyz`` and a gauge.

What it says (PostgreSQL 17+, the relay's slot a failover slot, the relay streaming it):
one ``/readyz`` line per standby host of ``CDC_PG_DSN`` - ``standby <host:port>: failover
slot carried for good (synced, not temporary)``, ``... not yet carried for good (temporary
copy)``, ``... not carried (no synchronized copy)`` or ``... unknown (cannot look: ...)``
- and ``outbox_relay_failover_slot_synced{standby="<host:port>"}`` 1 / 0 / -1. A DSN of
one host gets one line, ``standbys: failover slot unknown (...)``, saying why.

Guarantees:

* information only: these lines never change ``/readyz``'s status (a failover before
  the standby carries the slot goes through gap recovery: nothing is lost), and the
  silence detector and the stream never read them;
* one source: the look is :func:`cdc.wal.standby_copy.look_at_standbys`, the one
  ``outbox-cdc check`` reads;
* bounded: a thread of its own (``standby-watch``), never the streaming thread; one
  look every :data:`STANDBY_LOOK_INTERVAL_S`, each host within
  :data:`STANDBY_LOOK_TIMEOUT_S` (connecting included), at most
  :data:`~cdc.wal.standby_copy.MAX_STANDBY_HOSTS` hosts - so a round ends within
  their product; the gauge's labels are the DSN's hosts (a host that turned primary
  loses its series);
* a change of a standby's answer is logged once (INFO), not every look; a look that
  raises is logged at debug level and says ``unknown``, never ends the relay.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from prometheus_client import Gauge

from cdc.health import Liveness
from cdc.settings import Settings
from cdc.wal.standby_copy import (
    GAUGE_VALUE,
    Carry,
    StandbyCopy,
    dsn_hosts,
    look_at_standbys,
    readiness_notes,
)

log = logging.getLogger("cdc.relay")

#: Between two looks. The standby's temporary window measured 26 s after a first start:
#: a look every 15 s says "for good" at most that late, at 1 + hosts connections a look.
STANDBY_LOOK_INTERVAL_S = 15.0
#: The first look, after the relay's start (the monitor has read the slot by then).
FIRST_LOOK_S = 6.0
#: One host's look, connecting included: a standby that does not answer within it is
#: ``unknown`` (cannot look), and the next host is looked at.
STANDBY_LOOK_TIMEOUT_S = 3.0


class StandbyWatch:
    """The ``standby-watch`` thread: looks while ``looking()`` says so (the relay streams
    a failover slot), else shows nothing."""

    def __init__(
        self,
        settings: Settings,
        *,
        gauge: Gauge,
        liveness: Liveness,
        looking: Callable[[], bool],
        stop: threading.Event,
    ) -> None:
        self._settings = settings
        self._gauge = gauge
        self._liveness = liveness
        self._looking = looking
        self._stop = stop
        self._shown: dict[str, Carry] = {}

    def start(self) -> StandbyWatch:
        threading.Thread(target=self._run, name="standby-watch", daemon=True).start()
        return self

    def _run(self) -> None:
        wait_s = FIRST_LOOK_S
        while not self._stop.wait(wait_s):
            wait_s = STANDBY_LOOK_INTERVAL_S
            self.look_once()

    def look_once(self) -> None:
        """One look (or, not looking, nothing shown)."""
        if not self._looking():
            self.show([], ())
            return
        dsn = self._settings.pg_dsn.get_secret_value()
        try:
            copies = look_at_standbys(dsn, self._settings.slot, timeout_s=STANDBY_LOOK_TIMEOUT_S)
        except Exception as exc:  # (a look never ends the relay: said as unknown)
            log.debug("standby watch: %s", exc)
            why = f"the look failed: {type(exc).__name__}"
            self.show([], (f"standbys: failover slot unknown ({why})",))
            return
        self.show(copies, readiness_notes(copies, hosts=len(dsn_hosts(dsn))))

    def show(self, copies: Sequence[StandbyCopy], notes: tuple[str, ...]) -> None:
        """``notes`` on /readyz; each copy's gauge; a changed answer logged once."""
        now = {copy.where: copy.carry for copy in copies}
        for copy in copies:
            self._gauge.labels(copy.where).set(GAUGE_VALUE[copy.carry])
            if self._shown.get(copy.where) is not copy.carry:
                log.info("%s", copy.phrase)
        for where in self._shown.keys() - now.keys():
            self._gauge.remove(where)
        self._shown = now
        self._liveness.notes = notes
