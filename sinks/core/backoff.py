"""How long to wait before probing a down engine again: growing, jittered delays. Pure.

Guarantees: :class:`Backoff` hands out growing, jittered delays, never above
``cap_s`` unless the engine's ``Retry-After`` asks for more (it is a floor, itself
capped at :data:`~sinks.core.statuses.RETRY_AFTER_MAX_S`); a success starts over.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from enum import Enum

from sinks.core.statuses import RETRY_AFTER_MAX_S


class Jitter(Enum):
    """How :class:`Backoff` spreads its delays."""

    NONE = "none"  # exactly base * factor**n, capped: deterministic, for reasoning and tests
    FULL = "full"  # uniform(0, base * factor**n capped): spreads a fleet's probes widest
    DECORRELATED = "decorrelated"  # uniform(base, previous * factor) capped: grows, never ~0


class Backoff:
    """Growing, jittered delays between probes of a down engine.

    Transitions: ``next_delay_s()`` -> the n-th delay (n counts since the last
    ``reset()``); ``reset()`` -> back to the first delay, called after a success.
    """

    def __init__(
        self,
        *,
        base_s: float = 0.5,
        cap_s: float = 30.0,
        factor: float = 2.0,
        jitter: Jitter = Jitter.FULL,
        rand: Callable[[float, float], float] = random.uniform,
    ) -> None:
        if not 0 < base_s <= cap_s or factor < 1:
            raise ValueError("Backoff needs 0 < base_s <= cap_s and factor >= 1")
        self._base_s = base_s
        self._cap_s = cap_s
        self._factor = factor
        self._jitter = jitter
        self._rand = rand
        self._attempts = 0
        self._previous_s = base_s
        #: base_s * factor**attempts, capped; grown by multiplication so it never overflows
        self._ceiling_s = base_s

    @property
    def attempts(self) -> int:
        """Delays handed out since the last reset."""
        return self._attempts

    def next_delay_s(self, retry_after_s: float | None = None) -> float:
        """The next delay; at least ``retry_after_s`` when the engine sent one."""
        delay_s = self._jittered_s()
        self._attempts += 1
        self._previous_s = delay_s
        self._ceiling_s = min(self._cap_s, self._ceiling_s * self._factor)
        if retry_after_s is not None:
            delay_s = max(delay_s, min(retry_after_s, RETRY_AFTER_MAX_S))
        return delay_s

    def reset(self) -> None:
        """Start over from the first delay (the engine answered)."""
        self._attempts = 0
        self._previous_s = self._base_s
        self._ceiling_s = self._base_s

    def _jittered_s(self) -> float:
        if self._jitter is Jitter.DECORRELATED:
            upper_s = min(self._cap_s, self._previous_s * self._factor)
            return min(self._cap_s, self._rand(self._base_s, max(upper_s, self._base_s)))
        if self._jitter is Jitter.FULL:
            return self._rand(0.0, self._ceiling_s)
        return self._ceiling_s
