"""Logs and metric labels that stay bounded under a flood of events from outside.

:class:`RepeatLog` writes the first event of each kind in full (a WARNING
with its structured fields), then only counts the kind's events and writes one
summary line per :data:`SUMMARY_PERIOD_S` - "parked 12,345 events of type
'UserEmailChanged' in the last 60 s" - so 300,000 events of one kind make a
handful of lines, not 300,000. Every event is still counted in full by the
caller's metrics and, for parked events, kept in the parking lot.

:class:`BoundedLabels` keeps a metric's label set finite when its values come
from other teams' data (event types).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: A kind's repeats are summed up in one line this often.
SUMMARY_PERIOD_S = 60.0


@dataclass
class _Kind:
    since: float  # start of the current summary period
    count: int = 0  # events not yet written out in this period


class RepeatLog:
    """See the module docstring; ``what`` is the verb of the summary ("parked")."""

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        *,
        level: int = logging.WARNING,
        period_s: float = SUMMARY_PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._what = what
        self._level = level
        self._period_s = period_s
        self._clock = clock
        self._kinds: dict[str, _Kind] = {}

    def event(
        self, kind: str, msg: str, *args: object, extra: dict[str, Any] | None = None
    ) -> None:
        """One event of ``kind``: written in full the first time, else counted."""
        state = self._kinds.get(kind)
        if state is None:
            self._kinds[kind] = _Kind(since=self._clock())
            self._log.log(self._level, msg, *args, extra=extra)
            return
        state.count += 1
        self.tick()

    def tick(self) -> None:
        """Write the summary of every kind whose period is over."""
        now = self._clock()
        for kind, state in self._kinds.items():
            if state.count and now - state.since >= self._period_s:
                self._summary(kind, state, now)

    def flush(self) -> None:
        """Write every pending summary now (at shutdown)."""
        now = self._clock()
        for kind, state in self._kinds.items():
            if state.count:
                self._summary(kind, state, now)

    def _summary(self, kind: str, state: _Kind, now: float) -> None:
        self._log.log(
            self._level,
            "%s %d more events of type %r in the last %.0f s",
            self._what,
            state.count,
            kind,
            now - state.since,
            extra={"event_type": kind, "count": state.count},
        )
        state.count = 0
        state.since = now


class BoundedLabels:
    """A metric label drawn from outside data, bounded: the first ``limit`` values, then "other".

    Event types come from every producer of the outbox topics; a label per
    type must not let them grow the number of series without end.
    """

    OTHER = "other"

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._seen: set[str] = set()

    def label(self, value: str) -> str:
        if value in self._seen:
            return value
        if len(self._seen) < self._limit:
            self._seen.add(value)
            return value
        return self.OTHER
