"""The engine's endpoints as the sink sees them: each with its circuit, window and judgment. Pure.

**Trouble is judged where it happened** (DESIGN.md, "Sink invariants" 2 and 3).
Every record goes to one engine *route* - the endpoint its :class:`Verdict`
names (``/api/internal/users/sync``, ``/api/internal/quiz-attempts/sync``) -
and each route has its own circuit, adaptive window, probe backoff and
Retry-After hold. An answer is judged at the route of the request that
produced it (:attr:`Result.endpoint`): a quiz attempt whose user the engine
does not know makes a ``users/sync`` call too, and when *that* call fails it
is trouble of the users route, which the attempt then waits for.

===========================================  ===============================================
answer (:class:`ResultKind`)                 judgment
===========================================  ===============================================
2xx (DELIVERED)                              settled; evidence that its route works
a 4xx about the record: 400, 409, 422, a     the record's own: spends one attempt, parked
404 but ``user_not_found`` (REJECTED)        after ``inline_attempts``
refused, reset, timeouts, 408, 401/403,      trouble of the route: **never** spends an
3xx, the sink's own error (UNAVAILABLE)      attempt
429, 503 + Retry-After (THROTTLED), an       the route sheds load: its window is cut, its
expired request deadline (``shared``)        sends are held; spends nothing
a 5xx (SERVER_ERROR)                         trouble of the route, unless per-route
                                             evidence blames the record: the same route
                                             delivered :data:`EVIDENCE_DELIVERIES` other
                                             records after this failure and was not judged
                                             down in between (a payload that crashes the
                                             engine): then one attempt
===========================================  ===============================================

Route trouble on route R for record X (anything but the first two rows):

- X was R's probe, or R is CLOSED and delivered nothing since X was sent
  (nothing says R works): R's circuit OPENs; X goes back to the head of its
  key's lane and waits for R, with the key's later records behind it.
- R is not CLOSED (an answer to a request sent before it opened): X goes back
  to its lane; nothing else changes.
- R is CLOSED and delivered other records since X was sent (R works for the
  others), or X failed before while R worked (a *suspect*: its own failure
  must not hold R): X waits (RETRY_WAIT) a growing backoff, unspent; a 5xx
  leaves a *mark*, and when X comes due the mark becomes one spent attempt if
  the evidence above came meanwhile - else it is forgotten. A record keeps
  its attempts and failures while it waits in its lane.

So an engine outage, or one route's outage, spends no attempt of any record,
and other routes keep delivering while one route is down.

Circuit transitions, per route (the only ones)::

    CLOSED    --trouble, nothing delivered by it since sent--> OPEN      (probe after backoff)
    OPEN      --probe due, a record of the route waiting-----> HALF_OPEN (one probe Send)
    HALF_OPEN --probe settled: DELIVERED or REJECTED by it---> CLOSED    (backoff reset)
    HALF_OPEN --probe: trouble of the route------------------> OPEN      (longer backoff)
    HALF_OPEN --probe: UNROUTABLE, or ended by another route-> OPEN      (probe again now)
    OPEN      --nothing of the route waits (none queued, none--> CLOSED    (backoff reset)
                to send again, no Send out)

Any settled probe that is not trouble of its route closes that route's
circuit: a 4xx is an answer of a healthy route. A route whose records all went
elsewhere - revoked with their partition, or a probe (a quiz attempt waiting for
the users route) delivered by another route - has nothing to probe with: it
closes rather than saying "down" while nothing of it waits. Records that never need the
engine (bad input, ignored types) are settled without ever becoming a probe.
A newly assigned partition always gets an explicit Pause or Resume: the
client may remember a pause from before the partition was revoked.

:class:`Endpoint` keeps one endpoint's state and its circuit's moves;
:func:`judge_trouble` is the judgment of an answer that says nothing about the
record; :class:`sinks.core.machine.SinkCore` applies both to its records.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from enum import Enum

from sinks.core.backoff import Backoff
from sinks.core.delivery import Position
from sinks.core.window import Window

#: Deliveries of *other* records by the same route, after a record's 5xx and with no
#: trouble of that route in between, that blame the 5xx on the record. One is not
#: enough: a request that raced the start of an outage, or a blip, looks like that.
EVIDENCE_DELIVERIES = 2


class Circuit(Enum):
    """An engine route as the sink sees it."""

    CLOSED = "closed"  # the route is healthy: deliveries flow
    OPEN = "open"  # trouble of the route: nothing is sent to it until its probe is due
    HALF_OPEN = "half_open"  # exactly one probe delivery of the route in flight


@dataclass(frozen=True, slots=True)
class EndpointState:
    """One engine route as the core sees it now (gauges, ``/readyz``)."""

    endpoint: str
    circuit: Circuit
    reason: str  # the trouble that opened the circuit ("" while CLOSED)
    window: int  # the adaptive in-flight limit
    sending: int  # Sends out
    waiting: int  # records queued for it (heads of their lanes and the records behind)


#: A timer heap entry: (due, timer number, position); stale once the flight's timer moved on.
Timer = tuple[float, int, Position]


@dataclass(slots=True)
class Endpoint:
    """One engine route: its circuit, window, probe backoff, hold, evidence and retries."""

    name: str
    backoff: Backoff
    window: Window
    circuit: Circuit = Circuit.CLOSED
    reason: str = ""  # why the circuit is not CLOSED
    next_probe_at: float = 0.0
    probe_out: bool = False
    sending: int = 0  # Sends out that count in this route's window
    hold_until: float = 0.0  # no new Send before this (a throttled answer's Retry-After)
    cut_seq: int = 0  # a throttled Send numbered below this was answered by a cut already
    deliveries: int = 0  # 2xx by this route, ever
    openings: int = 0  # times the circuit opened or stayed open on a probe (voids marks)
    last_delivery_tick: int = -1
    retries: list[Timer] = field(default_factory=list)  # RETRY_WAIT flights, by due
    #: the record whose probe failed last (a payload that crashes the route looks like an
    #: outage each time: the next probe goes to another waiting record when there is one)
    failed_probe: Position | None = None

    def open(self, reason: str, *, now: float, delay_s: float) -> None:
        """OPEN, its next probe due ``delay_s`` from ``now``."""
        self.circuit = Circuit.OPEN
        self.reason = reason
        self.next_probe_at = now + delay_s

    def down(self, reason: str, retry_after_s: float | None, *, now: float) -> None:
        """Judged down: OPEN after the next (longer) probe backoff; no 5xx before is a
        record's own (``openings`` voids the marks)."""
        self.openings += 1
        self.open(reason, now=now, delay_s=self.backoff.next_delay_s(retry_after_s))

    def close(self) -> None:
        """CLOSED: backoff reset, the window in slow start (a route back from an outage is
        not stampeded)."""
        self.failed_probe = None
        self.circuit = Circuit.CLOSED
        self.reason = ""
        self.backoff.reset()
        self.window.restart()


class Trouble(enum.Enum):
    """What an answer that says nothing about the record does (:func:`judge_trouble`)."""

    PROBE_FAILED = "probe_failed"  # the endpoint's own probe: still down, wait longer
    STALE = "stale"  # sent before the endpoint opened: the record goes back, nothing changes
    THROTTLED = "throttled"  # the endpoint sheds load: fewer at once, hold new sends
    DOWN = "down"  # nothing says the endpoint works: OPEN, the record goes back
    SHARED = "shared"  # slow for everyone: fewer at once, the record goes back
    WAIT = "wait"  # the endpoint works for others: the record waits (a 5xx: a mark)


def judge_trouble(
    endpoint: Endpoint, *, probe: bool, throttled: bool, shared: bool, sent_tick: int, strikes: int
) -> Trouble:
    """The judgment of trouble of ``endpoint`` for a record sent at ``sent_tick`` that
    failed ``strikes`` times before while the endpoint worked (the module docstring)."""
    if probe:
        return Trouble.PROBE_FAILED
    if endpoint.circuit is not Circuit.CLOSED:
        return Trouble.STALE
    if throttled:
        return Trouble.THROTTLED
    if endpoint.last_delivery_tick <= sent_tick and not strikes:
        return Trouble.DOWN  # (and the record has no history of failing alone)
    if shared:
        return Trouble.SHARED
    return Trouble.WAIT
