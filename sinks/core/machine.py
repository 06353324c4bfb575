"""The sink's decisions, as one pure state machine: events in, actions out. No I/O.

The consumer shell (:mod:`sinks.runtime.sink`) feeds :class:`SinkCore` what
happened - a record consumed, an engine outcome, a park or commit result, an
assignment, a revocation, the passing of time - and carries out the actions
it answers with: :class:`Send`, :class:`Park`, :class:`Pause`,
:class:`Resume`, :class:`Commit`. Everything that decides is here, in one
place, so the whole machine is model-checked (``tests/unit/test_core_model.py``).

**Trouble is judged where it happened**: each engine endpoint has its own
circuit, adaptive window, probe backoff and Retry-After hold, and an answer is
judged at the endpoint of the request that produced it - the table of answers
and judgments and the circuit's transitions are in :mod:`sinks.core.endpoints`,
the window in :mod:`sinks.core.window`. So an engine outage, or one endpoint's
outage, spends no attempt of any record, and other endpoints keep delivering
while one is down.

Invariants (each checked after every step of the model test):

1. **Offsets**: a :class:`Commit` never names an offset past a record that is
   neither delivered nor parked, in that partition (:class:`OffsetWatermark`) -
   but one the parking lot refused alone, with and without its payload: it is
   *skipped* (:meth:`SinkCore.park_refused`: counted, returned for the shell to
   log), never a stalled partition.
   A commit counts only once the broker confirmed it (:meth:`commit_result`);
   a failed or lost commit is sent again.
2. **Per-key order**: records of one key go to the engine one at a time, in
   offset order - also across rebalances: a record still in flight from
   before a revocation is *adopted* when its partition comes back, keeping its
   place at the head of its key's lane (:class:`KeyScheduler`).
3. **Trouble of a route spends nothing** (the judgment above); a record's
   attempts never exceed the answers that blamed it.
4. **Only a record a healthy route rejects spends attempts**: after
   ``inline_attempts`` it is parked; a record that cannot be routed, or
   that the routing marks as bad input, is parked at once and never sent -
   so is one whose reading raised anything at all (classified before it is
   tracked: an exception never leaves an offset pending). Parks go in
   batches of at most :data:`PARK_BATCH_MAX` rows and
   :data:`PARK_BATCH_MAX_BYTES`; a batch the parking lot refuses for what it
   carries is split in halves, down to the record that causes it.
5. **No record is sent after it was parked**; nothing is sent to a route
   whose circuit is OPEN; while a route is HALF_OPEN exactly one probe of it
   is in flight. A route's circuit leaves CLOSED only on trouble of its own,
   and stays out of CLOSED only while something of the route waits.
6. **Bounded state**: nothing is kept for a partition no longer assigned,
   except records whose I/O is still out (orphans), until it returns. Every
   record the core holds for a partition counts - queued, in flight, waiting
   to retry, waiting for or failing to park, and settled records behind a
   lower one not yet settled (the watermark holds them): a partition holding
   more than its share (``max_buffered`` / partitions assigned) pauses, and
   above ``max_buffered`` in all every partition holding anything pauses -
   so at most a fetch batch per partition more is ever held. The same holds
   in bytes (``max_buffered_bytes``, each record's :attr:`Envelope.size`). A
   partition holding a queued record whose own route is not CLOSED pauses
   too, when every route of its records is down: Kafka holds that route's
   backlog (a probe still finds a record of the route, so nothing
   deadlocks); a partition that also carries a route that works keeps
   fetching within its share. A partition whose records can move is not held
   back because another's cannot.
7. **Each route slows to what the engine admits** (:class:`Window`): sends
   of a route stop until a throttled answer's ``Retry-After`` has passed; its
   in-flight limit is halved on a throttled or shared-deadline answer (once
   per round of sends), grows by one per window of deliveries (congestion
   avoidance), and restarts at one after an outage, doubling per window up to
   the level before (slow start) - floor 1, ceiling ``max_in_flight``; all
   routes together never have more than ``max_in_flight`` Sends out.
8. **A stall is visible**: :meth:`SinkCore.stalled_s` is how long nothing
   progressed (a record settled, a commit confirmed) while work waits (records
   held, or a settled offset not yet confirmed by the broker).
9. **Flat cost**: records waiting on a timer are in heaps keyed by their due
   time (one per route for retries, one for parks), runnable lanes in one
   queue per route, and the gauges read counters the core keeps: a step's cost
   does not grow with the number of records held (``make bench``).

Any settled probe that is not trouble of its endpoint closes its circuit; an
endpoint with nothing of it waiting closes rather than saying "down" (see
:mod:`sinks.core.endpoints`). Records that never need the engine (bad input,
ignored types) are settled without ever becoming a probe.
A newly assigned partition always gets an explicit Pause or Resume: the
client may remember a pause from before the partition was revoked.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum

from sinks.core.backoff import Backoff
from sinks.core.delivery import Envelope, KeyScheduler, OffsetWatermark, Position, TopicPartition
from sinks.core.endpoints import (
    EVIDENCE_DELIVERIES,
    Circuit,
    Endpoint,
    EndpointState,
    Trouble,
    judge_trouble,
)
from sinks.core.endpoints import Timer as _Timer
from sinks.core.window import Window

#: Longest a commit may stay unconfirmed before it is sent again (a lost callback).
COMMIT_TIMEOUT_S = 30.0
#: Records one :class:`Park` action carries at most: one round-trip for many rows.
PARK_BATCH_MAX = 500
#: Bytes of records one :class:`Park` carries at most (a record larger goes alone): a
#: batch is one ``jsonb`` document, whose values PostgreSQL caps at 256 MiB, sent in one
#: statement whose time ``statement_timeout`` bounds.
PARK_BATCH_MAX_BYTES = 4 * 1024 * 1024
#: A throttled answer without Retry-After holds new sends this long (the engine gave no hint).
THROTTLE_HOLD_S = 1.0
#: First wait after the parking lot failed; doubles up to :data:`PARK_RETRY_MAX_S`.
PARK_RETRY_S = 0.5
PARK_RETRY_MAX_S = 30.0
#: Longest a record waits before it is sent again (a retry, or a wait for evidence):
#: a record whose route works for others is never left waiting longer than this.
RETRY_WAIT_MAX_S = 30.0
#: Exponents above this are past any cap anyway; keeps ``2**n`` small.
_MAX_EXPONENT = 30
#: The reason prefix of a record whose reading raised (the routing could not say what it is).
UNREADABLE_RECORD = "unreadable record"
#: Characters of an exception's text kept in a parking reason.
_REASON_MAX_CHARS = 200


def _describe(exc: BaseException) -> str:
    """``<class>: <first line of the text>`` (bounded: a reason is a column and a log word)."""
    lines = str(exc).strip().splitlines()
    text = lines[0][:_REASON_MAX_CHARS] if lines else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Disposition(Enum):
    """What the routing says of one record (:class:`Verdict`)."""

    DELIVER = "deliver"  # send it to the engine
    IGNORE = "ignore"  # a type the sink deliberately skips: settled at once
    PARK = "park"  # bad input (no route, malformed, no id): parked at once, never sent


@dataclass(frozen=True, slots=True)
class Verdict:
    """The routing decision for a record; ``reason`` says why for IGNORE and PARK.

    ``endpoint``: the engine route a DELIVER record goes to (its circuit and
    window); records with the same endpoint share them.
    """

    disposition: Disposition
    reason: str = ""
    endpoint: str = ""


class ResultKind(Enum):
    """How one Send ended (the engine client's classification)."""

    DELIVERED = "delivered"  # 2xx
    REJECTED = "rejected"  # a healthy route refused this record (a 4xx about it): spends one
    SERVER_ERROR = "server_error"  # a 5xx: the route's trouble unless evidence blames the record
    UNAVAILABLE = "unavailable"  # the route's trouble (transport, 408, 401/403, ours): never spends
    THROTTLED = "throttled"  # the route sheds load (429, 503 + Retry-After): spends nothing
    UNROUTABLE = "unroutable"  # found unfit for sending only when sent: parked


@dataclass(frozen=True, slots=True)
class Result:
    """A Send's result; ``retry_after_s`` is the engine's Retry-After, if any.

    ``shared``: an UNAVAILABLE that says the route is slow for everyone (the
    request deadline expired), never the record's own failure: the route's
    window is cut. ``endpoint``: the route of the request that ended the
    delivery ("": the route the record was sent to) - a ``users/sync`` made
    for a quiz attempt's unknown user has a route of its own.
    """

    kind: ResultKind
    reason: str = ""
    retry_after_s: float | None = None
    shared: bool = False
    endpoint: str = ""


DELIVERED = Result(ResultKind.DELIVERED)


# -- actions --------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Send:
    """Deliver ``record`` to the engine; answer with :meth:`SinkCore.sent`.

    ``endpoint``: the route it is sent to (whose window and circuit it counts in).
    """

    record: Envelope
    probe: bool = False
    endpoint: str = ""


@dataclass(frozen=True, slots=True)
class ParkItem:
    """One record to park, why, and how many attempts it already spent.

    ``stub``: the parking lot refused the record's own row (alone): write a row
    without its payload, naming where the record is in Kafka (``reason`` says why).
    """

    record: Envelope
    reason: str
    attempts: int
    stub: bool = False


@dataclass(frozen=True, slots=True)
class Park:
    """Write these rows to the parking lot in one go; answer with parked / park_failed."""

    items: tuple[ParkItem, ...]


@dataclass(frozen=True, slots=True)
class Pause:
    """Stop fetching these partitions (the consumer keeps polling: group membership holds)."""

    partitions: tuple[TopicPartition, ...]


@dataclass(frozen=True, slots=True)
class Resume:
    """Fetch these partitions again."""

    partitions: tuple[TopicPartition, ...]


@dataclass(frozen=True, slots=True)
class Commit:
    """Commit these (topic, partition, next offset); answer with :meth:`SinkCore.commit_result`."""

    offsets: tuple[tuple[str, int, int], ...]


Action = Send | Park | Pause | Resume | Commit


class Phase(Enum):
    """Where a record taken from its key's lane stands (it holds the lane meanwhile)."""

    SENDING = "sending"  # a Send is out; waits for sent()
    RETRY_WAIT = "retry_wait"  # waits to be sent again at `due` (a retry, or for evidence)
    PARKING = "parking"  # a Park is out; waits for parked() / park_failed()
    PARK_WAIT = "park_wait"  # the parking lot failed; parked again at `due`
    PARK_QUEUED = "park_queued"  # waits for room in a Park batch


@dataclass(slots=True)
class _Flight:
    """A record taken out of the queue: in a lane (``laned``) or parked straight away."""

    record: Envelope
    generation: int  # the assignment generation whose watermark it settles
    laned: bool  # holds its key's lane (a routable record) - else a bad-input record
    phase: Phase
    route: str = ""  # the route it waits for / was last judged at
    sent_on: str = ""  # the route its last Send counted in
    due: float = 0.0
    timer: int = 0  # its live entry in a timer heap (older entries are stale)
    attempts: int = 0  # spent: answers that blamed it
    strikes: int = 0  # unspent failures while its route worked for others (backoff only)
    mark: tuple[int, int] | None = None  # a 5xx awaiting evidence: (deliveries, openings)
    sent_tick: int = 0  # the core's tick when sent: "delivered since" compares to it
    sent_seq: int = 0  # the Send's number (one cut of a window per round of sends)
    probe: bool = False
    reason: str = ""
    park_failures: int = 0
    #: the largest Park batch it may go in (halved each time a batch of it was refused)
    park_cap: int = PARK_BATCH_MAX
    park_stub: bool = False  # its own row was refused alone: parked without its payload


@dataclass(slots=True)
class _Partition:
    """What the sink holds for one assigned partition in one assignment generation."""

    generation: int
    watermark: OffsetWatermark = field(default_factory=OffsetWatermark)
    timestamps: dict[int, int] = field(default_factory=dict)  # pending offset -> ts (ms)
    last_offset: int | None = None  # highest offset taken in (ignore re-fetches)
    committed: int | None = None  # the broker confirmed this commit
    committing: int | None = None  # a Commit of this offset is out
    commit_sent_at: float = 0.0
    #: the engine routes of the records taken in this generation (bounded by the routing
    #: table): a partition known to carry a route that works is not paused for another's
    routes: set[str] = field(default_factory=set)


class SinkCore:
    """See the module docstring. Methods named for events; :meth:`actions` is the timer.

    ``backoff`` makes one probe :class:`Backoff` per route (each route backs off alone).
    """

    def __init__(
        self,
        *,
        max_in_flight: int,
        max_buffered: int,
        inline_attempts: int,
        inline_backoff_s: float,
        backoff: Callable[[], Backoff],
        commit_interval_s: float,
        classify: Callable[[Envelope], Verdict],
        max_buffered_bytes: int | None = None,
    ) -> None:
        if inline_attempts < 1:
            raise ValueError("inline_attempts must be at least 1")
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self._scheduler = KeyScheduler(max_in_flight=None)  # the routes' windows bound sends
        self._max_in_flight = max_in_flight
        self._max_buffered = max_buffered
        self._max_buffered_bytes = max_buffered_bytes
        self._inline_attempts = inline_attempts
        self._inline_backoff_s = inline_backoff_s
        self._new_backoff = backoff
        self._commit_interval_s = commit_interval_s
        self._classify = classify
        self._parts: dict[TopicPartition, _Partition] = {}
        self._generation = 0
        self._flights: dict[Position, _Flight] = {}  # taken out of the queue, not settled
        self._orphans: set[Position] = set()  # flights of partitions no longer ours, I/O out
        #: attempts and strikes of records back in their lane (kept for when they go again)
        self._carry: dict[Position, tuple[int, int]] = {}
        self._park_queue: deque[Position] = deque()  # PARK_QUEUED flights, in order
        self._park_timers: list[_Timer] = []  # PARK_WAIT flights, by due
        self._timers = 0  # timer entries ever made
        self._endpoints: dict[str, Endpoint] = {}
        self._rotation = 0  # which route starts its sends first (fair share of max_in_flight)
        self._paused: set[TopicPartition] = set()
        self._unsynced: set[TopicPartition] = set()  # assigned since the last Pause/Resume
        self._sending = 0  # Sends out, every route
        self._send_seq = 0  # Sends ever made
        self._tick = 0  # moves on every delivery: "delivered since it was sent"
        #: Attempts spent, ever (answers that blamed their record).
        self.attempts_spent = 0
        #: Records the parking lot refused even without their payload: settled unparked.
        self.parks_skipped = 0
        self._progress = 0  # records settled + commits confirmed, ever
        self._progress_seen = -1
        self._progress_at: float | None = None
        self._last_commit_at: float | None = None
        self._stopping = False

    # -- events -------------------------------------------------------------------
    def assign(self, partitions: Iterable[TopicPartition]) -> None:
        """Partitions assigned to this member (a new generation for each)."""
        for tp in partitions:
            if tp in self._parts:
                continue
            self._generation += 1
            self._parts[tp] = _Partition(self._generation)
            self._unsynced.add(tp)

    def revoke(
        self, partitions: Iterable[TopicPartition], *, lost: bool = False
    ) -> list[tuple[str, int, int]]:
        """Partitions taken away; returns the offsets to commit before letting go.

        ``lost`` (the member was thrown out of the group): nothing may be
        committed. Queued records of the partitions are forgotten; records
        whose I/O is out become orphans; records waiting on a timer are dropped.
        """
        final: list[tuple[str, int, int]] = []
        dropped = False
        for tp in partitions:
            part = self._parts.pop(tp, None)
            if part is None:
                continue
            offset = part.watermark.committable
            if (
                not lost
                and offset is not None
                and (part.committed is None or offset > part.committed)
            ):
                final.append((tp[0], tp[1], offset))
            self._drop_waiting(tp)
            for record in self._scheduler.drop_partition(*tp):
                self._carry.pop(record.position, None)
            self._paused.discard(tp)
            dropped = True
        if dropped:
            self._compact_timers()
        return final

    def consumed(self, record: Envelope, *, now_ms: int) -> Verdict | None:
        """A record fetched from Kafka; returns its routing verdict (None: not taken).

        ``now_ms`` dates a record without a timestamp (oldest-age gauge).
        """
        part = self._parts.get(record.topic_partition)
        if part is None or (part.last_offset is not None and record.offset <= part.last_offset):
            return None  # not (or no longer) ours, or a re-fetch of what we hold
        verdict = self._verdict(record)  # first: nothing is tracked that cannot be settled
        part.last_offset = record.offset
        part.watermark.track(record.offset, record.size)
        part.timestamps[record.offset] = record.timestamp_ms or now_ms
        if verdict.disposition is Disposition.IGNORE:
            self._done(record, part.generation)
            return verdict
        orphan = self._flights.get(record.position)
        if orphan is not None:  # in flight from before a revocation: the same record
            self._adopt(orphan, part.generation)
            return verdict
        if verdict.disposition is Disposition.PARK:
            self._flights[record.position] = _Flight(
                record, part.generation, laned=False, phase=Phase.PARK_QUEUED, reason=verdict.reason
            )
            self._park_queue.append(record.position)
        else:
            route = self._endpoint(verdict.endpoint).name
            part.routes.add(route)
            self._scheduler.submit(record, route)
        return verdict

    def _verdict(self, record: Envelope) -> Verdict:
        """The routing's verdict; whatever the routing raises while reading the record
        (a ``RecursionError`` as well as a ``ValueError``) makes it bad input: parked."""
        try:
            return self._classify(record)
        except Exception as exc:  # any failure to read a record is the record's own
            return Verdict(Disposition.PARK, f"{UNREADABLE_RECORD}: {_describe(exc)}")

    def sent(self, record: Envelope, outcome: Result, *, now: float) -> None:
        """A Send ended with ``outcome``: judged at the route it happened (module docstring)."""
        flight = self._flights.get(record.position)
        if flight is None or flight.phase is not Phase.SENDING:
            raise ValueError(f"record {record.position} has no Send out")
        sent_on = self._endpoints[flight.sent_on]
        sent_on.sending -= 1
        self._sending -= 1
        probe, flight.probe = flight.probe, False
        where = self._endpoint(outcome.endpoint) if outcome.endpoint else sent_on
        kind = outcome.kind
        if probe:
            sent_on.probe_out = False
            self._probe_answered(sent_on, where, kind, now=now)
        flight.route = where.name
        if kind is ResultKind.DELIVERED:
            self._tick += 1
            where.deliveries += 1
            where.last_delivery_tick = self._tick
            sent_on.window.delivered()
            self._settle(flight)
        elif kind is ResultKind.UNROUTABLE:
            self._to_park(flight, outcome.reason)
        elif kind is ResultKind.REJECTED:
            self._rejected(flight, outcome.reason, now=now)
        else:
            self._route_trouble(flight, where, outcome, now=now, probe=probe and where is sent_on)

    def parked(self, record: Envelope) -> None:
        """The parking lot holds ``record``'s row: it is done."""
        flight = self._flights.get(record.position)
        if flight is None or flight.phase is not Phase.PARKING:
            raise ValueError(f"record {record.position} has no Park out")
        self._settle(flight)

    def park_failed(self, record: Envelope, *, now: float) -> None:
        """The parking lot could not take ``record``: park it again after a growing wait."""
        flight = self._flights.get(record.position)
        if flight is None or flight.phase is not Phase.PARKING:
            raise ValueError(f"record {record.position} has no Park out")
        if self._forget_if_orphan(flight):
            return
        flight.park_failures += 1
        flight.phase = Phase.PARK_WAIT
        exponent = min(flight.park_failures - 1, _MAX_EXPONENT)
        flight.due = now + min(PARK_RETRY_MAX_S, PARK_RETRY_S * 2**exponent)
        heapq.heappush(self._park_timers, self._timer(flight))

    def park_refused(self, records: list[Envelope], error: str) -> list[ParkItem]:
        """The parking lot refused these records' batch for what it carries (not an outage:
        a value too large, a statement timeout): it is split in halves, down to the record
        that causes it. A record refused alone is parked once more without its payload
        (a row naming its place in Kafka); refused even so, it is *skipped* - settled
        unparked, returned for the shell to log and count - never a stalled partition."""
        flights = []
        for record in records:
            flight = self._flights.get(record.position)
            if flight is None or flight.phase is not Phase.PARKING:
                raise ValueError(f"record {record.position} has no Park out")
            flights.append(flight)
        cap = max(1, (len(flights) + 1) // 2)
        skipped: list[ParkItem] = []
        requeue: list[Position] = []
        for flight in flights:
            if self._forget_if_orphan(flight):
                continue
            if len(flights) == 1 and flight.park_stub:
                skipped.append(ParkItem(flight.record, f"{flight.reason}; {error}", 0))
                self.parks_skipped += 1
                self._settle(flight)
                continue
            if len(flights) == 1:
                flight.park_stub = True
                flight.reason = f"{flight.reason}; the parking lot refused the record: {error}"
            flight.park_cap = min(flight.park_cap, cap)
            flight.phase = Phase.PARK_QUEUED
            requeue.append(flight.record.position)
        self._park_queue.extendleft(reversed(requeue))  # first again, in their order
        return skipped

    def commit_result(self, topic: str, partition: int, offset: int, *, ok: bool) -> None:
        """The broker answered a Commit of ``offset``; a failed one is sent again."""
        part = self._parts.get((topic, partition))
        if part is None:
            return
        if part.committing == offset:
            part.committing = None
        if ok and (part.committed is None or offset > part.committed):
            part.committed = offset
            self._progress += 1

    def stop(self) -> None:
        """Shutting down: take and send nothing new; what is out may still finish."""
        self._stopping = True

    # -- the timer: what to do now ------------------------------------------------------
    def actions(self, *, now: float) -> list[Action]:
        """Every action due at ``now``, in the order to carry them out."""
        out: list[Action] = []
        if self._progress != self._progress_seen or not self._work_waiting():
            self._progress_seen = self._progress
            self._progress_at = now
        self._close_idle_circuits()
        if not self._stopping:
            self._start_sends(out, now)
            self._start_parks(out, now)
        self._pause_or_resume(out)
        commit = self._due_commit(now)
        if commit is not None:
            out.append(commit)
        return out

    def next_due(self) -> float | None:
        """The earliest time :meth:`actions` may have something new without another event."""
        times: list[float] = []
        if self._last_commit_at is not None:
            times.append(self._last_commit_at + self._commit_interval_s)
        if not self._stopping:
            global_room = self._max_in_flight - self._sending > 0
            for route in self._endpoints.values():
                times += self._route_due(route, global_room=global_room)
            if self._park_timers:  # (a stale entry only wakes the loop early)
                times.append(self._park_timers[0][0])
        return min(times) if times else None

    def _route_due(self, route: Endpoint, *, global_room: bool) -> list[float]:
        """When ``route`` may send next without another event (empty: an event decides)."""
        if not global_room:
            return []  # a Send's answer makes room: an event, not a timer
        due = self._peek_retry(route)
        if route.circuit is Circuit.CLOSED:
            if route.window.limit <= route.sending:
                return []
            hold = route.hold_until  # a throttled route's Retry-After delays every Send
            times = [] if due is None else [max(due, hold)]
            if hold and self._scheduler.can_start(route.name):
                times.append(hold)
            return times
        if route.circuit is Circuit.OPEN:
            # The probe goes when it is due *and* a record of the route can go.
            times = [route.next_probe_at] if self._scheduler.can_start(route.name) else []
            return times if due is None else [*times, max(due, route.next_probe_at)]
        return []

    def final_commits(self) -> list[tuple[str, int, int]]:
        """At shutdown: every partition's settled offset not yet confirmed by the broker."""
        out = []
        for (topic, partition), part in self._parts.items():
            offset = part.watermark.committable
            if offset is not None and (part.committed is None or offset > part.committed):
                out.append((topic, partition, offset))
        return out

    # -- queries ------------------------------------------------------------------
    @property
    def partitions(self) -> list[TopicPartition]:
        """The assigned partitions."""
        return list(self._parts)

    @property
    def paused(self) -> frozenset[TopicPartition]:
        """The partitions paused by the last Pause/Resume actions."""
        return frozenset(self._paused)

    @property
    def in_flight(self) -> int:
        """Records taken out of their queue and not yet settled (sending, waiting, parking)."""
        return len(self._flights)

    @property
    def sending(self) -> int:
        """Engine requests out right now (every route)."""
        return self._sending

    @property
    def queued(self) -> int:
        """Records waiting for their key's turn, their route or a free slot."""
        return self._scheduler.queued

    @property
    def held(self) -> int:
        """Records held in memory, in every phase: what every partition's watermark holds
        (pending, and settled behind a pending one) plus orphans. Partitions, not records,
        are counted through: O(partitions)."""
        held = len(self._orphans)
        for part in self._parts.values():
            held += part.watermark.held
        return held

    @property
    def held_bytes(self) -> int:
        """Bytes of the records :attr:`held` counts (O(partitions + orphans))."""
        held = sum(self._flights[p].record.size for p in self._orphans if p in self._flights)
        for part in self._parts.values():
            held += part.watermark.held_bytes
        return held

    def held_bytes_for(self, topic: str, partition: int) -> int:
        """Bytes of the records held for one partition."""
        part = self._parts.get((topic, partition))
        return 0 if part is None else part.watermark.held_bytes

    def held_for(self, topic: str, partition: int) -> int:
        """Records held for one partition (pending, and settled behind a pending one)."""
        part = self._parts.get((topic, partition))
        return 0 if part is None else part.watermark.held

    def needs_pause(self) -> bool:
        """True when a partition not yet paused holds more than it may (pause it now)."""
        return bool(self._want_paused() - self._paused)

    def _want_paused(self) -> set[TopicPartition]:
        """Partitions that must not fetch: all when stopping; one holding a queued record
        whose own route is down, when every route its records go to is down (Kafka holds
        that route's backlog - not a record that waits for another route's call, a quiz
        attempt's user sync: its route works; and a partition that also carries a route
        that works keeps fetching, within its share, so that route's later events still
        go out); one
        holding more than its share; and, while all together hold more than
        ``max_buffered``, every one that holds anything (one holding nothing may fetch:
        its records can move)."""
        if self._stopping:
            return set(self._parts)
        over = self.held > self._max_buffered or self._over_bytes(self.held_bytes)
        share, byte_share = self.buffer_share, self.buffer_share_bytes
        down = {r.name for r in self._endpoints.values() if r.circuit is not Circuit.CLOSED}
        return {
            tp
            for tp, part in self._parts.items()
            if part.watermark.held > share
            or (byte_share is not None and part.watermark.held_bytes > byte_share)
            or (over and part.watermark.held > 0)
            or (part.routes <= down and any(self._scheduler.queued_in(*tp, r) for r in down))
        }

    def _over_bytes(self, held_bytes: int) -> bool:
        return self._max_buffered_bytes is not None and held_bytes > self._max_buffered_bytes

    @property
    def max_buffered(self) -> int:
        """Records held, all partitions together, above which every one holding any pauses."""
        return self._max_buffered

    @property
    def buffer_share(self) -> int:
        """What one partition may hold before it pauses: ``max_buffered`` / partitions."""
        return max(1, self._max_buffered // max(1, len(self._parts)))

    @property
    def buffer_share_bytes(self) -> int | None:
        """Bytes one partition may hold before it pauses (None: no byte bound)."""
        if self._max_buffered_bytes is None:
            return None
        return max(1, self._max_buffered_bytes // max(1, len(self._parts)))

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def circuit(self) -> Circuit:
        """CLOSED while every route's circuit is; else the first other route's state."""
        for route in self._endpoints.values():
            if route.circuit is not Circuit.CLOSED:
                return route.circuit
        return Circuit.CLOSED

    @property
    def circuit_reason(self) -> str:
        """Why routes are not CLOSED: ``<endpoint>: <trouble>``, ``; ``-joined."""
        return "; ".join(
            f"{route.name or 'engine'}: {route.reason}"
            for route in self._endpoints.values()
            if route.circuit is not Circuit.CLOSED
        )

    def circuit_of(self, endpoint: str) -> Circuit:
        """The circuit of one route (CLOSED for a route never used)."""
        route = self._endpoints.get(endpoint)
        return Circuit.CLOSED if route is None else route.circuit

    def window_of(self, endpoint: str) -> Window:
        """The adaptive window of one route (a full one for a route never used)."""
        route = self._endpoints.get(endpoint)
        return Window(self._max_in_flight) if route is None else route.window

    def throttled_until(self, endpoint: str) -> float:
        """No new Send to ``endpoint`` before this monotonic time (0: none held)."""
        route = self._endpoints.get(endpoint)
        return 0.0 if route is None else route.hold_until

    def endpoints(self) -> list[EndpointState]:
        """Every route used so far, as it stands (O(routes): the routing table bounds them)."""
        return [
            EndpointState(
                endpoint=r.name,
                circuit=r.circuit,
                reason=r.reason,
                window=r.window.limit,
                sending=r.sending,
                waiting=self._scheduler.queued_for(r.name),
            )
            for r in self._endpoints.values()
        ]

    def stalled_s(self, now: float) -> float:
        """Seconds without progress (a record settled, a commit confirmed) while work waits.

        0 while nothing waits. As of the last :meth:`actions` call and ``now``.
        """
        if self._progress_at is None or not self._work_waiting():
            return 0.0
        return max(0.0, now - self._progress_at)

    def _work_waiting(self) -> bool:
        if self._flights or self._scheduler.queued:
            return True
        return any(
            p.watermark.committable is not None
            and (p.committed is None or p.watermark.committable > p.committed)
            for p in self._parts.values()
        )

    def held_positions(self) -> set[Position]:
        """Every position the core holds (queued or taken out) - the bounded-state check."""
        return self._scheduler.queued_positions() | set(self._flights)

    def footprint(self) -> int:
        """Entries kept across every per-record container: bounded by what is assigned."""
        per_partition = sum(len(p.timestamps) + p.watermark.held for p in self._parts.values())
        timers = len(self._park_timers) + sum(len(r.retries) for r in self._endpoints.values())
        return (
            self._scheduler.pending
            + len(self._flights)
            + len(self._park_queue)
            + len(self._carry)
            + timers
            + per_partition
        )

    def orphan_positions(self) -> set[Position]:
        """Taken-out records of partitions no longer assigned (their I/O is out)."""
        return set(self._orphans)

    def committable(self, topic: str, partition: int) -> int | None:
        """The partition's settled offset (every record below it delivered or parked)."""
        part = self._parts.get((topic, partition))
        return None if part is None else part.watermark.committable

    def committed(self, topic: str, partition: int) -> int | None:
        """The last commit the broker confirmed for the partition in this assignment."""
        part = self._parts.get((topic, partition))
        return None if part is None else part.committed

    def oldest_pending_timestamp_ms(self) -> int | None:
        """Timestamp of the oldest record not yet delivered or parked (oldest-age gauge)."""
        oldest: int | None = None
        for part in self._parts.values():
            offset = part.watermark.oldest_pending
            if offset is not None:
                ts = part.timestamps.get(offset)
                if ts is not None and (oldest is None or ts < oldest):
                    oldest = ts
        return oldest

    def probe_in_flight(self) -> bool:
        """True while a probe's Send is out (of any route)."""
        return any(route.probe_out for route in self._endpoints.values())

    # -- routes -----------------------------------------------------------------------
    def _endpoint(self, endpoint: str) -> Endpoint:
        route = self._endpoints.get(endpoint)
        if route is None:
            route = self._endpoints[endpoint] = Endpoint(
                endpoint, backoff=self._new_backoff(), window=Window(self._max_in_flight)
            )
        return route

    def _probe_answered(
        self, route: Endpoint, where: Endpoint, kind: ResultKind, *, now: float
    ) -> None:
        """``route``'s probe ended; ``where`` is the route whose request ended it.

        A 2xx or a 4xx by the route itself is an answer of a healthy route:
        CLOSED. An answer that says nothing about the route (the probe found
        unfit only when sent, or ended by another route's request): OPEN with
        the next probe due at once. Trouble of the route itself is left to
        :meth:`_route_trouble` (OPEN, longer backoff).
        """
        if where is not route or kind is ResultKind.UNROUTABLE:
            route.open(route.reason, now=now, delay_s=0.0)
        elif kind not in _ROUTE_TROUBLE:
            route.close()

    def _route_trouble(
        self, flight: _Flight, route: Endpoint, outcome: Result, *, now: float, probe: bool
    ) -> None:
        """An answer that says nothing about the record: trouble of ``route``
        (:func:`~sinks.core.endpoints.judge_trouble`), carried out."""
        trouble = judge_trouble(
            route,
            probe=probe,
            throttled=outcome.kind is ResultKind.THROTTLED,
            shared=outcome.shared,
            sent_tick=flight.sent_tick,
            strikes=flight.strikes,
        )
        if trouble is Trouble.PROBE_FAILED:
            route.failed_probe = flight.record.position
            self._hold(flight)
            route.down(outcome.reason, outcome.retry_after_s, now=now)
        elif trouble is Trouble.STALE:
            self._hold(flight)
        elif trouble is Trouble.THROTTLED:
            self._slow_down(route, flight, now + (outcome.retry_after_s or THROTTLE_HOLD_S))
        elif trouble is Trouble.DOWN:
            flight.strikes += 1
            self._hold(flight)
            route.down(outcome.reason, outcome.retry_after_s, now=now)
        elif trouble is Trouble.SHARED:
            self._slow_down(route, flight, now + (outcome.retry_after_s or 0.0))
        else:  # a blip, or a 5xx of this record's own - it waits; only evidence makes the
            # 5xx an attempt
            flight.strikes += 1
            flight.reason = outcome.reason
            is_5xx = outcome.kind is ResultKind.SERVER_ERROR
            flight.mark = (route.deliveries, route.openings) if is_5xx else None
            self._wait(flight, route, now=now)

    def _close_idle_circuits(self) -> None:
        """An OPEN route with nothing of it waiting closes: there is nothing to probe it
        with (its records were revoked, or its probe was delivered by another route), and
        nothing of it is held back - readiness and the gauges must not say it is down.
        Its next record goes as an ordinary Send; trouble opens it again. O(routes)."""
        for route in self._endpoints.values():
            if route.circuit is Circuit.OPEN and not self._waits_for(route):
                route.close()

    def _waits_for(self, route: Endpoint) -> bool:
        """Something of ``route`` waits: Sends out on it, records queued for it (heads of
        their lanes and the records behind them), or records waiting to be sent again."""
        return bool(
            route.sending
            or self._scheduler.queued_for(route.name)
            or self._peek_retry(route) is not None
        )

    # -- sends ----------------------------------------------------------------------
    def _start_sends(self, out: list[Action], now: float) -> None:
        routes = list(self._endpoints.values())
        if not routes:
            return
        first = self._rotation % len(routes)  # each route takes the first turn in turn
        self._rotation += 1
        for route in routes[first:] + routes[:first]:
            if route.circuit is Circuit.CLOSED:
                self._send_closed(route, out, now)
            elif route.circuit is Circuit.OPEN and now >= route.next_probe_at:
                self._send_probe(route, out, now)

    def _send_closed(self, route: Endpoint, out: list[Action], now: float) -> None:
        if now < route.hold_until:
            return  # the route asked us to wait (Retry-After)
        route.hold_until = 0.0
        while self._room(route) > 0:
            flight = self._pop_due_retry(route, now)
            if flight is None:
                break
            if self._confirmed(flight, route):
                out.append(self._send(flight, route, probe=False))
        room = self._room(route)
        if room > 0:
            for record in self._scheduler.ready(limit=room, route=route.name):
                out.append(self._send(self._take(record, route), route, probe=False))

    def _send_probe(self, route: Endpoint, out: list[Action], now: float) -> None:
        """One record tests the route: one that never failed alone first (a *suspect*, a
        record that failed while the route worked, or the route's last failed probe, may
        be what breaks it - a payload that crashes the engine), then a due retry."""
        if self._max_in_flight - self._sending <= 0:
            return
        head = self._scheduler.peek(route.name)
        if head is not None and (
            self._carry.get(head.position, (0, 0))[1] or head.position == route.failed_probe
        ):
            due = self._peek_retry(route)
            retry = None if due is None or due > now else self._live_retry(route)
            if retry is not None and not retry.strikes:
                head = None  # a retry that never failed alone probes instead
        probe = None
        if head is not None:
            probe = self._take(self._scheduler.ready(limit=1, route=route.name)[0], route)
        while probe is None:
            retry = self._pop_due_retry(route, now)
            if retry is None:
                return
            if self._confirmed(retry, route):
                probe = retry
        route.circuit = Circuit.HALF_OPEN
        out.append(self._send(probe, route, probe=True))

    def _room(self, route: Endpoint) -> int:
        """Sends the route's window, and all routes' bound together, admit now."""
        return max(0, min(route.window.limit - route.sending, self._max_in_flight - self._sending))

    def _take(self, record: Envelope, route: Endpoint) -> _Flight:
        part = self._parts[record.topic_partition]
        flight = _Flight(record, part.generation, laned=True, phase=Phase.SENDING, route=route.name)
        flight.attempts, flight.strikes = self._carry.pop(record.position, (0, 0))
        self._flights[record.position] = flight
        return flight

    def _send(self, flight: _Flight, route: Endpoint, *, probe: bool) -> Send:
        flight.phase = Phase.SENDING
        flight.probe = probe
        flight.route = flight.sent_on = route.name
        flight.sent_tick = self._tick
        flight.sent_seq = self._send_seq
        self._send_seq += 1
        route.sending += 1
        self._sending += 1
        if probe:
            route.probe_out = True
        return Send(flight.record, probe=probe, endpoint=route.name)

    def _rejected(self, flight: _Flight, reason: str, *, now: float) -> None:
        """A 4xx about the record: one attempt spent; parked after ``inline_attempts``."""
        flight.attempts += 1
        self.attempts_spent += 1
        if self._forget_if_orphan(flight):
            return
        if flight.attempts >= self._inline_attempts:
            self._to_park(flight, f"{reason} (after {flight.attempts} attempts)")
            return
        flight.reason = reason
        flight.mark = None
        self._wait(flight, self._endpoints[flight.route], now=now)

    def _wait(self, flight: _Flight, route: Endpoint, *, now: float) -> None:
        """The record waits (taken out, its lane held) to be sent again to ``route``."""
        if self._forget_if_orphan(flight):
            return
        exponent = min(flight.attempts + flight.strikes - 1, _MAX_EXPONENT)
        flight.phase = Phase.RETRY_WAIT
        flight.due = now + min(RETRY_WAIT_MAX_S, self._inline_backoff_s * 2**exponent)
        heapq.heappush(route.retries, self._timer(flight))

    def _confirmed(self, flight: _Flight, route: Endpoint) -> bool:
        """A due record's 5xx mark is judged: False when it was parked instead of sent.

        The mark becomes a spent attempt only if ``route`` delivered
        :data:`EVIDENCE_DELIVERIES` others since, and was not judged down in
        between; else it is forgotten (it said nothing about the record).
        """
        mark, flight.mark = flight.mark, None
        if mark is None:
            return True
        deliveries, openings = mark
        if route.openings != openings or route.deliveries < deliveries + EVIDENCE_DELIVERIES:
            return True
        flight.attempts += 1
        self.attempts_spent += 1
        if flight.attempts < self._inline_attempts:
            return True
        self._to_park(
            flight,
            f"{flight.reason}, while {route.name or 'its route'} delivered other records"
            f" (after {flight.attempts} attempts)",
        )
        return False

    def _hold(self, flight: _Flight) -> None:
        """Back to the head of its lane, unspent, waiting for its route (its history kept)."""
        if (flight.attempts or flight.strikes) and not self._is_orphan(flight):
            self._carry[flight.record.position] = (flight.attempts, flight.strikes)
        self._drop_flight(flight)
        self._scheduler.release(flight.record, flight.route)  # an orphan is forgotten by it

    def _slow_down(self, route: Endpoint, flight: _Flight, hold_until: float) -> None:
        """The route admits less than we send: unspent back to its lane, fewer at once.

        The window is cut once per round: answers to Sends made before the last
        cut are the same congestion, already answered.
        """
        self._hold(flight)
        if flight.sent_seq >= route.cut_seq:
            route.window.cut()
            route.cut_seq = self._send_seq
        route.hold_until = max(route.hold_until, hold_until)

    # -- timers ---------------------------------------------------------------------
    def _timer(self, flight: _Flight) -> _Timer:
        self._timers += 1
        flight.timer = self._timers
        return (flight.due, self._timers, flight.record.position)

    def _live(self, entry: _Timer, phase: Phase) -> _Flight | None:
        flight = self._flights.get(entry[2])
        if flight is None or flight.phase is not phase or flight.timer != entry[1]:
            return None
        return flight

    def _peek_retry(self, route: Endpoint) -> float | None:
        """The due time of the route's first live retry (stale entries are dropped)."""
        heap = route.retries
        while heap:
            if self._live(heap[0], Phase.RETRY_WAIT) is not None:
                return heap[0][0]
            heapq.heappop(heap)
        return None

    def _live_retry(self, route: Endpoint) -> _Flight | None:
        """The route's first live retry (after :meth:`_peek_retry`), left in place."""
        return self._live(route.retries[0], Phase.RETRY_WAIT) if route.retries else None

    def _pop_due_retry(self, route: Endpoint, now: float) -> _Flight | None:
        due = self._peek_retry(route)
        if due is None or due > now:
            return None
        return self._live(heapq.heappop(route.retries), Phase.RETRY_WAIT)

    def _compact_timers(self) -> None:
        """After a revocation: heaps without the entries of records no longer held."""
        for route in self._endpoints.values():
            route.retries = [e for e in route.retries if self._live(e, Phase.RETRY_WAIT)]
            heapq.heapify(route.retries)
        self._park_timers = [e for e in self._park_timers if self._live(e, Phase.PARK_WAIT)]
        heapq.heapify(self._park_timers)

    # -- parks ----------------------------------------------------------------------
    def _to_park(self, flight: _Flight, reason: str) -> None:
        if self._forget_if_orphan(flight):
            return
        flight.phase = Phase.PARK_QUEUED
        flight.reason = reason
        self._park_queue.append(flight.record.position)

    def _start_parks(self, out: list[Action], now: float) -> None:
        timers = self._park_timers
        while timers and timers[0][0] <= now:
            flight = self._live(heapq.heappop(timers), Phase.PARK_WAIT)
            if flight is not None:
                flight.phase = Phase.PARK_QUEUED
                self._park_queue.append(flight.record.position)
        while self._park_queue:
            out.append(self._park_batch())

    def _park_batch(self) -> Park:
        """The next records of the park queue, within :data:`PARK_BATCH_MAX` rows,
        :data:`PARK_BATCH_MAX_BYTES` (one record at least) and every record's cap."""
        items: list[ParkItem] = []
        cap, size = PARK_BATCH_MAX, 0
        while self._park_queue:
            flight = self._flights[self._park_queue[0]]
            cap = min(cap, flight.park_cap)
            if items and (len(items) >= cap or size + flight.record.size > PARK_BATCH_MAX_BYTES):
                break
            self._park_queue.popleft()
            flight.phase = Phase.PARKING
            size += flight.record.size
            items.append(ParkItem(flight.record, flight.reason, flight.attempts, flight.park_stub))
        return Park(tuple(items))

    # -- settling ---------------------------------------------------------------------
    def _settle(self, flight: _Flight) -> None:
        """Delivered or parked: the lane moves on, the watermark too (if still ours)."""
        self._drop_flight(flight)
        if flight.laned:
            self._scheduler.finish(flight.record)
        self._progress += 1
        self._done(flight.record, flight.generation)

    def _done(self, record: Envelope, generation: int) -> None:
        part = self._parts.get(record.topic_partition)
        if part is not None and part.generation == generation:
            part.watermark.done(record.offset)
            part.timestamps.pop(record.offset, None)

    def _drop_flight(self, flight: _Flight) -> None:
        position = flight.record.position
        del self._flights[position]
        self._orphans.discard(position)

    def _adopt(self, flight: _Flight, generation: int) -> None:
        """The orphan's partition came back: it settles the new generation's offset."""
        flight.generation = generation
        self._orphans.discard(flight.record.position)
        if flight.laned:
            self._scheduler.submit(flight.record)  # adopted: keeps its place in its lane

    def _is_orphan(self, flight: _Flight) -> bool:
        part = self._parts.get(flight.record.topic_partition)
        return part is None or part.generation != flight.generation

    def _forget_if_orphan(self, flight: _Flight) -> bool:
        """An orphan that is not done: drop it - its partition's new owner delivers it."""
        if not self._is_orphan(flight):
            return False
        self._drop_flight(flight)
        if flight.laned:
            self._scheduler.finish(flight.record)
        return True

    def _drop_waiting(self, tp: TopicPartition) -> None:
        """A revoked partition's records with no I/O out are forgotten now; the rest orphans."""
        for position, flight in list(self._flights.items()):
            if flight.record.topic_partition != tp:
                continue
            if flight.phase in _IO_OUT:
                self._orphans.add(position)
                continue
            self._drop_flight(flight)
            if flight.laned:
                self._scheduler.finish(flight.record)
        self._park_queue = deque(p for p in self._park_queue if p in self._flights)

    # -- pausing and committing ----------------------------------------------------------
    def _pause_or_resume(self, out: list[Action]) -> None:
        """Pause what holds too much (its share, or all together too much); resume the rest."""
        want = self._want_paused()
        unsynced, self._unsynced = self._unsynced, set()
        fresh = tuple(tp for tp in self._parts if tp in want and tp not in self._paused)
        if fresh:
            self._paused.update(fresh)
            out.append(Pause(fresh))
        # A newly assigned partition is resumed explicitly: the client may still
        # hold it paused from before it was revoked (librdkafka keeps a
        # partition's pause across a revoke and a re-assign).
        resumed = (self._paused - want) | ((unsynced & self._parts.keys()) - want)
        if resumed:
            self._paused -= resumed
            out.append(Resume(tuple(sorted(resumed))))

    def _due_commit(self, now: float) -> Commit | None:
        last = self._last_commit_at
        if last is not None and now < last + self._commit_interval_s:  # as next_due() says
            return None
        self._last_commit_at = now
        offsets = []
        for (topic, partition), part in self._parts.items():
            offset = part.watermark.committable
            if offset is None or (part.committed is not None and offset <= part.committed):
                continue
            if part.committing is not None and now - part.commit_sent_at < COMMIT_TIMEOUT_S:
                continue  # one commit out per partition; its answer comes first
            part.committing = offset
            part.commit_sent_at = now
            offsets.append((topic, partition, offset))
        return Commit(tuple(offsets)) if offsets else None


#: Phases whose I/O is out: the record stays (as an orphan) until it returns.
_IO_OUT = frozenset({Phase.SENDING, Phase.PARKING})
#: Results that are trouble of a route: a probe answered so settles nothing.
_ROUTE_TROUBLE = frozenset({ResultKind.UNAVAILABLE, ResultKind.SERVER_ERROR, ResultKind.THROTTLED})
