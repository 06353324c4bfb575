"""Kafka side of the relay: producer configuration, topic creation, error classes.

Guarantees:

* the producer is idempotent with ``acks=all`` and never gives up on a record
  by itself (``message.timeout.ms=0``): while Kafka is away records wait in the
  bounded local queue and the relay stops reading WAL (back-pressure);
* topics are created explicitly (configured partitions and replication
  factor) before the first record is produced to them, never by broker
  auto-creation;
* :func:`is_record_error` tells a record Kafka refuses for itself (too large,
  invalid) — dead-lettered — from trouble of the cluster, which is retried.

Partitioning: ``partitioner=murmur2_random`` - librdkafka's port of the Java
client's default, ``toPositive(murmur2(key)) % partitions`` - so a key lands
on the partition Debezium (Kafka Connect) or any Java producer would pick, and
moving between them on live topics keeps each key on one partition. (The relay
never sends a NULL key, so the ``_random`` half never applies.) Override with
``KAFKA_CONFIG_PARTITIONER`` (``consistent_random`` was librdkafka's CRC32 default).

Tuning (documented in the README, overridable with ``KAFKA_CONFIG_*``):
``linger.ms=5`` and ``batch.size=1 MB`` batch a burst into few requests while
an isolated commit waits at most 5 ms; ``compression.type=lz4`` is cheap on
CPU and halves JSON; ``message.max.bytes=1000000`` stays under the broker's
default ``max.message.bytes`` (1 MiB) so an oversize record is refused locally
and dead-lettered instead of poisoning an idempotent batch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from cdc.errors import KafkaUnavailableError
from cdc.kafkalog import KafkaClientEvents

log = logging.getLogger(__name__)

PRODUCER_DEFAULTS: dict[str, str | int | bool] = {
    "partitioner": "murmur2_random",
    "enable.idempotence": True,
    "acks": "all",
    "linger.ms": 5,
    "batch.size": 1_000_000,
    "compression.type": "lz4",
    "message.timeout.ms": 0,
    "message.max.bytes": 1_000_000,
    "queue.buffering.max.messages": 100_000,
    "queue.buffering.max.kbytes": 65_536,
    "max.in.flight.requests.per.connection": 5,
}

#: Error codes that mean "this record itself is unacceptable".
RECORD_ERRORS = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.INVALID_MSG,
        KafkaError.INVALID_MSG_SIZE,
        KafkaError.INVALID_RECORD,
        KafkaError.RECORD_LIST_TOO_LARGE,
        KafkaError.INVALID_TIMESTAMP,
    }
)


def is_record_error(err: KafkaError) -> bool:
    """True when Kafka refused the record for itself (dead-letter it)."""
    return err.code() in RECORD_ERRORS


def producer_config(bootstrap: str, overrides: Mapping[str, str]) -> dict[str, str | int | bool]:
    """The relay's producer settings: our defaults, then the user's ``KAFKA_CONFIG_*``."""
    config: dict[str, str | int | bool] = dict(PRODUCER_DEFAULTS)
    config.update(overrides)
    config["bootstrap.servers"] = bootstrap
    config["enable.idempotence"] = True
    config["acks"] = "all"
    return config


def make_producer(
    bootstrap: str, overrides: Mapping[str, str], *, events: KafkaClientEvents | None = None
) -> Producer:
    """The relay's producer; librdkafka's errors and log lines go through ``events``
    (by default a :class:`KafkaClientEvents` that only logs), never raw to stderr."""
    events = events or KafkaClientEvents("producer")
    return Producer({**producer_config(bootstrap, overrides), **events.config()})


class TopicManager:
    """Creates topics once, explicitly; remembers which exist."""

    def __init__(
        self,
        *,
        bootstrap: str,
        overrides: Mapping[str, str],
        partitions: int,
        replication_factor: int,
        timeout_s: float = 30.0,
    ) -> None:
        config: dict[str, str | int | float | bool] = {
            k: v for k, v in overrides.items() if k.startswith(("security.", "sasl.", "ssl."))
        }
        config["bootstrap.servers"] = bootstrap
        self._admin = AdminClient({**config, **KafkaClientEvents("relay-admin").config()})
        self._partitions = partitions
        self._replication_factor = replication_factor
        self._timeout_s = timeout_s
        self.known: set[str] = set()

    def ensure(self, topics: Iterable[str]) -> None:
        """Make sure every topic exists; raise KafkaUnavailableError when Kafka does not answer."""
        wanted = [t for t in topics if t not in self.known]
        if not wanted:
            return
        try:
            existing = self._admin.list_topics(timeout=self._timeout_s).topics
        except KafkaException as exc:
            raise KafkaUnavailableError(f"cannot list topics: {exc}") from exc
        missing = [t for t in wanted if t not in existing]
        if missing:
            self._create(missing)
        self.known.update(wanted)

    def _create(self, topics: list[str]) -> None:
        new = [
            NewTopic(
                t, num_partitions=self._partitions, replication_factor=self._replication_factor
            )
            for t in topics
        ]
        for topic, future in self._admin.create_topics(
            new, request_timeout=self._timeout_s
        ).items():
            try:
                future.result(timeout=self._timeout_s)
                log.info("topic %s created (%d partitions)", topic, self._partitions)
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    continue
                raise KafkaUnavailableError(f"cannot create topic {topic}: {exc}") from exc
