"""Synchronous faces of the parking lot (:mod:`sinks.parking.lot`) for the command line.

Guarantees: each call opens the lot, does one thing with the same rules as the
admin API (a retry spends no attempt on an engine outage, a rejection does;
rows being retried elsewhere are left alone) and closes the lot again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from cdc.settings import Settings
from sinks.engine.client import EngineClient
from sinks.ops.errors import OpsUsageError
from sinks.parking.lot import ParkedEvent, ParkingLot
from sinks.parking.reasons import REASONS_SHOWN, ReasonCount
from sinks.parking.retrier import Retrier, RetrySummary

_T = TypeVar("_T")


def parked_events(
    settings: Settings,
    *,
    limit: int = 100,
    statuses: Sequence[str] = ("FAILED", "PENDING"),
    event_type: str | None = None,
) -> list[ParkedEvent]:
    """The oldest ``limit`` rows of the parking lot in ``statuses``, of ``event_type`` if given."""
    return asyncio.run(
        _with_lot(
            settings,
            lambda lot: lot.list_rows(statuses=statuses, event_type=event_type, limit=limit),
        )
    )


def retry_scheduled(row: ParkedEvent, *, fingerprint: str, max_attempts: int) -> bool:
    """The scheduler will retry ``row`` (at its ``next_retry_at``): it is open, has attempts
    left, and is not an UNROUTABLE row under the routing it was parked with (no route for
    its type yet: it waits for ``SINK_ROUTES`` to change). The rule of the lot's due rows."""
    if row.status == "DONE" or row.retry_count >= max_attempts:
        return False
    return not (row.event_type == "UNROUTABLE" and row.routes_fingerprint == fingerprint)


def parked_json(row: ParkedEvent, *, scheduled: bool) -> dict[str, object]:
    """A parked row for ``failed list --json``: the table's columns under the names they
    have there (``event_id``, the row's id, and ``event_type``, its sync type, as in the
    admin API), and what they hold named plainly: ``id`` (the row),
    ``sync_type`` (USER_SYNC, QUIZ_SYNC, UNROUTABLE), ``type`` (the record's own type,
    e.g. OrderPlaced) and ``retry_scheduled`` (the scheduler will retry it at
    ``next_retry_at``)."""
    return {
        "id": row.event_id,
        "sync_type": row.event_type,
        "type": row.type_header or None,
        "retry_scheduled": scheduled,
        **row.as_json(),
    }


def count_acceptable(
    settings: Settings, *, ids: Sequence[int] | None, event_type: str | None
) -> int:
    """How many open rows :func:`accept_parked` would mark DONE."""
    return asyncio.run(
        _with_lot(
            settings,
            lambda lot: lot.count_acceptable(ids=list(ids) if ids else None, event_type=event_type),
        )
    )


def accept_parked(
    settings: Settings,
    *,
    ids: Sequence[int] | None,
    event_type: str | None,
    reason: str | None = None,
) -> list[int]:
    """Mark open rows DONE without sending them ("accept as skipped"); the ids marked;
    ``reason`` is written into their ``last_error``."""
    if not ids and not event_type:
        raise OpsUsageError("give parked event ids or an event type")
    return asyncio.run(
        _with_lot(
            settings,
            lambda lot: lot.accept(
                ids=list(ids) if ids else None, event_type=event_type, reason=reason
            ),
        )
    )


def parking_counts(settings: Settings) -> dict[str, int]:
    """Rows of the parking lot per status (FAILED, PENDING, DONE)."""
    return asyncio.run(_with_lot(settings, lambda lot: lot.counts()))


def parked_reasons(settings: Settings, *, limit: int = REASONS_SHOWN) -> list[ReasonCount]:
    """Open rows per reason class, the ``limit`` largest, most first: what the console's
    overview shows (:meth:`ParkingLot.counts_by_reason`)."""
    return asyncio.run(_with_lot(settings, lambda lot: lot.counts_by_reason(limit=limit)))


def reasons_json(counts: Sequence[ReasonCount]) -> list[dict[str, object]]:
    """``failed reasons --json``'s rows: ``reason`` (the class) and ``count`` (open rows)."""
    return [{"reason": c.reason, "count": c.count} for c in counts]


def retry_parked(settings: Settings, *, ids: Sequence[int] | None, retry_all: bool) -> RetrySummary:
    """Retry chosen rows (or every open row, up to 100) exactly as the admin API does."""
    if not ids and not retry_all:
        raise OpsUsageError("give parked event ids or retry_all")

    async def run(lot: ParkingLot) -> RetrySummary:
        async with EngineClient.from_settings(settings) as engine:
            retrier = Retrier(lot=lot, engine=engine, settings=settings)
            return await retrier.retry(list(ids) if ids else None, retry_all=retry_all)

    return asyncio.run(_with_lot(settings, run))


async def _with_lot(settings: Settings, use: Callable[[ParkingLot], Awaitable[_T]]) -> _T:
    lot = ParkingLot(settings.require("pg_dsn").pg_dsn.get_secret_value())
    try:
        return await use(lot)
    finally:
        await lot.close()
