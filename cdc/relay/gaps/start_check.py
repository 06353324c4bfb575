"""The relay's start-up check: what the last start published is checked, once per process.

Guarantees: once a session has confirmed past the WAL position of its start, the rows
committed between the relay's last record in Kafka (minus the margin; never before
its first start when that chose not to publish the rows already there) and that
start (minus the margin) are checked against the relay's records in its topics by
the audit's comparison (:func:`cdc.audit.verify_since`: only records of this relay's
system, timeline lineage and slot vouch for a row); missing ones are re-published
through the one re-publish path (:mod:`cdc.repair.republish`), marked
``recovered: verify``.

It holds the slot's audit lock (:class:`cdc.repair.lock.AuditLock`, the one lock type
of :mod:`cdc.repair.lock`: exempt from idle timeouts, checked before each use, taken
again when lost) while it checks and repairs: while an audit holds it, the check
waits (polling every :data:`START_CHECK_POLL_S`, at most
:data:`START_CHECK_BUSY_WAIT_S`), so the two never repair at once and the check sees
what the audit republished; a wait is logged once when it begins (INFO) and once when
it ends (INFO when the check proceeds, WARNING when it gives up), never per poll. It
runs in a thread, once per process (again at the next session if it failed or waited
too long), and never stops the stream.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timedelta

import psycopg
from confluent_kafka import KafkaException

from cdc import gaps
from cdc.audit.run import verify_since
from cdc.audit.window import Window, to_ms
from cdc.errors import CdcError
from cdc.lineage import LastRecord
from cdc.relay.gaps import recovery
from cdc.relay.health.metrics import RelayMetrics
from cdc.relay.health.state import RelayState
from cdc.repair.lock import AuditBusyError
from cdc.settings import Settings
from cdc.wal.replproto import str_to_lsn
from cdc.wal.slots import ServerIdentity, read_slot

log = logging.getLogger("cdc.relay")

#: Missing ids the start-up check's WARNING line names.
LOGGED_IDS = 5
#: The start-up check polls the slot's confirmed LSN this often until it passes the start,
#: and the audit lock this often while an audit holds it.
START_CHECK_POLL_S = 2.0
#: Longest the start-up check waits for an audit holding the slot's audit lock (an audit
#: of a 1,000,000-row window takes tens of seconds; `outbox-cdc audit --repair` of a
#: wider one longer): past it, the check is tried again at the next session.
START_CHECK_BUSY_WAIT_S = 1_800.0


class StartCheck:
    """The start-up check of one relay process (held by the slot guard)."""

    def __init__(self, settings: Settings, metrics: RelayMetrics, stop: threading.Event) -> None:
        self.settings = settings
        self.metrics = metrics
        self._stop = stop
        #: running, or None
        self._thread: threading.Thread | None = None
        #: done (checked, or nothing to check): not armed again in this process
        self.checked = False

    def arm(
        self,
        last: LastRecord | None,
        server: ServerIdentity,
        origin: str,
        start_lsn: str,
        start_at: datetime,
        since: datetime | None,
    ) -> None:
        """Check (in a thread) the window since ``last`` (never before ``since``: the rows
        committed before the relay's first start are not its own) once the slot
        confirmed past ``start_lsn``; once per process (again at the next session if it
        failed)."""
        if self.checked or (self._thread is not None and self._thread.is_alive()):
            return
        if last is None:  # nothing of the relay's in Kafka: nothing published to check
            self.checked = True
            return
        margin = timedelta(seconds=self.settings.gap_margin_s)
        begin = last.commit_ts - margin
        begin = begin if since is None else max(begin, since)
        end = start_at - margin
        if to_ms(end) <= to_ms(begin):
            self.checked = True
            return
        self._thread = threading.Thread(
            target=self._run,
            args=(Window.between(begin, end), server, origin, str_to_lsn(start_lsn)),
            name="start-check",
            daemon=True,
        )
        self._thread.start()

    def _run(self, window: Window, server: ServerIdentity, origin: str, start_lsn: int) -> None:
        try:
            if not self._wait_confirmed(start_lsn):
                return
            self.checked = self.check_window(window, server, origin)
        except (CdcError, KafkaException, psycopg.Error, OSError, ValueError) as exc:
            log.warning(
                "start-up check of slot %s failed (tried again at the next session): %s",
                self.settings.slot,
                exc,
            )
        except Exception as exc:  # (a thread's error would only be printed)
            log.exception("start-up check of slot %s failed: %s", self.settings.slot, exc)

    def _wait_confirmed(self, lsn: int) -> bool:
        """Until the slot confirmed past ``lsn`` (every earlier transaction is in Kafka)."""
        while not self._stop.is_set():
            with recovery.connect(self.settings) as conn:
                slot = read_slot(conn, self.settings.slot)
            if slot is not None and slot.confirmed_flush_lsn >= lsn:
                return True
            self._stop.wait(START_CHECK_POLL_S)
        return False

    def check_window(self, window: Window, server: ServerIdentity, origin: str) -> bool:
        """Check ``window`` and republish what is missing, under the slot's audit lock
        (waiting while an audit holds it); True when it was checked (or too large to)."""
        s = self.settings
        with recovery.connect(s) as conn:
            topics = gaps.outputs(conn, s.slot, gaps.OUTPUT_TOPIC)
        span = f"{window.as_json()['since']} .. {window.as_json()['until']}"
        began = time.monotonic()
        deadline = began + START_CHECK_BUSY_WAIT_S
        waited = False
        while True:
            try:
                found = verify_since(
                    s,
                    window.since,
                    until=window.until,
                    server=server,
                    origin=origin,
                    topics=topics,
                    max_rows=s.start_verify_max_rows,
                )
                if waited:
                    log.info(
                        "start-up check of slot %s proceeds: the audit lock was free after %.0fs",
                        s.slot,
                        time.monotonic() - began,
                    )
                break
            except AuditBusyError as exc:
                if time.monotonic() > deadline:
                    log.warning(
                        "start-up check of slot %s (%s) not done: %s for more than %gs"
                        " (tried again at the next session)",
                        s.slot,
                        span,
                        exc,
                        START_CHECK_BUSY_WAIT_S,
                    )
                    return False
                if not waited:  # (one line per wait, not one per poll)
                    log.info(
                        "start-up check of slot %s waits (at most %gs): %s",
                        s.slot,
                        START_CHECK_BUSY_WAIT_S,
                        exc,
                    )
                    waited = True
                if self._stop.wait(START_CHECK_POLL_S):
                    return False
        if found.skipped:
            log.warning("start-up check of slot %s skipped (%s): %s", s.slot, span, found.skipped)
            return True
        if not found.missing:
            log.info(
                "start-up check of slot %s: the %d outbox rows committed in %s are in Kafka",
                s.slot,
                found.table_rows,
                span,
            )
            return True
        self.metrics.start_check_republished.inc(found.republished)
        log.warning(
            "start-up check of slot %s: %d of the %d outbox rows committed in %s were not in"
            " Kafka (first: %s): re-published (header recovered=verify)%s",
            s.slot,
            len(found.missing),
            found.table_rows,
            span,
            ", ".join(found.first_missing_ids(LOGGED_IDS)),
            "; " + "; ".join(found.notes) if found.notes else "",
            extra={"state": RelayState.STREAMING.value},
        )
        return True
