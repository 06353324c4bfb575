"""The relay's own error paths, driven without a broker (pure: a scripted producer).

* a librdkafka fatal error (raised from ``poll`` as confluent-kafka does, or
  ``_FATAL`` from ``produce``) ends the session with ProducerFatalError; the
  relay purges, closes and drops the producer, reports ``rebuilding`` and waits
  a back-off that grows while fatal errors follow each other;
* a dead letter that cannot be written (``produce`` raising, a failed report)
  stays in line unacknowledged, holds the stream (WAL is not read, /readyz
  names the cause) and is retried after a growing back-off; a dead letter
  Kafka refuses for its size is written in its minimal form;
* the poison ids and the dead-letter metric stay bounded over distinct refused
  events well beyond the bound;
* librdkafka's errors and log lines of the producer and the admin client reach
  the logging tree and the error counter.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer

from cdc.errors import KafkaUnavailableError, ProducerFatalError
from cdc.kafka.log import KafkaClientEvents
from cdc.kafka.producer import TopicManager, discard_producer, make_producer
from cdc.relay.health.state import DLQ_RETRY_MIN_S, POISON_MAX, PoisonIds, RelayState, Session
from cdc.relay.stream import loop as relay_mod
from cdc.relay.stream.dead_letters import DLQ_MINIMAL_FIELD_BYTES
from cdc.relay.stream.loop import REBUILD_MAX_S, REBUILD_MIN_S, Relay
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


@dataclass
class ScriptedProducer:
    """``Producer``'s surface the relay uses. Per topic, ``produce`` first raises
    the scripted exceptions (None: that call succeeds) and reports fail with the
    scripted errors; ``poll`` raises the scripted exceptions, then reports every
    record produced."""

    raises: dict[str, list[BaseException | None]] = field(default_factory=dict)
    fails: dict[str, deque[KafkaError]] = field(default_factory=dict)
    poll_raises: list[BaseException] = field(default_factory=list)
    sent: list[Produced] = field(default_factory=list)
    pending: list[Produced] = field(default_factory=list)
    attempts: dict[str, int] = field(default_factory=dict)
    polls: int = 0

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
        self.attempts[topic] = self.attempts.get(topic, 0) + 1
        if self.raises.get(topic):
            failure = self.raises[topic].pop(0)
            if failure is not None:
                raise failure
        record = Produced(topic, value, key, timestamp, list(headers), callback)
        self.sent.append(record)
        self.pending.append(record)

    def poll(self, timeout: float = 0) -> int:
        self.polls += 1
        if self.poll_raises:
            raise self.poll_raises.pop(0)
        pending, self.pending = self.pending, []
        for record in pending:
            errors = self.fails.get(record.topic)
            record.callback(errors.popleft() if errors else None, DeliveredMsg(record))
            record.callback = None  # (confluent-kafka lets go of it once reported)
        return len(pending)

    def __len__(self) -> int:  # (records waiting for their reports)
        return len(self.pending)

    def flush(self, timeout: float = 0) -> int:
        self.poll(timeout)
        return len(self.pending)

    def to(self, topic: str) -> list[Produced]:
        return [s for s in self.sent if s.topic == topic]


class ReadNothing:
    """A replication stream that must not be read (the relay is HELD)."""

    wal_sender_timeout_ms = 60_000

    def __init__(self) -> None:
        self.statuses: list[int] = []

    def send_status(
        self, lsn: int, *, reply_requested: bool = False, ask_raise: bool = True
    ) -> int:
        self.statuses.append(lsn)
        return lsn  # (a stream without a limit)

    def get_nowait(self) -> tuple[int, None]:
        raise AssertionError("WAL was read while a dead letter was failing")

    def read(self, timeout_s: float) -> None:
        raise AssertionError("WAL was read while a dead letter was failing")


@pytest.fixture
def relay(monkeypatch: pytest.MonkeyPatch) -> Iterator[Relay]:
    monkeypatch.setattr(relay_mod, "TopicManager", lambda **_: FakeTopics())
    r = Relay(
        Settings(pg_dsn="postgresql://x", kafka_bootstrap_servers="127.0.0.1:9", dlq_topic=DLQ),
        serve_http=False,
    )
    r._producer = ScriptedProducer()  # type: ignore[assignment]
    r.decoder.utf8 = True
    yield r


def producer_of(relay: Relay) -> ScriptedProducer:
    producer = relay._producer
    assert isinstance(producer, ScriptedProducer)
    return producer


def new_session(stream: object | None = None) -> Session:
    return Session(stream=stream or ReadNothing(), tracker=LsnTracker(0))  # type: ignore[arg-type]


def malformed_tx(relay: Relay, sess: Session, final_lsn: int, n: int = 0) -> None:
    """One transaction of one row the router refuses (its aggregatetype makes no topic)."""
    relay.decoder.on_change(sess, begin(final_lsn))
    relay.decoder.on_change(
        sess, insert(row(event_id=f"{n:08d}-0d55-4b44-8d1e-7f6f8f1a2b3c", aggregatetype=b"a b"))
    )
    relay.decoder.on_change(sess, commit(final_lsn))


def kafka_error(code: int, *, fatal: bool = False) -> KafkaError:
    return KafkaError(code, None, fatal=fatal)


def sample(relay: Relay, name: str, labels: dict[str, str] | None = None) -> float:
    return relay.registry.get_sample_value(name, labels or {}) or 0.0


# --- bounded state -------------------------------------------------------------------


def test_poison_ids_forget_the_least_recently_used_beyond_their_bound() -> None:
    poison = PoisonIds(max_entries=3)
    for n in range(4):
        poison.remember(b"e%d" % n, DeadLetterCode.TOO_LARGE, "Broker: Message size too large")
    assert list(poison) == [b"e1", b"e2", b"e3"]
    too_large = (DeadLetterCode.TOO_LARGE, "Broker: Message size too large", True)
    assert poison.recall(b"e1") == too_large
    poison.remember(b"e4", DeadLetterCode.INVALID_RECORD, "Broker: Invalid record")
    assert list(poison) == [b"e3", b"e1", b"e4"], "a recalled id is kept over older ones"
    assert poison.recall(b"e0") is None


def test_distinct_refused_events_beyond_the_bound_keep_poison_ids_and_metric_series_bounded(
    relay: Relay, caplog: pytest.LogCaptureFixture
) -> None:
    """More records than the poison ids' bound (POISON_MAX plus CDC_MAX_IN_FLIGHT)
    whose batches the broker refuses (their reports fail) are remembered as suspects
    - at most the bound, the session ended, none
    dead-lettered yet; read again in a new session, the suspects still remembered are
    each produced alone and, refused alone, dead-lettered. 1,000 rows with distinct
    unroutable aggregatetypes (distinct reason texts) are dead-lettered at once. Every
    one is written and confirmed. (tests/integration/test_relay_errors.py does 100,000
    against the real broker.)"""
    caplog.set_level(logging.ERROR, logger="cdc.relay")  # one warning per dead letter
    producer = producer_of(relay)
    topic = "outbox.event.user"
    relay._topics.known.add(topic)
    relay.decoder.topic_of[b"user"] = topic
    bound = relay.poison.max_entries
    assert bound == POISON_MAX + relay.settings.relay_max_in_flight
    total, per_tx = bound + 5_000, 500
    producer.fails[topic] = deque([kafka_error(KafkaError.MSG_SIZE_TOO_LARGE)] * total)
    refused_id = "{:08d}-5d1c-4f7e-9a53-0e6f3c1d2a10".format
    sess = new_session()
    relay.decoder.on_change(sess, relation())
    lsn = 0x10_0000
    for first in range(0, total, per_tx):
        relay.decoder.on_change(sess, begin(lsn))
        for n in range(first, first + per_tx):
            relay.decoder.on_change(sess, insert(row(event_id=refused_id(n))))
        relay.decoder.on_change(sess, commit(lsn))
        lsn += 0x1000
        producer.poll()  # refusals of batches: suspects
    assert isinstance(sess.fatal, KafkaError), "a refused batch ends the session"
    assert not sess.pending_dlq and not producer.to(DLQ), "no batch-mate dead-lettered"
    assert len(relay.poison) == bound
    assert sample(relay, "outbox_relay_poison_ids") == bound
    assert {alone for _, _, alone in relay.poison.values()} == {False}

    # Read again: the suspects still remembered go alone, each refused alone.
    producer.fails[topic] = deque([kafka_error(KafkaError.MSG_SIZE_TOO_LARGE)] * bound)
    sess = new_session()
    relay.decoder.on_change(sess, relation())
    lsn = 0x100_0000
    for first in range(total - bound, total, per_tx):
        relay.decoder.on_change(sess, begin(lsn))
        for n in range(first, first + per_tx):
            relay.decoder.on_change(sess, insert(row(event_id=refused_id(n))))
        relay.decoder.on_change(sess, commit(lsn))
        lsn += 0x1000
        relay.dead_letters.drain(sess)
        producer.poll()  # dead letters written
    for n in range(1_000):
        relay.decoder.on_change(sess, begin(lsn))
        relay.decoder.on_change(
            sess,
            insert(row(event_id=f"{n:08d}-aaaa-4f7e-9a53-0e6f3c1d2a10", aggregatetype=b"x %d" % n)),
        )
        relay.decoder.on_change(sess, commit(lsn))
        lsn += 0x1000
    relay.dead_letters.drain(sess)
    producer.poll()

    assert sess.fatal is None
    assert len(relay.poison) == bound
    assert {alone for _, _, alone in relay.poison.values()} == {True}
    assert len(producer.to(DLQ)) == bound + 1_000
    series = {
        s.labels["reason"]
        for metric in relay.registry.collect()
        if metric.name == "outbox_relay_dead_lettered"
        for s in metric.samples
        if s.name.endswith("_total")
    }
    assert series == {"too_large", "invalid_topic"}
    assert sample(relay, "outbox_relay_dead_lettered_total", {"reason": "too_large"}) == bound
    assert sess.tracker.in_flight == 0
    assert sess.tracker.confirmable == lsn - 0x1000 + 40
    reasons = {dict(s.headers)["dlq.reason"] for s in producer.to(DLQ)}
    assert b"Broker: Message size too large" in reasons
    assert b"aggregatetype 'x 999' makes an invalid topic name 'outbox.event.x 999'" in reasons


# --- dead letters that cannot be written -------------------------------------------------


@pytest.mark.parametrize(
    ("failure", "cause"),
    [
        (BufferError("Local: Queue full"), "local queue is full"),
        (KafkaException(KafkaError(KafkaError._TRANSPORT, "broker down")), "broker down"),
        (KafkaException(KafkaError(KafkaError._UNKNOWN_TOPIC)), "Unknown topic"),
    ],
    ids=["BufferError", "KafkaException-transport", "KafkaException-unknown-topic"],
)
def test_a_dead_letter_produce_that_raises_holds_the_stream_and_is_retried_after_a_back_off(
    relay: Relay, failure: BaseException, cause: str
) -> None:
    producer = producer_of(relay)
    producer.raises[DLQ] = [failure, failure]
    sess = new_session()
    relay.decoder.on_change(sess, relation())
    malformed_tx(relay, sess, 0x1000)

    relay.dead_letters.drain(sess)
    assert sess.held is not None and cause in sess.held
    assert len(sess.pending_dlq) == 1, "the dead letter stays in line"
    assert sess.tracker.in_flight == 1
    assert sess.tracker.confirmable == 0, "its transaction is not confirmed"
    first_retry_in = sess.dlq_retry_at - time.monotonic()
    assert 0 < first_retry_in <= DLQ_RETRY_MIN_S

    relay.dead_letters.drain(sess)
    assert producer.attempts[DLQ] == 1, "no retry before the back-off has passed"

    sess.dlq_retry_at = 0.0  # the back-off has passed
    relay.dead_letters.drain(sess)
    assert producer.attempts[DLQ] == 2
    assert sess.dlq_retry_at - time.monotonic() > first_retry_in, "the back-off grows"

    sess.dlq_retry_at = 0.0
    relay.dead_letters.drain(sess)
    producer.poll()
    assert len(producer.to(DLQ)) == 1
    assert sess.held is None and not sess.pending_dlq
    assert sess.tracker.in_flight == 0
    assert sess.tracker.confirmable == 0x1000 + 40
    assert sample(relay, "outbox_relay_dead_letter_retries_total") == 2
    assert sample(relay, "outbox_relay_dead_lettered_total", {"reason": "invalid_topic"}) == 1


def test_a_failed_dead_letter_report_puts_it_back_in_line_and_the_retry_writes_it(
    relay: Relay,
) -> None:
    producer = producer_of(relay)
    producer.fails[DLQ] = deque([kafka_error(KafkaError.UNKNOWN_TOPIC_OR_PART)])
    sess = new_session()
    relay.decoder.on_change(sess, relation())
    malformed_tx(relay, sess, 0x1000)
    relay.dead_letters.drain(sess)
    producer.poll()

    assert sess.held is not None and "UNKNOWN_TOPIC_OR_PART" in sess.held
    assert len(sess.pending_dlq) == 1
    assert sess.tracker.confirmable == 0
    assert sample(relay, "outbox_relay_kafka_errors_total", {"code": "UNKNOWN_TOPIC_OR_PART"}) == 1

    sess.dlq_retry_at = 0.0
    relay.dead_letters.drain(sess)
    producer.poll()
    assert sess.held is None
    assert sess.tracker.confirmable == 0x1000 + 40
    assert len(producer.to(DLQ)) == 2  # the failed attempt and the written one


def test_while_a_dead_letter_fails_the_relay_is_held_not_ready_and_reads_no_wal(
    relay: Relay,
) -> None:
    producer = producer_of(relay)
    failure = KafkaException(KafkaError(KafkaError._TRANSPORT, "broker down"))
    producer.raises[DLQ] = [failure] * 100
    stream = ReadNothing()
    sess = new_session(stream)
    relay.decoder.on_change(sess, relation())
    malformed_tx(relay, sess, 0x1000)
    states: list[tuple[RelayState, bool, str]] = []
    real_poll = producer.poll

    def poll(timeout: float = 0) -> int:
        states.append((relay.state, relay.liveness.ready, relay.liveness.state))
        if len(states) >= 6:
            relay.stop()
        return real_poll(timeout)

    producer.poll = poll  # type: ignore[method-assign]
    relay._stream_loop(sess)  # ReadNothing fails the test if WAL is read

    held = [s for s in states if s[0] is RelayState.HELD]
    assert held, states
    assert all(not ready for _, ready, _ in held)
    assert "held: dead letter to outbox.dlq not written" in held[-1][2]
    assert "broker down" in held[-1][2]
    assert stream.statuses, "the server still gets status updates"
    assert producer.attempts[DLQ] == 1, "retried only after the back-off"


def test_a_dead_letter_kafka_refuses_for_its_size_is_written_in_minimal_form(
    relay: Relay,
) -> None:
    """A 3 MB key Kafka refuses locally, then again in its dead letter; and a
    2 MB aggregatetype the router refuses, quoted twice in the reason: both
    dead letters are refused for their size, then written minimal."""
    producer = producer_of(relay)
    topic = "outbox.event.user"
    relay._topics.known.add(topic)
    relay.decoder.topic_of[b"user"] = topic
    too_large = KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
    producer.raises[topic] = [too_large]
    producer.raises[DLQ] = [too_large, None, too_large, None]  # each: full refused, minimal ok
    sess = new_session()
    relay.decoder.on_change(sess, relation())
    relay.decoder.on_change(sess, begin(0x1000))
    relay.decoder.on_change(sess, insert(row(aggregateid=b"k" * 3_000_000)))
    second = "1c0e8e0a-0d55-4b44-8d1e-7f6f8f1a2b3c"
    relay.decoder.on_change(
        sess, insert(row(event_id=second, aggregatetype=b"t" * 2_000_000 + b" x"))
    )
    relay.decoder.on_change(sess, commit(0x1000))

    relay.dead_letters.drain(sess)
    producer.poll()

    big_key, big_reason = producer.to(DLQ)
    assert len(big_key.key) == DLQ_MINIMAL_FIELD_BYTES
    assert b'"original_key_size":3000000' in big_key.value
    assert dict(big_key.headers)["id"] == b"0b9f6f2e-5d1c-4f7e-9a53-0e6f3c1d2a10"
    headers = dict(big_reason.headers)
    assert all(len(v) <= DLQ_MINIMAL_FIELD_BYTES for v in headers.values())
    assert headers["dlq.reason"].startswith(b"aggregatetype 'ttt")
    assert headers["id"] == second.encode()
    assert b'"truncated":true' in big_reason.value
    assert sess.held is None
    assert sess.tracker.confirmable == 0x1000 + 40


def test_a_purged_dead_letter_is_not_put_back_in_line(relay: Relay) -> None:
    producer = producer_of(relay)
    producer.fails[DLQ] = deque([kafka_error(KafkaError._PURGE_QUEUE)])
    sess = new_session()
    relay.decoder.on_change(sess, relation())
    malformed_tx(relay, sess, 0x1000)
    relay.dead_letters.drain(sess)
    producer.poll()
    assert not sess.pending_dlq and sess.held is None
    assert sess.tracker.in_flight == 1, "never acknowledged: read again by the next session"


# --- fatal producer errors -------------------------------------------------------------


def test_a_fatal_error_raised_from_poll_ends_the_session_as_producer_fatal(relay: Relay) -> None:
    fatal = KafkaError(KafkaError._GAPLESS_GUARANTEE, "gap-less guarantee", fatal=True)
    producer_of(relay).poll_raises.append(KafkaException(fatal))
    with pytest.raises(ProducerFatalError, match="_GAPLESS_GUARANTEE: gap-less guarantee"):
        relay._poll(0)
    assert relay._events.fatal == "gap-less guarantee"
    assert sample(relay, "outbox_relay_kafka_errors_total", {"code": "_GAPLESS_GUARANTEE"}) == 1


@pytest.mark.parametrize(
    ("poll_raises", "named"),
    [
        ([KafkaException(KafkaError(KafkaError._GAPLESS_GUARANTEE, "gap", fatal=True))], "gap"),
        ([], "_FATAL"),
    ],
    ids=["fatal-error-raised-by-the-next-poll", "already-raised"],
)
def test_produce_refusing_with_fatal_on_the_hot_path_ends_the_session_as_producer_fatal(
    relay: Relay, poll_raises: list[BaseException], named: str
) -> None:
    """Before: ``_FATAL`` from produce ended the session as Kafka trouble and the
    next session reused the dead producer - a reconnect loop delivering nothing.
    The cause named is the fatal error itself when a poll still raises it."""
    producer = producer_of(relay)
    topic = "outbox.event.user"
    relay._topics.known.add(topic)
    relay.decoder.topic_of[b"user"] = topic
    producer.raises[topic] = [KafkaException(KafkaError(KafkaError._FATAL))]
    producer.poll_raises = poll_raises
    sess = new_session()
    relay.decoder.on_change(sess, relation())
    relay.decoder.on_change(sess, begin(0x1000))
    with pytest.raises(ProducerFatalError, match=named):
        relay.decoder.on_change(sess, insert(row()))
    assert sess.tracker.confirmable == 0
    assert relay._events.fatal is not None


def test_a_fatal_dead_letter_produce_ends_the_session_as_producer_fatal(relay: Relay) -> None:
    producer_of(relay).raises[DLQ] = [KafkaException(KafkaError(KafkaError._FATAL))]
    sess = new_session()
    relay.decoder.on_change(sess, relation())
    malformed_tx(relay, sess, 0x1000)
    with pytest.raises(ProducerFatalError):
        relay.dead_letters.drain(sess)
    assert sess.tracker.confirmable == 0


def test_other_poll_errors_end_the_session_as_kafka_trouble_not_an_exit(relay: Relay) -> None:
    producer_of(relay).poll_raises.append(KafkaException(KafkaError(KafkaError._TRANSPORT)))
    with pytest.raises(KafkaUnavailableError) as info:
        relay._poll(0)
    assert not isinstance(info.value, ProducerFatalError)


def test_each_fatal_error_rebuilds_the_producer_after_a_growing_back_off(
    relay: Relay, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sessions that die of a fatal error at once, again and again: each is
    followed by a discard of the producer and a wait that never drops below
    REBUILD_MIN_S and doubles up to REBUILD_MAX_S; no exception escapes."""
    sessions = 0
    producers: list[object] = []
    seen: list[tuple[float, RelayState, bool, str, bool]] = []

    def session() -> None:
        nonlocal sessions
        sessions += 1
        if relay._producer is None:
            relay._producer = ScriptedProducer()  # type: ignore[assignment]
        producers.append(relay._producer)
        raise ProducerFatalError("producer fatal error _FATAL: fenced")

    discarded: list[object] = []

    def wait(delay_s: float) -> None:
        seen.append(
            (
                delay_s,
                relay.state,
                relay.liveness.ready,
                relay.liveness.state,
                relay._producer is None,
            )
        )
        if len(seen) == 10:
            relay.stop()

    monkeypatch.setattr(relay, "_session", session)
    monkeypatch.setattr(relay, "_wait", wait)
    monkeypatch.setattr(relay_mod, "discard_producer", discarded.append)
    relay._run_sessions()

    delays = [d for d, *_ in seen]
    assert delays == [min(REBUILD_MIN_S * 2**n, REBUILD_MAX_S) for n in range(10)]
    assert all(state is RelayState.REBUILDING for _, state, *_ in seen)
    assert not any(ready for _, _, ready, *_ in seen)
    assert seen[0][3] == "rebuilding: producer fatal error _FATAL: fenced"
    assert all(gone for *_, gone in seen), "the producer is dropped before the wait"
    assert discarded == producers, "every dead producer was purged and closed"
    assert len(set(map(id, producers))) == 10, "each session had a new producer"
    assert sample(relay, "outbox_relay_producer_rebuilds_total") == 10


def test_a_standby_serves_a_kept_producer_and_rebuilds_it_after_a_fatal_error(
    relay: Relay, monkeypatch: pytest.MonkeyPatch
) -> None:
    """librdkafka queues log lines and errors until served: a standby keeps
    polling a producer it kept, and a fatal error found there is handled."""
    producer = producer_of(relay)
    fatal = KafkaError(KafkaError._FATAL, "fenced", fatal=True)
    producer.poll_raises.append(KafkaException(fatal))
    discarded: list[object] = []
    monkeypatch.setattr(relay_mod, "discard_producer", discarded.append)
    monkeypatch.setattr(relay, "_wait", lambda delay_s: None)
    relay.standby.wait("slot busy")
    assert producer.polls == 1
    assert discarded == [producer] and relay._producer is None
    assert relay.state is RelayState.REBUILDING
    assert sample(relay, "outbox_relay_producer_rebuilds_total") == 1


def test_discarding_a_producer_purges_its_records_unacknowledged_and_closes_it() -> None:
    producer = Producer({"bootstrap.servers": "127.0.0.1:9", "log_level": 0})
    reports: list[str] = []
    for n in range(3):
        producer.produce("t", b"v%d" % n, callback=lambda err, _m: reports.append(err.name()))
    discard_producer(producer)
    assert reports == ["_PURGE_QUEUE"] * 3
    with pytest.raises(RuntimeError):  # closed
        producer.produce("t", b"after")


# --- librdkafka's own errors and logs ---------------------------------------------------


def _served_until(serve: Any, done: Any, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        serve()
        time.sleep(0.05)
    return bool(done())


def test_the_producers_and_admin_clients_errors_and_logs_reach_logging_and_the_metric(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Both clients point at a closed port: librdkafka reports transport errors
    (error_cb) and logs connection failures; both reach the logging tree and
    the relay's counter - once the clients are served (poll)."""
    counted: list[str] = []
    events = {name: KafkaClientEvents(name, count=counted.append) for name in ("producer", "admin")}
    producer = make_producer("127.0.0.1:9", {}, events=events["producer"])
    topics = TopicManager(
        bootstrap="127.0.0.1:9",
        overrides={},
        partitions=1,
        replication_factor=1,
        events=events["admin"],
    )
    with caplog.at_level(logging.INFO):
        assert _served_until(lambda: producer.poll(0), lambda: "_TRANSPORT" in counted)
        produced = len(counted)
        assert _served_until(topics.serve, lambda: len(counted) > produced)
    loggers = {r.name for r in caplog.records}
    assert {"kafka.producer", "kafka.admin", "cdc.kafka.log"} <= loggers
    assert {r.kafka_client for r in caplog.records if r.name == "cdc.kafka.log"} == {  # type: ignore[attr-defined]
        "producer",
        "admin",
    }
    discard_producer(producer)


# --- delivery reports counted per run of records (cdc.relay.stream.producing.Reports) ----------


def test_records_are_acknowledged_only_once_every_report_is_served_and_the_session_let_go(
    relay: Relay,
) -> None:
    """A transaction's records share one Reports: nothing is acknowledged before
    their reports are served, nor while the session may still add records to it
    (the open transaction); letting go then acknowledges them in one step."""
    producer = producer_of(relay)
    topic = "outbox.event.user"
    relay._topics.known.add(topic)
    relay.decoder.topic_of[b"user"] = topic
    sess = new_session()
    relay.decoder.on_change(sess, relation())
    relay.decoder.on_change(sess, begin(0x1000))
    for n in range(3):
        relay.decoder.on_change(sess, insert(row(event_id=f"{n:08d}-5d1c-4f7e-9a53-0e6f3c1d2a10")))
    producer.poll()  # all three reported; the transaction is still open
    assert sess.tracker.in_flight == 3, "still countable: the session holds the Reports"
    sess.reports = None  # (the loop lets go after each read batch)
    assert sess.tracker.in_flight == 0
    relay.decoder.on_change(sess, insert(row(event_id="00000009-5d1c-4f7e-9a53-0e6f3c1d2a10")))
    relay.decoder.on_change(sess, commit(0x1000))
    assert sess.tracker.in_flight == 1, "produced, not yet reported: not acknowledged"
    assert sess.tracker.confirmable == 0
    producer.poll()
    assert sess.tracker.in_flight == 0
    assert sess.tracker.confirmable == 0x1000 + 40
    assert sess.acked == {topic: 4}


def test_refused_reports_of_alike_records_in_one_transaction_are_matched_to_their_ids(
    relay: Relay,
) -> None:
    """Reports carry no headers: a refused record's event id is found by its key
    and value among the records its Reports counted, each id claimed once, even
    when several records are alike in both; the others are acknowledged. Refused
    with their batch, the two are suspects (the session ends); read again, each is
    produced alone: the one refused alone is dead-lettered, the other delivered and
    forgotten."""
    producer = producer_of(relay)
    topic = "outbox.event.user"
    relay._topics.known.add(topic)
    relay.decoder.topic_of[b"user"] = topic
    ids = [f"{n:08d}-5d1c-4f7e-9a53-0e6f3c1d2a10" for n in range(4)]
    sess = new_session()
    relay.decoder.on_change(sess, relation())
    relay.decoder.on_change(sess, begin(0x1000))
    relay.decoder.on_change(sess, insert(row(event_id=ids[0], payload=b'{"a":1}')))
    for event_id in ids[1:]:
        relay.decoder.on_change(sess, insert(row(event_id=event_id, payload=b'{"a":2}')))
    relay.decoder.on_change(sess, commit(0x1000))
    refused = kafka_error(KafkaError.MSG_SIZE_TOO_LARGE)
    # reports in produce order: the first delivered, the next two refused, the last delivered
    producer.fails[topic] = deque([None, refused, refused, None])  # type: ignore[list-item]
    producer.poll()
    relay.dead_letters.drain(sess)
    producer.poll()

    assert not producer.to(DLQ) and sess.fatal is refused
    assert sorted(relay.poison) == sorted([ids[1].encode(), ids[2].encode()])
    assert sess.tracker.in_flight == 2 and sess.acked == {topic: 2}

    sess = new_session()  # read again: ids[1] refused alone, ids[2] delivered alone
    producer.fails[topic] = deque([None, refused, None, None])  # type: ignore[list-item]
    relay.decoder.on_change(sess, relation())
    relay.decoder.on_change(sess, begin(0x1000))
    relay.decoder.on_change(sess, insert(row(event_id=ids[0], payload=b'{"a":1}')))
    for event_id in ids[1:]:
        relay.decoder.on_change(sess, insert(row(event_id=event_id, payload=b'{"a":2}')))
    relay.decoder.on_change(sess, commit(0x1000))
    producer.poll()
    relay.dead_letters.drain(sess)
    producer.poll()

    assert sess.fatal is None
    assert [dict(r.headers)["id"] for r in producer.to(DLQ)] == [ids[1].encode()]
    assert list(relay.poison.items()) == [
        (ids[1].encode(), (DeadLetterCode.TOO_LARGE, "Broker: Message size too large", True))
    ]
    assert sess.tracker.in_flight == 0
    assert sess.tracker.confirmable == 0x1000 + 40
    # (counted: ids[0] before ids[1] went alone - the wait for its report answered the
    # server and moved the count to the metric - then ids[2] and ids[3])
    relayed = sample(relay, "outbox_relay_events_total", {"topic": topic})
    assert relayed + sess.acked.get(topic, 0) == 3
