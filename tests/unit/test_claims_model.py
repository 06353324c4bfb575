"""Parking-lot claims (sinks.parking.claims) against a reference model of what retriers did.

Several retriers (sink instances) claim rows the way the SQL does - the
oldest claimable row first, a live lease skipped - attempt them, settle them,
crash, and time passes. The model keeps the history: which retrier holds an
attempt in progress on which row, which attempts were counted, when each row
was last found due. After every step:

* no two retriers attempt one row at once while the first one's lease holds;
* ``retry_count`` equals the rejected attempts the rules counted - an attempt
  whose lease was taken over is not counted, none is counted twice;
* a scheduled claim finds its row due: between two scheduled attempts of a row
  lies the backoff its last outcome set (at most once per due time);
* a crashed retrier's row is claimable again once its lease expired;
* an ``UNROUTABLE`` row is left alone by the scheduler until the routing
  configuration changes: never two scheduled attempts under one fingerprint.

A mutant at the bottom restores the old claim (``status IN ('FAILED',
'PENDING')``, no lease) and shows the model catches two schedulers on one row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from sinks.parking import claims
from sinks.parking.claims import AttemptResult, ClaimRow, RowStatus

RETRIERS = ("a", "b", "c")
LEASE_S = 10.0
BASE_S = 2.0
PERIOD_S = 5.0
MAX_ATTEMPTS = 4


@dataclass
class Attempt:
    """A retrier working on a row: claimed at ``started``, not yet settled."""

    by: str
    event_id: int
    started: float
    scheduled: bool


class ClaimsModel(RuleBasedStateMachine):
    """See the module docstring."""

    claimable = staticmethod(claims.claimable)

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.rows: dict[int, ClaimRow] = {}
        self.working: list[Attempt] = []  # claims in progress
        self.counted: dict[int, int] = {}  # rejected attempts counted per row
        self.crashed: set[str] = set()
        self.fingerprint = "routes-1"  # the routing configuration in force
        self.tried_under: dict[int, str] = {}  # unroutable row -> fingerprint last tried

    def claim_first(self, by: str, *, scheduled: bool, only: int | None = None) -> None:
        """The SQL's claim: the oldest claimable row (``FOR UPDATE SKIP LOCKED``)."""
        for event_id in sorted(self.rows):
            row = self.rows[event_id]
            if only is not None and event_id != only:
                continue
            if not self.claimable(
                row,
                now=self.now,
                scheduled=scheduled,
                max_attempts=MAX_ATTEMPTS,
                fingerprint=self.fingerprint,
            ):
                continue
            assert not (scheduled and row.keyless), (
                f"row {event_id} has no event id and was claimed by the scheduler"
            )
            if scheduled and row.unroutable:
                assert self.tried_under[event_id] != self.fingerprint, (
                    f"unroutable row {event_id} retried under the routing it failed under"
                )
            for other in self.working:
                if other.event_id == event_id and other.by != by and other.by not in self.crashed:
                    assert self.now >= other.started + LEASE_S, (
                        f"{by} claimed row {event_id} while {other.by}'s lease holds"
                    )
            if scheduled:
                assert row.next_retry_at is None or row.next_retry_at <= self.now
                assert row.retry_count < MAX_ATTEMPTS
            self.rows[event_id] = claims.claim(row, by=by, now=self.now, lease_s=LEASE_S)
            self.working = [w for w in self.working if w.event_id != event_id or w.by == by]
            self.working.append(Attempt(by, event_id, self.now, scheduled))
            return

    @rule(unroutable=st.booleans(), keyless=st.sampled_from([False, False, True]))
    def park(self, unroutable: bool, keyless: bool) -> None:
        event_id = len(self.rows) + 1
        self.rows[event_id] = ClaimRow(
            event_id,
            next_retry_at=self.now + BASE_S,
            unroutable=unroutable or keyless,
            keyless=keyless,
            fingerprint=self.fingerprint,
        )
        self.counted[event_id] = 0
        self.tried_under[event_id] = self.fingerprint

    @rule()
    def routing_changes(self) -> None:
        self.fingerprint = f"routes-{int(self.fingerprint.split('-')[1]) + 1}"

    @rule(by=st.sampled_from(RETRIERS))
    def scheduler_claims(self, by: str) -> None:
        if by not in self.crashed and not any(w.by == by for w in self.working):
            self.claim_first(by, scheduled=True)

    @rule(by=st.sampled_from(RETRIERS), data=st.data())
    def operator_claims(self, by: str, data: st.DataObject) -> None:
        if self.rows and by not in self.crashed and not any(w.by == by for w in self.working):
            only = data.draw(st.sampled_from(sorted(self.rows)))
            self.claim_first(by, scheduled=False, only=only)

    @precondition(lambda self: self.working)
    @rule(data=st.data(), result=st.sampled_from(list(AttemptResult)))
    def attempt_ends(self, data: st.DataObject, result: AttemptResult) -> None:
        attempt = data.draw(st.sampled_from(self.working))
        self.working.remove(attempt)
        if attempt.by in self.crashed:
            return  # a crashed retrier settles nothing
        row = self.rows[attempt.event_id]
        after = claims.settle(
            row,
            by=attempt.by,
            result=result,
            now=self.now,
            backoff_base_s=BASE_S,
            period_s=PERIOD_S,
            fingerprint=self.fingerprint,
        )
        holds = row.status is RowStatus.PENDING and row.claimed_by == attempt.by
        assert (after is not None) == holds, "only the lease holder's outcome counts"
        if after is None:
            return
        if result is AttemptResult.REJECTED:
            self.counted[attempt.event_id] += 1
        self.tried_under[attempt.event_id] = self.fingerprint
        if result not in (AttemptResult.DELIVERED, AttemptResult.SKIPPED):
            assert after.next_retry_at is not None and after.next_retry_at > self.now
        self.rows[attempt.event_id] = after

    @rule(by=st.sampled_from(RETRIERS))
    def retrier_crashes(self, by: str) -> None:
        self.crashed.add(by)

    @rule(by=st.sampled_from(RETRIERS))
    def retrier_restarts(self, by: str) -> None:
        self.crashed.discard(by)
        self.working = [w for w in self.working if w.by != by]

    @rule(dt=st.sampled_from([0.5, 2.0, 5.0, 11.0]))
    def time_passes(self, dt: float) -> None:
        self.now += dt

    @invariant()
    def every_attempt_is_counted_once(self) -> None:
        for event_id, row in self.rows.items():
            assert row.retry_count == self.counted[event_id]

    @invariant()
    def an_expired_lease_frees_its_row(self) -> None:
        for row in self.rows.values():
            if row.status is RowStatus.PENDING and row.claimed_until is not None:
                expired = row.claimed_until <= self.now
                assert claims.claimable(row, now=self.now, scheduled=False) == expired


CLAIMS_SETTINGS = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestClaimsModel = ClaimsModel.TestCase
TestClaimsModel.settings = CLAIMS_SETTINGS


def _claimable_without_lease(
    row: ClaimRow,
    *,
    now: float,
    scheduled: bool,
    max_attempts: int | None = None,
    fingerprint: str | None = None,
) -> bool:
    """The claim as it was: any FAILED or PENDING row, due and below the limit."""
    unleased = replace(row, status=RowStatus.FAILED) if row.status is RowStatus.PENDING else row
    return claims.claimable(
        unleased, now=now, scheduled=scheduled, max_attempts=max_attempts, fingerprint=fingerprint
    )


def _claimable_ignoring_routing(
    row: ClaimRow,
    *,
    now: float,
    scheduled: bool,
    max_attempts: int | None = None,
    fingerprint: str | None = None,
) -> bool:
    """The claim before the ignore-list work: an UNROUTABLE row retried every period."""
    return claims.claimable(
        replace(row, unroutable=False), now=now, scheduled=scheduled, max_attempts=max_attempts
    )


def test_the_model_catches_two_retriers_on_one_row() -> None:
    mutant = type("Mutant", (ClaimsModel,), {"claimable": staticmethod(_claimable_without_lease)})
    with pytest.raises(AssertionError, match=r"while .* lease holds|counted"):
        run_state_machine_as_test(
            mutant,
            settings=settings(
                CLAIMS_SETTINGS,
                max_examples=2000,
                database=None,
                print_blob=False,
                report_multiple_bugs=False,
                derandomize=True,  # the same search every run: the finding is reproducible
                phases=[Phase.generate],
            ),
        )


def test_the_model_catches_unroutable_rows_retried_without_a_routing_change() -> None:
    mutant = type(
        "Mutant", (ClaimsModel,), {"claimable": staticmethod(_claimable_ignoring_routing)}
    )
    with pytest.raises(AssertionError, match="retried under the routing it failed under"):
        run_state_machine_as_test(
            mutant,
            settings=settings(
                CLAIMS_SETTINGS,
                max_examples=2000,
                database=None,
                print_blob=False,
                report_multiple_bugs=False,
                derandomize=True,
                phases=[Phase.generate],
            ),
        )


def _claimable_ignoring_keys(
    row: ClaimRow,
    *,
    now: float,
    scheduled: bool,
    max_attempts: int | None = None,
    fingerprint: str | None = None,
) -> bool:
    """Issue 47 item 2 as it was: a row without an event id was retried (under a made-up
    key) once the routing changed."""
    return claims.claimable(
        replace(row, keyless=False),
        now=now,
        scheduled=scheduled,
        max_attempts=max_attempts,
        fingerprint=fingerprint,
    )


def test_the_model_catches_a_row_without_an_event_id_claimed_by_the_scheduler() -> None:
    mutant = type("Mutant", (ClaimsModel,), {"claimable": staticmethod(_claimable_ignoring_keys)})
    with pytest.raises(AssertionError, match="has no event id and was claimed"):
        run_state_machine_as_test(
            mutant,
            settings=settings(
                CLAIMS_SETTINGS,
                max_examples=2000,
                database=None,
                print_blob=False,
                report_multiple_bugs=False,
                derandomize=True,
                phases=[Phase.generate],
            ),
        )
