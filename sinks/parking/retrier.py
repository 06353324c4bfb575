"""Retries of parked events: the admin API, the CLI and the scheduler share this.

Guarantees (Sink invariants 6 and 7):

* a retry sends the event exactly as Kafka held it (type, payload, idempotency
  key, trace context), through the same dispatch as the consumer;
* every row is retried under a lease (:mod:`sinks.parking.claims`), one row at a
  time, so any number of sink instances (and operators) never retry the same
  row at once, and each attempt is counted exactly once;
* success turns the row DONE; a rejection spends an attempt (``retry_count+1``)
  and sets an exponential ``next_retry_at``; engine-wide trouble spends nothing
  and puts the row back to FAILED, due again after one scheduler period;
* the scheduler takes at most ``retry_batch_size`` due rows below
  ``retry_max_attempts`` per run, and leaves ``UNROUTABLE`` rows alone until
  the routing configuration changed; explicit retries (ids or ``retry_all``)
  are an operator's decision and ignore ``next_retry_at``, the attempt limit
  and the routing (never a live lease: such ids are reported as busy);
* a row whose type the routing now ignores is marked DONE without a request;
* an operator's retry can be given a deadline (the admin API's): no row is
  started after it, and the answer names the rows not tried;
* a row without an event id is never sent (the scheduler does not claim it; an
  operator's retry of it fails, saying why): no key but the event's own, ever;
* a parking lot that cannot answer (:class:`~sinks.parking.lot.ParkingLotUnavailable`,
  within its bounded waits) fails the run or the request, never hangs it; the
  scheduler logs one line and tries again next period (a claimed row's lease expires).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field

from cdc.settings import Settings
from sinks.core.errors import EngineUnavailable, SinkError
from sinks.engine.client import EngineClient
from sinks.engine.dispatch import deliver
from sinks.parking.claims import AttemptResult
from sinks.parking.lot import ParkedEvent, ParkingLot, ParkingLotUnavailable
from sinks.shared.routes import Routing
from sinks.shared.tracing import engine_trace_headers

log = logging.getLogger("sinks.retrier")

#: Parking-lot event type -> the record type to route a row whose headers lack it.
_DEFAULT_TYPES = {"USER_SYNC": "UserRegistered", "QUIZ_SYNC": "QuizAttemptSubmitted"}
#: Why a row without an event id is never sent (it has no idempotency key).
NO_EVENT_ID = (
    "no event id (the record's 'id' header held no uuid): never sent without its"
    " idempotency key; fix the producer and re-publish the event, or discard the row"
)
#: Rows an explicit retry_all takes at most (the admin list shows 100 too).
RETRY_ALL_LIMIT = 100
#: Ids a retry answer names at most per kind: a message stays a line, whatever was asked.
MAX_IDS_QUOTED = 20


def retry_message(
    unknown_ids: list[int],
    busy_ids: list[int] | None = None,
    *,
    untried_ids: list[int] | None = None,
    deadline_s: float | None = None,
) -> str:
    """A retry answer's ``message`` (admin API and CLI): at most 20 ids per kind not retried."""
    message = "Retry failed sync events finished"
    if deadline_s is not None and untried_ids is not None:
        message = (
            f"Retry failed sync events stopped at its deadline ({deadline_s:g} s): ask again"
            " for the rest"
        )
    for what, ids in (
        ("unknown or not open", unknown_ids),
        ("being retried by another instance right now", busy_ids or []),
        ("not tried before the deadline", untried_ids or []),
    ):
        if ids:
            named = ids[:MAX_IDS_QUOTED]
            more = len(ids) - len(named)
            message += f"; {what}: {named}" + (f" and {more} more" if more else "")
    return message


def claimer_id() -> str:
    """A name for this process's leases: host, pid and a random part (unique per start)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass
class RetrySummary:
    """What one retry run did.

    ``unknown_ids`` were asked for but are not open rows; ``busy_ids`` are
    held by another retrier's lease right now.
    """

    processed_count: int = 0
    done_count: int = 0
    failed_count: int = 0
    unknown_ids: list[int] = field(default_factory=list)
    busy_ids: list[int] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)
    #: asked for, not tried: the run reached its deadline first (None: it did not)
    untried_ids: list[int] | None = None

    def as_data(self) -> dict[str, int]:
        return {
            "processed_count": self.processed_count,
            "done_count": self.done_count,
            "failed_count": self.failed_count,
        }


class Retrier:
    """Retries parked rows against the engine, under leases named ``claimer``."""

    def __init__(
        self,
        *,
        lot: ParkingLot,
        engine: EngineClient,
        settings: Settings,
        claimer: str | None = None,
        routing: Routing | None = None,
    ) -> None:
        self._lot = lot
        self._engine = engine
        self._settings = settings
        self.claimer = claimer or claimer_id()
        self.routing = routing or Routing.from_settings(settings)

    async def retry(
        self, ids: list[int] | None, *, retry_all: bool, deadline_s: float | None = None
    ) -> RetrySummary:
        """Retry chosen rows (``ids``) or, with ``retry_all``, every open row (up to 100).

        ``deadline_s``: no row is started after this long (the admin API answers within
        it and one row's retry); the rows not tried are in ``untried_ids``."""
        summary = RetrySummary()
        until = None if deadline_s is None else time.monotonic() + deadline_s
        if ids:
            wanted = sorted(set(ids))
            for n, event_id in enumerate(wanted):
                if until is not None and time.monotonic() >= until:
                    summary.untried_ids = wanted[n:]
                    break
                row = await self._lot.claim_id(event_id, by=self.claimer)
                if row is None:
                    await self._not_claimed(event_id, summary)
                else:
                    await self._retry_row(row, summary)
        elif retry_all:
            await self._claim_and_retry(
                summary, scheduled=False, limit=RETRY_ALL_LIMIT, until=until
            )
        return summary

    async def run_scheduled(self) -> RetrySummary:
        """One scheduler run: due rows below the attempt limit, at most a batch."""
        summary = RetrySummary()
        await self._claim_and_retry(summary, scheduled=True, limit=self._settings.retry_batch_size)
        if summary.processed_count:
            log.info(
                "scheduler retried %d parked events: %d done, %d failed",
                summary.processed_count,
                summary.done_count,
                summary.failed_count,
            )
        return summary

    async def _claim_and_retry(
        self, summary: RetrySummary, *, scheduled: bool, limit: int, until: float | None = None
    ) -> None:
        after_id = 0  # one pass in id order: a row retried in this run is not taken again
        while summary.processed_count < limit:
            if until is not None and time.monotonic() >= until:
                summary.untried_ids = []  # (the rest of retry_all: not named, not claimed)
                return
            row = await self._lot.claim_next(
                by=self.claimer,
                scheduled=scheduled,
                max_attempts=self._settings.retry_max_attempts if scheduled else None,
                fingerprint=self.routing.fingerprint,
                after_id=after_id,
            )
            if row is None:
                return
            after_id = row.event_id
            await self._retry_row(row, summary)

    async def _not_claimed(self, event_id: int, summary: RetrySummary) -> None:
        rows = await self._lot.get([event_id])
        if rows and rows[0].status == "PENDING":
            summary.busy_ids.append(event_id)
        else:
            summary.unknown_ids.append(event_id)

    async def _retry_row(self, row: ParkedEvent, summary: RetrySummary) -> None:
        summary.processed_count += 1
        result, error = await self._attempt(row)
        counted = await self._lot.settle(
            row,
            by=self.claimer,
            result=result,
            error=error,
            backoff_base_s=self._settings.retry_backoff_base_s,
            period_s=self._settings.scheduler_interval_s,
            fingerprint=self.routing.fingerprint,
        )
        if not counted:
            log.warning(
                "parked event #%d: lease lost during the retry; its outcome is not recorded",
                row.event_id,
                extra={"parked_id": row.event_id, "event_id": row.outbox_event_id},
            )
        if result in (AttemptResult.DELIVERED, AttemptResult.SKIPPED):
            summary.done_count += 1
        else:
            summary.failed_count += 1
            summary.errors[row.event_id] = error or ""

    async def _attempt(self, row: ParkedEvent) -> tuple[AttemptResult, str | None]:
        event_type = row.type_header or _DEFAULT_TYPES.get(row.event_type, "")
        event_id = row.outbox_event_id  # canonical (uuid::text): the key the consumer used
        if not event_id:  # never delivered under a key that is not the event's own
            return AttemptResult.UNAVAILABLE, NO_EVENT_ID
        if self.routing.is_ignored(row.kafka_topic or "", event_type):
            return AttemptResult.SKIPPED, f"skipped: {event_type!r} is in SINK_IGNORED_TYPES"
        try:
            await deliver(
                self._engine,
                event_type=event_type,
                payload=row.payload_json.encode(),
                event_id=event_id,
                routing=self.routing,
                headers=engine_trace_headers(row.kafka_headers),
            )
        except EngineUnavailable as exc:
            return AttemptResult.UNAVAILABLE, f"engine unavailable: {exc.reason}"
        except SinkError as exc:
            return AttemptResult.REJECTED, exc.reason
        return AttemptResult.DELIVERED, None


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
            except ParkingLotUnavailable as exc:  # bounded waits: one line, no traceback
                log.warning("scheduler run failed: %s; trying again next period", exc)
            except Exception:
                log.exception("scheduler run failed; trying again next period")
            self.runs += 1
