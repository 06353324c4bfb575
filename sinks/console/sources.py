"""Where the console's pages read from: the CLI's and the admin API's own functions, bounded.

Guarantees:

* one source: lag and the slot are :func:`sinks.ops.lag.pipeline_lag` (``outbox-cdc lag``,
  which reads ``slot status`` too), gaps :func:`cdc.gaps.open_gaps`, the parking lot the
  admin API's :class:`~sinks.parking.lot.ParkingLot` and :class:`~sinks.parking.retrier.Retrier`
  (a retry spends no attempt on an engine outage, a rejection does; a row leased elsewhere
  is left alone), a trace :func:`sinks.trace.search.trace_event` / ``trace_key``, an
  audit :func:`cdc.audit.run.run_audit` with ``outbox-cdc audit``'s window;
* no blocking call runs on the event loop (the sink's deliveries share it): Kafka,
  PostgreSQL's synchronous reads, the trace and the audit run on worker threads;
* the cost is bounded whatever the number of open pages: a lag read is shared by every
  request within :data:`LAG_TTL_S` (one read in flight at a time), an audit runs one at a
  time (a second is refused with a line saying so), a relay request waits at most
  :data:`RELAY_TIMEOUT_S`;
* a read that fails is a :class:`~sinks.console.views.Readout` with its reason (the page
  shows it), never an exception out of here, and its text carries no secret (errors are
  the CLI's own, which redact DSNs).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any, TypeVar

import httpx
from prometheus_client import CollectorRegistry

from cdc.audit.run import AuditReport, run_audit
from cdc.audit.window import window_for
from cdc.gaps import HistoryRow, open_gaps
from cdc.health import Liveness
from cdc.pgconn import connect
from cdc.settings import Settings
from sinks.console.history import LagHistory
from sinks.console.views import (
    PARKED_PAGE_ROWS,
    AuditMetricsView,
    Overview,
    ParkedFilter,
    Readout,
    audit_metrics,
    relay_view,
    route_views,
)
from sinks.ops.lag import PipelineLag, pipeline_lag
from sinks.parking.lot import ParkedEvent, ParkingLot
from sinks.parking.reasons import ReasonCount
from sinks.parking.retrier import Retrier, RetrySummary
from sinks.shared.routes import (
    QUIZ_ATTEMPTS_SYNC_PATH,
    USERS_SYNC_PATH,
    Routing,
    SyncType,
)
from sinks.trace.model import EventTrace
from sinks.trace.search import trace_event, trace_key

log = logging.getLogger("sinks.console")

_T = TypeVar("_T")

#: A lag read (Kafka's offsets, the slot, the parking lot's counts) serves every page for
#: this long: the overview refreshes every few seconds, in any number of tabs.
LAG_TTL_S = 4.0
#: Longest wait for the relay's /readyz or /metrics.
RELAY_TIMEOUT_S = 2.0
#: Records a trace reads per partition at most (the CLI's default).
TRACE_MAX_RECORDS = 20_000
#: A retry started from the console starts no row after this long (the admin API's bound).
RETRY_DEADLINE_S = 20.0
#: The engine path each sync type is sent to (the registry's ``route`` label).
ROUTE_PATHS = {SyncType.USER_SYNC: USERS_SYNC_PATH, SyncType.QUIZ_SYNC: QUIZ_ATTEMPTS_SYNC_PATH}
#: Missing rows an audit run from the console lists (all are counted and repaired).
AUDIT_LISTED = 200


def first_line(exc: BaseException) -> str:
    """``<class>: <first line>`` of an error, bounded (what a page shows)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300]}" if lines else type(exc).__name__


def relay_url(settings: Settings) -> str:
    """The relay's HTTP base URL: ``CONSOLE_RELAY_URL``, else the local relay's port."""
    return (settings.console_relay_url or f"http://127.0.0.1:{settings.relay_http_port}").rstrip(
        "/"
    )


def registry_samples(registry: CollectorRegistry) -> Iterator[tuple[str, dict[str, str], float]]:
    for metric in registry.collect():
        for sample in metric.samples:
            yield sample.name, dict(sample.labels), sample.value


class AuditBusy(RuntimeError):  # noqa: N818 - named after the condition, as the lot's
    """An audit started from the console is still running."""


class ConsoleSources:
    """The reads and actions of the console, on the sink's own objects."""

    def __init__(
        self,
        *,
        settings: Settings,
        lot: ParkingLot,
        retrier: Retrier,
        registry: CollectorRegistry,
        liveness: Liveness,
        transport: httpx.AsyncBaseTransport | None = None,
        lag_reader: Callable[[Settings], PipelineLag] = pipeline_lag,
    ) -> None:
        self.settings = settings
        self.lot = lot
        self.retrier = retrier
        self.registry = registry
        self.liveness = liveness
        self.history = LagHistory()
        self.relay_url = relay_url(settings)
        self._transport = transport
        self._read_lag = lag_reader
        self._lag: tuple[float, Readout[PipelineLag]] | None = None
        self._lag_lock = asyncio.Lock()
        self._audit_lock = asyncio.Lock()
        self.last_audit: dict[str, Any] | None = None

    # ------------------------------------------------------------------ reads
    async def lag(self) -> Readout[PipelineLag]:
        """``outbox-cdc lag``'s report, shared for :data:`LAG_TTL_S`."""
        async with self._lag_lock:
            if self._lag is not None and time.monotonic() - self._lag[0] < LAG_TTL_S:
                return self._lag[1]
            readout = await _threaded(self._read_lag, self.settings)
            if readout.value is not None:
                self.history.record(
                    readout.value.at_ms,
                    ((p.topic, p.partition, p.lag) for p in readout.value.partitions),
                )
            self._lag = (time.monotonic(), readout)
            return readout

    async def relay(self, path: str) -> tuple[int | None, str, str | None]:
        """One GET of the relay's HTTP port: (status, body, error)."""
        try:
            async with httpx.AsyncClient(
                transport=self._transport, timeout=RELAY_TIMEOUT_S
            ) as client:
                answer = await client.get(self.relay_url + path)
        except httpx.HTTPError as exc:
            return None, "", first_line(exc)
        return answer.status_code, answer.text, None

    async def relay_audit(self) -> Readout[AuditMetricsView]:
        status, body, error = await self.relay("/metrics")
        if error is not None or status != 200:
            return Readout(None, error or f"relay /metrics answered HTTP {status}")
        try:
            return Readout(audit_metrics(body))
        except ValueError as exc:
            return Readout(None, first_line(exc))

    async def gaps(self) -> Readout[list[HistoryRow]]:
        dsn = self.settings.pg_dsn.get_secret_value()

        def read(_: object) -> list[HistoryRow]:
            with connect(dsn) as conn:
                return open_gaps(conn)

        return await _threaded(read, None)

    async def parked_counts(self) -> Readout[dict[tuple[str, str], int]]:
        try:
            return Readout(await self.lot.counts_by_type())
        except Exception as exc:  # the page shows what failed
            return Readout(None, first_line(exc))

    async def parked_reasons(self) -> Readout[list[ReasonCount]]:
        """What ``outbox-cdc failed reasons`` prints (:meth:`ParkingLot.counts_by_reason`)."""
        try:
            return Readout(await self.lot.counts_by_reason())
        except Exception as exc:  # the page shows what failed
            return Readout(None, first_line(exc))

    async def overview(self) -> Overview:
        lag, gaps, parked, reasons, audit, (status, body, error) = await asyncio.gather(
            self.lag(),
            self.gaps(),
            self.parked_counts(),
            self.parked_reasons(),
            self.relay_audit(),
            self.relay("/readyz"),
        )
        routed = {
            t: ROUTE_PATHS.get(s, str(s))
            for t, s in Routing.from_settings(self.settings).routed_types.items()
        }
        return Overview(
            at=datetime.now(UTC),
            relay=relay_view(self.relay_url, status, body, error),
            lag=lag,
            gaps=gaps,
            parked=parked,
            reasons=reasons,
            routes=route_views(registry_samples(self.registry), routed),
            sink_state=self.liveness.state,
            audit=audit,
            last_console_audit=self.last_audit,
        )

    async def parked(self, f: ParkedFilter) -> Readout[list[ParkedEvent]]:
        try:
            rows = await self.lot.list_rows(
                statuses=f.statuses,
                event_type=f.event_type,
                limit=PARKED_PAGE_ROWS,
                key=f.key,
                reason=f.reason,
                reason_class=f.reason_class,
                since=f.since,
                until=f.until,
            )
        except Exception as exc:  # the page shows what failed
            return Readout(None, first_line(exc))
        return Readout(rows)

    async def parked_row(self, event_id: int) -> Readout[ParkedEvent]:
        try:
            rows = await self.lot.get([event_id])
        except Exception as exc:  # the page shows what failed
            return Readout(None, first_line(exc))
        return Readout(rows[0] if rows else None, None if rows else f"no parked row {event_id}")

    async def trace(self, *, event_id: str | None, key: str | None) -> Readout[list[EventTrace]]:
        settings = self.settings

        def run(_: object) -> list[EventTrace]:
            if event_id:
                return [trace_event(settings, event_id, max_records=TRACE_MAX_RECORDS)]
            assert key
            return trace_key(settings, key, max_records=TRACE_MAX_RECORDS)

        return await _threaded(run, None)

    # ---------------------------------------------------------------- actions
    async def retry(self, ids: list[int]) -> RetrySummary:
        """The admin API's retry of the named rows (same rules, same bound)."""
        return await self.retrier.retry(ids, retry_all=False, deadline_s=RETRY_DEADLINE_S)

    async def discard(self, ids: list[int], reason: str) -> list[int]:
        """``outbox-cdc failed accept``: open rows marked DONE unsent, with the reason."""
        return await self.lot.accept(ids=ids, event_type=None, reason=reason)

    async def run_audit(self, *, repair: bool, since: str | None) -> Readout[dict[str, Any]]:
        """``outbox-cdc audit [--since S] [--repair]``; :class:`AuditBusy` while one runs."""
        if self._audit_lock.locked():
            raise AuditBusy("an audit started here is still running: wait for its answer")
        async with self._audit_lock:
            settings = self.settings

            def run(_: object) -> AuditReport:
                s = settings
                window = window_for(
                    now=datetime.now(UTC),
                    settle_s=s.audit_settle_s,
                    width_s=s.audit_window_s,
                    since=since or None,
                )
                return run_audit(s, window, repair=repair, limit=AUDIT_LISTED)

            readout = await _threaded(run, None)
            if readout.value is None:
                return Readout(None, readout.error)
            report = {**readout.value.as_json(), "repair": repair, "at": datetime.now(UTC)}
            self.last_audit = report
            log.info(
                "console audit %s: %s (repair %s)",
                report["run_id"],
                report["verdict"],
                "on" if repair else "off",
            )
            return Readout(report)


async def _threaded(func: Callable[[Any], _T], arg: Any) -> Readout[_T]:
    try:
        return Readout(await asyncio.to_thread(func, arg))
    except Exception as exc:  # the page shows what failed
        return Readout(None, first_line(exc))
