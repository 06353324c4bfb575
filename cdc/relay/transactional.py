"""Exactly-once mode outside the stream: gap recovery, the start-up check and the audit's repair.

Guarantees (``CDC_DELIVERY=exactly-once`` only; at-least-once publishing is unchanged):

* :func:`present_ids` reads, with ``isolation.level=read_committed``, the ``id``
  header of every record of the relay's outbox topics and its dead-letter topic
  from the first offset whose timestamp is at or after ``since_ms`` to the end of
  each partition (a row's records carry its commit time: every record of a row
  committed since then lies there, republished ones included); bounded by
  :data:`READ_STALL_S` without progress;
* a publisher (:class:`cdc.relay.republish.Publisher`) given a
  :class:`Transactions` skips every row whose id is present, and publishes the rest
  inside Kafka transactions of its own ``transactional.id`` (the relay's plus
  ``.recovery`` or ``.repair``: a second run of the same kind fences the first;
  the streaming relay's id is never taken), each committed once Kafka
  acknowledged its records (:meth:`Transactions.commit`): a read_committed
  consumer sees a republished row once, or - after a failure - not at all, and
  the next run publishes it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from cdc import constants as c
from cdc.errors import KafkaUnavailableError
from cdc.kafkalog import KafkaClientEvents
from cdc.producer import producer_config
from cdc.settings import Settings

log = logging.getLogger("cdc.relay")

#: Kafka requests (metadata, offsets) of the read give up after this.
KAFKA_TIMEOUT_S = 15.0
#: A read of the present ids that makes no progress this long fails.
READ_STALL_S = 60.0
#: init_transactions / commit_transaction / abort_transaction wait at most this long.
TX_CALL_TIMEOUT_S = 30.0


def exactly_once(settings: Settings) -> bool:
    return settings.delivery == "exactly-once"


def transactional_id(settings: Settings, system_id: str, purpose: str) -> str:
    """The id of the relay's publishing of ``purpose`` (recovery, repair)."""
    base = settings.transactional_id or f"outbox-cdc.{system_id}.{settings.slot}"
    return f"{base}.{purpose}"


class Transactions:
    """A transactional producer publishing outside the stream, and the ids to skip."""

    def __init__(self, settings: Settings, *, system_id: str, purpose: str) -> None:
        config: dict[str, Any] = dict(
            producer_config(settings.kafka_bootstrap_servers, settings.kafka_config)
        )
        config.update(KafkaClientEvents(f"{purpose}-producer").config())
        config["delivery.report.only.error"] = True
        config["transactional.id"] = transactional_id(settings, system_id, purpose)
        config["transaction.timeout.ms"] = settings.tx_timeout_ms
        config["message.timeout.ms"] = settings.tx_timeout_ms
        self.producer = Producer(config)
        self.present: set[str] = set()
        self.skipped = 0
        self._open = False
        _call("init_transactions", lambda: self.producer.init_transactions(TX_CALL_TIMEOUT_S))

    def skip(self, event_id: str) -> bool:
        """Whether ``event_id`` is in Kafka already (counted); else a transaction is open."""
        if event_id in self.present:
            self.skipped += 1
            return True
        if not self._open:
            _call("begin_transaction", self.producer.begin_transaction)
            self._open = True
        return False

    def commit(self) -> None:
        """Commit the open transaction (its records are all acknowledged)."""
        if self._open:
            _call("commit_transaction", lambda: self.producer.commit_transaction(TX_CALL_TIMEOUT_S))
            self._open = False

    def abort(self) -> None:
        """Abort an open transaction (after a failure); errors are logged only."""
        if self._open:
            self._open = False
            try:
                self.producer.abort_transaction(TX_CALL_TIMEOUT_S)
            except KafkaException as exc:
                log.warning("abort of a republishing transaction failed: %s", exc)


def _call(what: str, call: Callable[[], None]) -> None:
    """A transactional call; its failure as KafkaUnavailableError (the run fails: the
    broker, or the next run's init_transactions, aborts what it left open)."""
    try:
        call()
    except KafkaException as exc:
        raise KafkaUnavailableError(f"{what} failed: {exc}") from exc


def _consumer(settings: Settings) -> Consumer:
    return Consumer(
        {
            "bootstrap.servers": settings.kafka_bootstrap_servers,
            "client.id": "outbox-cdc-present-ids",
            "group.id": f"outbox-cdc-present-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            **KafkaClientEvents("present-ids").config(),
            **settings.kafka_config,
            "isolation.level": "read_committed",
        }
    )


def present_ids(settings: Settings, since_ms: int, topics: Iterable[str] | None = None) -> set[str]:
    """The ids of the records read_committed consumers see in the relay's topics from
    ``since_ms`` on (see the module docstring)."""
    client = _consumer(settings)
    try:
        meta = client.list_topics(timeout=KAFKA_TIMEOUT_S).topics
        names = (
            [t for t in topics if t in meta]
            if topics is not None
            else [t for t in meta if t.startswith(settings.topic_prefix)]
        )
        if settings.dlq_topic in meta and settings.dlq_topic not in names:
            names.append(settings.dlq_topic)
        wanted = [TopicPartition(t, p, since_ms) for t in names for p in meta[t].partitions]
        starts = client.offsets_for_times(wanted, timeout=KAFKA_TIMEOUT_S) if wanted else []
        todo: dict[tuple[str, int], int] = {}
        assign = []
        for found in starts:
            _, high = client.get_watermark_offsets(
                TopicPartition(found.topic, found.partition), timeout=KAFKA_TIMEOUT_S
            )
            if 0 <= found.offset < high:
                todo[(found.topic, found.partition)] = high
                assign.append(TopicPartition(found.topic, found.partition, found.offset))
        return _read(client, assign, todo)
    except KafkaException as exc:
        raise KafkaUnavailableError(f"reading the ids present in Kafka: {exc}") from exc
    finally:
        client.close()


def _read(
    client: Consumer, assign: list[TopicPartition], todo: dict[tuple[str, int], int]
) -> set[str]:
    present: set[str] = set()
    if not todo:
        return present
    client.assign(assign)
    last_progress = time.monotonic()
    while todo:
        messages = client.consume(5000, 0.5)
        if messages:
            last_progress = time.monotonic()
        elif time.monotonic() - last_progress > READ_STALL_S:
            raise KafkaUnavailableError(
                f"reading the ids present in Kafka made no progress for {READ_STALL_S:g}s"
            )
        for msg in messages:
            _take(msg, present, todo)
    return present


def _take(msg: Any, present: set[str], todo: dict[tuple[str, int], int]) -> None:
    """One consumed message: its id kept; its partition done at the end or EOF."""
    err = msg.error()
    where = (msg.topic(), msg.partition())
    if err is not None:
        if err.code() == KafkaError._PARTITION_EOF:
            todo.pop(where, None)
        return
    for name, value in msg.headers() or ():
        if name == c.HEADER_ID and isinstance(value, bytes):
            present.add(value.decode(errors="replace"))
            break
    if msg.offset() + 1 >= todo.get(where, 0):
        todo.pop(where, None)
