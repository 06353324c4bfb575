"""The sink's parks, carried out: a :class:`~sinks.core.machine.Park` becomes one write.

Guarantees (the decisions are the core's, :mod:`sinks.core.machine`):

* one batch, one round-trip, on the parking lot's own connection, every wait
  bounded (:mod:`sinks.parking.lot`); one batch is encoded and written at a time, so
  what parking costs in memory beyond the records held is one batch
  (:data:`sinks.core.machine.PARK_BATCH_MAX_BYTES`);
* a parking lot that fails (an outage: a connection, a lock, no answer) keeps the
  records unsettled - the core parks them again after a growing wait - and makes
  ``/readyz`` say ``parking lot unavailable: <why>`` until a park succeeds;
* a batch PostgreSQL refuses for what it carries (:class:`~sinks.parking.lot.ParkRefused`:
  a value over a limit, a ``statement_timeout``) is split by the core, down to the
  record that causes it; that record is parked once more without its payload (a row
  naming its place in Kafka), and refused even so it is skipped: one ERROR line with
  its topic, partition, offset and id, and ``outbox_sink_park_skipped_total`` - never
  a stalled partition.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from sinks.core.machine import Park, ParkItem, SinkCore
from sinks.core.schedule import retry_delay_s
from sinks.parking.lot import ParkingLot, ParkingLotUnavailable, ParkRefused, ParkRequest

if TYPE_CHECKING:
    from cdc.settings import Settings
    from sinks.runtime.metrics import SinkMetrics
    from sinks.shared.logs import BoundedLabels, RepeatLog
    from sinks.shared.routes import Routing

log = logging.getLogger("sinks.consumer")  # the name operators filter on: kept across moves

#: The parking lot's event_type of a record whose type has no route.
UNROUTABLE = "UNROUTABLE"
#: Bytes of a key or header kept in the row of a record parked without its payload.
STUB_HEADER_MAX = 256
#: Bytes of records held in memory (per instance) above which partitions pause.
MAX_BUFFERED_BYTES = 128 * 1024 * 1024


class ParkingShell:
    """The park half of :class:`sinks.runtime.sink.Sink` (see the module docstring)."""

    settings: Settings
    lot: ParkingLot
    core: SinkCore
    metrics: SinkMetrics
    routing: Routing
    parked_count: int
    _park_error: str | None
    _parked_log: RepeatLog
    _type_labels: BoundedLabels
    #: one park batch is encoded and written at a time (the lot runs one statement anyway)
    _park_turn: asyncio.Lock

    async def _park(self, park: Park) -> None:
        try:
            # One batch encoded at a time: the rows of every queued batch built at once
            # would copy what the core holds several times over (text, JSON document).
            async with self._park_turn:
                requests = [self._park_request(item) for item in park.items]
                await self.lot.park_many(requests)  # bounded: the lot's waits all time out
        except ParkRefused as exc:  # the statement, not the lot: split down to the record
            self._park_refused(park, exc)
            return
        except Exception as exc:  # the records stay unsettled; the core parks them again
            self._park_failed(park, exc)
            return
        if self._park_error is not None:
            was = self._park_error
            log.info("parking lot available again (was: %s)", was, extra={"state": "running"})
            self._park_error = None
        self.metrics.lot_available.set(1)
        self.metrics.park_batch.observe(len(requests))
        for item, request in zip(park.items, requests, strict=True):
            self.parked_count += 1
            self.metrics.parked.labels(request.sync_type).inc()
            if request.sync_type == UNROUTABLE:
                label = self._type_labels.label(item.record.event_type)
                self.metrics.unrouted.labels(label).inc()
            self._parked_log.event(
                item.record.event_type or "?",
                "event %s of type %r parked after %d attempts: %s",
                item.record.event_id or item.record.position,
                item.record.event_type,
                item.attempts,
                item.reason,
                extra={
                    "event_id": item.record.event_id,
                    "topic": item.record.topic,
                    "partition": item.record.partition,
                    "offset": item.record.offset,
                },
            )
            self.core.parked(item.record)

    def _park_refused(self, park: Park, exc: ParkRefused) -> None:
        """PostgreSQL refused the batch for what it carries: the core splits it, down to
        the record that causes it; one refused even without its payload is skipped - an
        ERROR line with where it is in Kafka, and ``outbox_sink_park_skipped_total``."""
        self.metrics.park_refused.inc()
        log.warning(
            "park batch of %d records refused (%s): split, down to the record that causes it",
            len(park.items),
            exc.reason,
            extra={"state": "park_refused"},
        )
        for item in self.core.park_refused([i.record for i in park.items], exc.reason):
            record = item.record
            self.metrics.park_skipped.inc()
            log.error(
                "event %s at %s[%d]@%d (%d bytes) skipped: the parking lot refused it even"
                " without its payload (%s); read it from Kafka there",
                record.event_id or "-",
                record.topic,
                record.partition,
                record.offset,
                record.size,
                item.reason,
                extra={
                    "event_id": record.event_id,
                    "topic": record.topic,
                    "partition": record.partition,
                    "offset": record.offset,
                },
            )

    def _park_failed(self, park: Park, exc: Exception) -> None:
        """The records wait (the core parks them again, with a growing wait); readiness says why.

        One log line per change of the reason, not per failed batch.
        """
        self.metrics.park_failures.inc()
        self.metrics.lot_available.set(0)
        if isinstance(exc, ParkingLotUnavailable):
            error = str(exc)
        else:  # not an outage the lot knows: our own bug, or a row PostgreSQL refused
            lines = str(exc).strip().splitlines()
            error = f"parking lot unavailable: {type(exc).__name__}: {lines[0] if lines else ''}"
        if error != self._park_error:
            log.error(
                "%s; %d events wait to be parked (tried again with a growing wait; partitions"
                " pause once %d records are held)",
                error,
                len(park.items),
                self.core.max_buffered,
                exc_info=None if isinstance(exc, ParkingLotUnavailable) else exc,
                extra={"state": "parking_lot_unavailable"},
            )
        self._park_error = error
        now = time.monotonic()
        for item in park.items:
            self.core.park_failed(item.record, now=now)

    def _park_request(self, item: ParkItem) -> ParkRequest:
        record = item.record
        if item.stub:
            return self._stub_request(item)
        # No event id: never delivered (no idempotency key), so never a row a retrier sends.
        routed = self.routing.sync_type_for(record.event_type) if record.event_id else None
        sync_type = routed or UNROUTABLE
        return ParkRequest(
            outbox_event_id=record.event_id,
            sync_type=str(sync_type),
            payload=record.value,
            reason=item.reason,
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            key=record.key,
            headers=record.headers,
            retry_in_s=retry_delay_s(item.attempts, self.settings.retry_backoff_base_s),
            attempts=item.attempts,
            routes_fingerprint=self.routing.fingerprint,
        )

    def _stub_request(self, item: ParkItem) -> ParkRequest:
        """The row of a record the parking lot refused whole: no payload, no headers but
        its id and type - where it is in Kafka, and why (never retried on its own)."""
        record = item.record
        kept = {k: v[:STUB_HEADER_MAX] for k, v in record.headers.items() if k in ("id", "type")}
        return ParkRequest(
            outbox_event_id=record.event_id,
            sync_type=UNROUTABLE,
            payload=b"",
            reason=(
                f"{item.reason}; payload of {record.size} bytes not stored: read it from"
                f" {record.topic}[{record.partition}]@{record.offset}"
            ),
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            key=None if record.key is None else record.key[:STUB_HEADER_MAX],
            headers=kept,
            retry_in_s=0.0,
            attempts=item.attempts,
            routes_fingerprint=self.routing.fingerprint,
        )
