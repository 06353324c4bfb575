"""The idempotent consumer's pure bookkeeping: a record's event id, its failed
attempts, and which partitions the helper holds paused. No I/O.

Guarantees:

* :func:`event_id_of` never raises anything but :class:`BadEvent` (with the
  reason), whatever bytes the record holds;
* :class:`AttemptBook` - a record is given up after exactly ``max_attempts``
  failures in a row; the backoff between them doubles up to a cap;
* :class:`PauseBook` - a partition the helper paused after a failure is
  resumed once its backoff is over, **also across revoke/assign**: the client
  (librdkafka) keeps a partition's pause flag when the partition is revoked
  and assigned again, so the book keeps the deadline too, and answers every
  assignment with an explicit pause (deadline still ahead) or resume (none,
  or over) for each newly assigned partition. What it keeps is bounded: an
  entry for a partition not assigned any more is dropped once its deadline
  passed.

PauseBook transitions (one partition)::

    FREE   --hold(now + delay)-----------------> HELD      (client: pause; the caller seeks back)
    HELD   --revoked---------------------------> AWAY      (deadline kept)
    AWAY   --assigned, deadline ahead----------> HELD      (client: pause again)
    AWAY   --assigned, deadline over-----------> FREE      (client: resume)
    FREE   --assigned--------------------------> FREE      (client: resume: a stale pause goes)
    HELD   --due(now >= deadline)--------------> FREE      (client: resume)
    AWAY   --due(now >= deadline)--------------> (forgotten)
"""

from __future__ import annotations

import enum
import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

from sinks.core.delivery import Envelope
from sinks.core.schedule import retry_delay_s
from sinks.idempotent.constants import MAX_EVENT_ID_CHARS, RETRY_BACKOFF_CAP_S
from sinks.idempotent.errors import BadEvent, ConsumerUsageError

#: (topic, partition)
TP = tuple[str, int]
#: (topic, partition, offset)
Position = tuple[str, int, int]


def event_id_of(record: Envelope) -> str:
    """The record's event id from its ``id`` header; raises :class:`BadEvent`.

    The relay and Debezium (default ``SimpleHeaderConverter``) send the id as
    plain UTF-8; a JSON string (Connect's ``JsonConverter`` as header converter)
    is unquoted. A uuid is written in its canonical lower-case form, so the
    spellings of one id share one ledger row. Duplicate ``id`` headers: the
    last one counts (Kafka's ``lastHeader``), as in the sink. A record whose
    headers could not be read at all is bad input with that reason.
    """
    if record.unreadable:
        raise BadEvent(record.unreadable)
    raw = record.headers.get("id")
    if raw is None:
        raise BadEvent("no id header: the event id is the idempotency key")
    try:
        text = raw.decode("utf-8").strip()
        if len(text) >= 2 and text[0] == text[-1] == '"':
            text = str(json.loads(text)).strip()
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadEvent(f"id header is not UTF-8 text: {exc}") from exc
    if not text or len(text) > MAX_EVENT_ID_CHARS:
        raise BadEvent(f"id header must be 1-{MAX_EVENT_ID_CHARS} characters, not {len(text)}")
    if not text.isprintable():
        raise BadEvent("id header holds control characters")
    try:
        return str(uuid.UUID(text))
    except ValueError:
        return text


class AttemptBook:
    """Failed attempts per record position and the backoff between them. Pure."""

    def __init__(self, *, max_attempts: int, backoff_base_s: float) -> None:
        if max_attempts < 1:
            raise ConsumerUsageError(f"max_attempts must be at least 1, not {max_attempts}")
        self.max_attempts = max_attempts
        self._base_s = backoff_base_s
        self._failures: dict[Position, int] = {}

    def failures(self, position: Position) -> int:
        return self._failures.get(position, 0)

    def failed(self, position: Position) -> float | None:
        """Count a failure: the delay before the next attempt, or None to give up."""
        count = self._failures.get(position, 0) + 1
        self._failures[position] = count
        if count >= self.max_attempts:
            return None
        return retry_delay_s(count - 1, self._base_s, cap_s=RETRY_BACKOFF_CAP_S)

    def settle(self, position: Position) -> None:
        """The record is done (handled, skipped, parked or dead-lettered)."""
        self._failures.pop(position, None)

    def forget_partitions(self, tps: Iterable[TP]) -> None:
        """Partitions revoked: their next owner starts the counts afresh."""
        gone = set(tps)
        for position in [p for p in self._failures if (p[0], p[1]) in gone]:
            del self._failures[position]


class Hold(enum.Enum):
    """Where one partition stands in a :class:`PauseBook`."""

    FREE = "free"  # not held by the helper: the client must not have it paused
    HELD = "held"  # assigned, paused by the helper until its deadline
    AWAY = "away"  # held when it was revoked; its deadline still counts if it comes back


@dataclass(frozen=True, slots=True)
class PauseActions:
    """What the client must do now: pause these partitions, resume those."""

    pause: tuple[TP, ...] = ()
    resume: tuple[TP, ...] = ()


@dataclass(slots=True)
class _Entry:
    resume_at: float
    assigned: bool = field(default=True)


class PauseBook:
    """Which partitions the helper holds paused, and until when. See the module docstring."""

    def __init__(self) -> None:
        self._entries: dict[TP, _Entry] = {}

    def hold(self, tp: TP, *, until: float) -> PauseActions:
        """``tp`` (assigned) failed a record: keep it paused until ``until``."""
        self._entries[tp] = _Entry(until)
        return PauseActions(pause=(tp,))

    def assigned(self, tps: Iterable[TP], *, now: float) -> PauseActions:
        """``tps`` were (re)assigned: an explicit pause or resume for each."""
        pause: list[TP] = []
        resume: list[TP] = []
        for tp in tps:
            entry = self._entries.get(tp)
            if entry is not None and entry.resume_at > now:
                entry.assigned = True
                pause.append(tp)
            else:
                self._entries.pop(tp, None)
                resume.append(tp)
        return PauseActions(pause=tuple(pause), resume=tuple(resume))

    def revoked(self, tps: Iterable[TP]) -> None:
        """``tps`` were revoked (or lost): their deadlines are kept for a return."""
        for tp in tps:
            entry = self._entries.get(tp)
            if entry is not None:
                entry.assigned = False

    def due(self, now: float) -> PauseActions:
        """Resume the held partitions whose backoff is over; forget those away and over."""
        resume: list[TP] = []
        for tp, entry in list(self._entries.items()):
            if entry.resume_at <= now:
                del self._entries[tp]
                if entry.assigned:
                    resume.append(tp)
        return PauseActions(resume=tuple(resume))

    def state(self, tp: TP) -> Hold:
        entry = self._entries.get(tp)
        if entry is None:
            return Hold.FREE
        return Hold.HELD if entry.assigned else Hold.AWAY

    def holds(self, tp: TP) -> bool:
        """True while ``tp`` is assigned and held paused (a record from it is stale)."""
        return self.state(tp) is Hold.HELD

    def __len__(self) -> int:
        return len(self._entries)

    def next_due(self) -> float | None:
        """The earliest deadline kept, if any."""
        return min((e.resume_at for e in self._entries.values()), default=None)
