"""The parking lot's SQL does exactly what the pure claim rules (sinks.parking.claims) say.

A hypothesis state machine parks rows, claims them (scheduled, by id, as
several retriers), settles attempts with every outcome, changes the routing
and moves a test clock - each step applied both to PostgreSQL through
:class:`sinks.parking.lot.ParkingLot` and to rows kept by the pure functions of
:mod:`sinks.parking.claims`. After every step the two must agree on every row: status,
retry_count, next_retry_at, lease and routing fingerprint; and every claim
must return the row the rules pick. The rules themselves are model-checked in
tests/unit/test_claims_model.py.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from sinks.parking import claims
from sinks.parking.claims import AttemptResult, ClaimRow, RowStatus
from sinks.parking.lot import ParkedEvent, ParkingLot, ParkRequest

pytestmark = pytest.mark.integration

EPOCH = datetime(2030, 1, 1, tzinfo=UTC)
RETRIERS = ("a", "b")
LEASE_S = 10.0
BASE_S = 2.0
PERIOD_S = 5.0
MAX_ATTEMPTS = 3


def _at(seconds: float) -> datetime:
    return EPOCH + timedelta(seconds=seconds)


def _seconds(when: datetime | None) -> float | None:
    return None if when is None else round((when - EPOCH).total_seconds(), 3)


def machine_for(dsn: str) -> type[RuleBasedStateMachine]:
    class ClaimsAgainstSql(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.loop = asyncio.new_event_loop()
            self.lot = ParkingLot(dsn)
            self.run(self.lot._fetch("TRUNCATE failed_sync_events"))
            self.now = 0.0
            self.fingerprint = "f1"
            self.model: dict[int, ClaimRow] = {}

        def run(self, coro):  # type: ignore[no-untyped-def]
            return self.loop.run_until_complete(coro)

        def teardown(self) -> None:
            self.run(self.lot.close())
            self.loop.close()

        def db_rows(self) -> dict[int, ParkedEvent]:
            rows = self.run(
                self.lot.list_rows(statuses=list(RowStatus), event_type=None, limit=1000)
            )
            return {r.event_id: r for r in rows}

        @rule(
            unroutable=st.booleans(),
            delay=st.sampled_from([0.0, 1.0, 4.0]),
            keyless=st.sampled_from([False, False, True]),
        )
        def park(self, unroutable: bool, delay: float, keyless: bool) -> None:
            request = ParkRequest(
                outbox_event_id=None if keyless else str(uuid.uuid4()),
                sync_type="UNROUTABLE" if unroutable else "USER_SYNC",
                payload=b"{}",
                reason="test",
                topic="t",
                partition=0,
                offset=len(self.model),
                key=None,
                headers={},
                retry_in_s=delay,
                routes_fingerprint=self.fingerprint,
            )
            (event_id,) = self.run(self.lot.park_many([request], now=_at(self.now)))
            self.model[event_id] = ClaimRow(
                event_id,
                next_retry_at=self.now + delay,
                unroutable=unroutable,
                keyless=keyless,
                fingerprint=self.fingerprint,
            )

        @rule(by=st.sampled_from(RETRIERS), scheduled=st.booleans(), after=st.integers(0, 3))
        def claim_next(self, by: str, scheduled: bool, after: int) -> None:
            after_id = min(self.model, default=0) - 1 + after if self.model else 0
            got = self.run(
                self.lot.claim_next(
                    by=by,
                    scheduled=scheduled,
                    max_attempts=MAX_ATTEMPTS if scheduled else None,
                    fingerprint=self.fingerprint,
                    after_id=after_id,
                    lease_s=LEASE_S,
                    now=_at(self.now),
                )
            )
            expected = next(
                (
                    event_id
                    for event_id in sorted(self.model)
                    if event_id > after_id
                    and claims.claimable(
                        self.model[event_id],
                        now=self.now,
                        scheduled=scheduled,
                        max_attempts=MAX_ATTEMPTS if scheduled else None,
                        fingerprint=self.fingerprint,
                    )
                ),
                None,
            )
            assert (got.event_id if got else None) == expected
            if expected is not None:
                self.model[expected] = claims.claim(
                    self.model[expected], by=by, now=self.now, lease_s=LEASE_S
                )

        @rule(by=st.sampled_from(RETRIERS), data=st.data())
        def claim_by_id(self, by: str, data: st.DataObject) -> None:
            if not self.model:
                return
            event_id = data.draw(st.sampled_from(sorted(self.model)))
            got = self.run(self.lot.claim_id(event_id, by=by, lease_s=LEASE_S, now=_at(self.now)))
            ok = claims.claimable(self.model[event_id], now=self.now, scheduled=False)
            assert (got is not None) == ok
            if ok:
                self.model[event_id] = claims.claim(
                    self.model[event_id], by=by, now=self.now, lease_s=LEASE_S
                )

        @rule(
            by=st.sampled_from(RETRIERS),
            result=st.sampled_from(list(AttemptResult)),
            data=st.data(),
        )
        def settle(self, by: str, result: AttemptResult, data: st.DataObject) -> None:
            if not self.model:
                return
            event_id = data.draw(st.sampled_from(sorted(self.model)))
            row = self.db_rows()[event_id]
            counted = self.run(
                self.lot.settle(
                    row,
                    by=by,
                    result=result,
                    error="x",
                    backoff_base_s=BASE_S,
                    period_s=PERIOD_S,
                    fingerprint=self.fingerprint,
                    now=_at(self.now),
                )
            )
            after = claims.settle(
                self.model[event_id],
                by=by,
                result=result,
                now=self.now,
                backoff_base_s=BASE_S,
                period_s=PERIOD_S,
                fingerprint=self.fingerprint,
            )
            assert counted == (after is not None)
            if after is not None:
                self.model[event_id] = after

        @rule(dt=st.sampled_from([0.5, 2.0, 11.0]))
        def time_passes(self, dt: float) -> None:
            self.now += dt

        @rule()
        def routing_changes(self) -> None:
            self.fingerprint = f"f{int(self.fingerprint[1:]) + 1}"

        @invariant()
        def sql_and_rules_agree(self) -> None:
            db = self.db_rows()
            assert set(db) == set(self.model)
            for event_id, expected in self.model.items():
                row = db[event_id]
                got = ClaimRow(
                    event_id,
                    status=RowStatus(row.status),
                    retry_count=row.retry_count,
                    next_retry_at=_seconds(row.next_retry_at),
                    claimed_by=row.claimed_by,
                    claimed_until=_seconds(row.claimed_until),
                    unroutable=row.event_type == "UNROUTABLE",
                    keyless=row.outbox_event_id is None,
                    fingerprint=row.routes_fingerprint,
                )
                want = replace(
                    expected,
                    next_retry_at=None
                    if expected.next_retry_at is None
                    else round(expected.next_retry_at, 3),
                    claimed_until=None
                    if expected.claimed_until is None
                    else round(expected.claimed_until, 3),
                )
                assert got == want, f"row {event_id}: SQL {got} != rules {want}"

    return ClaimsAgainstSql


def test_the_parking_lot_sql_follows_the_claim_rules(empty_db_dsn: str) -> None:
    from cdc.migrate import migrate

    migrate(empty_db_dsn)
    run_state_machine_as_test(
        machine_for(empty_db_dsn),
        settings=settings(
            max_examples=40,
            stateful_step_count=25,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
