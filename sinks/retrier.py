"""Retries of parked events: the admin API, the CLI and the scheduler share this.

Guarantees (Sink invariants 6 and 7):

* a retry sends the event exactly as Kafka held it (type, payload, idempotency
  key, trace context), through the same dispatch as the consumer;
* success turns the row DONE; a rejection spends an attempt (``retry_count+1``)
  and sets an exponential ``next_retry_at``; engine-wide trouble spends nothing
  and puts the row back to FAILED;
* the scheduler takes at most ``retry_batch_size`` due rows below
  ``retry_max_attempts`` per run; explicit retries (ids or ``retry_all``) are
  an operator's decision and ignore ``next_retry_at`` and the attempt limit.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from cdc.settings import Settings
from sinks.dispatch import deliver
from sinks.engine import EngineClient
from sinks.errors import EngineUnavailable, SinkError
from sinks.parking import ParkedEvent, ParkingLot
from sinks.retry import retry_delay_s
from sinks.tracing import engine_trace_headers

log = logging.getLogger(__name__)

#: Parking-lot event type -> the record type to route a row whose headers lack it.
_DEFAULT_TYPES = {"USER_SYNC": "UserRegistered", "QUIZ_SYNC": "QuizAttemptSubmitted"}
#: Rows an explicit retry_all takes at most (the admin list shows 100 too).
RETRY_ALL_LIMIT = 100


@dataclass
class RetrySummary:
    """What one retry run did; ``unknown_ids`` were asked for but are not open rows."""

    processed_count: int = 0
    done_count: int = 0
    failed_count: int = 0
    unknown_ids: list[int] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)

    def as_data(self) -> dict[str, int]:
        return {
            "processed_count": self.processed_count,
            "done_count": self.done_count,
            "failed_count": self.failed_count,
        }


class Retrier:
    """Retries parked rows against the engine."""

    def __init__(self, *, lot: ParkingLot, engine: EngineClient, settings: Settings) -> None:
        self._lot = lot
        self._engine = engine
        self._settings = settings

    async def retry(self, ids: list[int] | None, *, retry_all: bool) -> RetrySummary:
        """Retry chosen rows (``ids``) or, with ``retry_all``, every open row (up to 100)."""
        if ids:
            rows = await self._lot.claim(
                sorted(set(ids)), limit=len(set(ids)), max_attempts=None, due_only=False
            )
            found = {r.event_id for r in rows}
            summary = await self._retry_rows(rows)
            summary.unknown_ids = sorted(set(ids) - found)
            return summary
        if retry_all:
            rows = await self._lot.claim(
                None, limit=RETRY_ALL_LIMIT, max_attempts=None, due_only=False
            )
            return await self._retry_rows(rows)
        return RetrySummary()

    async def run_scheduled(self) -> RetrySummary:
        """One scheduler run: due rows below the attempt limit, at most a batch."""
        rows = await self._lot.claim(
            None,
            limit=self._settings.retry_batch_size,
            max_attempts=self._settings.retry_max_attempts,
            due_only=True,
        )
        summary = await self._retry_rows(rows)
        if summary.processed_count:
            log.info(
                "scheduler retried %d parked events: %d done, %d failed",
                summary.processed_count,
                summary.done_count,
                summary.failed_count,
            )
        return summary

    async def _retry_rows(self, rows: list[ParkedEvent]) -> RetrySummary:
        summary = RetrySummary()
        for row in rows:
            summary.processed_count += 1
            error = await self._retry_one(row)
            if error is None:
                summary.done_count += 1
            else:
                summary.failed_count += 1
                summary.errors[row.event_id] = error
        return summary

    async def _retry_one(self, row: ParkedEvent) -> str | None:
        event_type = row.type_header or _DEFAULT_TYPES.get(row.event_type, "")
        event_id = row.outbox_event_id or f"parked-{row.event_id}"
        try:
            await deliver(
                self._engine,
                event_type=event_type,
                payload=row.payload_json.encode(),
                event_id=event_id,
                headers=engine_trace_headers(row.kafka_headers),
            )
        except EngineUnavailable as exc:
            await self._lot.release(row.event_id)
            return f"engine unavailable: {exc.reason}"
        except SinkError as exc:
            delay = retry_delay_s(row.retry_count + 1, self._settings.retry_backoff_base_s)
            await self._lot.mark_failed(row.event_id, exc.reason, retry_in_s=delay)
            return exc.reason
        await self._lot.mark_done(row.event_id)
        return None


class Scheduler:
    """Runs :meth:`Retrier.run_scheduled` every ``scheduler_interval_s`` while enabled."""

    def __init__(self, retrier: Retrier, *, interval_s: float, enabled: bool) -> None:
        self._retrier = retrier
        self._interval_s = interval_s
        self.enabled = enabled
        self.runs = 0

    async def run(self, stop: asyncio.Event) -> None:
        if not self.enabled:
            log.info("parking-lot scheduler disabled (OUTBOX_SCHEDULER_ENABLED=false)")
            return
        log.info("parking-lot scheduler every %.0fs", self._interval_s)
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=self._interval_s)
                return
            except TimeoutError:
                pass
            try:
                await self._retrier.run_scheduled()
            except Exception:
                log.exception("scheduler run failed; trying again next period")
            self.runs += 1
