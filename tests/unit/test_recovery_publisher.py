"""The gap recovery's publisher (cdc.repair.publisher.Publisher) against a producer
that reports like confluent-kafka with ``delivery.report.only.error``: a delivered
record calls nothing, a refused one calls its callback; reports carry no headers.

A record the broker refuses when it reports (not when ``produce`` is called) is
dead-lettered with its event id, found by its key and value among the records its
callback counted (the report has no headers), even among records alike in key."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from confluent_kafka import KafkaError

from cdc import constants as c
from cdc.errors import KafkaUnavailableError
from cdc.repair.publisher import Acks, Publisher
from cdc.repair.republish import outbox_record
from cdc.router import KafkaRecord, TxContext
from cdc.settings import Settings
from tests.unit.test_relay_routing import FakeTopics

DLQ = "outbox.dlq"


class Report:
    """A delivery report's message: no headers (as librdkafka's)."""

    def __init__(self, topic: str, key: bytes, value: bytes, timestamp: int) -> None:
        self._topic, self._key, self._value, self._ts = topic, key, value, timestamp

    def topic(self) -> str:
        return self._topic

    def key(self) -> bytes:
        return self._key

    def value(self) -> bytes:
        return self._value

    def headers(self) -> None:
        return None

    def timestamp(self) -> tuple[int, int]:
        return (1, self._ts)


class ReportingProducer:
    """Refuses the records whose key is in ``refuse`` when it reports them."""

    def __init__(self, refuse: set[bytes]) -> None:
        self.refuse = refuse
        self.produced: list[tuple[str, bytes, list[tuple[str, bytes]]]] = []
        self.pending: list[tuple[Any, Report]] = []

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
        self.produced.append((topic, key, list(headers)))
        self.pending.append((callback, Report(topic, key, value, timestamp)))

    def poll(self, timeout: float = 0) -> int:
        pending, self.pending = self.pending, []
        for callback, report in pending:
            if report.key() in self.refuse and report.topic() != DLQ:
                callback(KafkaError(KafkaError.INVALID_TIMESTAMP), report)
        return len(pending)

    def flush(self, timeout: float = 0) -> int:
        self.poll()
        return len(self.pending)

    def __len__(self) -> int:
        return len(self.pending)


def _record(n: int) -> KafkaRecord:
    event_id = f"{n:08d}-5d1c-4f7e-9a53-0e6f3c1d2a10"
    headers = [(c.HEADER_ID, event_id.encode()), (c.HEADER_TYPE, b"T"), ("recovered", b"7")]
    return KafkaRecord("outbox.event.user", b"k%d" % n, b'{"n": %d}' % n, headers, 1_000, event_id)


def test_a_record_refused_in_its_report_is_dead_lettered_with_its_event_id() -> None:
    producer = ReportingProducer(refuse={b"k1"})
    topics = FakeTopics()
    settings = Settings(pg_dsn="postgresql://x", kafka_bootstrap_servers="x:1", dlq_topic=DLQ)
    publisher = Publisher(settings, producer, topics, Acks())  # type: ignore[arg-type]
    records = [_record(n) for n in range(3)]
    alike = dataclasses.replace(
        records[1], event_id="00000009-5d1c-4f7e-9a53-0e6f3c1d2a10", value=b"{}"
    )
    for record in [*records, alike]:  # (the last: same key as a refused one, another value)
        publisher.send(record)

    publisher.wait_acked()

    dead = [(key, dict(headers)) for topic, key, headers in producer.produced if topic == DLQ]
    assert [(key, h[c.HEADER_ID]) for key, h in dead] == [
        (b"k1", records[1].event_id.encode()),
        (b"k1", alike.event_id.encode()),
    ]
    assert all(h[c.HEADER_DLQ_REASON].startswith(b"Kafka refused the record") for _, h in dead)
    assert publisher.sent == 4, "each refused record is replaced by its dead letter"
    assert not producer.pending


class FakeTransactions:
    """:class:`cdc.repair.transactional.Transactions` over a :class:`ReportingProducer`:
    what each committed transaction held; ``fail_commits`` commits fail (abortable)."""

    def __init__(
        self,
        producer: ReportingProducer,
        max_records: int,
        fail_commits: int = 0,
        present: frozenset[str] = frozenset(),
    ):
        self.producer = producer
        self.present = present
        self.begun = 0
        self.max_records = max_records
        self.fail_commits = fail_commits
        self.skipped = 0
        self.open = False
        self.start = 0
        self.committed: list[list[tuple[str, bytes, list[tuple[str, bytes]]]]] = []
        self.aborted = 0

    def skip(self, event_id: str) -> bool:
        if event_id in self.present:
            self.skipped += 1
            return True
        return False

    def begin(self) -> None:
        if not self.open:
            self.open, self.start = True, len(self.producer.produced)
            self.begun += 1

    def full(self, records: int) -> bool:
        return self.open and records >= self.max_records

    def commit(self) -> None:
        if not self.open:  # (as Transactions.commit: nothing open, nothing to commit)
            return
        if self.fail_commits:
            self.fail_commits -= 1
            raise KafkaUnavailableError("commit_transaction failed: an abortable error")
        self.committed.append(self.producer.produced[self.start :])
        self.open = False

    def abort(self, *, strict: bool = False) -> None:
        self.open = False
        self.aborted += 1

    def renew(self) -> ReportingProducer:
        """The failed transaction aborted; the same stand-in producer (its reports kept)."""
        self.abort()
        return self.producer


def _eos_publisher(
    refuse: set[bytes],
    max_records: int,
    fail_commits: int = 0,
    present: frozenset[str] = frozenset(),
) -> tuple[Publisher, FakeTransactions]:
    producer = ReportingProducer(refuse=refuse)
    settings = Settings(pg_dsn="postgresql://x", kafka_bootstrap_servers="x:1", dlq_topic=DLQ)
    tx = FakeTransactions(producer, max_records, fail_commits, present)
    publisher = Publisher(settings, producer, FakeTopics(), Acks(), tx=tx, again=_again)  # type: ignore[arg-type]
    return publisher, tx


def _again(ids: list[str]) -> list[KafkaRecord]:
    """The redo source of :func:`_record`'s records (the table's rows, made again)."""
    return [_record(int(event_id[:8])) for event_id in ids]


def _ids(records: list[tuple[str, bytes, list[tuple[str, bytes]]]]) -> list[bytes]:
    return [dict(headers)[c.HEADER_ID] for _, _, headers in records]


def test_a_window_is_published_in_transactions_of_at_most_max_records_each_once() -> None:
    """23 records, CDC_TX_MAX_RECORDS 5: five transactions (5, 5, 5, 5, 3), in order,
    every record in exactly one of them - never the window in one."""
    publisher, tx = _eos_publisher(set(), max_records=5)
    records = [_record(n) for n in range(23)]
    for record in records:
        publisher.send(record)
    publisher.wait_acked()
    assert [len(t) for t in tx.committed] == [5, 5, 5, 5, 3]
    assert [i for t in tx.committed for i in _ids(t)] == [r.event_id.encode() for r in records]
    assert publisher.sent == 23 and not tx.open and tx.aborted == 0


def test_a_transaction_with_a_refused_record_is_aborted_and_redone_alone() -> None:
    """A record Kafka refuses in its report makes its transaction fail: that one is
    aborted and redone with the record produced alone (Kafka judges a batch: it may
    have been an innocent batch-mate); refused alone, it is aborted and redone again,
    with the record's dead letter; the transactions before and after it are committed
    once, untouched."""
    publisher, tx = _eos_publisher({b"k7"}, max_records=5)
    records = [_record(n) for n in range(12)]
    for record in records:
        publisher.send(record)
    publisher.wait_acked()
    assert tx.aborted == 2 and publisher.redone == 2
    assert publisher.alone == {records[7].event_id}
    assert [len(t) for t in tx.committed] == [5, 5, 2]
    second = tx.committed[1]
    assert [topic for topic, _, _ in second] == [records[5].topic] * 2 + [DLQ] + [
        records[5].topic
    ] * 2
    ids = [i for t in tx.committed for i in _ids(t)]
    assert ids == [r.event_id.encode() for r in records], (
        "each once, the refused one as a dead letter"
    )
    assert publisher.sent == 12


def test_a_failed_commit_redoes_the_transaction_and_gives_up_after_its_attempts() -> None:
    from cdc.repair.publisher import TX_ATTEMPTS

    publisher, tx = _eos_publisher(set(), max_records=4, fail_commits=2)
    for record in [_record(n) for n in range(6)]:
        publisher.send(record)
    publisher.wait_acked()
    assert [len(t) for t in tx.committed] == [4, 2] and tx.aborted == 2
    assert publisher.sent == 6
    publisher, tx = _eos_publisher(set(), max_records=4, fail_commits=TX_ATTEMPTS + 1)
    with pytest.raises(KafkaUnavailableError, match=f"aborted {TX_ATTEMPTS} times"):
        for record in [_record(n) for n in range(4)]:
            publisher.send(record)
        publisher.wait_acked()
    assert not tx.committed


def test_records_made_while_a_commit_is_under_way_wait_for_the_next_transaction() -> None:
    """A full transaction's commit runs on a thread of its own; the records sent
    meanwhile are held - none joins the committing transaction - and produced, in the
    order sent, into the next one once the commit returned."""
    import threading

    publisher, tx = _eos_publisher(set(), max_records=5)
    release = threading.Event()
    commit = tx.commit

    def slow_commit() -> None:
        assert release.wait(10)
        commit()

    tx.commit = slow_commit  # type: ignore[method-assign]
    records = [_record(n) for n in range(8)]
    for record in records[:5]:
        publisher.send(record)
    assert publisher.job is not None  # (the first transaction's commit, under way)
    for record in records[5:]:
        publisher.send(record)
    assert len(tx.producer.produced) == 5 and len(publisher.held) == 3
    release.set()
    publisher.wait_acked()
    assert [len(t) for t in tx.committed] == [5, 3]
    assert [i for t in tx.committed for i in _ids(t)] == [r.event_id.encode() for r in records]


def test_held_records_that_fill_a_transaction_start_its_commit_and_the_rest_wait() -> None:
    """Commits slower than the reading: the records held while one commits fill the next
    transaction, whose commit then starts on its thread at once (not inline, holding the
    reading up) while the records after it are held in turn; every transaction at most
    ``max_records``, every record once, in the order sent."""
    import time

    publisher, tx = _eos_publisher(set(), max_records=5)
    commit = tx.commit

    def slow_commit() -> None:
        time.sleep(0.2)
        commit()

    tx.commit = slow_commit  # type: ignore[method-assign]
    records = [_record(n) for n in range(17)]
    for record in records[:10]:
        publisher.send(record)
    # (the tenth filled the held records: the first commit ended, the second is under way)
    assert publisher.job is not None and not publisher.held and len(tx.committed) == 1
    for record in records[10:]:
        publisher.send(record)
    publisher.wait_acked()
    assert [len(t) for t in tx.committed] == [5, 5, 5, 2]
    assert [i for t in tx.committed for i in _ids(t)] == [r.event_id.encode() for r in records]
    assert publisher.job is None and not publisher.held and not tx.open


def test_a_window_kafka_holds_already_opens_no_transaction() -> None:
    """Edge: every row present in Kafka - nothing produced, no transaction begun (an empty
    Kafka transaction still costs the coordinator its round trips); one missing row among
    them opens exactly one."""
    records = [_record(n) for n in range(6)]
    publisher, tx = _eos_publisher(set(), 5, present=frozenset(r.event_id for r in records))
    for record in records:
        publisher.send(record)
    publisher.wait_acked()
    assert tx.begun == 0 and not tx.committed and tx.skipped == 6 and publisher.sent == 0
    publisher, tx = _eos_publisher(set(), 5, present=frozenset(r.event_id for r in records[1:]))
    for record in records:
        publisher.send(record)
    publisher.wait_acked()
    assert tx.begun == 1 and [_ids(t) for t in tx.committed] == [[records[0].event_id.encode()]]


ORIGIN = (c.HEADER_ORIGIN, b"7301/2/outbox_slot")


def test_a_republished_dead_letter_carries_the_republishers_origin() -> None:
    """Edge: both ways a republished row becomes a dead letter - Kafka refuses its record
    in the report (no headers come back), or the router refuses the row read from the
    table (no commit LSN: the table does not hold it) - give a dead letter with the
    run's ``origin`` (cdc.evidence: every record the relay publishes carries one)."""
    producer = ReportingProducer(refuse={b"k1"})
    settings = Settings(pg_dsn="postgresql://x", kafka_bootstrap_servers="x:1", dlq_topic=DLQ)
    publisher = Publisher(settings, producer, FakeTopics(), Acks(), origin=ORIGIN)  # type: ignore[arg-type]
    publisher.send(_record(1))
    publisher.wait_acked()
    refused = [dict(h) for topic, _, h in producer.produced if topic == DLQ]
    assert [h[c.HEADER_ORIGIN] for h in refused] == [ORIGIN[1]]

    unroutable = ("0000000a-5d1c-4f7e-9a53-0e6f3c1d2a10", "", "agg-1", "T", "{}", None)
    record = outbox_record(unroutable, TxContext("", 1_000_000, ORIGIN), settings, b"verify")
    assert record.topic == DLQ  # (no aggregate type: no topic)
    headers = dict(record.headers)
    assert headers[c.HEADER_ORIGIN] == ORIGIN[1]
    assert c.HEADER_LSN not in headers  # (no commit LSN is made up)
    assert headers[c.HEADER_RECOVERED] == b"verify"


class BatchJudgingProducer(ReportingProducer):
    """Refuses, when it reports them, every record served with one whose key is in
    ``refuse`` - a batch judged whole, as Kafka does - and no other."""

    def poll(self, timeout: float = 0) -> int:
        pending, self.pending = self.pending, []
        batch_refused = any(r.key() in self.refuse and r.topic() != DLQ for _, r in pending)
        for callback, report in pending:
            if batch_refused and report.topic() != DLQ:
                callback(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE), report)
        return len(pending)


def test_a_refused_batch_is_judged_record_by_record_and_an_alike_record_is_not_lost() -> None:
    """At-least-once republishing: a batch refused whole (one guilty record in it) names
    suspects; each is made again from its row and produced alone, and only the guilty one
    is dead-lettered. One suspect has an alike record (same key and value, another id)
    delivered earlier in the same run: the report cannot say which of the two was
    refused, so both are judged again - the refused one is not taken for delivered."""
    producer = BatchJudgingProducer(refuse={b"k2"})
    settings = Settings(pg_dsn="postgresql://x", kafka_bootstrap_servers="x:1", dlq_topic=DLQ)
    records = [_record(n) for n in range(4)]
    other = "00000009-5d1c-4f7e-9a53-0e6f3c1d2a10"
    headers = [(c.HEADER_ID, other.encode()), *records[1].headers[1:]]
    alike = dataclasses.replace(records[1], event_id=other, headers=headers)
    rows = {r.event_id: r for r in [*records, alike]}
    publisher = Publisher(
        settings,
        producer,  # type: ignore[arg-type]
        FakeTopics(),  # type: ignore[arg-type]
        Acks(),
        again=lambda ids: [rows[i] for i in ids],
    )
    publisher.send(alike)
    producer.poll()  # (alone in its batch: delivered)
    for record in records:  # (one batch with the guilty k2: refused whole)
        publisher.send(record)
    publisher.wait_acked()

    delivered = [
        dict(headers)[c.HEADER_ID].decode()
        for topic, key, headers in producer.produced
        if topic != DLQ
    ]
    dead = [dict(h)[c.HEADER_ID].decode() for topic, _, h in producer.produced if topic == DLQ]
    assert dead == [records[2].event_id]
    assert set(delivered) == {r.event_id for r in [*records, alike]}
    assert publisher.alone >= {r.event_id for r in records}, "each judged alone"
    assert not producer.pending
