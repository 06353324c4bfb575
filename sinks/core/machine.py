"""The sink's decisions, as one pure state machine: events in, actions out. No I/O.

The consumer shell (:mod:`sinks.consumer`) feeds :class:`SinkCore` what
happened - a record consumed, an engine outcome, a park or commit result, an
assignment, a revocation, the passing of time - and carries out the actions
it answers with: :class:`Send`, :class:`Park`, :class:`Pause`,
:class:`Resume`, :class:`Commit`. Everything that decides is here, in one
place, so the whole machine is model-checked (``tests/unit/test_core_model.py``).

Invariants (DESIGN.md, "Sink invariants"; each checked after every step of
the model test):

1. **Offsets**: a :class:`Commit` never names an offset past a record that is
   neither delivered nor parked, in that partition (:class:`OffsetWatermark`).
   A commit counts only once the broker confirmed it (:meth:`commit_result`);
   a failed or lost commit is sent again.
2. **Per-key order**: records of one key go to the engine one at a time, in
   offset order - also across rebalances: a record still in flight from
   before a revocation is *adopted* when its partition comes back, keeping its
   place at the head of its key's lane (:class:`KeyScheduler`).
3. **Engine-wide trouble spends nothing**: a :class:`Result` of kind
   ``UNAVAILABLE`` with no success elsewhere since the record was sent opens
   the circuit; the record goes back to the head of its lane. A ``THROTTLED``
   result (429, or 503 with ``Retry-After``) and an ``UNAVAILABLE`` one marked
   ``shared`` (the request deadline expired) are engine-wide *whatever else
   succeeds*: they never spend an attempt.
4. **Only a record the healthy engine rejects spends attempts**: after
   ``inline_attempts`` it is parked; a record that cannot be routed, or
   that the routing marks as bad input, is parked at once and never sent.
5. **No record is sent after it was parked**, and nothing is sent while the
   circuit is OPEN; while HALF_OPEN exactly one probe is in flight.
6. **Bounded state**: nothing is kept for a partition no longer assigned,
   except records whose I/O is still out (orphans), until it returns; and
   every record held, whatever its phase (queued, sending, waiting to retry,
   waiting for or failing to park, or settled behind a record that is not),
   counts toward ``max_buffered``: above it every partition pauses, so at most
   one fetch batch more is ever held.
7. **The sink slows to what the engine admits** (:class:`Window`): sends stop
   until a throttled answer's ``Retry-After`` has passed; the in-flight limit
   is halved on a throttled or shared-deadline answer (once per round of
   sends), grows by one per window of deliveries (congestion avoidance), and
   restarts at one after an outage, doubling per window up to the level
   before (slow start) - floor 1, ceiling ``max_in_flight``.
8. **A stall is visible**: :meth:`SinkCore.stalled_s` is how long nothing
   progressed (a record settled, a commit confirmed) while work waits (records
   held, or a settled offset not yet confirmed by the broker).

Circuit transitions (the only ones)::

    CLOSED    --UNAVAILABLE, no success since it was sent--> OPEN      (probe at now + backoff)
    OPEN      --probe due, a routable record waiting------> HALF_OPEN (exactly one Send, probe)
    HALF_OPEN --probe settled: DELIVERED or REJECTED------> CLOSED    (backoff reset)
    HALF_OPEN --probe UNAVAILABLE-------------------------> OPEN      (longer backoff)
    HALF_OPEN --probe UNROUTABLE (never reached engine)---> OPEN      (probe again now)

Any settled probe that is not engine-wide trouble closes the circuit: a 4xx
is an answer of a healthy engine. Records that never need the engine (bad
input, ignored types) are settled without ever becoming a probe.

Partitions are paused while the circuit is not CLOSED and records wait (Kafka
holds the backlog), while more than ``max_buffered`` records are held (in any
phase), and
once stopping; with the circuit open and nothing queued they are resumed, so
a record can arrive to serve as the next probe (no deadlock). A newly assigned
partition always gets an explicit Pause or Resume: the client may remember a
pause from before the partition was revoked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum

from sinks.core.delivery import Envelope, KeyScheduler, OffsetWatermark, Position, TopicPartition
from sinks.core.retry import Backoff

#: Longest a commit may stay unconfirmed before it is sent again (a lost callback).
COMMIT_TIMEOUT_S = 30.0
#: Records one :class:`Park` action carries at most: one round-trip for many rows.
PARK_BATCH_MAX = 500
#: A throttled answer without Retry-After holds new sends this long (the engine gave no hint).
THROTTLE_HOLD_S = 1.0
#: First wait after the parking lot failed; doubles up to :data:`PARK_RETRY_MAX_S`.
PARK_RETRY_S = 0.5
PARK_RETRY_MAX_S = 30.0


class Circuit(Enum):
    """The engine as the sink sees it."""

    CLOSED = "closed"  # engine healthy: deliveries flow
    OPEN = "open"  # engine-wide trouble: nothing is sent until the probe is due
    HALF_OPEN = "half_open"  # exactly one probe delivery in flight


class Route(Enum):
    """What the routing says of one record (:class:`Verdict`)."""

    DELIVER = "deliver"  # send it to the engine
    IGNORE = "ignore"  # a type the sink deliberately skips: settled at once
    PARK = "park"  # bad input (no route, malformed, no id): parked at once, never sent


@dataclass(frozen=True, slots=True)
class Verdict:
    """The routing decision for a record; ``reason`` says why for IGNORE and PARK."""

    route: Route
    reason: str = ""


class ResultKind(Enum):
    """How one Send ended (the engine client's classification)."""

    DELIVERED = "delivered"  # 2xx
    REJECTED = "rejected"  # the healthy engine refused this record: spends an attempt
    UNAVAILABLE = "unavailable"  # engine-wide trouble: spends nothing
    THROTTLED = "throttled"  # the engine sheds load (429, 503 + Retry-After): spends nothing
    UNROUTABLE = "unroutable"  # found unfit for sending only when sent: parked


@dataclass(frozen=True, slots=True)
class Result:
    """A Send's result; ``retry_after_s`` is the engine's Retry-After, if any.

    ``shared``: an UNAVAILABLE that is engine-wide even while other records
    succeed (the request deadline expired: the engine is slow for everyone),
    so it never counts as the record's own failure.
    """

    kind: ResultKind
    reason: str = ""
    retry_after_s: float | None = None
    shared: bool = False


DELIVERED = Result(ResultKind.DELIVERED)


# -- actions --------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Send:
    """Deliver ``record`` to the engine; answer with :meth:`SinkCore.sent`."""

    record: Envelope
    probe: bool = False


@dataclass(frozen=True, slots=True)
class ParkItem:
    """One record to park, why, and how many attempts it already spent."""

    record: Envelope
    reason: str
    attempts: int


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
    RETRY_WAIT = "retry_wait"  # the healthy engine rejected it; sent again at `due`
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
    due: float = 0.0
    attempts: int = 0
    successes_at_send: int = 0
    sent_seq: int = 0  # the Send's number (one cut of the window per round of sends)
    probe: bool = False
    reason: str = ""
    park_failures: int = 0


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


class Window:
    """The adaptive in-flight limit (AIMD with slow start, as TCP's congestion window).

    Transitions: ``delivered()`` -> below ``threshold`` +1 per delivery
    (doubling per round: slow start), from it +1 per ``limit`` deliveries
    (congestion avoidance); ``cut()`` -> halved (floor 1), threshold = the new
    limit; ``restart()`` (the engine came back) -> 1, threshold = the limit
    before (or the ceiling when it had fallen to 1). Never above ``ceiling``.
    """

    def __init__(self, ceiling: int) -> None:
        self.ceiling = ceiling
        self.limit = ceiling
        self.threshold = ceiling
        self._acked = 0

    def delivered(self) -> None:
        if self.limit >= self.ceiling:
            return
        if self.limit < self.threshold:
            self.limit += 1
            return
        self._acked += 1
        if self._acked >= self.limit:
            self._acked = 0
            self.limit += 1

    def cut(self) -> None:
        self.limit = max(1, self.limit // 2)
        self.threshold = self.limit
        self._acked = 0

    def restart(self) -> None:
        self.threshold = self.limit if self.limit > 1 else self.ceiling
        self.limit = 1
        self._acked = 0


class SinkCore:
    """See the module docstring. Methods named for events; :meth:`actions` is the timer."""

    def __init__(
        self,
        *,
        max_in_flight: int,
        max_buffered: int,
        inline_attempts: int,
        inline_backoff_s: float,
        backoff: Backoff,
        commit_interval_s: float,
        classify: Callable[[Envelope], Verdict],
    ) -> None:
        if inline_attempts < 1:
            raise ValueError("inline_attempts must be at least 1")
        self._scheduler = KeyScheduler(max_in_flight=max_in_flight)
        self._max_buffered = max_buffered
        self._inline_attempts = inline_attempts
        self._inline_backoff_s = inline_backoff_s
        self._backoff = backoff
        self._commit_interval_s = commit_interval_s
        self._classify = classify
        self._parts: dict[TopicPartition, _Partition] = {}
        self._generation = 0
        self._flights: dict[Position, _Flight] = {}  # taken out of the queue, not settled
        self._park_queue: list[Position] = []  # PARK_QUEUED flights, in order
        self._paused: set[TopicPartition] = set()
        self._unsynced: set[TopicPartition] = set()  # assigned since the last Pause/Resume
        self._successes = 0
        self.window = Window(max_in_flight)
        self._sending = 0  # Sends out (phase SENDING)
        self._send_seq = 0  # Sends ever made
        self._cut_seq = 0  # a throttled Send numbered below this was already answered by a cut
        self._hold_until = 0.0  # no new Send before this (Retry-After of a throttled answer)
        self._progress = 0  # records settled + commits confirmed, ever
        self._progress_seen = -1
        self._progress_at: float | None = None
        self._last_commit_at: float | None = None
        self._stopping = False
        self.circuit = Circuit.CLOSED
        #: Why the circuit is not CLOSED (the last engine-wide failure), for /readyz.
        self.circuit_reason = ""
        self._next_probe_at = 0.0

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
            self._scheduler.drop_partition(*tp)
            self._paused.discard(tp)
        return final

    def consumed(self, record: Envelope, *, now_ms: int) -> Verdict | None:
        """A record fetched from Kafka; returns its routing verdict (None: not taken).

        ``now_ms`` dates a record without a timestamp (oldest-age gauge).
        """
        part = self._parts.get(record.topic_partition)
        if part is None or (part.last_offset is not None and record.offset <= part.last_offset):
            return None  # not (or no longer) ours, or a re-fetch of what we hold
        part.last_offset = record.offset
        part.watermark.track(record.offset)
        part.timestamps[record.offset] = record.timestamp_ms or now_ms
        verdict = self._classify(record)
        if verdict.route is Route.IGNORE:
            self._done(record, part.generation)
            return verdict
        orphan = self._flights.get(record.position)
        if orphan is not None:  # in flight from before a revocation: the same record
            self._adopt(orphan, part.generation)
            return verdict
        if verdict.route is Route.PARK:
            self._flights[record.position] = _Flight(
                record, part.generation, laned=False, phase=Phase.PARK_QUEUED, reason=verdict.reason
            )
            self._park_queue.append(record.position)
        else:
            self._scheduler.submit(record)
        return verdict

    def sent(self, record: Envelope, outcome: Result, *, now: float) -> None:
        """A Send ended with ``outcome``."""
        flight = self._flights.get(record.position)
        if flight is None or flight.phase is not Phase.SENDING:
            raise ValueError(f"record {record.position} has no Send out")
        probe = flight.probe
        flight.probe = False
        self._sending -= 1
        kind = outcome.kind
        if probe and kind not in _ENGINE_WIDE:
            self._probe_settled(kind, now=now)
        if kind is ResultKind.DELIVERED:
            self._successes += 1
            self.window.delivered()
            self._settle(flight)
        elif kind is ResultKind.UNROUTABLE:
            self._to_park(flight, outcome.reason)
        elif kind is ResultKind.REJECTED:
            self._rejected(flight, outcome.reason, now=now)
        elif self.circuit is not Circuit.CLOSED or probe:
            self._engine_down(flight, outcome, now=now, probe=probe)
        elif kind is ResultKind.THROTTLED:
            self._slow_down(flight, now + (outcome.retry_after_s or THROTTLE_HOLD_S))
        elif self._successes <= flight.successes_at_send:
            self._engine_down(flight, outcome, now=now, probe=probe)
        elif outcome.shared:  # the engine is slow for everyone: fewer at once, not this one's
            self._slow_down(flight, now + (outcome.retry_after_s or 0.0))
        else:  # others succeed meanwhile: this record's own trouble
            self._rejected(flight, f"failed while others succeeded: {outcome.reason}", now=now)

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
        flight.due = now + min(PARK_RETRY_MAX_S, PARK_RETRY_S * 2 ** (flight.park_failures - 1))

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
            waits = [f for f in self._flights.values() if f.phase in _TIMED]
            times += [f.due for f in waits if f.phase is Phase.PARK_WAIT]
            retries = [f.due for f in waits if f.phase is Phase.RETRY_WAIT]
            if self.circuit is Circuit.CLOSED:
                hold = self._hold_until  # a throttled engine's Retry-After delays every Send
                if self._room() > 0:  # else a Send's answer makes room: an event, not a timer
                    times += [max(due, hold) for due in retries]
                    if hold and self._scheduler.can_start():
                        times.append(hold)
            elif self.circuit is Circuit.OPEN:
                # The probe goes when it is due *and* a record can go: the first
                # retry to come due, or now if a lane can start a record.
                if self._scheduler.can_start():
                    times.append(self._next_probe_at)
                times += [max(due, self._next_probe_at) for due in retries]
        return min(times) if times else None

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
        """Engine requests out right now."""
        return sum(1 for f in self._flights.values() if f.phase is Phase.SENDING)

    @property
    def queued(self) -> int:
        """Records waiting for their key's turn or a free slot."""
        return self._scheduler.queued

    @property
    def held(self) -> int:
        """Records held in memory: queued + taken out + settled behind an unsettled one.

        A record delivered (or ignored) while a lower offset of its partition still
        waits - e.g. to be parked while the parking lot is down - stays in that
        partition's watermark until the gap closes: it is held too (invariant 6).
        """
        behind = sum(p.watermark.held - p.watermark.pending for p in self._parts.values())
        return self._scheduler.queued + len(self._flights) + behind

    @property
    def stopping(self) -> bool:
        return self._stopping

    def stalled_s(self, now: float) -> float:
        """Seconds without progress (a record settled, a commit confirmed) while work waits.

        0 while nothing waits. As of the last :meth:`actions` call and ``now``.
        """
        if self._progress_at is None or not self._work_waiting():
            return 0.0
        return max(0.0, now - self._progress_at)

    def throttled_until(self) -> float:
        """No new Send before this monotonic time (0: none held)."""
        return self._hold_until

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
        return self._scheduler.pending + len(self._flights) + len(self._park_queue) + per_partition

    def orphan_positions(self) -> set[Position]:
        """Taken-out records of partitions no longer assigned (their I/O is out)."""
        return {p for p, f in self._flights.items() if self._is_orphan(f)}

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
        """True while a probe's Send is out."""
        return any(f.probe and f.phase is Phase.SENDING for f in self._flights.values())

    # -- sends ----------------------------------------------------------------------
    def _start_sends(self, out: list[Action], now: float) -> None:
        if self.circuit is Circuit.CLOSED:
            if now < self._hold_until:
                return  # the engine asked us to wait (Retry-After)
            self._hold_until = 0.0
            for flight in self._due(Phase.RETRY_WAIT, now)[: self._room()]:
                out.append(self._send(flight, probe=False))
            room = self._room()
            if room > 0:
                for record in self._scheduler.ready(limit=room):
                    out.append(self._send(self._take(record), probe=False))
        elif self.circuit is Circuit.OPEN and now >= self._next_probe_at:
            retries = self._due(Phase.RETRY_WAIT, now)
            if retries:
                probe: _Flight | None = retries[0]
            else:
                ready = self._scheduler.ready(limit=1)
                probe = self._take(ready[0]) if ready else None
            if probe is not None:
                self.circuit = Circuit.HALF_OPEN
                out.append(self._send(probe, probe=True))

    def _room(self) -> int:
        """Sends the window admits now."""
        return max(0, self.window.limit - self._sending)

    def _take(self, record: Envelope) -> _Flight:
        part = self._parts[record.topic_partition]
        flight = _Flight(record, part.generation, laned=True, phase=Phase.SENDING)
        self._flights[record.position] = flight
        return flight

    def _send(self, flight: _Flight, *, probe: bool) -> Send:
        flight.phase = Phase.SENDING
        flight.probe = probe
        flight.successes_at_send = self._successes
        flight.sent_seq = self._send_seq
        self._send_seq += 1
        self._sending += 1
        return Send(flight.record, probe=probe)

    def _rejected(self, flight: _Flight, reason: str, *, now: float) -> None:
        flight.attempts += 1
        if self._forget_if_orphan(flight):
            return
        if flight.attempts >= self._inline_attempts:
            self._to_park(flight, f"{reason} (after {flight.attempts} attempts)")
            return
        flight.phase = Phase.RETRY_WAIT
        flight.due = now + self._inline_backoff_s * 2 ** (flight.attempts - 1)
        flight.reason = reason

    def _engine_down(self, flight: _Flight, outcome: Result, *, now: float, probe: bool) -> None:
        """Engine-wide trouble: the record goes back to the head of its lane, unspent.

        Only a failure while CLOSED, or the probe's own, moves the circuit: a
        late failure of a record sent before the circuit opened changes nothing.
        """
        del self._flights[flight.record.position]
        self._scheduler.release(flight.record)  # an orphan is forgotten by the release
        if self.circuit is Circuit.CLOSED or probe:
            delay_s = self._backoff.next_delay_s(outcome.retry_after_s)
            self._open_circuit(outcome.reason, now=now, delay_s=delay_s)

    def _slow_down(self, flight: _Flight, hold_until: float) -> None:
        """The engine admits less than we send: unspent back to its lane, fewer at once.

        The window is cut once per round: answers to Sends made before the last
        cut are the same congestion, already answered.
        """
        del self._flights[flight.record.position]
        self._scheduler.release(flight.record)  # an orphan is forgotten by the release
        if flight.sent_seq >= self._cut_seq:
            self.window.cut()
            self._cut_seq = self._send_seq
        self._hold_until = max(self._hold_until, hold_until)

    def _probe_settled(self, kind: ResultKind, *, now: float) -> None:
        """The probe ended without engine-wide trouble.

        A 2xx or a 4xx for the record itself is an answer of a healthy engine:
        CLOSED. A probe found unfit only when sent never reached the engine and
        says nothing: OPEN, with the next probe due at once.
        """
        if kind is ResultKind.UNROUTABLE:
            self._open_circuit(self.circuit_reason, now=now, delay_s=0.0)
        else:
            self._close_circuit()

    def _open_circuit(self, reason: str, *, now: float, delay_s: float) -> None:
        self.circuit = Circuit.OPEN
        self.circuit_reason = reason
        self._next_probe_at = now + delay_s

    def _close_circuit(self) -> None:
        self.circuit = Circuit.CLOSED
        self.circuit_reason = ""
        self._backoff.reset()
        self.window.restart()  # slow start: an engine back from an outage is not stampeded

    # -- parks ----------------------------------------------------------------------
    def _to_park(self, flight: _Flight, reason: str) -> None:
        if self._forget_if_orphan(flight):
            return
        flight.phase = Phase.PARK_QUEUED
        flight.reason = reason
        self._park_queue.append(flight.record.position)

    def _start_parks(self, out: list[Action], now: float) -> None:
        for flight in self._due(Phase.PARK_WAIT, now):
            flight.phase = Phase.PARK_QUEUED
            self._park_queue.append(flight.record.position)
        while self._park_queue:
            batch = self._park_queue[:PARK_BATCH_MAX]
            del self._park_queue[:PARK_BATCH_MAX]
            items = []
            for position in batch:
                flight = self._flights[position]
                flight.phase = Phase.PARKING
                items.append(ParkItem(flight.record, flight.reason, flight.attempts))
            out.append(Park(tuple(items)))

    # -- settling ---------------------------------------------------------------------
    def _settle(self, flight: _Flight) -> None:
        """Delivered or parked: the lane moves on, the watermark too (if still ours)."""
        del self._flights[flight.record.position]
        if flight.laned:
            self._scheduler.finish(flight.record)
        self._progress += 1
        self._done(flight.record, flight.generation)

    def _done(self, record: Envelope, generation: int) -> None:
        part = self._parts.get(record.topic_partition)
        if part is not None and part.generation == generation:
            part.watermark.done(record.offset)
            part.timestamps.pop(record.offset, None)

    def _adopt(self, flight: _Flight, generation: int) -> None:
        """The orphan's partition came back: it settles the new generation's offset."""
        flight.generation = generation
        if flight.laned:
            self._scheduler.submit(flight.record)  # adopted: keeps its place in its lane

    def _is_orphan(self, flight: _Flight) -> bool:
        part = self._parts.get(flight.record.topic_partition)
        return part is None or part.generation != flight.generation

    def _forget_if_orphan(self, flight: _Flight) -> bool:
        """An orphan that is not done: drop it - its partition's new owner delivers it."""
        if not self._is_orphan(flight):
            return False
        del self._flights[flight.record.position]
        if flight.laned:
            self._scheduler.finish(flight.record)
        return True

    def _drop_waiting(self, tp: TopicPartition) -> None:
        """A revoked partition's records with no I/O out are forgotten now."""
        for position, flight in list(self._flights.items()):
            if flight.record.topic_partition != tp or flight.phase in _IO_OUT:
                continue
            del self._flights[position]
            if flight.laned:
                self._scheduler.finish(flight.record)
        self._park_queue = [p for p in self._park_queue if p in self._flights]

    def _due(self, phase: Phase, now: float) -> list[_Flight]:
        due = [f for f in self._flights.values() if f.phase is phase and f.due <= now]
        due.sort(key=lambda f: f.due)
        return due

    # -- pausing and committing ----------------------------------------------------------
    def _pause_or_resume(self, out: list[Action]) -> None:
        buffered = self.held  # every phase counts: parking that fails holds records too
        want = (
            self._stopping
            or (self.circuit is not Circuit.CLOSED and self._scheduler.queued > 0)
            or buffered > self._max_buffered
        )
        unsynced, self._unsynced = self._unsynced, set()
        if want:
            fresh = tuple(tp for tp in self._parts if tp not in self._paused)
            if fresh:
                self._paused.update(fresh)
                out.append(Pause(fresh))
        elif self._paused or unsynced:
            # A newly assigned partition is resumed explicitly: the client may
            # still hold it paused from before it was revoked (librdkafka keeps
            # a partition's pause across a revoke and a re-assign).
            resumed = tuple(sorted(self._paused | (unsynced & set(self._parts))))
            self._paused.clear()
            out.append(Resume(resumed))

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
#: Results that are engine-wide trouble: a probe answered so settles nothing.
_ENGINE_WIDE = frozenset({ResultKind.UNAVAILABLE, ResultKind.THROTTLED})
#: Phases that end on a timer.
_TIMED = frozenset({Phase.RETRY_WAIT, Phase.PARK_WAIT})
