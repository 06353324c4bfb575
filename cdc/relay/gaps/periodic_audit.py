"""The relay's unattended audit: every ``CDC_AUDIT_INTERVAL_S``, the trailing window, repaired.

Guarantees:

* it runs on a thread of its own with connections and clients of its own: the
  stream is never delayed by it, and no error of it ends the relay (a failed run
  is logged, counted ``outbox_audit_runs_total{result="failed"}`` and retried at
  the next interval);
* only the active relay audits: a run starts only while the relay streams its
  slot (:data:`ACTIVE_STATES`: not a standby, not in a gap), and every run that
  may repair holds the slot's audit lock (a second relay, or ``outbox-cdc audit
  --repair``, makes it skip: ``result="skipped"``);
* the window is ``CDC_AUDIT_WINDOW_S`` wide and ends ``CDC_AUDIT_SETTLE_S`` ago;
  events still in the slot are in flight, never judged missing nor clean
  (``in_flight``, when nothing was missing); when the audit cannot tell (the slot
  cannot be read, the server cannot be identified: "cannot judge") it judges
  nothing (``skipped``);
* it never starts before the relay's first start when that chose not to publish
  the rows already in the table (``slot init --from now``, an empty outbox): those
  rows are never judged nor republished (the start-up check keeps the same
  boundary); a window that ends before it is not run (``skipped``);
* what it finds missing is republished (``CDC_AUDIT_REPAIR=on``, the default)
  and counted; a run that found something writes one WARNING line naming the
  counts and the first ids; ``outbox_audit_missing`` is the last judged run's count.

Results (the ``result`` label): ``clean``, ``found`` (missing or removed before
the group processed them), ``in_flight`` (nothing missing, rows still in the slot),
``skipped``, ``failed``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime

import psycopg
from confluent_kafka import KafkaException
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cdc.audit.run import AuditReport, run_audit
from cdc.audit.window import BeforeFirstStartError, window_for
from cdc.errors import CdcError
from cdc.relay.health.state import RelayState
from cdc.repair.lock import AuditBusyError
from cdc.settings import Settings

log = logging.getLogger("cdc.audit")

#: States in which the relay holds its slot and streams: it may audit.
ACTIVE_STATES = frozenset(
    {RelayState.STREAMING, RelayState.BACKPRESSURE, RelayState.STALLED, RelayState.HELD}
)
#: The values of outbox_audit_runs_total's ``result`` label.
RESULTS = ("clean", "found", "in_flight", "skipped", "failed")
#: Missing ids named in the WARNING line.
LOGGED_IDS = 5
#: Bounds of outbox_audit_duration_seconds (a window of 1,000,000 rows takes tens of seconds).
DURATION_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class AuditMetrics:
    """The periodic audit's metrics, in the relay's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.runs = Counter(
            "outbox_audit_runs_total",
            "Periodic audits of the relay, by result (clean, found, in_flight, skipped, failed)",
            ["result"],
            registry=registry,
        )
        self.missing = Gauge(
            "outbox_audit_missing",
            "Events the last judged audit found missing from Kafka (before its repair)",
            registry=registry,
        )
        self.expired = Gauge(
            "outbox_audit_expired_unprocessed",
            "Records the last judged audit found removed before the group processed them",
            registry=registry,
        )
        self.repaired = Counter(
            "outbox_audit_repaired_total",
            "Events the periodic audit republished (header recovered=audit-<run>)",
            registry=registry,
        )
        for result in RESULTS:  # every series from the start (rate() and alerts see a 0)
            self.runs.labels(result)
        self.duration = Histogram(
            "outbox_audit_duration_seconds",
            "Duration of one periodic audit (table, slot, Kafka, group, repair)",
            buckets=DURATION_BUCKETS_S,
            registry=registry,
        )


class PeriodicAudit:
    """See the module docstring. :meth:`start` returns None when the audit is off."""

    def __init__(
        self,
        settings: Settings,
        *,
        registry: CollectorRegistry,
        active: Callable[[], bool],
        stop: threading.Event,
    ) -> None:
        self.settings = settings
        self.metrics = AuditMetrics(registry)
        self._active = active
        self._stop = stop
        self._thread = threading.Thread(target=self._loop, name="outbox-audit", daemon=True)

    def start(self) -> PeriodicAudit | None:
        if self.settings.audit_interval_s <= 0:
            log.info("periodic audit off (CDC_AUDIT_INTERVAL_S=0)")
            return None
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.audit_interval_s):
            if self._active():
                self.run_once()

    def run_once(self) -> AuditReport | None:
        """One audit of the trailing window; the report, or None when skipped or failed."""
        s = self.settings
        window = window_for(
            now=datetime.now(UTC), settle_s=s.audit_settle_s, width_s=s.audit_window_s
        )
        started = time.monotonic()
        try:
            report = run_audit(s, window, repair=s.audit_repair, repair_unproven=False)
        except (AuditBusyError, BeforeFirstStartError) as exc:
            self.metrics.runs.labels("skipped").inc()
            log.info("audit skipped: %s", exc)
            return None
        except (CdcError, psycopg.Error, KafkaException) as exc:
            self.metrics.runs.labels("failed").inc()
            log.warning("audit of the last %gs failed: %s", s.audit_window_s, exc)
            return None
        finally:
            self.metrics.duration.observe(time.monotonic() - started)
        if report.pending.ids is None:
            self.metrics.runs.labels("skipped").inc()
            log.info("audit %s not judged: %s", report.run_id, report.pending.note)
            return report
        if report.cannot_judge is not None and not report.missing_count:
            self.metrics.runs.labels("skipped").inc()
            log.warning("audit %s not judged: %s", report.run_id, report.cannot_judge)
            return report
        self._record(report)
        return report

    def _record(self, report: AuditReport) -> None:
        self.metrics.missing.set(report.missing_count)
        self.metrics.expired.set(report.expired_count)
        self.metrics.repaired.inc(report.repaired)
        verdict = report.verdict
        self.metrics.runs.labels(verdict.replace(" ", "_")).inc()
        if verdict == "in flight":
            log.info(
                "audit %s: window %s .. %s: nothing missing, %d rows still in the slot (in flight)",
                report.run_id,
                report.window.as_json()["since"],
                report.window.as_json()["until"],
                report.in_flight,
            )
            return
        if report.clean:
            log.info(
                "audit %s: window %s .. %s complete (%d rows)",
                report.run_id,
                report.window.as_json()["since"],
                report.window.as_json()["until"],
                report.table.judged_rows,
            )
            return
        log.warning("%s", finding_line(report), extra={"audit_run": report.run_id})


def finding_line(report: AuditReport) -> str:
    """The one WARNING line of a run that found something."""
    window = report.window.as_json()
    parts = [f"audit {report.run_id} of {window['since']} .. {window['until']}:"]
    if report.missing_count:
        first = ", ".join(report.first_missing_ids(LOGGED_IDS))
        more = " ..." if report.missing_count > LOGGED_IDS else ""
        parts.append(f"{report.missing_count} events missing from Kafka (first: {first}{more});")
    if report.group.expired:
        where = ", ".join(
            f"{e.topic}[{e.partition}] {e.committed_offset}..{e.log_start_offset - 1}"
            for e in report.group.expired
        )
        parts.append(
            f"{report.expired_count} records removed before group {report.group.group}"
            f" processed them ({where});"
        )
    if report.repaired:
        parts.append(f"republished {report.repaired} ({report.repair_mark})")
    elif report.missing_count:
        parts.append("not republished (CDC_AUDIT_REPAIR=off)")
    return " ".join(parts).rstrip(";")
