"""Kafka judges a batch, not a record: the relay's answer, model-checked on its real code.

A topic's ``max.message.bytes`` is checked against a whole batch, and librdkafka fails
every record of a refused batch. The relay (:class:`cdc.relay.stream.producing.Producing`,
:class:`cdc.relay.health.state.PoisonIds`) remembers the records of a refused batch as
suspects and ends the session; read again, each suspect is produced alone, and only a
refusal of the record alone makes its dead letter.

The producer here is a stand-in that batches what is pending at random (a batch never
spans a flush, as in librdkafka) and refuses every batch holding a guilty record. Over
any guilty set, any batching and any transaction shape, sessions follow each other as
the relay's loop runs them (the next reads every transaction again) until one ends
clean, and then:

* every guilty record is in the dead-letter topic, and nothing else is;
* every innocent record was delivered to its topic;
* it took at most one session more than the records there are (each session judges at
  least one suspect alone).

A fault inside the machinery: Kafka away while the records before a suspect are waited
for (at-least-once records never time out) - the relay answers the server at each step,
says ``backpressure``, and a stop ends the wait.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from confluent_kafka import KafkaError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc.errors import KafkaUnavailableError
from cdc.relay.health.state import RelayState, Session
from cdc.relay.stream import loop as relay_mod
from cdc.relay.stream.loop import Relay
from cdc.router import DeadLetterCode
from cdc.settings import Settings
from cdc.wal.lsn import LsnTracker
from tests.unit.test_relay_routing import (
    DeliveredMsg,
    FakeTopics,
    Produced,
    begin,
    commit,
    insert,
    relation,
    row,
)

DLQ = "outbox.dlq"
TOPIC = "outbox.event.user"
REFUSED = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "Broker: Message size too large")


@dataclass
class BatchingProducer:
    """``Producer``'s surface the relay uses. What is pending when served goes out in
    batches of random sizes, in order; a batch holding a guilty record is refused whole
    (each of its records' reports fails), any other is delivered (dead letters too)."""

    guilty: set[bytes]
    rng: random.Random
    pending: list[Produced] = field(default_factory=list)
    delivered: list[Produced] = field(default_factory=list)

    def produce(
        self,
        topic: str,
        value: bytes,
        key: bytes,
        partition: int,
        callback: Any,
        on_delivery: Any,
        timestamp: int,
        headers: list[tuple[str, bytes]],
    ) -> None:
        self.pending.append(Produced(topic, value, key, timestamp, list(headers), callback))

    def poll(self, timeout: float = 0) -> int:
        pending, self.pending = self.pending, []
        at = 0
        while at < len(pending):
            size = self.rng.randint(1, 6)
            batch, at = pending[at : at + size], at + size
            refused = any(r.topic != DLQ and dict(r.headers)["id"] in self.guilty for r in batch)
            for record in batch:
                if not refused:
                    self.delivered.append(record)
                record.callback(REFUSED if refused else None, DeliveredMsg(record))
                record.callback = None  # (confluent-kafka lets go of it once reported)
        return len(pending)

    def flush(self, timeout: float = 0) -> int:
        self.poll(timeout)
        return 0

    def __len__(self) -> int:
        return len(self.pending)


@pytest.fixture
def make_relay(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setattr(relay_mod, "TopicManager", lambda **_: FakeTopics())

    def make(producer: BatchingProducer) -> Relay:
        r = Relay(
            Settings(pg_dsn="postgresql://x", kafka_bootstrap_servers="127.0.0.1:9", dlq_topic=DLQ),
            serve_http=False,
        )
        r._producer = producer  # type: ignore[assignment]
        r.decoder.utf8 = True
        r._topics.known.add(TOPIC)
        r.decoder.topic_of[b"user"] = TOPIC
        return r

    yield make


def _session(relay: Relay, txs: list[list[str]]) -> Session:
    """One session: every transaction read (again), its reports served after each; it
    ends early when a report or a wait raised what the loop would end it for."""
    sess = Session(stream=_Stream(), tracker=LsnTracker(0))  # type: ignore[arg-type]
    producer = relay._producer
    assert isinstance(producer, BatchingProducer)
    relay.decoder.on_change(sess, relation())
    try:
        for n, ids in enumerate(txs):
            lsn = 0x1000 * (n + 1)
            relay.decoder.on_change(sess, begin(lsn))
            for event_id in ids:
                relay.decoder.on_change(sess, insert(row(event_id=event_id)))
            relay.decoder.on_change(sess, commit(lsn))
            sess.reports = None
            producer.poll()
            relay.dead_letters.drain(sess)
            producer.poll()
            if sess.fatal is not None:
                return sess
    except KafkaUnavailableError:  # (a wait for a suspect's turn saw the session end)
        assert sess.fatal is not None
    return sess


class _Stream:
    wal_sender_timeout_ms = 60_000

    def __init__(self) -> None:
        self.statuses = 0

    def send_status(self, lsn: int, **_: Any) -> int:
        self.statuses += 1
        return lsn


# (the fixture makes a new relay per example: only its monkeypatch is shared)
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    shape=st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=6),
    guilty_at=st.sets(st.integers(min_value=0, max_value=35), max_size=4),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_only_the_guilty_are_dead_lettered_and_every_innocent_is_delivered(
    make_relay: Any, shape: list[int], guilty_at: set[int], seed: int
) -> None:
    txs, n = [], 0
    for size in shape:
        txs.append([f"{i:08d}-5d1c-4f7e-9a53-0e6f3c1d2a10" for i in range(n, n + size)])
        n += size
    every = [i for tx in txs for i in tx]
    guilty = {every[i].encode() for i in guilty_at if i < len(every)}
    producer = BatchingProducer(guilty, random.Random(seed))
    relay = make_relay(producer)
    sessions = 0
    while True:
        sessions += 1
        assert sessions <= len(every) + 1, "each session judges at least one suspect alone"
        if _session(relay, txs).fatal is None:
            break
    letters = {dict(r.headers)["id"] for r in producer.delivered if r.topic == DLQ}
    assert letters == guilty
    delivered = {dict(r.headers)["id"] for r in producer.delivered if r.topic == TOPIC}
    assert delivered == {i.encode() for i in every} - guilty
    assert all(entry[2] for entry in relay.poison.values()), "no suspect left unjudged"


@dataclass
class AwayProducer(BatchingProducer):
    """Kafka away: nothing is ever reported; each flush waits its timeout out. The relay
    is asked to stop after ``stop_after`` flushes."""

    relay: Any = None
    stop_after: int = 3
    flushes: int = 0

    def flush(self, timeout: float = 0) -> int:
        self.flushes += 1
        if self.flushes >= self.stop_after:
            self.relay._stop.set()
        return len(self.pending)

    def poll(self, timeout: float = 0) -> int:
        return 0


def test_a_suspects_wait_while_kafka_is_away_answers_the_server_says_so_and_ends_at_a_stop(
    make_relay: Any,
) -> None:
    """The wait for the records before a suspect (a fault inside the new machinery):
    Kafka is away, at-least-once records never time out - the relay answers the server
    at every step, says ``backpressure`` (not ``streaming``), and a stop ends the wait
    (the session ends; nothing was acknowledged, so everything is read again)."""
    suspect = "00000001-5d1c-4f7e-9a53-0e6f3c1d2a10"
    producer = AwayProducer(set(), random.Random(0))
    relay = make_relay(producer)
    producer.relay = relay
    relay.poison.suspect(suspect.encode(), DeadLetterCode.TOO_LARGE, "Broker: too large")
    stream = _Stream()
    sess = Session(stream=stream, tracker=LsnTracker(0))  # type: ignore[arg-type]
    relay.decoder.on_change(sess, relation())
    relay.decoder.on_change(sess, begin(0x1000))
    relay.decoder.on_change(sess, insert(row(event_id="00000000-5d1c-4f7e-9a53-0e6f3c1d2a10")))
    with pytest.raises(KafkaUnavailableError, match="stopping"):
        relay.decoder.on_change(sess, insert(row(event_id=suspect)))
    assert producer.flushes == 3 and stream.statuses == 3, "the server answered at each step"
    assert relay._state is RelayState.BACKPRESSURE
    assert [dict(r.headers)["id"].decode() for r in producer.pending] == [
        "00000000-5d1c-4f7e-9a53-0e6f3c1d2a10"
    ], "the suspect waits its turn: not produced while another record is in flight"
    assert sess.tracker.in_flight == 1 and sess.tracker.confirmable == 0  # (the suspect: not added)
