"""What the operator selects, parsed and ordered (pure): durations, times, topics, events.

Guarantees: an ISO-8601 duration or date-time that does not parse raises
:class:`~sinks.ops.errors.OpsUsageError` naming the problem; a topic selection never
accepts Kafka's internal ``__*`` topics; records merged from several partitions
come out in commit order (the ``lsn`` header, else the record timestamp) and
offset order within a partition is never changed.
"""

from __future__ import annotations

import heapq
import re
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from cdc.constants import HEADER_LSN
from cdc.settings import Settings
from cdc.wal.replproto import str_to_lsn
from sinks.core.delivery import Envelope
from sinks.ops.errors import OpsUsageError

#: (topic, partition)
TP = tuple[str, int]


_DURATION = re.compile(
    r"P(?:(?P<weeks>\d+(?:[.,]\d+)?)W)?(?:(?P<days>\d+(?:[.,]\d+)?)D)?"
    r"(?:T(?:(?P<hours>\d+(?:[.,]\d+)?)H)?(?:(?P<minutes>\d+(?:[.,]\d+)?)M)?"
    r"(?:(?P<seconds>\d+(?:[.,]\d+)?)S)?)?"
)


_DURATION_UNIT_S = {"weeks": 604_800, "days": 86_400, "hours": 3_600, "minutes": 60, "seconds": 1}


def parse_iso_duration_s(text: str) -> float:
    """An ISO-8601 duration in seconds: ``PT15M`` -> 900.0, ``P1DT2H`` -> 93600.0.

    Weeks, days, hours, minutes and seconds, each optional, any may carry a
    fraction (``PT1.5H``). Years and months are refused: they have no fixed
    length. Raises :class:`OpsUsageError` naming the problem.
    """
    raw = text.strip().upper()
    date_part = raw.partition("T")[0]
    if raw.startswith("P") and ("Y" in date_part or "M" in date_part):
        raise OpsUsageError(
            f"duration {text!r}: years and months have no fixed length; use days (P30D)"
        )
    match = _DURATION.fullmatch(raw)
    if match is None or raw in {"P", "PT"} or raw.endswith("T"):
        raise OpsUsageError(f"not an ISO-8601 duration: {text!r} (e.g. PT15M, PT1H30M, P1D, P1W)")
    return float(
        sum(
            float(value.replace(",", ".")) * _DURATION_UNIT_S[unit]
            for unit, value in match.groupdict().items()
            if value is not None
        )
    )


def parse_datetime_ms(text: str) -> int:
    """An ISO-8601 date-time as Unix epoch milliseconds; without an offset it is UTC."""
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError as exc:
        raise OpsUsageError(
            f"not an ISO-8601 date-time: {text!r} (e.g. 2024-05-01T10:00:00+02:00)"
        ) from exc
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


def now_ms() -> int:
    """The wall clock in Unix epoch milliseconds (Kafka's record timestamp unit)."""
    return time.time_ns() // 1_000_000


@dataclass(frozen=True, slots=True, kw_only=True)
class TopicSelection:
    """A topic and, optionally, some of its partitions (``None`` = all)."""

    topic: str
    partitions: tuple[int, ...] | None = None


def parse_topic_spec(spec: str) -> TopicSelection:
    """``"T"`` -> all partitions of T; ``"T:0,2"`` -> partitions 0 and 2 of T."""
    topic, sep, parts = spec.strip().partition(":")
    if not topic:
        raise OpsUsageError(f"topic spec {spec!r}: empty topic name")
    if not sep:
        return TopicSelection(topic=topic)
    try:
        partitions = tuple(sorted({int(p) for p in parts.split(",") if p.strip()}))
    except ValueError as exc:
        raise OpsUsageError(
            f"topic spec {spec!r}: partitions must be integers (e.g. {topic}:0,2)"
        ) from exc
    if not partitions or min(partitions) < 0:
        raise OpsUsageError(f"topic spec {spec!r}: give partitions as {topic}:0,2")
    return TopicSelection(topic=topic, partitions=partitions)


def default_topic_filter(settings: Settings) -> Callable[[str], bool]:
    """The sink's own topics: ``SINK_TOPICS_PATTERN`` when set, else ``CDC_TOPIC_PREFIX``."""
    if settings.sink_topics_pattern:
        pattern = re.compile(settings.sink_topics_pattern.removeprefix("^"))
        return lambda name: pattern.match(name) is not None
    prefix = settings.topic_prefix
    return lambda name: name.startswith(prefix)


def select_topics(names: Iterable[str], accept: Callable[[str], bool]) -> list[str]:
    """The accepted topic names, sorted; Kafka's internal ``__*`` topics never."""
    return sorted(n for n in names if not n.startswith("__") and accept(n))


def named_partitions(selections: Sequence[TopicSelection] | None) -> frozenset[TP]:
    """The partitions the operator listed one by one (``--topic T:0,2``)."""
    return frozenset(
        (sel.topic, p)
        for sel in selections or ()
        if sel.partitions is not None
        for p in sel.partitions
    )


def normalize_event_id(value: str) -> str:
    """A uuid in its canonical lower-case form (as the ``id`` header carries it)."""
    try:
        return str(uuid.UUID(value.strip()))
    except ValueError:
        return value.strip()


@dataclass(frozen=True, slots=True, kw_only=True)
class RedeliverySelector:
    """Which records to send again: by event id (the ``id`` header) or by key."""

    event_ids: frozenset[str] = frozenset()
    key: bytes | None = None

    @classmethod
    def of(cls, *, event_ids: Iterable[str] | None, key: str | None) -> RedeliverySelector:
        ids = frozenset(normalize_event_id(e) for e in event_ids or ())
        if bool(ids) == (key is not None):
            raise OpsUsageError("choose the events by event id or by key (exactly one)")
        return cls(event_ids=ids, key=key.encode() if key is not None else None)

    def matches(self, record: Envelope) -> bool:
        if self.key is not None:
            return record.key == self.key
        return record.event_id in self.event_ids


def commit_order_key(record: Envelope) -> tuple[int, int]:
    """Commit order across partitions: the ``lsn`` header, then the record timestamp."""
    try:
        lsn = str_to_lsn(record.header(HEADER_LSN))
    except ValueError:
        lsn = 0
    return (lsn, record.timestamp_ms or 0)


def in_commit_order(per_partition: Iterable[Sequence[Envelope]]) -> list[Envelope]:
    """Merge partitions (each in offset order, which is kept) into commit order; an
    event id seen twice (an at-least-once duplicate in Kafka) is kept once."""
    seen: set[str] = set()
    out: list[Envelope] = []
    for record in heapq.merge(*per_partition, key=commit_order_key):
        event_id = record.event_id
        if event_id and event_id in seen:
            continue
        seen.add(event_id)
        out.append(record)
    return out
