"""What each console page shows, as data: pure functions over what the CLI computes.

Guarantees:

* every number a page shows comes from an object the CLI or the admin API already
  computes (:class:`~sinks.ops.lag.PipelineLag` of ``outbox-cdc lag``, the
  :class:`~cdc.ops.SlotStatus` of ``slot status``, the parking lot's rows and
  counts, :class:`~sinks.trace.model.EventTrace` of ``trace``,
  :class:`~cdc.audit.run.AuditReport` of ``audit``, the relay's ``/readyz`` and
  ``/metrics``, the sink's own registry); this module only selects, orders and names;
* something that could not be read is shown as unknown with the reason, never as
  zero (the lag totals of an unreadable Kafka, a relay that does not answer);
* what a request asks for (a sort key, a filter) is checked against fixed lists and
  bounds here: a bad value is one line naming it, never an exception.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import Enum
from typing import Generic, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from cdc.gaps import HistoryRow
from cdc.ops import SlotStatus
from sinks.ops.lag import PipelineLag
from sinks.ops.offsets import PartitionLag
from sinks.parking.reasons import ReasonCount

#: The suffix the relay's ``/readyz`` body carries in exactly-once mode.
EXACTLY_ONCE_MARK = "(exactly-once)"
#: The metrics the relay's periodic audit writes (cdc.audit.periodic).
AUDIT_RUNS = "outbox_audit_runs"
AUDIT_MISSING = "outbox_audit_missing"
AUDIT_EXPIRED = "outbox_audit_expired_unprocessed"
AUDIT_REPAIRED = "outbox_audit_repaired"
#: The sink's per-route gauges (sinks.runtime.metrics).
ROUTE_CIRCUIT = "outbox_sink_route_circuit_open"
ROUTE_WAITING = "outbox_sink_route_waiting_records"
#: Longest filter value taken (a key, a reason text, a type).
MAX_FILTER_CHARS = 200
#: Parked rows one page lists at most (the admin API's "top 100").
PARKED_PAGE_ROWS = 100
#: Statuses of the parking lot (FAILED: waits for its retry; PENDING: being retried;
#: DONE: delivered, or accepted as skipped).
STATUSES = ("FAILED", "PENDING", "DONE")


class Mode(Enum):
    """How the relay publishes, as its ``/readyz`` says."""

    AT_LEAST_ONCE = "at-least-once"  # the default: consumers dedupe on the id header
    EXACTLY_ONCE = "exactly-once"  # Kafka transactions with the relay's checkpoint
    UNKNOWN = "unknown"  # the relay did not answer


@dataclass(frozen=True)
class RelayView:
    """The relay as its ``/readyz`` answers: 200 ready, 503 with its state, or no answer."""

    url: str
    ready: bool
    state: str
    mode: Mode


def relay_view(url: str, status_code: int | None, body: str, error: str | None) -> RelayView:
    """The relay's readiness from one ``/readyz`` answer (``error``: none came)."""
    if status_code is None or error is not None:
        return RelayView(url, False, f"unreachable: {error or 'no answer'}", Mode.UNKNOWN)
    text = body.strip()[:300]
    exactly_once = EXACTLY_ONCE_MARK in text
    state = text.replace(EXACTLY_ONCE_MARK, "").strip() or f"HTTP {status_code}"
    mode = Mode.EXACTLY_ONCE if exactly_once else Mode.AT_LEAST_ONCE
    return RelayView(url, status_code == 200, state, mode)


@dataclass(frozen=True)
class AuditMetricsView:
    """The relay's periodic audit, from its ``/metrics`` (None: not read)."""

    runs: dict[str, float]
    missing: float | None
    expired: float | None
    repaired: float | None

    @property
    def total_runs(self) -> float:
        return sum(self.runs.values())


def audit_metrics(text: str) -> AuditMetricsView:
    """The audit's series out of a Prometheus text exposition (the relay's ``/metrics``)."""
    runs: dict[str, float] = {}
    single: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == AUDIT_RUNS + "_total":
                runs[sample.labels.get("result", "?")] = sample.value
            elif sample.name in (AUDIT_MISSING, AUDIT_EXPIRED, AUDIT_REPAIRED + "_total"):
                single[sample.name] = sample.value
    return AuditMetricsView(
        runs=runs,
        missing=single.get(AUDIT_MISSING),
        expired=single.get(AUDIT_EXPIRED),
        repaired=single.get(AUDIT_REPAIRED + "_total"),
    )


@dataclass(frozen=True)
class RouteView:
    """One engine route as the sink's registry has it."""

    route: str
    circuit_open: bool
    waiting: int
    types: tuple[str, ...]


def route_views(
    samples: Iterable[tuple[str, Mapping[str, str], float]], routed: Mapping[str, str]
) -> list[RouteView]:
    """Routes from the registry's ``(name, labels, value)`` samples; ``routed`` is the
    routing's event type -> engine path (its routes show even before their first use)."""
    circuit: dict[str, bool] = {}
    waiting: dict[str, int] = {}
    for name, labels, value in samples:
        route = labels.get("route")
        if route is None:
            continue
        if name == ROUTE_CIRCUIT:
            circuit[route] = value >= 1
        elif name == ROUTE_WAITING:
            waiting[route] = int(value)
    by_call: dict[str, list[str]] = {}
    for event_type, call in routed.items():
        by_call.setdefault(call, []).append(event_type)
    names = sorted(set(circuit) | set(waiting) | set(by_call))
    return [
        RouteView(
            route=name,
            circuit_open=circuit.get(name, False),
            waiting=waiting.get(name, 0),
            types=tuple(sorted(by_call.get(name, ()))),
        )
        for name in names
    ]


T = TypeVar("T")


@dataclass(frozen=True)
class Readout(Generic[T]):
    """A value read from somewhere, or why it could not be."""

    value: T | None
    error: str | None = None


@dataclass(frozen=True, kw_only=True)
class Overview:
    """The first page: every answer of the operator's morning, at one moment."""

    at: datetime
    relay: RelayView
    lag: Readout[PipelineLag]
    gaps: Readout[list[HistoryRow]]
    parked: Readout[dict[tuple[str, str], int]]
    #: open rows per reason class, the largest first (``outbox-cdc failed reasons``)
    reasons: Readout[list[ReasonCount]]
    routes: list[RouteView]
    sink_state: str
    audit: Readout[AuditMetricsView]
    last_console_audit: dict[str, object] | None = None

    @property
    def slot(self) -> SlotStatus | None:
        return self.lag.value.slot if self.lag.value is not None else None

    def parked_rows(self) -> list[tuple[str, dict[str, int]]]:
        """Per sync type: its count per status (every status, 0 when none)."""
        out: dict[str, dict[str, int]] = {}
        for (sync_type, status), n in sorted((self.parked.value or {}).items()):
            out.setdefault(sync_type, dict.fromkeys(STATUSES, 0))[status] = n
        return list(out.items())


#: Columns the lag table sorts by, and the value each sorts on (unknowns last).
LAG_SORT_KEYS = ("topic", "partition", "committed", "end", "lag", "age")


def _lag_key(key: str, p: PartitionLag) -> tuple[bool, object]:
    values: dict[str, object | None] = {
        "topic": (p.topic, p.partition),
        "partition": (p.partition, p.topic),
        "committed": p.committed_offset,
        "end": p.end_offset,
        "lag": p.lag,
        "age": p.oldest_unprocessed_age_s,
    }
    value = values[key]
    return (value is None, value if value is not None else 0)


def sort_partitions(
    rows: Sequence[PartitionLag], key: str | None, descending: bool
) -> tuple[list[PartitionLag], str]:
    """The rows in the asked order (an unknown key: by lag, most first) and the key used."""
    if key not in LAG_SORT_KEYS:
        key, descending = "lag", True
    known = [r for r in rows if _lag_key(key, r)[0] is False]
    unknown = [r for r in rows if _lag_key(key, r)[0] is True]
    known.sort(key=lambda r: _lag_key(key, r)[1], reverse=descending)  # type: ignore[arg-type,return-value]
    return known + unknown, key


class FilterError(ValueError):
    """A filter of the parking lot's page that cannot be used (one line naming it)."""


@dataclass(frozen=True, kw_only=True)
class ParkedFilter:
    """The parking lot page's filters, checked."""

    statuses: tuple[str, ...] = ("FAILED", "PENDING")
    event_type: str | None = None
    reason: str | None = None
    #: a reason class, matched exactly (the overview's by-reason links)
    reason_class: str | None = None
    key: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    query: dict[str, str] = field(default_factory=dict)


def _time(name: str, text: str) -> datetime | None:
    if not text:
        return None
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise FilterError(f"{name}: not a time (use 2026-12-04T06:00 or ISO-8601)") from None
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _text(name: str, params: Mapping[str, str]) -> str | None:
    value = params.get(name, "").strip()
    if len(value) > MAX_FILTER_CHARS:
        raise FilterError(f"{name}: longer than {MAX_FILTER_CHARS} characters")
    return value or None


def parked_filter(params: Mapping[str, str]) -> ParkedFilter:
    """The filters of a query string (status: one of :data:`STATUSES` or ``open``, the
    default: FAILED and PENDING); :class:`FilterError` names a bad one."""
    status = params.get("status", "open") or "open"
    if status == "open":
        statuses: tuple[str, ...] = ("FAILED", "PENDING")
    elif status == "all":
        statuses = STATUSES
    elif status in STATUSES:
        statuses = (status,)
    else:
        raise FilterError(f"status: one of open, all, {', '.join(STATUSES)}")
    since = _time("since", params.get("since", "").strip())
    until = _time("until", params.get("until", "").strip())
    if since is not None and until is not None and until <= since:
        raise FilterError("until: must be after since")
    names = ("status", "type", "reason", "reason_class", "key", "since", "until")
    return ParkedFilter(
        statuses=statuses,
        event_type=_text("type", params),
        reason=_text("reason", params),
        reason_class=_text("reason_class", params),
        key=_text("key", params),
        since=since,
        until=until,
        query={k: params[k] for k in names if params.get(k)},
    )


def ids_of(values: Iterable[str]) -> list[int]:
    """Row ids from form values (each a positive integer; anything else: FilterError)."""
    ids = []
    for value in values:
        if not value.isdigit() or int(value) < 1:
            raise FilterError(f"event id {value[:20]!r}: not a parking-lot row id")
        ids.append(int(value))
    return sorted(set(ids))


def age_text(age_s: float | None) -> str:
    """An age as the CLI's tables say it: ``-`` unknown, seconds, minutes, hours."""
    if age_s is None:
        return "unknown"
    if age_s < 120:
        return f"{age_s:.1f} s"
    if age_s < 7200:
        return f"{age_s / 60:.1f} min"
    return f"{age_s / 3600:.1f} h"


def bytes_text(n: int | None) -> str:
    if n is None:
        return "unknown"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover - the loop returns
