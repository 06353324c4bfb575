"""Parking lot, retrier and scheduler against real PostgreSQL and the stub over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from cdc.settings import Settings
from sinks.engine.client import EngineClient
from sinks.parking.lot import (
    LotTimeouts,
    ParkingLot,
    ParkingLotUnavailable,
    ParkRequest,
    lot_conninfo,
)
from sinks.parking.retrier import Retrier, Scheduler
from sinks.stub.server import StubServer
from tests.tcpfault import TcpFaultProxy

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


def _delete(dsn: str, row_ids: list[int]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM failed_sync_events WHERE event_id = ANY(%s)", (row_ids,))


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


# -- a stuck parking lot: every wait bounded (issue 35) ------------------------------------

#: Short bounds so the tests wait seconds, not the production defaults.
QUICK = LotTimeouts(lock_ms=1_000, statement_ms=5_000, deadline_s=3.0, queue_s=0.5)
#: The longest any call below may take: a hang fails the test instead of the suite's timeout.
HANG_S = 60.0


@contextlib.contextmanager
def _table_locked(dsn: str) -> Iterator[None]:
    """``LOCK TABLE failed_sync_events IN ACCESS EXCLUSIVE MODE`` held by another session."""
    with psycopg.connect(dsn) as conn:
        conn.execute("LOCK TABLE failed_sync_events IN ACCESS EXCLUSIVE MODE")
        yield
        conn.rollback()


def test_a_park_on_a_locked_table_fails_within_its_lock_timeout_and_succeeds_after(
    db_dsn: str,
) -> None:
    """Edge: a LOCK TABLE held by someone else - the park fails with one line, never hangs,
    and the same lot parks once the lock is gone (the connection survives lock_timeout)."""

    async def scenario() -> tuple[str, int]:
        lot = ParkingLot(db_dsn, timeouts=QUICK)
        with _table_locked(db_dsn), pytest.raises(ParkingLotUnavailable) as failed:
            async with asyncio.timeout(HANG_S):
                await lot.park(_request(str(uuid.uuid4())))
        row_id = await lot.park(_request(str(uuid.uuid4())))
        await lot.close()
        return str(failed.value), row_id

    message, row_id = asyncio.run(scenario())
    assert message == (
        "parking lot unavailable: failed_sync_events is locked by another session"
        " (lock_timeout 1 s)"
    )
    assert _row(db_dsn, row_id)[0] == "FAILED"


def test_a_caller_waits_for_a_busy_lot_connection_at_most_its_queue_bound(db_dsn: str) -> None:
    """Edge: a park waiting on the lock holds the lot's connection - another caller (the
    admin API, the scheduler) is told "busy" after queue_s instead of queueing behind it."""
    slow = LotTimeouts(lock_ms=4_000, statement_ms=10_000, deadline_s=15.0, queue_s=0.5)

    async def scenario() -> tuple[str, str]:
        lot = ParkingLot(db_dsn, timeouts=slow)
        await lot.counts()  # connected: the park below waits on the lock, not the connect
        with _table_locked(db_dsn):
            park = asyncio.create_task(lot.park(_request(str(uuid.uuid4()))))
            await asyncio.sleep(0.2)  # the park holds the connection, waiting for the lock
            with pytest.raises(ParkingLotUnavailable) as busy:
                async with asyncio.timeout(HANG_S):
                    await lot.list_open()
            with pytest.raises(ParkingLotUnavailable) as locked:
                async with asyncio.timeout(HANG_S):
                    await park
        await lot.close()
        return str(busy.value), str(locked.value)

    busy, locked = asyncio.run(scenario())
    assert busy == (
        "parking lot unavailable: busy: other statements have held its connection for over 0.5 s"
    )
    assert "is locked by another session" in locked


def test_a_silent_database_fails_a_statement_at_its_deadline_and_the_lot_reconnects(
    db_dsn: str,
) -> None:
    """Edge: a hung server (bytes stop both ways, the TCP connection stays up, so neither
    keepalives nor the server's own timeouts can end the wait) - the client-side deadline
    does, and the next statement runs on a new connection."""
    params = conninfo_to_dict(db_dsn)

    async def scenario(proxy: TcpFaultProxy) -> str:
        dsn = make_conninfo(db_dsn, host="127.0.0.1", port=str(proxy.port))
        lot = ParkingLot(dsn, timeouts=QUICK)
        await lot.counts()
        proxy.silence()
        await asyncio.sleep(0.2)  # the proxy's pumps look at the flag every 0.05 s
        with pytest.raises(ParkingLotUnavailable) as silent:
            async with asyncio.timeout(HANG_S):
                await lot.park(_request(str(uuid.uuid4())))
        proxy.resume()
        proxy.reset()
        assert sum((await lot.counts()).values()) >= 0  # a new connection answers
        await lot.close()
        return str(silent.value)

    with TcpFaultProxy(str(params.get("host", "127.0.0.1")), int(params["port"])) as proxy:
        message = asyncio.run(scenario(proxy))
    assert message == "parking lot unavailable: no answer from PostgreSQL within 3 s"


def test_the_lot_connection_carries_timeouts_and_keepalives_unless_the_dsn_sets_them() -> None:
    """Edge: the DSN's own settings win; its own options are kept (ours first, theirs override)."""
    info = conninfo_to_dict(
        lot_conninfo(
            "postgresql://u:p@db:5432/x?keepalives_idle=60&options=-c%20work_mem%3D64MB",
            LotTimeouts(),
        )
    )
    assert info["keepalives"] == "1"
    assert info["keepalives_idle"] == "60"
    assert info["tcp_user_timeout"] == "15000"
    assert info["connect_timeout"] == "5"
    assert info["options"] == "-c statement_timeout=15000 -c lock_timeout=2000 -c work_mem=64MB"


def test_a_keyless_record_read_again_finds_its_row_and_is_never_sent(
    db_dsn: str, stub: StubServer
) -> None:
    """Issue 47 item 2: a record without an event id is one row per place in Kafka (a
    replay parks no second row); an operator's retry of it fails without a request."""
    topic = f"t-{uuid.uuid4().hex[:8]}"

    def keyless(offset: int) -> ParkRequest:
        return ParkRequest(
            outbox_event_id=None,
            sync_type="UNROUTABLE",
            payload=b'{"user_id":"u"}',
            reason="record has no 'id' header",
            topic=topic,
            partition=0,
            offset=offset,
            key=b"k",
            headers={"type": b"UserRegistered"},
            retry_in_s=0.0,
        )

    async def run() -> tuple[list[int], list[int], object]:
        lot = ParkingLot(db_dsn)
        first = await lot.park_many([keyless(7), keyless(8), keyless(7)])
        again = await lot.park_many([keyless(7)])
        async with EngineClient(base_url=stub.url, api_key=API_KEY) as engine:
            retrier = Retrier(lot=lot, engine=engine, settings=_settings(db_dsn, stub))
            summary = await retrier.retry(again, retry_all=False)
        await lot.close()
        return first, again, summary

    first, again, summary = asyncio.run(run())
    _delete(db_dsn, first)  # (the session's parking lot: later tests list its oldest rows)
    assert len(first) == 2 and again[0] in first, "one row per place in Kafka"
    assert summary.failed_count == 1 and "no event id" in next(iter(summary.errors.values()))  # type: ignore[attr-defined]
    assert stub.stats()["requests"] == 0, "never sent under a made-up key"


def test_an_admin_retry_starts_no_row_after_its_deadline(db_dsn: str) -> None:
    """Issue 47 item 7: a retry of many rows against a slow engine stops at its
    deadline, names the rows it did not try, and leaves them as they were."""
    with StubServer(api_key=API_KEY, latency_ms=300) as slow:

        async def run() -> tuple[list[int], object, float]:
            lot = ParkingLot(db_dsn)
            ids = await lot.park_many([_request(str(uuid.uuid4())) for _ in range(30)])
            async with EngineClient(base_url=slow.url, api_key=API_KEY) as engine:
                retrier = Retrier(lot=lot, engine=engine, settings=_settings(db_dsn, slow))
                started = asyncio.get_running_loop().time()
                summary = await retrier.retry(ids, retry_all=False, deadline_s=1.0)
                took_s = asyncio.get_running_loop().time() - started
            await lot.close()
            return ids, summary, took_s

        ids, summary, took_s = asyncio.run(run())
    rows = {row_id: _row(db_dsn, row_id)[0] for row_id in ids}
    _delete(db_dsn, ids)  # (the session's parking lot: later tests list its oldest rows)
    untried = summary.untried_ids  # type: ignore[attr-defined]
    processed = summary.processed_count  # type: ignore[attr-defined]
    assert untried and processed + len(untried) == len(ids), (processed, untried)
    assert untried == sorted(ids)[processed:]
    for row_id in untried:
        assert rows[row_id] == "FAILED", "a row not tried is left as it was"
    print(f"\n[admin retry] {processed} of {len(ids)} rows tried in {took_s:.1f} s (deadline 1 s)")


def test_the_consoles_filters_and_a_discard_with_a_reason_hold_on_the_real_table(
    db_dsn: str,
) -> None:
    """list_rows' key, reason and time filters (a reason's ``%``, ``_`` and quotes are
    literal text, never patterns), counts per sync type, and accept's reason written into
    last_error ahead of the engine's answer."""
    marker = uuid.uuid4().hex

    def request(reason: str) -> ParkRequest:
        return dataclasses.replace(_request(str(uuid.uuid4())), reason=f"{reason} {marker}")

    async def run() -> None:
        lot = ParkingLot(db_dsn)
        ids: list[int] = []
        try:
            a, b = request("HTTP 422: 50% off 'quoted'"), request("HTTP 400 from engine")
            ids = await lot.park_many([a, b])
            key_a = (a.key or b"").decode()
            assert [r.event_id for r in await lot.list_rows(key=key_a)] == [ids[0]]
            literal = await lot.list_rows(reason=f"50% off 'quoted' {marker}")
            assert [r.event_id for r in literal] == [ids[0]]
            assert await lot.list_rows(reason=f"50_ off 'quoted' {marker}") == []
            assert await lot.list_rows(reason=f"%{marker}") == []
            assert len(await lot.list_rows(reason=marker)) == 2
            now = (await lot.get(ids[:1]))[0].created_at
            later, earlier = now + timedelta(hours=1), now - timedelta(hours=1)
            assert await lot.list_rows(reason=marker, since=later) == []
            assert await lot.list_rows(reason=marker, until=earlier) == []
            assert len(await lot.list_rows(reason=marker, since=earlier, until=later)) == 2
            assert (await lot.counts_by_type())[("USER_SYNC", "FAILED")] >= 2
            reason = "test data; it's 100% fake"
            assert await lot.accept(ids=ids[:1], event_type=None, reason=reason) == ids[:1]
            done = (await lot.get(ids[:1]))[0]
            assert done.status == "DONE"
            assert done.last_error is not None
            assert done.last_error.startswith(
                f"accepted as skipped by an operator ({reason}); was: HTTP 422: 50% off"
            )
            assert (await lot.get(ids[1:]))[0].status == "FAILED"
        finally:
            await lot.close()
            _delete(db_dsn, ids)

    asyncio.run(run())
