"""Parking-lot claims as a pure state machine: who may retry a row, and what an attempt does.

:mod:`sinks.parking.lot` carries these rules out in SQL (one statement per
transition, the same predicates); ``tests/unit/test_claims_model.py`` checks
the rules against a reference model and ``tests/integration/test_claims_sql.py``
checks that the SQL does exactly what these functions do.

A claim is a **lease**: ``claimed_by`` (the retrier instance) and
``claimed_until``. Guarantees, for any number of sink instances:

* a row is claimed by one retrier at a time: a live lease is never taken;
* a row is attempted at most once per due time: a rejected attempt moves
  ``next_retry_at`` forward by the exponential backoff, an engine outage by
  the scheduler period - so no instance finds it due again in the same period;
* each attempt is counted exactly once: only the lease holder's outcome is
  recorded; one whose lease was taken over meanwhile changes nothing;
* a crashed claimer's lease expires after ``lease_s``, and the row is
  claimable again.

Transitions of one row (``t`` = now)::

    FAILED            --claim(C)----------------> PENDING, claimed_by=C, claimed_until=t+lease
    PENDING, expired  --claim(D)----------------> PENDING, claimed_by=D, claimed_until=t+lease
    PENDING(C)        --C: delivered------------> DONE
    PENDING(C)        --C: skipped (now ignored)-> DONE
    PENDING(C)        --C: rejected-------------> FAILED, retry_count+1, next_retry_at=t+backoff
    PENDING(C)        --C: engine unavailable---> FAILED, next_retry_at=t+period (nothing spent)
    PENDING(C)        --D≠C: any outcome--------> unchanged (C's lease was taken over)
    DONE              --(nothing)---------------> DONE

A scheduled claim needs the row due (``next_retry_at`` ≤ t) and below the
attempt limit; an operator's claim (admin API, ``failed retry``) ignores both,
but never takes a live lease either.

A row without an event id (``keyless``: the record had no ``id`` holding a uuid)
has no idempotency key: the scheduler never claims it (an operator fixes or
discards it; an operator's retry of it fails without a request).

An ``UNROUTABLE`` row (an event type without a route) cannot fare better on a
retry until the routing changes: the scheduler leaves it alone while its
``fingerprint`` - the routing configuration it was parked or last tried
under - equals the current one. Every settle stamps the current fingerprint.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from sinks.core.schedule import retry_delay_s

#: How long a claim holds a row. One retry is at most a quiz attempt, a user
#: sync and the attempt again (3 requests of connect + read timeouts, ~15 s
#: with the defaults); four times that leaves room for a slow pool and GC.
CLAIM_LEASE_S = 60.0


class RowStatus(enum.StrEnum):
    """``failed_sync_events.status``."""

    FAILED = "FAILED"  # waiting for its next_retry_at (or an operator)
    PENDING = "PENDING"  # claimed: a retrier holds its lease
    DONE = "DONE"  # the engine accepted it


class AttemptResult(enum.Enum):
    """How one retry of a parked row ended."""

    DELIVERED = "delivered"  # 2xx: the row is DONE
    REJECTED = "rejected"  # the healthy engine refused it again: an attempt is spent
    UNAVAILABLE = "unavailable"  # engine-wide trouble: nothing is spent
    SKIPPED = "skipped"  # the routing now ignores its type: the row is DONE, nothing sent


@dataclass(frozen=True, slots=True)
class ClaimRow:
    """The claim-relevant part of one ``failed_sync_events`` row; times in seconds."""

    event_id: int
    status: RowStatus = RowStatus.FAILED
    retry_count: int = 0
    next_retry_at: float | None = None
    claimed_by: str | None = None
    claimed_until: float | None = None
    unroutable: bool = False  # parked because its type had no route
    keyless: bool = False  # no event id (no idempotency key): never delivered by a retrier
    fingerprint: str | None = None  # the routing configuration it was last tried under


def lease_live(row: ClaimRow, *, now: float) -> bool:
    """True while a retrier's claim on ``row`` holds."""
    return (
        row.status is RowStatus.PENDING
        and row.claimed_until is not None
        and row.claimed_until > now
    )


def claimable(
    row: ClaimRow,
    *,
    now: float,
    scheduled: bool,
    max_attempts: int | None = None,
    fingerprint: str | None = None,
) -> bool:
    """May a retrier claim ``row`` now?

    ``scheduled``: it must also be due, below the limit and - if unroutable -
    parked under another routing configuration than ``fingerprint``.
    """
    if row.status is RowStatus.DONE or lease_live(row, now=now):
        return False
    if not scheduled:
        return True
    if row.keyless or (row.unroutable and row.fingerprint == fingerprint):
        return False
    due = row.next_retry_at is None or row.next_retry_at <= now
    below = max_attempts is None or row.retry_count < max_attempts
    return due and below


def claim(row: ClaimRow, *, by: str, now: float, lease_s: float = CLAIM_LEASE_S) -> ClaimRow:
    """``by`` takes the lease (the caller checked :func:`claimable`)."""
    return replace(row, status=RowStatus.PENDING, claimed_by=by, claimed_until=now + lease_s)


def settle(
    row: ClaimRow,
    *,
    by: str,
    result: AttemptResult,
    now: float,
    backoff_base_s: float,
    period_s: float,
    fingerprint: str | None = None,
) -> ClaimRow | None:
    """The row after ``by``'s attempt ended with ``result``; ``None`` when ``by`` lost the lease.

    ``fingerprint``: the routing configuration the attempt was made under.
    """
    if row.status is not RowStatus.PENDING or row.claimed_by != by:
        return None
    released = replace(row, claimed_by=None, claimed_until=None, fingerprint=fingerprint)
    if result in (AttemptResult.DELIVERED, AttemptResult.SKIPPED):
        return replace(released, status=RowStatus.DONE, next_retry_at=None)
    if result is AttemptResult.REJECTED:
        spent = row.retry_count + 1
        return replace(
            released,
            status=RowStatus.FAILED,
            retry_count=spent,
            next_retry_at=now + retry_delay_s(spent, backoff_base_s),
        )
    return replace(released, status=RowStatus.FAILED, next_retry_at=now + period_s)
