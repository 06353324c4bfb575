"""Growing delays between attempts of something that keeps failing: pure, the clock passed in.

Guarantees of :class:`Backoff`:

* every delay is at least ``min_s`` and at most ``max_s``; the delays double
  while failures follow each other, so a thing that fails at once every time (a
  crash loop) is attempted at most once per ``min_s`` and, soon, once per ``max_s``;
* the delays start again from ``min_s`` only after :meth:`Backoff.reset` (the
  owner saw a success) or once an attempt ran ``calm_s`` without failing.

Transitions (``n`` = failures counted since the last reset)::

    failed(now) -> delay min(max_s, min_s * 2**n), then n + 1
                   (n = 0 first when the attempt that just failed started
                    calm_s or more before now)
    reset()     -> n = 0
"""

from __future__ import annotations

__all__ = ["Backoff"]


class Backoff:
    """Delays between attempts; see the module docstring."""

    __slots__ = ("_attempt_started_s", "_calm_s", "_failures", "_max_s", "_min_s")

    def __init__(self, *, min_s: float, max_s: float, calm_s: float | None = None) -> None:
        if not 0 < min_s <= max_s:
            raise ValueError(f"Backoff needs 0 < min_s <= max_s, got {min_s}, {max_s}")
        if calm_s is not None and calm_s <= 0:
            raise ValueError(f"calm_s must be positive, got {calm_s}")
        self._min_s = min_s
        self._max_s = max_s
        self._calm_s = calm_s
        self._failures = 0
        self._attempt_started_s: float | None = None  # when the retry after a failure begins

    @property
    def failures(self) -> int:
        """Failures counted since the last reset (or calm attempt)."""
        return self._failures

    def failed(self, now_s: float) -> float:
        """An attempt failed at ``now_s``: how long to wait before the next one."""
        started = self._attempt_started_s
        if self._calm_s is not None and started is not None and now_s - started >= self._calm_s:
            self._failures = 0
        delay_s = float(min(self._max_s, self._min_s * 2.0 ** min(self._failures, 64)))
        self._failures += 1
        self._attempt_started_s = now_s + delay_s
        return delay_s

    def reset(self) -> None:
        """The attempt succeeded: the next failure waits ``min_s`` again."""
        self._failures = 0
        self._attempt_started_s = None
