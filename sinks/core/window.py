"""An engine endpoint's adaptive in-flight limit (AIMD with slow start). Pure.

Guarantees (the machine's invariant 7, :mod:`sinks.core.machine`): the limit is
halved (floor 1) on a cut, grows by one per delivery below the threshold (slow
start: doubling per round) and by one per window of deliveries from it (congestion
avoidance), restarts at one after an outage, and is never above ``ceiling``.
"""

from __future__ import annotations


class Window:
    """The adaptive in-flight limit (AIMD with slow start, as TCP's congestion window).

    Transitions: ``delivered()`` -> below ``threshold`` +1 per delivery
    (doubling per round: slow start), from it +1 per ``limit`` deliveries
    (congestion avoidance); ``cut()`` -> halved (floor 1), threshold = the new
    limit; ``restart()`` (the route came back) -> 1, threshold = the limit
    before (or the ceiling when it had fallen to 1). Never above ``ceiling``.
    """

    def __init__(self, ceiling: int) -> None:
        self.ceiling = ceiling
        self.limit = ceiling
        self.threshold = ceiling
        self._acked = 0

    def delivered(self) -> None:
        if self.limit >= self.ceiling:
            return
        if self.limit < self.threshold:
            self.limit += 1
            return
        self._acked += 1
        if self._acked >= self.limit:
            self._acked = 0
            self.limit += 1

    def cut(self) -> None:
        self.limit = max(1, self.limit // 2)
        self.threshold = self.limit
        self._acked = 0

    def restart(self) -> None:
        self.threshold = self.limit if self.limit > 1 else self.ceiling
        self.limit = 1
        self._acked = 0
