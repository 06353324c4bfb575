"""Exactly-once mode's checkpoint topic: where the relay's committed WAL position lives in Kafka.

Guarantees:

* the topic is created compacted, with one partition (one log: a key's last
  value is its newest), before the first checkpoint is produced; it is never
  noted as one of the relay's record topics (its records carry no event, and
  the start-up's tail reads never look at it);
* a checkpoint record is key ``origin`` (``<system>/<timeline>/<slot>``,
  :mod:`cdc.lineage`), value the commit end-LSN as PostgreSQL writes it
  (``0/1A2B3C8``), header ``origin``; it is produced inside the Kafka
  transaction whose records it covers, so it is visible exactly when they are;
* :func:`read_checkpoint` reads the whole partition with
  ``isolation.level=read_committed`` up to its end (the last stable offset:
  nothing of an open or aborted transaction) and returns the newest value of
  the origin's key, or None; it is bounded by :data:`READ_TIMEOUT_S` and
  raises :class:`~cdc.errors.KafkaUnavailableError` past it. A value that does
  not parse is skipped with a warning (anyone may write to a topic).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from cdc import constants as c
from cdc.errors import KafkaUnavailableError
from cdc.kafkalog import KafkaClientEvents
from cdc.settings import Settings
from cdc.wal.replproto import str_to_lsn

log = logging.getLogger("cdc.relay")

#: Longest a start waits to read its checkpoint (the topic is compacted: small).
READ_TIMEOUT_S = 60.0
#: Kafka admin requests (list, create) give up after this.
ADMIN_TIMEOUT_S = 30.0
#: The checkpoint topic's configuration: compacted; segments rolled every 10 minutes
#: (the active segment is never compacted: a start reads at most ~10 minutes of
#: commits plus one value per origin); cleaned at 10 % dirty.
TOPIC_CONFIG = {
    "cleanup.policy": "compact",
    "segment.ms": "600000",
    "min.cleanable.dirty.ratio": "0.1",
}


def checkpoint_topic(settings: Settings) -> str:
    """``CDC_CHECKPOINT_TOPIC``, or the topic prefix without its last dot + ``__checkpoints``."""
    return settings.checkpoint_topic or settings.topic_prefix.rstrip(".") + "__checkpoints"


def _client_config(settings: Settings, purpose: str) -> dict[str, Any]:
    return {
        "bootstrap.servers": settings.kafka_bootstrap_servers,
        "client.id": f"outbox-cdc-{purpose}",
        **KafkaClientEvents(purpose).config(),
        **{
            k: v
            for k, v in settings.kafka_config.items()
            if k.startswith(("security.", "sasl.", "ssl."))
        },
    }


def ensure_checkpoint_topic(settings: Settings) -> str:
    """Create the checkpoint topic (compacted, one partition) unless it exists; its name."""
    topic = checkpoint_topic(settings)
    admin = AdminClient(_client_config(settings, "checkpoint-admin"))
    try:
        if topic in admin.list_topics(timeout=ADMIN_TIMEOUT_S).topics:
            return topic
        new = NewTopic(
            topic,
            num_partitions=1,
            replication_factor=settings.topic_replication_factor,
            config=TOPIC_CONFIG,
        )
        future = admin.create_topics([new], request_timeout=ADMIN_TIMEOUT_S)[topic]
        future.result(timeout=ADMIN_TIMEOUT_S)
        log.info("checkpoint topic %s created (compacted)", topic, extra={"topic": topic})
    except KafkaException as exc:
        err = exc.args[0] if exc.args else None
        if not (isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS):
            raise KafkaUnavailableError(f"checkpoint topic {topic}: {exc}") from exc
    return topic


def read_checkpoint(
    settings: Settings, topic: str, origin: str, *, timeout_s: float = READ_TIMEOUT_S
) -> int | None:
    """The newest committed checkpoint of ``origin`` in ``topic``, or None."""
    consumer = Consumer(
        {
            **_client_config(settings, "checkpoint"),
            "group.id": f"outbox-cdc-checkpoint-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
        }
    )
    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        return _read_to_end(consumer, topic, origin.encode(), timeout_s)
    finally:
        consumer.close()


def _read_to_end(consumer: Consumer, topic: str, key: bytes, timeout_s: float) -> int | None:
    deadline = time.monotonic() + timeout_s
    found: int | None = None
    while time.monotonic() < deadline:
        for msg in consumer.consume(1000, min(1.0, max(deadline - time.monotonic(), 0.01))):
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    return found
                if err.fatal() or not err.retriable():
                    raise KafkaUnavailableError(f"reading checkpoint topic {topic}: {err}")
                continue
            if msg.key() != key:
                continue
            try:
                found = str_to_lsn((msg.value() or b"").decode())
            except (ValueError, UnicodeDecodeError):
                log.warning(
                    "checkpoint topic %s offset %d: value is no LSN; skipped",
                    topic,
                    msg.offset(),
                    extra={"topic": topic},
                )
    raise KafkaUnavailableError(
        f"checkpoint topic {topic}: not read to its end within {timeout_s:g}s"
    )


def checkpoint_headers(origin: str) -> list[tuple[str, bytes]]:
    """The headers of a checkpoint record."""
    return [(c.HEADER_ORIGIN, origin.encode())]
