"""What ``/readyz`` says about the sink, and one log line per change of it.

Guarantees (:class:`Readiness`, read from the core and the shell at every step):

* ready only while every engine route's circuit is CLOSED (else
  ``engine unavailable: <the routes down and why>``), the parking lot answers
  (else ``parking lot unavailable: <why>``), the sink is not stalled (nothing
  delivered, parked or committed for ``SINK_STALL_AFTER_S`` while work waits:
  ``stalled: ...``; a shorter blip never shows) and the consumer reaches a broker
  (``kafka unreachable: <why>``, at once while records are held, after
  :data:`KAFKA_UNREACHABLE_IDLE_S` with nothing held; :class:`cdc.kafka.log.KafkaReach`);
* a change of state is logged once, with its reason (OPEN and HALF_OPEN are one:
  down); an unchanged state logs nothing.
"""

from __future__ import annotations

import logging
import time

from cdc.health import Liveness
from cdc.kafka.log import KafkaClientEvents
from cdc.settings import Settings
from sinks.core.endpoints import Circuit
from sinks.core.machine import SinkCore

log = logging.getLogger("sinks.consumer")  # the name operators filter on: kept across moves

#: With nothing held, a consumer that reaches no broker for this long makes /readyz say
#: ``kafka unreachable``: a broker restart or a leader move is shorter.
KAFKA_UNREACHABLE_IDLE_S = 10.0

#: circuit, its reason, parking lot up, stalled, kafka unreachable (why)
_State = tuple[Circuit, str, bool, bool, str]


class Readiness:
    """See the module docstring. :meth:`report` at every step of the shell."""

    def __init__(
        self,
        *,
        settings: Settings,
        core: SinkCore,
        liveness: Liveness,
        kafka_events: KafkaClientEvents,
    ) -> None:
        self.settings = settings
        self.core = core
        self.liveness = liveness
        self.kafka_events = kafka_events
        self._reported: _State | None = None

    def stalled(self, stalled_s: float) -> bool:
        return stalled_s > self.settings.sink_stall_after_s

    def report(self, *, park_error: str | None, kafka_heard_at: float | None) -> None:
        """Readiness, and one log line per change of the circuit or the parking lot."""
        circuit, reason = self.core.circuit, self.core.circuit_reason
        stalled = self.stalled(self.core.stalled_s(time.monotonic()))
        unreachable = self._kafka_unreachable(kafka_heard_at)
        state = (circuit, reason, park_error is None, stalled, unreachable)
        if state == self._reported:
            return
        previous = self._reported
        self._reported = state
        if unreachable:
            status = unreachable
        elif circuit is not Circuit.CLOSED:
            status = f"engine unavailable: {reason}"
        elif park_error is not None:
            status = park_error
        else:
            status = ""
        if stalled:
            status = self._stall_status(status)
        self.liveness.set(status or "running", ready=not status)
        self._log_change(previous, state)

    def _kafka_unreachable(self, kafka_heard_at: float | None) -> str:
        """``kafka unreachable: <why>`` while no broker answers (overruled by records, an
        assignment or a commit since): at once with records held or being sent, after
        :data:`KAFKA_UNREACHABLE_IDLE_S` with none (what waits in Kafka is unseen)."""
        reach = self.kafka_events.reach
        away_s = reach.unreachable_s(progress_at=kafka_heard_at) if reach else None
        busy = self.core.held or self.core.sending
        if away_s is None or (not busy and away_s < KAFKA_UNREACHABLE_IDLE_S):
            return ""
        return f"kafka unreachable: {self.kafka_events.why_unreachable()}"

    def _stall_status(self, cause: str) -> str:
        after_s = self.settings.sink_stall_after_s
        status = (
            f"stalled: nothing delivered, parked or committed for over {after_s:g} s"
            f" while work waits ({self.core.held} records held)"
        )
        return f"{status}; {cause}" if cause else status

    def _log_change(
        self,
        previous: _State | None,
        state: _State,
    ) -> None:
        """One line per change of the engine's state (OPEN and HALF_OPEN are one: down),
        and one when Kafka becomes unreachable (or reachable again)."""
        if previous is None:
            return
        if state[4] and not previous[4]:
            log.warning("sink: %s; not ready until a broker answers", state[4])
        elif previous[4] and not state[4]:
            log.info("sink: kafka reachable again")
        was_down, down = previous[0] is not Circuit.CLOSED, state[0] is not Circuit.CLOSED
        extra = {"state": state[0].value}
        if down and not was_down:
            log.warning(
                "engine unavailable: %s; holding its records, probing; other routes deliver",
                state[1],
                extra=extra,
            )
        elif down and previous[1] != state[1]:
            log.warning("engine still unavailable, now: %s", state[1], extra=extra)
        elif was_down and not down:
            log.info("engine is back (was: %s); resuming", previous[1], extra=extra)
        if state[3] and not previous[3]:
            log.warning(
                "sink stalled: nothing delivered, parked or committed for over %g s while"
                " %d records wait",
                self.settings.sink_stall_after_s,
                self.core.held,
                extra={"state": "stalled"},
            )
        elif previous[3] and not state[3]:
            log.info("sink progresses again (was stalled)", extra={"state": "running"})
