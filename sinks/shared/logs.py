"""Logs and metric labels that stay bounded under a flood of events from outside.

:class:`RepeatLog` writes the first event of each kind in full (a line with
its structured fields), then only counts the kind's events and writes one
summary line per kind per :data:`SUMMARY_PERIOD_S` - "parked 12,345 more
events of type 'UserEmailChanged' in the last 60 s" - so 300,000 events of one
kind make a handful of lines, not 300,000. Every event is still counted in
full by the caller's metrics and, for parked events, kept in the parking lot.

Kinds come from other teams' data (event types), so their number is not ours
to bound; :class:`RepeatLog` bounds what it keeps and writes whatever comes:

* memory: at most :data:`MAX_KINDS` kinds are remembered (least recently seen
  forgotten first, its unwritten count moved to "other types");
* lines: at most :data:`NEW_KINDS_PER_PERIOD` kinds are *named* (written in
  full) per period; the events of any further new kind are counted under
  "other types", written as one summary line per period - so 100,000 distinct
  types in a minute make at most ``NEW_KINDS_PER_PERIOD + MAX_KINDS + 1``
  lines that minute, not 100,000;
* time: an event costs O(1) (a dict look-up and an LRU move); summaries are
  written when a period ends (:meth:`RepeatLog.tick`, O(1) until then).

:class:`BoundedLabels` keeps a metric's label set finite when its values come
from other teams' data (event types).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

#: Repeats are summed up in one line per kind this often.
SUMMARY_PERIOD_S = 60.0
#: Kinds remembered at most (each a few hundred bytes): a few hundred types is
#: more than any real stream has; a flood of distinct types is "other types".
MAX_KINDS = 256
#: New kinds written in full per period at most; later new kinds of the same
#: period are counted under "other types" (distinct types cannot flood the log).
NEW_KINDS_PER_PERIOD = 32


class RepeatLog:
    """See the module docstring; ``what`` is the verb of the summary ("parked").

    ``summarize_kinds=False``: a named kind is written once and its repeats only
    counted (for deliberate events such as skipped types); the "other types"
    line is still written.
    """

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        *,
        level: int = logging.WARNING,
        period_s: float = SUMMARY_PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
        max_kinds: int = MAX_KINDS,
        new_per_period: int = NEW_KINDS_PER_PERIOD,
        summarize_kinds: bool = True,
    ) -> None:
        if max_kinds < 1 or new_per_period < 0:
            raise ValueError("max_kinds must be at least 1, new_per_period at least 0")
        self._log = logger
        self._what = what
        self._level = level
        self._period_s = period_s
        self._clock = clock
        self._max_kinds = max_kinds
        self._new_per_period = new_per_period
        self._summarize_kinds = summarize_kinds
        self._kinds: OrderedDict[str, int] = OrderedDict()  # kind -> repeats not yet written
        self._since = clock()  # start of the current period
        self._named = 0  # kinds written in full in this period
        self._other = 0  # events of kinds not named, not yet written

    @property
    def kinds(self) -> int:
        """Kinds remembered now (at most ``max_kinds``)."""
        return len(self._kinds)

    def event(
        self, kind: str, msg: str, *args: object, extra: dict[str, Any] | None = None
    ) -> None:
        """One event of ``kind``: written in full the first time (within budget), else counted."""
        self.tick()
        kinds = self._kinds
        count = kinds.get(kind)
        if count is not None:
            kinds[kind] = count + 1
            kinds.move_to_end(kind)
            return
        if self._named >= self._new_per_period:
            self._other += 1
            return
        self._named += 1
        kinds[kind] = 0
        if len(kinds) > self._max_kinds:
            _, forgotten = kinds.popitem(last=False)
            self._other += forgotten
        self._log.log(self._level, msg, *args, extra=extra)

    def tick(self) -> None:
        """At the end of a period: its summary lines; O(1) until then."""
        now = self._clock()
        if now - self._since >= self._period_s:
            self._summaries(now)

    def flush(self) -> None:
        """Write every pending summary now (at shutdown)."""
        self._summaries(self._clock())

    def _summaries(self, now: float) -> None:
        elapsed_s = now - self._since
        if self._summarize_kinds:
            for kind, count in self._kinds.items():
                if count:
                    self._log.log(
                        self._level,
                        "%s %d more events of type %r in the last %.0f s",
                        self._what,
                        count,
                        kind,
                        elapsed_s,
                        extra={"event_type": kind, "count": count},
                    )
        if self._other:
            self._log.log(
                self._level,
                "%s %d events of other types in the last %.0f s (more types than are named"
                " in the log; the metrics count each one)",
                self._what,
                self._other,
                elapsed_s,
                extra={"count": self._other},
            )
        for kind in self._kinds:
            self._kinds[kind] = 0
        self._other = 0
        self._named = 0
        self._since = now


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
