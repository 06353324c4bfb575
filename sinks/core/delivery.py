"""Delivery bookkeeping: which offsets may be committed, which records may start. Pure.

Guarantees (Sink invariant 1):

- :class:`OffsetWatermark` - an offset is offered for commit only when every
  record taken in below it, in that partition, is done (delivered or parked).
  Kafka's convention: the committed offset is the *next* one to read, i.e. the
  last done contiguous offset + 1. Gaps (compaction, transaction markers) never
  hold it back.
- :class:`KeyScheduler` - records of one key are handed out strictly in
  submission order, one at a time; different keys run concurrently, never more
  than ``max_in_flight`` records at once.

- :meth:`Envelope.from_kafka` - every record is data: a consumed record of any
  bytes (header names that are not UTF-8, null header values, duplicate names,
  huge header sets, null keys, tombstones) becomes an :class:`Envelope`, never
  an exception. Headers are read by :func:`read_headers` - the one function the
  sink and :mod:`sinks.idempotent` both use - exactly once per message; a
  record whose headers cannot be read carries the reason in
  :attr:`Envelope.unreadable` (it is parked or dead-lettered, never delivered).

Neither talks to Kafka or HTTP: the consumer loop drives them.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from cdc.constants import (
    HEADER_AGGREGATE_TYPE,
    HEADER_COMMIT_TS,
    HEADER_ID,
    HEADER_LSN,
    HEADER_TYPE,
)

# Re-exported: the one defensive reader lives in cdc, the ground floor.
from cdc.records import UNREADABLE_HEADERS as UNREADABLE_HEADERS  # noqa: PLC0414
from cdc.records import HeaderList as HeaderList  # noqa: PLC0414
from cdc.records import HeaderRead as HeaderRead  # noqa: PLC0414
from cdc.records import canonical_id
from cdc.records import read_headers as read_headers  # noqa: PLC0414

#: (topic, partition, offset): where a record sits in Kafka; unique per record.
Position = tuple[str, int, int]
#: (topic, partition)
TopicPartition = tuple[str, int]

#: confluent-kafka's TIMESTAMP_NOT_AVAILABLE timestamp type.
_KAFKA_TIMESTAMP_NOT_AVAILABLE = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Envelope:
    """One Kafka record as the sink sees it (key = aggregateid, value = payload JSON)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    #: By name, the last of duplicates winning (Kafka's ``lastHeader``); None values as b"".
    headers: dict[str, bytes] = field(default_factory=dict, hash=False)
    timestamp_ms: int | None = None
    #: Every header in record order, duplicates and null values kept (parking, dead letters).
    header_list: HeaderList = field(default=(), hash=False, compare=False)
    #: Why the record cannot be interpreted (``unreadable_headers: ...``); ``""`` when fine.
    unreadable: str = ""
    #: The ``id`` header's uuid in canonical text (:func:`cdc.records.canonical_id`), read
    #: once when the envelope is made: the event's idempotency key everywhere (delivery,
    #: parking lot, retries); ``""`` when the header is missing or holds no uuid.
    event_id: str = field(init=False, default="", compare=False)
    #: Bytes the record carries (key, value, header names and values): what holding it
    #: costs, counted toward the sink's byte bounds.
    size: int = field(init=False, default=0, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "event_id", canonical_id(self.headers.get(HEADER_ID)))
        size = len(self.key or b"") + len(self.value or b"")
        for name, value in self.header_list or self.headers.items():
            size += len(name) + len(value or b"")
        object.__setattr__(self, "size", size)

    @classmethod
    def from_kafka(cls, message: Any) -> Envelope:
        """An envelope from a confluent-kafka ``Message`` (duck-typed); never raises on bytes.

        Headers come from :func:`read_headers` (the message's ``headers()`` is not
        to be called again afterwards).
        """
        ts_type, ts_ms = message.timestamp()
        read = read_headers(message)
        return cls(
            topic=message.topic(),
            partition=message.partition(),
            offset=message.offset(),
            key=message.key(),
            value=message.value(),
            headers=headers_dict(read.headers),
            timestamp_ms=None if ts_type == _KAFKA_TIMESTAMP_NOT_AVAILABLE else ts_ms,
            header_list=read.headers,
            unreadable=read.problem,
        )

    @property
    def position(self) -> Position:
        """(topic, partition, offset)."""
        return (self.topic, self.partition, self.offset)

    @property
    def topic_partition(self) -> TopicPartition:
        """(topic, partition)."""
        return (self.topic, self.partition)

    @property
    def raw_id(self) -> str:
        """The ``id`` header as written (reasons, logs); ``""`` when missing."""
        return self.header(HEADER_ID)

    @property
    def event_type(self) -> str:
        """The ``type`` header (``UserRegistered`` ...); ``""`` when missing."""
        return self.header(HEADER_TYPE)

    @property
    def aggregate_type(self) -> str:
        """The ``aggregatetype`` header; ``""`` when missing."""
        return self.header(HEADER_AGGREGATE_TYPE)

    @property
    def lsn(self) -> str:
        """The commit LSN header (lineage); ``""`` when missing."""
        return self.header(HEADER_LSN)

    @property
    def commit_ts(self) -> str:
        """The commit timestamp header (lineage); ``""`` when missing."""
        return self.header(HEADER_COMMIT_TS)

    def header(self, name: str) -> str:
        """A header as text (UTF-8, undecodable bytes replaced); ``""`` when missing."""
        raw = self.headers.get(name)
        return "" if raw is None else raw.decode("utf-8", errors="replace")


def headers_dict(headers: Iterable[tuple[str, bytes | None]] | None) -> dict[str, bytes]:
    """Kafka's header list as a dict; a ``None`` value becomes ``b""``, the last one wins."""
    return {name: value or b"" for name, value in headers or ()}


class OffsetState(Enum):
    """Where one offset of a partition stands in an :class:`OffsetWatermark`."""

    UNTRACKED = "untracked"  # never taken in (ahead of the stream, or a gap between pending ones)
    PENDING = "pending"  # taken in, not yet delivered or parked: holds the commit back
    DONE = "done"  # delivered or parked, but a lower offset is still pending
    COMMITTABLE = "committable"  # below `committable`: everything up to here is settled


class OffsetWatermark:
    """The commit point of one partition.

    Transitions, each O(1) amortised::

        UNTRACKED --track(o)--> PENDING --done(o)--> DONE --(all lower settled)--> COMMITTABLE

    ``track`` takes strictly increasing offsets (gaps allowed); ``done`` accepts
    only a PENDING offset. A rebalance or seek starts a new watermark.
    """

    def __init__(self) -> None:
        self._queue: deque[int] = deque()  # tracked, not yet below `committable`, in order
        self._pending: set[int] = set()
        self._done: set[int] = set()  # done offsets still in _queue
        self._last_tracked: int | None = None
        self._committable: int | None = None
        self._last_taken: int | None = None
        self._sizes: dict[int, int] = {}  # bytes of held offsets (those with a size)
        self._held_bytes = 0

    def track(self, offset: int, size: int = 0) -> None:
        """A record at ``offset`` (of ``size`` bytes) was taken in; it holds the commit
        (and its bytes count in :attr:`held_bytes`) until it and every offset below are done."""
        if self._last_tracked is not None and offset <= self._last_tracked:
            raise ValueError(f"offset {offset} tracked after {self._last_tracked}")
        self._last_tracked = offset
        self._queue.append(offset)
        self._pending.add(offset)
        if size:
            self._sizes[offset] = size
            self._held_bytes += size

    def done(self, offset: int) -> None:
        """The record at ``offset`` is delivered or parked."""
        try:
            self._pending.remove(offset)
        except KeyError:
            raise ValueError(f"offset {offset} is not pending") from None
        self._done.add(offset)
        queue = self._queue
        while queue and queue[0] in self._done:
            settled = queue.popleft()
            self._done.remove(settled)
            self._held_bytes -= self._sizes.pop(settled, 0)
            self._committable = settled + 1

    @property
    def committable(self) -> int | None:
        """The offset to commit (every tracked offset below it is done); ``None`` if none yet."""
        return self._committable

    def take_committable(self) -> int | None:
        """:attr:`committable` if it moved since the last take, else ``None`` (commit once)."""
        if self._committable is None or self._committable == self._last_taken:
            return None
        self._last_taken = self._committable
        return self._committable

    @property
    def oldest_pending(self) -> int | None:
        """The lowest offset still holding the commit back (lag / oldest-age metrics)."""
        return self._queue[0] if self._queue else None

    @property
    def pending(self) -> int:
        """Offsets tracked and not yet delivered or parked."""
        return len(self._pending)

    @property
    def held(self) -> int:
        """Offsets tracked and not yet committable (pending + done above a pending one)."""
        return len(self._queue)

    @property
    def held_bytes(self) -> int:
        """Bytes of the :attr:`held` offsets (the sizes given to :meth:`track`)."""
        return self._held_bytes

    def state(self, offset: int) -> OffsetState:
        """Where ``offset`` stands."""
        if offset in self._pending:
            return OffsetState.PENDING
        if offset in self._done:
            return OffsetState.DONE
        if self._committable is not None and offset < self._committable:
            return OffsetState.COMMITTABLE
        return OffsetState.UNTRACKED


class RecordState(Enum):
    """Where one record stands in a :class:`KeyScheduler`."""

    UNKNOWN = "unknown"  # not held: never submitted, finished, or dropped with its partition
    QUEUED = "queued"  # submitted; waits for its key's turn or for a free in-flight slot
    IN_FLIGHT = "in_flight"  # handed out by ready(); its key waits for finish() or release()


#: Records with the same lane key run one at a time, in order. A keyed record's
#: lane is its key (aggregateid: a user's registration and attempts share it,
#: across topics); a record without a key has a lane of its own.
LaneKey = bytes | Position


class KeyScheduler:
    """Per-key order with bounded concurrency across keys, and a route per record.

    Transitions (one record)::

        UNKNOWN   --submit-------------------------------> QUEUED
        QUEUED    --ready (head of its lane, slot free)--> IN_FLIGHT
        IN_FLIGHT --finish (delivered or parked)---------> UNKNOWN   (the lane's next may start)
        IN_FLIGHT --release (try again later)------------> QUEUED    (still the head of its lane)
        QUEUED    --drop_partition-----------------------> UNKNOWN
        IN_FLIGHT --drop_partition-----------------------> IN_FLIGHT, orphan
        orphan    --submit (the same position again)-----> IN_FLIGHT (adopted)
        orphan    --finish or release--------------------> UNKNOWN   (the lane moves on)

    A record in flight when its partition is dropped stays IN_FLIGHT (it cannot
    be recalled) and keeps its slot and its lane: an *orphan*. ``finish`` or
    ``release`` of an orphan forgets it (its partition belongs to another
    consumer now, which delivers it again). If the partition comes back while
    the orphan is still in flight, the re-consumed copy is the same record
    (same position): ``submit`` *adopts* the orphan instead of queueing a copy,
    so the record keeps its original place at the head of its key's lane, and
    a later ``release`` puts it back there. The scheduler does not bound what
    is queued: the consumer pauses its partitions when :attr:`pending` is high.

    **Routes.** Every held record carries a *route* (for the sink: the engine
    endpoint it waits for; ``""`` by default), given at ``submit`` and changed
    by ``release(record, route=...)``. ``ready(route=r)`` hands out only heads
    of lanes whose head waits for ``r``: a lane whose head waits for a route
    that cannot take it holds its later records (per-key order), while lanes
    of other routes start. Each route keeps its own queue of runnable lanes,
    so ``ready`` and ``can_start`` cost O(1) amortised per record, whatever
    number of records is held. ``max_in_flight=None``: no bound here (the
    caller bounds what it sends).
    """

    def __init__(self, *, max_in_flight: int | None) -> None:
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self._max_in_flight = max_in_flight
        #: head first: each record, the route it waits for and its own (given at submit);
        #: the head may be in flight
        self._lanes: dict[LaneKey, deque[tuple[Envelope, Hashable, Hashable]]] = {}
        self._busy: set[LaneKey] = set()  # lanes whose head is in flight
        #: per route, lanes that may start their head (entries may be stale: checked on use)
        self._runnable: dict[Hashable, deque[LaneKey]] = {}
        #: every non-empty, non-busy lane -> the route it is filed under (its live entry)
        self._runnable_route: dict[LaneKey, Hashable] = {}
        self._in_flight: dict[Position, Envelope] = {}
        self._orphans: set[Position] = set()  # in flight, partition dropped meanwhile
        self._queued: set[Position] = set()
        self._queued_by_route: Counter[Hashable] = Counter()
        self._queued_by_place: Counter[tuple[TopicPartition, Hashable]] = Counter()  # own route
        self._per_partition: Counter[TopicPartition] = Counter()

    @property
    def max_in_flight(self) -> int | None:
        """The bound on records in flight at once (``None``: the caller's)."""
        return self._max_in_flight

    @property
    def in_flight(self) -> int:
        """Records handed out and not yet finished or released."""
        return len(self._in_flight)

    @property
    def queued(self) -> int:
        """Records submitted and not yet handed out."""
        return len(self._queued)

    def queued_for(self, route: Hashable) -> int:
        """Queued records waiting for ``route`` (heads and the records behind them)."""
        return self._queued_by_route.get(route, 0)

    def queued_in(self, topic: str, partition: int, route: Hashable) -> int:
        """Queued records of one partition whose own route (the one given at submit) is
        ``route`` - whatever route they wait for now."""
        return self._queued_by_place.get(((topic, partition), route), 0)

    @property
    def pending(self) -> int:
        """Queued + in flight."""
        return len(self._queued) + len(self._in_flight)

    def pending_for(self, topic: str, partition: int) -> int:
        """Queued + in flight of one partition (in-flight records of a dropped one included)."""
        return self._per_partition[(topic, partition)]

    def submit(self, record: Envelope, route: Hashable = "") -> bool:
        """Queue ``record`` behind the earlier records of its key; it waits for ``route``.

        Returns True when ``record`` is an orphan's position coming back (its
        partition was re-assigned while it was in flight): the orphan is
        adopted - it stays in flight at the head of its lane, no copy is queued.
        """
        position = record.position
        if position in self._orphans:
            self._orphans.discard(position)
            return True
        if position in self._queued or position in self._in_flight:
            raise ValueError(f"record {position} is already held")
        lane = lane_key(record)
        queue = self._lanes.get(lane)
        if queue is None:
            queue = self._lanes[lane] = deque()
        queue.append((record, route, route))
        self._queued.add(position)
        self._count_queued(record, route, route, 1)
        self._per_partition[record.topic_partition] += 1
        if lane not in self._busy:
            self._make_runnable(lane)
        return False

    def can_start(self, route: Hashable = "") -> bool:
        """True when :meth:`ready` for ``route`` would hand out a record now."""
        if self._max_in_flight is not None and len(self._in_flight) >= self._max_in_flight:
            return False
        return self._first_runnable(route) is not None

    def peek(self, route: Hashable = "") -> Envelope | None:
        """The record :meth:`ready` for ``route`` would hand out first (nothing changes)."""
        lane = self._first_runnable(route)
        return None if lane is None else self._lanes[lane][0][0]

    def queued_positions(self) -> set[Position]:
        """Positions of the queued records (a copy)."""
        return set(self._queued)

    def is_orphan(self, record: Envelope) -> bool:
        """True while ``record`` is in flight from a partition dropped since it started."""
        return record.position in self._orphans

    def ready(self, limit: int | None = None, route: Hashable = "") -> list[Envelope]:
        """Records waiting for ``route`` that may start now (at most ``limit``): IN_FLIGHT."""
        started: list[Envelope] = []
        room = limit if limit is not None else len(self._queued)
        if self._max_in_flight is not None:
            room = min(room, self._max_in_flight - len(self._in_flight))
        while len(started) < room:
            lane = self._first_runnable(route)
            if lane is None:
                break
            self._runnable[route].popleft()
            del self._runnable_route[lane]
            record, _, home = self._lanes[lane][0]
            self._busy.add(lane)
            self._in_flight[record.position] = record
            self._queued.remove(record.position)
            self._count_queued(record, route, home, -1)
            started.append(record)
        return started

    def finish(self, record: Envelope) -> None:
        """``record`` is delivered or parked: the next record of its key may start."""
        self._take_in_flight(record)
        self._pop_head(record)

    def release(self, record: Envelope, route: Hashable | None = None) -> None:
        """``record`` goes back, still first of its key, to be handed out again by ready().

        ``route``: the route it waits for from now on (unchanged when ``None``).
        """
        self._take_in_flight(record)
        if record.position in self._orphans:
            self._pop_head(record)
            return
        lane = lane_key(record)
        queue = self._lanes[lane]
        _, waits_for, home = queue[0]
        if route is None:
            route = waits_for
        else:
            queue[0] = (record, route, home)
        self._busy.discard(lane)
        self._queued.add(record.position)
        self._count_queued(record, route, home, 1)
        self._make_runnable(lane)

    def drop_partition(self, topic: str, partition: int) -> list[Envelope]:
        """Forget the queued records of a revoked partition; returns them, in order."""
        dropped: list[Envelope] = []
        for lane, queue in list(self._lanes.items()):
            kept: deque[tuple[Envelope, Hashable, Hashable]] = deque()
            for record, route, home in queue:
                lost = record.topic_partition == (topic, partition)
                if lost and self._in_flight.get(record.position) is not record:
                    dropped.append(record)
                    self._count_queued(record, route, home, -1)
                else:
                    kept.append((record, route, home))
                    if lost:
                        self._orphans.add(record.position)
            if kept:
                self._lanes[lane] = kept
                if lane not in self._busy:  # its head may have changed: file it again
                    self._runnable_route.pop(lane, None)
                    self._make_runnable(lane)
            else:
                del self._lanes[lane]
                self._runnable_route.pop(lane, None)
        self._queued.difference_update(r.position for r in dropped)
        self._per_partition[(topic, partition)] -= len(dropped)
        self._forget_partition_if_empty((topic, partition))
        return dropped

    def state(self, record: Envelope) -> RecordState:
        """Where ``record`` stands."""
        if record.position in self._in_flight:
            return RecordState.IN_FLIGHT
        if record.position in self._queued:
            return RecordState.QUEUED
        return RecordState.UNKNOWN

    def _first_runnable(self, route: Hashable) -> LaneKey | None:
        """The first lane whose head waits for ``route`` and may start; stale entries go.

        An entry is stale when its lane was filed again elsewhere, or its head
        now waits for another route (it is filed there instead): each is
        dropped once, so the cost is amortised over the submits and releases
        that filed it.
        """
        runnable = self._runnable.get(route)
        while runnable:
            lane = runnable[0]
            if self._runnable_route.get(lane) != route:
                runnable.popleft()  # not its live entry
                continue
            head_route = self._lanes[lane][0][1]
            if head_route != route:
                runnable.popleft()
                self._runnable_route[lane] = head_route
                self._runnable.setdefault(head_route, deque()).append(lane)
                continue
            return lane
        return None

    def _count_queued(self, record: Envelope, route: Hashable, home: Hashable, delta: int) -> None:
        self._queued_by_route[route] += delta
        place = (record.topic_partition, home)
        count = self._queued_by_place[place] + delta
        if count:
            self._queued_by_place[place] = count
        else:
            del self._queued_by_place[place]

    def _make_runnable(self, lane: LaneKey) -> None:
        if lane not in self._runnable_route:
            route = self._lanes[lane][0][1]
            self._runnable_route[lane] = route
            self._runnable.setdefault(route, deque()).append(lane)

    def _take_in_flight(self, record: Envelope) -> None:
        if self._in_flight.pop(record.position, None) is None:
            raise ValueError(f"record {record.position} is not in flight")

    def _pop_head(self, record: Envelope) -> None:
        """Remove the in-flight head ``record`` from its lane; the lane moves on."""
        lane = lane_key(record)
        queue = self._lanes[lane]
        queue.popleft()
        self._busy.discard(lane)
        self._orphans.discard(record.position)
        self._per_partition[record.topic_partition] -= 1
        self._forget_partition_if_empty(record.topic_partition)
        if queue:
            self._make_runnable(lane)
        else:
            del self._lanes[lane]

    def _forget_partition_if_empty(self, tp: TopicPartition) -> None:
        if self._per_partition.get(tp, 0) <= 0:
            self._per_partition.pop(tp, None)


def lane_key(record: Envelope) -> LaneKey:
    """The lane of a record: its key, or its own position when it has none."""
    return record.key if record.key is not None else record.position
