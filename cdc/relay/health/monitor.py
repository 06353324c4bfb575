"""The relay's monitor thread: the slot gauges, the optional heartbeat, the admin client's logs.

The slot gauges: lag bytes, ``wal_status`` and ``safe_wal_size`` (how close
``max_slot_wal_keep_size`` is to invalidating the slot). What holds the slot's
decoding back on the server (:func:`cdc.wal.slots.decoding_held_back`: a
``synchronized_standby_slots`` entry that does not exist or no standby streams
from) is read every tick into :attr:`SlotMonitor.held_back`: ``/readyz`` answers 503
naming it while the relay streams (it receives nothing meanwhile), one WARNING when
it starts, one INFO when it ends. Whether the slot is a failover slot is kept in
:attr:`SlotMonitor.slot_failover` (the standby watch, :mod:`cdc.relay.standby.watch`,
looks at the standbys' copies only then).

Guarantees: it works on a PostgreSQL connection of its own, never the
replication connection, so it never delays the stream; a failure is logged at
debug level and retried on the next tick, never ends the relay.
"""

from __future__ import annotations

import logging
import threading
import time

import psycopg

from cdc import constants as c
from cdc.kafka.producer import (
    TopicManager,
)
from cdc.pgconn import connect
from cdc.relay.health.metrics import RelayMetrics
from cdc.settings import Settings
from cdc.wal.slots import SlotRow, decoding_held_back, read_slot
from cdc.wal.stream import slot_info

log = logging.getLogger("cdc.relay")


#: Slot lag and heartbeat period of the monitor thread.
MONITOR_INTERVAL_S = 5.0


class SlotMonitor:
    """The relay's monitor thread (a collaborator of :class:`~cdc.relay.stream.loop.Relay`)."""

    def __init__(
        self,
        settings: Settings,
        metrics: RelayMetrics,
        stop: threading.Event,
        topics: TopicManager,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self._stop = stop
        self._topics = topics
        #: why the server holds the slot's decoding back (None: nothing does)
        self.held_back: str | None = None
        #: the slot is a failover slot (17+), as last read: the standby watch looks then
        self.slot_failover = False

    def run(self) -> None:
        """Slot lag gauge and optional heartbeat, on a connection of its own; serves
        the admin client's log lines and errors (queued until served)."""
        s = self.settings
        last_beat = 0.0
        while not self._stop.wait(
            MONITOR_INTERVAL_S
            if s.heartbeat_interval_s <= 0
            else min(MONITOR_INTERVAL_S, s.heartbeat_interval_s)
        ):
            self._topics.serve()
            try:
                with connect(s.pg_dsn.get_secret_value()) as conn:
                    info = slot_info(conn, s.slot)
                    if info is not None and info.lag_bytes is not None:
                        self.metrics.slot_lag.set(info.lag_bytes)
                    row = read_slot(conn, s.slot)
                    observe_slot(self.metrics, row)
                    self.slot_failover = row is not None and row.failover
                    self._observe_held_back(decoding_held_back(conn, s.slot))
                    if (
                        s.heartbeat_interval_s > 0
                        and time.monotonic() - last_beat >= s.heartbeat_interval_s
                    ):
                        conn.execute(
                            "SELECT pg_logical_emit_message(false, %s, '')",
                            (c.OUTBOX_MESSAGE_PREFIX + "-heartbeat",),
                        )
                        last_beat = time.monotonic()
            except psycopg.Error as exc:
                log.debug("slot monitor: %s", exc)

    def _observe_held_back(self, held: list[str]) -> None:
        """Keep what holds decoding back for /readyz; say when it starts and ends."""
        reason = "; ".join(held) or None
        if reason == self.held_back:
            return
        if reason is not None:
            log.warning("logical decoding of slot %s held back: %s", self.settings.slot, reason)
        else:
            log.info("logical decoding of slot %s no longer held back", self.settings.slot)
        self.held_back = reason


def observe_slot(metrics: RelayMetrics, slot: SlotRow | None) -> None:
    """Set the slot's wal_status (one label 1, the others 0) and safe_wal_size gauges."""
    current = slot.wal_status if slot is not None else "missing"
    for status in ("reserved", "extended", "unreserved", "lost", "missing"):
        metrics.slot_wal_status.labels(status).set(1 if status == current else 0)
    size = slot.safe_wal_size if slot is not None else None
    metrics.slot_safe_wal_size.set(-1 if size is None else size)
