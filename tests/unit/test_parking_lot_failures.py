"""The parking lot's failures leave nothing behind: a failed park's batch is freed at once.

A paused sink whose PostgreSQL is away retries its parks for as long as the outage
lasts. Each failure must free its batch by reference counting: the sink raises the
cyclic GC's gen-0 threshold (``cdc.collector.THRESHOLDS``), so garbage in a
reference cycle waits long - psycopg's connect keeps the error it raises in its own
frame (a cycle through the traceback), which once held every failed batch's JSON
document (~250 KiB) until a collection: the paused sink's memory rose by one
document per failure. No service: nothing listens on port 1.
"""

from __future__ import annotations

import asyncio
import gc

import pytest

from sinks.parking.lot import LotTimeouts, ParkingLot, ParkingLotUnavailable, ParkRequest

#: Nothing listens on port 1: every connect is refused at once.
UNREACHABLE_DSN = "postgresql://sink:pw@127.0.0.1:1/nowhere?connect_timeout=2"


def _batch(size: int) -> list[ParkRequest]:
    return [
        ParkRequest(
            outbox_event_id=f"8b9c0c52-3d6e-4b39-9b8f-{n:012x}",
            sync_type="UNROUTABLE",
            payload=b'{"user_id": "%d"}' % n,
            reason="no route for event type 'NoSuchType'",
            topic="t.outbox.event.user",
            partition=0,
            offset=n,
            key=b"k",
            headers={"type": b"NoSuchType"},
            retry_in_s=0.5,
        )
        for n in range(size)
    ]


def test_a_park_that_fails_to_connect_leaves_no_reference_cycle() -> None:
    async def failed_parks() -> int:
        lot = ParkingLot(UNREACHABLE_DSN, timeouts=LotTimeouts(queue_s=None))
        gc.collect()
        for _ in range(5):
            with pytest.raises(ParkingLotUnavailable, match="Connection refused"):
                await lot.park_many(_batch(500))
        return gc.collect()  # what only the cyclic GC would have freed

    enabled = gc.isenabled()
    gc.disable()  # (no collection of its own between the parks and the count)
    try:
        left_for_the_gc = asyncio.run(failed_parks())
    finally:
        if enabled:
            gc.enable()
    assert left_for_the_gc == 0, f"{left_for_the_gc} objects of failed parks in reference cycles"
