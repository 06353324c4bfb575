"""Parking lot, retrier and scheduler against real PostgreSQL and the stub over HTTP."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from cdc.settings import Settings
from sinks.engine import EngineClient
from sinks.parking.lot import ParkingLot, ParkRequest
from sinks.parking.retrier import Retrier, Scheduler
from sinks.stub.server import StubServer

pytestmark = pytest.mark.integration

API_KEY = "k"


@pytest.fixture
def stub() -> Iterator[StubServer]:
    with StubServer(api_key=API_KEY) as server:
        yield server


def _settings(db_dsn: str, stub: StubServer, **overrides: object) -> Settings:
    base: dict[str, object] = {
        "pg_dsn": db_dsn,
        "engine_base_url": stub.url,
        "internal_api_key": API_KEY,
        "retry_max_attempts": 3,
        "retry_backoff_base_s": 0.2,
        "scheduler_interval_s": 0.3,
    }
    base.update(overrides)
    return Settings(**base)  # type: ignore[arg-type]


def _request(event_id: str, *, user_id: str | None = None) -> ParkRequest:
    user = user_id or str(uuid.uuid4())
    return ParkRequest(
        outbox_event_id=event_id,
        sync_type="USER_SYNC",
        payload=f'{{"user_id":"{user}"}}'.encode(),
        reason="HTTP 400 from engine",
        topic="outbox.event.user",
        partition=0,
        offset=1,
        key=user.encode(),
        headers={"id": event_id.encode(), "type": b"UserRegistered"},
        retry_in_s=0.0,
    )


def _row(dsn: str, row_id: int) -> tuple:  # type: ignore[type-arg]
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT status, retry_count, next_retry_at, last_error, updated_at"
            " FROM failed_sync_events"
            " WHERE event_id = %s",
            (row_id,),
        ).fetchone()
    assert row is not None
    return row


async def _run_scheduler(settings: Settings, seconds: float, *, enabled: bool = True) -> int:
    engine = EngineClient.from_settings(settings)
    lot = ParkingLot(settings.pg_dsn.get_secret_value())
    scheduler = Scheduler(
        Retrier(lot=lot, engine=engine, settings=settings),
        interval_s=settings.scheduler_interval_s,
        enabled=enabled,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(scheduler.run(stop))
    await asyncio.sleep(seconds)
    stop.set()
    await task
    await engine.aclose()
    await lot.close()
    return scheduler.runs


def test_a_redelivered_event_keeps_one_parking_row(db_dsn: str) -> None:
    async def park_twice() -> tuple[int, int]:
        lot = ParkingLot(db_dsn)
        event_id = str(uuid.uuid4())
        first = await lot.park(_request(event_id))
        second = await lot.park(_request(event_id))
        await lot.close()
        return first, second

    first, second = asyncio.run(park_twice())
    assert first == second


def test_scheduler_retries_due_rows_with_growing_backoff_and_stops_at_max_attempts(
    db_dsn: str, stub: StubServer
) -> None:
    event_id = str(uuid.uuid4())
    stub.add_faults({"event_id": event_id, "status": 400, "times": -1})
    settings = _settings(db_dsn, stub)

    async def scenario() -> tuple[int, list[tuple]]:  # type: ignore[type-arg]
        lot = ParkingLot(db_dsn)
        row_id = await lot.park(_request(event_id))
        await lot.close()
        seen = []
        engine = EngineClient.from_settings(settings)
        lot = ParkingLot(db_dsn)
        retrier = Retrier(lot=lot, engine=engine, settings=settings)
        for _ in range(20):
            await retrier.run_scheduled()
            seen.append(_row(db_dsn, row_id))
            await asyncio.sleep(0.25)
        await engine.aclose()
        await lot.close()
        return row_id, seen

    _, seen = asyncio.run(scenario())
    counts = [s[1] for s in seen]
    assert counts[-1] == 3, "stops at OUTBOX_RETRY_MAX_ATTEMPTS"
    assert counts == sorted(counts)
    assert set(counts) == {1, 2, 3}, "each attempt recorded"
    waits = {}
    for status, count, next_retry_at, error, updated_at in seen:
        assert status == "FAILED"
        assert "400" in error
        waits[count] = (next_retry_at - updated_at).total_seconds()
    # Exponential: after attempt n the row waits base * 2**n seconds.
    assert waits[1] < waits[2] < waits[3]
    assert waits[3] == pytest.approx(0.2 * 2**3, abs=0.05)
    stats = stub.stats()
    assert stats["by_status"].get("400", 0) == 3


def test_scheduler_turns_a_row_done_once_the_engine_accepts_it(
    db_dsn: str, stub: StubServer
) -> None:
    event_id = str(uuid.uuid4())
    stub.add_faults({"event_id": event_id, "status": 400, "times": 1})
    settings = _settings(db_dsn, stub)

    async def park() -> int:
        lot = ParkingLot(db_dsn)
        row_id = await lot.park(_request(event_id))
        await lot.close()
        return row_id

    row_id = asyncio.run(park())
    asyncio.run(_run_scheduler(settings, 3.0))
    status, retry_count, _, error, _ = _row(db_dsn, row_id)
    assert (status, retry_count, error) == ("DONE", 1, None)
    assert stub.applied(event_id=event_id)["count"] == 1


def test_disabled_scheduler_retries_nothing(db_dsn: str, stub: StubServer) -> None:
    settings = _settings(db_dsn, stub)

    async def park() -> int:
        lot = ParkingLot(db_dsn)
        row_id = await lot.park(_request(str(uuid.uuid4())))
        await lot.close()
        return row_id

    row_id = asyncio.run(park())
    runs = asyncio.run(_run_scheduler(settings, 1.5, enabled=False))
    assert runs == 0
    assert _row(db_dsn, row_id)[:2] == ("FAILED", 0)
    assert stub.stats()["requests"] == 0


def test_engine_outage_during_a_retry_spends_no_attempt(db_dsn: str) -> None:
    settings = Settings(
        pg_dsn=db_dsn, engine_base_url="http://127.0.0.1:9", engine_connect_timeout_s=0.5
    )

    async def scenario() -> int:
        lot = ParkingLot(db_dsn)
        row_id = await lot.park(_request(str(uuid.uuid4())))
        engine = EngineClient.from_settings(settings)
        summary = await Retrier(lot=lot, engine=engine, settings=settings).retry(
            [row_id], retry_all=False
        )
        assert summary.as_data() == {"processed_count": 1, "done_count": 0, "failed_count": 1}
        await engine.aclose()
        await lot.close()
        return row_id

    row_id = asyncio.run(scenario())
    assert _row(db_dsn, row_id)[:2] == ("FAILED", 0)
