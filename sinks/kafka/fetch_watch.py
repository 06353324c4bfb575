"""A partition that should be fetching and is not gets restarted: the wait for records is bounded.

The sink pauses and resumes partitions through librdkafka, whose fetch state is
not ours to read. If a partition stays stopped when it should fetch - a resume
lost between the core, the thread and the client, a fetcher that never
restarted - nothing else notices: the core holds nothing for it, commits
nothing new, raises no stall warning, while its records wait on the broker.
This module bounds that wait with evidence the sink owns: which offset it
expects next, when it last got a record, and the broker's end of the log.

Guarantees (:class:`FetchWatch` is pure; the worker thread is its shell):

* a partition is *suspect* when it is assigned, not paused by the sink, not
  stopped on purpose (``auto.offset.reset=error``), and no record of it came for
  ``stall_after_s`` since it was assigned, resumed, last fetched, last checked or
  the thread last held back (its hand-off to the loop full: silence counts only
  while the thread fetches);
* a suspect is *stalled* only when the broker's end of the log (the last stable
  offset: the consumer reads committed records) lies more than one offset past
  the next offset the sink expects - one offset is a transaction marker after
  the last record, never a record - so an idle partition is never restarted
  for being idle;
* a stalled partition is resumed and sought to the next offset it expects (the
  offset after the last record handed to the loop, or the consumer's position,
  or the group's commit): nothing skipped, at most the records of an
  in-flight fetch read twice (the core ignores what it already holds); one
  WARNING names the partition, the offsets and how long it was silent, and
  ``outbox_sink_fetch_restarts_total`` counts it;
* each partition is checked at most once per ``stall_after_s``: a partition
  whose tail is records the consumer never returns (an aborted transaction) is
  sought again at that pace, never in a loop;
* an offset reset (the configured policy restarting a partition whose offset was
  out of range) is where the partition is expected from then on (:meth:`FetchWatch.reset`):
  it is never sought back to the removed offset (a reset, an ERROR and
  ``offsets_expired_total`` again every ``stall_after_s``: false pages);
* what it keeps is bounded by the assignment: a revoked partition is forgotten.
"""

from __future__ import annotations

from dataclasses import dataclass

TP = tuple[str, int]

#: A partition silent this long while it should fetch is checked against the broker.
STALL_AFTER_S = 30.0


@dataclass(slots=True)
class _Part:
    #: the offset after the last record fetched; None before the first one
    next_offset: int | None
    #: when the partition last showed life (assigned, resumed, a record, a check)
    quiet_since: float
    paused: bool = False
    stopped: bool = False


@dataclass(frozen=True, slots=True)
class Restart:
    """Resume ``tp`` and seek it to ``offset``: the broker holds ``end`` and nothing came."""

    tp: TP
    offset: int
    end: int
    silent_s: float


class FetchWatch:
    """See the module docstring: events in, suspects and restarts out."""

    def __init__(self, stall_after_s: float = STALL_AFTER_S) -> None:
        self.stall_after_s = stall_after_s
        self._parts: dict[TP, _Part] = {}

    def __len__(self) -> int:
        return len(self._parts)

    def assigned(self, tps: list[TP], now: float) -> None:
        for tp in tps:
            self._parts[tp] = _Part(next_offset=None, quiet_since=now)

    def revoked(self, tps: list[TP]) -> None:
        for tp in tps:
            self._parts.pop(tp, None)

    def paused(self, tps: tuple[TP, ...]) -> None:
        for tp in tps:
            part = self._parts.get(tp)
            if part is not None:
                part.paused = True

    def resumed(self, tps: tuple[TP, ...], now: float) -> None:
        for tp in tps:
            part = self._parts.get(tp)
            if part is not None and part.paused:
                part.paused = False
                part.quiet_since = now

    def stopped(self, tp: TP) -> None:
        """The partition stays stopped on purpose (``auto.offset.reset=error``)."""
        part = self._parts.get(tp)
        if part is not None:
            part.stopped = True

    def reset(self, tp: TP, start: int, now: float) -> None:
        """The partition was restarted at ``start`` by the offset-reset policy (a logical
        offset - beginning, end - is negative): that is where it is expected now, never
        the offset that was out of range (sought back there, it would reset again)."""
        part = self._parts.get(tp)
        if part is not None:
            part.next_offset = start if start >= 0 else None
            part.quiet_since = now
            part.stopped = False

    def held_back(self, now: float) -> None:
        """The thread fetched nothing on purpose (its hand-off to the loop is full):
        silence is counted only while it fetches."""
        for part in self._parts.values():
            part.quiet_since = now

    def fetched(self, tp: TP, offset: int, now: float) -> None:
        part = self._parts.get(tp)
        if part is not None:
            part.next_offset = offset + 1
            part.quiet_since = now

    def lively_since(self, tp: TP, at: float) -> bool:
        """True when ``tp`` showed life after ``at`` (a record, a resume, a held-back turn),
        or is no longer watched: an answer asked for at ``at`` is stale."""
        part = self._parts.get(tp)
        return part is None or part.quiet_since > at

    def next_offset(self, tp: TP) -> int | None:
        part = self._parts.get(tp)
        return None if part is None else part.next_offset

    def suspects(self, now: float) -> list[tuple[TP, float]]:
        """Partitions that should fetch and were silent for ``stall_after_s``, with how
        long; each is marked checked (its next check is ``stall_after_s`` later)."""
        out = []
        for tp, part in self._parts.items():
            silent_s = now - part.quiet_since
            if part.paused or part.stopped or silent_s < self.stall_after_s:
                continue
            part.quiet_since = now
            out.append((tp, silent_s))
        return sorted(out)

    def judge(self, tp: TP, expected: int | None, end: int, silent_s: float) -> Restart | None:
        """A restart when the broker's end lies past the next offset expected plus one
        (a trailing transaction marker); None for an idle partition, a partition no
        longer watched, or no evidence of where it should be."""
        if expected is None or expected < 0 or end <= expected + 1 or tp not in self._parts:
            return None
        return Restart(tp=tp, offset=expected, end=end, silent_s=silent_s)
