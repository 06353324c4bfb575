"""The relay's monitor thread: the slot gauges, the optional heartbeat, the admin client's logs.

The slot gauges: lag bytes, ``wal_status`` and ``safe_wal_size`` (how close
``max_slot_wal_keep_size`` is to invalidating the slot).

Guarantees: it works on a PostgreSQL connection of its own, never the
replication connection, so it never delays the stream; a failure is logged at
debug level and retried on the next tick, never ends the relay.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import psycopg

from cdc import constants as c
from cdc.pgconn import connect
from cdc.producer import (
    TopicManager,
)
from cdc.relay.guard import observe_slot
from cdc.relay.metrics import RelayMetrics
from cdc.settings import Settings
from cdc.wal.slots import read_slot
from cdc.wal.stream import slot_info

log = logging.getLogger("cdc.relay")


#: Slot lag and heartbeat period of the monitor thread.
MONITOR_INTERVAL_S = 5.0


class SlotMonitor:
    """The relay's monitor thread (a mixin of :class:`~cdc.relay.loop.Relay`)."""

    if TYPE_CHECKING:
        settings: Settings
        metrics: RelayMetrics
        _stop: threading.Event
        _topics: TopicManager

    def _monitor(self) -> None:
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
                    observe_slot(self.metrics, read_slot(conn, s.slot))
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
