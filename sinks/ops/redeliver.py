"""Redelivery: find chosen records in Kafka and send them to the engine again.

Guarantees: :func:`redeliver` moves no offset of any group. It sends each
chosen record through :func:`sinks.engine.dispatch.deliver` with its own ``id``
header as ``Idempotency-Key``, one at a time, in commit order (LSN header,
else the record timestamp; offset order within a partition is never changed).
After engine-wide trouble the rest are reported ``not_sent``, never skipped
silently.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from cdc.settings import Settings
from sinks.core.delivery import Envelope
from sinks.core.errors import (
    EngineUnavailable,
    SinkError,
    Unroutable,
)
from sinks.engine.client import EngineClient
from sinks.engine.dispatch import deliver
from sinks.ops.kafka import SCAN_BATCH, SCAN_IDLE_TIMEOUT_S, KafkaOps
from sinks.ops.offsets import clamp_offset
from sinks.ops.selection import TP, RedeliverySelector, TopicSelection, in_commit_order

#: progress(phase, done, total): phases ``scan`` and ``deliver``; total may be None.
ProgressFn = Callable[[str, int, int | None], None]


class Outcome(enum.StrEnum):
    """What became of one redelivered event."""

    DELIVERED = "delivered"  # the engine answered 2xx: applied now
    DUPLICATE = "duplicate"  # the engine answered 2xx {"status":"duplicate"}: applied before
    REJECTED = "rejected"  # the healthy engine refused this event (4xx)
    UNROUTABLE = "unroutable"  # no route, bad payload or no id header: never sent
    ENGINE_UNAVAILABLE = "engine_unavailable"  # engine-wide trouble on this one
    NOT_SENT = "not_sent"  # not tried: the engine was unavailable before its turn


#: Outcomes that leave the event applied by the engine (now, or before).
APPLIED = frozenset({Outcome.DELIVERED, Outcome.DUPLICATE})


@dataclass(frozen=True, slots=True, kw_only=True)
class Redelivery:
    """One event sent again and what the engine said."""

    event_id: str
    event_type: str
    topic: str
    partition: int
    offset: int
    key: str | None
    outcome: Outcome
    detail: str = ""

    def as_json(self) -> dict[str, object]:
        return {
            "event_id": self.event_id,
            "event_type": self.event_type,
            "topic": self.topic,
            "partition": self.partition,
            "offset": self.offset,
            "key": self.key,
            "outcome": self.outcome.value,
            "detail": self.detail,
        }


@dataclass(frozen=True, kw_only=True)
class RedeliveryReport:
    """Everything a redelivery sent, in order; ids asked for but not found in Kafka."""

    items: tuple[Redelivery, ...]
    missing_event_ids: tuple[str, ...] = ()
    scanned_count: int = 0

    @property
    def ok(self) -> bool:
        """Every chosen event was found and delivered."""
        return not self.missing_event_ids and all(i.outcome in APPLIED for i in self.items)

    def counts(self) -> dict[str, int]:
        out = {o.value: 0 for o in Outcome}
        for item in self.items:
            out[item.outcome.value] += 1
        return out

    def as_json(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "counts": self.counts(),
            "scanned_count": self.scanned_count,
            "missing_event_ids": list(self.missing_event_ids),
            "events": [i.as_json() for i in self.items],
        }


def redeliver(
    settings: Settings,
    *,
    event_ids: Iterable[str] | None = None,
    key: str | None = None,
    since_ms: int | None = None,
    topics: Sequence[TopicSelection] | None = None,
    progress: ProgressFn | None = None,
) -> RedeliveryReport:
    """Find the chosen records in Kafka and deliver each to the engine again.

    By event id (``id`` header) or by key (every record with that key, commit
    order). The scan starts at ``offsets_for_times(since_ms)`` (epoch ms) or the beginning and
    ends at the end offsets seen when it starts. No group offset moves.
    """
    selector = RedeliverySelector.of(event_ids=event_ids, key=key)
    records, scanned = _find(
        settings, selector, since_ms=since_ms, topics=topics, progress=progress
    )
    found = {r.event_id for r in records}
    missing = tuple(sorted(selector.event_ids - found))
    items = asyncio.run(_send_all(settings, records, progress=progress))
    return RedeliveryReport(items=tuple(items), missing_event_ids=missing, scanned_count=scanned)


def _find(
    settings: Settings,
    selector: RedeliverySelector,
    *,
    since_ms: int | None,
    topics: Sequence[TopicSelection] | None,
    progress: ProgressFn | None,
) -> tuple[list[Envelope], int]:
    """The matching records in commit order, and how many records were read."""
    with KafkaOps(settings) as kafka:
        tps = kafka.partitions(topics)
        marks = kafka.watermarks(tps)
        starts = {tp: low for tp, (low, _high) in marks.items()}
        if since_ms is not None:
            by_time = kafka.offsets_for_time(tps, since_ms)
            starts = {tp: _scan_start(by_time.get(tp), marks[tp]) for tp in tps}
        ends = {tp: high for tp, (_low, high) in marks.items()}
        total = sum(max(0, ends[tp] - starts[tp]) for tp in tps)
        per_partition: dict[TP, list[Envelope]] = {tp: [] for tp in tps}
        scanned = 0
        wanted = set(selector.event_ids)
        for record in kafka.read(starts, ends=ends, idle_timeout_s=SCAN_IDLE_TIMEOUT_S):
            scanned += 1
            if selector.matches(record):
                per_partition[record.topic_partition].append(record)
                wanted.discard(record.event_id)
            if progress is not None and scanned % SCAN_BATCH == 0:
                progress("scan", scanned, total)
            if selector.event_ids and not wanted:
                break
        if progress is not None:
            progress("scan", total, total)
    return in_commit_order(per_partition.values()), scanned


def _scan_start(time_offset: int | None, mark: tuple[int, int]) -> int:
    low, high = mark
    return high if time_offset is None else clamp_offset(time_offset, low=low, high=high)


async def _send_all(
    settings: Settings, records: Sequence[Envelope], *, progress: ProgressFn | None
) -> list[Redelivery]:
    """Deliver one after another; after engine-wide trouble the rest are NOT_SENT."""
    out: list[Redelivery] = []
    unavailable = False
    async with EngineClient.from_settings(settings) as engine:
        for done, record in enumerate(records, start=1):
            if unavailable:
                out.append(_redelivery(record, Outcome.NOT_SENT, "engine unavailable earlier"))
                continue
            outcome, detail = await _send_one(engine, record)
            unavailable = outcome is Outcome.ENGINE_UNAVAILABLE
            out.append(_redelivery(record, outcome, detail))
            if progress is not None:
                progress("deliver", done, len(records))
    return out


async def _send_one(engine: EngineClient, record: Envelope) -> tuple[Outcome, str]:
    duplicates: list[str] = []
    try:
        call = await deliver(
            engine,
            event_type=record.event_type,
            payload=record.value,
            event_id=record.event_id,
            duplicates=duplicates,
        )
    except EngineUnavailable as exc:
        return Outcome.ENGINE_UNAVAILABLE, exc.reason
    except Unroutable as exc:
        return Outcome.UNROUTABLE, exc.reason
    except SinkError as exc:
        return Outcome.REJECTED, exc.reason
    if duplicates:
        return Outcome.DUPLICATE, call.path
    return Outcome.DELIVERED, call.path


def _redelivery(record: Envelope, outcome: Outcome, detail: str) -> Redelivery:
    return Redelivery(
        event_id=record.event_id,
        event_type=record.event_type,
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=record.key.decode("utf-8", "replace") if record.key is not None else None,
        outcome=outcome,
        detail=detail,
    )
