"""What the relay's /readyz says while Kafka does not answer (a collaborator of the relay loop).

Guarantees:

* while work waits (records in flight, dead letters pending) and the producer reaches
  no broker (:class:`cdc.kafka.log.KafkaReach`; overruled by any acknowledgement since),
  the session is STALLED at once with ``kafka unreachable: <librdkafka's reason>`` -
  not only after ``CDC_RELAY_STALL_AFTER_S``; with nothing waiting a broker away is no
  outage and nothing is said;
* while a session starts or reconnects (a Kafka client waits for its first answer,
  up to the topic manager's timeout), or waits mid-stream for a new topic to be
  created, a Kafka error (a refused connect, a TLS handshake) makes /readyz name it
  (``starting: kafka unreachable: ...``, ``... (creating topic T)``) instead of a bare
  state; only the readiness text changes (the callback runs on the thread that serves
  the client), and the state's own text returns when the wait ends.
"""

from __future__ import annotations

from collections.abc import Callable

from cdc.health import Liveness
from cdc.kafka.log import CAUSELESS_ERRORS, KafkaClientEvents
from cdc.relay.health.stall import StallWatch
from cdc.relay.health.state import RelayState, Session


class KafkaReadiness:
    """See the module docstring (a collaborator of :class:`~cdc.relay.stream.loop.Relay`)."""

    #: the producer's client events (set by the loop: they are made with
    #: :meth:`on_kafka_error` as their error callback)
    events: KafkaClientEvents

    def __init__(
        self,
        liveness: Liveness,
        *,
        state: Callable[[], tuple[RelayState, str]],
        held_records: Callable[[Session], int],
    ) -> None:
        self.liveness = liveness
        self._state_of = state
        self._held_records = held_records
        #: a topic the session waits for Kafka to create (mid-stream), else None
        self._topic_in_creation: str | None = None

    def on_kafka_error(self, code: str, text: str) -> None:
        """A Kafka client's error (``on_error``): named by /readyz while a session starts,
        reconnects or waits for a topic (see the module docstring)."""
        state, topic = self._state_of()[0], self._topic_in_creation
        if code in CAUSELESS_ERRORS:
            return
        if topic is not None:  # a new topic, mid-stream: nothing moves until Kafka answers
            self.liveness.set(
                f"{state.value}: kafka unreachable: {text} (creating topic {topic})", ready=False
            )
        elif state in (RelayState.STARTING, RelayState.RECONNECTING):
            self.liveness.set(f"{state.value}: kafka unreachable: {text}", ready=False)

    def creating_topic(self, topic: str | None) -> None:
        """The session waits for Kafka to create ``topic`` (None: no more): while it
        waits, a Kafka error names the wait in /readyz; after, the state's own text."""
        self._topic_in_creation = topic
        if topic is None:
            state, reason = self._state_of()
            self.liveness.set(
                f"{state.value}: {reason}" if reason else state.value,
                ready=state in (RelayState.STREAMING, RelayState.BACKPRESSURE),
            )

    def unreachable(self, sess: Session, stall: StallWatch, now: float) -> str | None:
        """``kafka unreachable: <why>`` while work waits (records in flight or dead letters
        pending) and the producer reaches no broker (:class:`cdc.kafka.log.KafkaReach`,
        overruled by any acknowledgement since): at once, not after the stall threshold.
        A broker away while nothing waits is no outage: nothing is said then."""
        reach = self.events.reach
        waiting = sess.tracker.in_flight > self._held_records(sess) or bool(sess.pending_dlq)
        if reach is None or not waiting:
            return None
        if reach.unreachable_s(progress_at=now - stall.idle_s(now)) is None:
            return None
        return f"kafka unreachable: {self.events.why_unreachable()}"
