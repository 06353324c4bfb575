"""When a parked record is tried again: the parking lot's exponential schedule. Pure.

Guarantees: the n-th retry of a row waits ``base_s * 2**n``, never more than
:data:`PARKING_RETRY_CAP_S` (and never an overflow, whatever ``n``); a negative
count or base is refused.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

#: The parking lot never waits more than a day between two retries of a row.
PARKING_RETRY_CAP_S = 24 * 3600.0
#: Exponents above this are past any cap anyway; keeps ``2**n`` finite.
_MAX_EXPONENT = 64


def retry_delay_s(retry_count: int, base_s: float, *, cap_s: float = PARKING_RETRY_CAP_S) -> float:
    """``base_s * 2**retry_count``, capped at ``cap_s``: the parking lot's wait."""
    if retry_count < 0 or base_s < 0:
        raise ValueError("retry_count and base_s must not be negative")
    return min(cap_s, math.ldexp(base_s, min(retry_count, _MAX_EXPONENT)))


def next_retry_at(
    retry_count: int,
    base_s: float,
    *,
    now: datetime | None = None,
    cap_s: float = PARKING_RETRY_CAP_S,
) -> datetime:
    """When a parked row that failed ``retry_count`` times is due again (UTC-aware)."""
    start = datetime.now(UTC) if now is None else now
    return start + timedelta(seconds=retry_delay_s(retry_count, base_s, cap_s=cap_s))
