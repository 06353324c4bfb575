"""Stall watch: work waits and nothing moves for longer than a threshold.

Guarantees: :meth:`StallWatch.observe` returns a reason (for ``/readyz``) only
when records are in flight or dead letters pending *and* no record was
acknowledged, no in-flight record retired and the confirmable LSN did not move
for ``after_s`` seconds; it returns None again at the first acknowledgement.
A short blip (shorter than ``after_s``) never shows; an idle relay (nothing
waiting) is never stalled.
"""

from __future__ import annotations


class StallWatch:
    """Tracks the last progress of one streaming session."""

    def __init__(self, after_s: float, now: float) -> None:
        self.after_s = after_s
        self._since = now
        self._mark: tuple[int, int, int] = (0, 0, 0)
        self._waiting = False

    def observe(
        self, now: float, *, in_flight: int, pending: int, acked: int, confirmable: int
    ) -> str | None:
        """The stall's reason, or None; ``acked`` is any count that grows with acks."""
        mark = (in_flight, acked, confirmable)
        waiting = in_flight > 0 or pending > 0
        if (
            not (waiting and self._waiting)  # the wait starts now at the earliest
            or mark[1:] != self._mark[1:]
            or in_flight < self._mark[0]
        ):
            self._since = now
        self._mark, self._waiting = mark, waiting
        idle_s = now - self._since
        if waiting and idle_s >= self.after_s:
            return (
                f"no record acknowledged for {idle_s:.0f}s with {in_flight} in flight"
                f" and {pending} dead letters pending"
            )
        return None

    def idle_s(self, now: float) -> float:
        """Seconds since the last progress (0 while nothing waits)."""
        return now - self._since
