"""Dead letters of the idempotent consumer: the record as it came, plus why.

Guarantees: :meth:`DeadLetters.send` returns only once Kafka acknowledged the
dead letter (``acks=all``, idempotent producer), and raises
:class:`DeadLetterError` otherwise - the caller spends no attempt and polls the
record again. The dead letter carries the record's key, value, timestamp and
every header it had (from the envelope: the message's headers are read once,
by :func:`sinks.core.delivery.read_headers`), minus old ``dlq.*`` ones, plus
``dlq.reason``, ``dlq.original.topic``/``partition``/``offset`` and ``dlq.consumer``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from cdc.constants import HEADER_DLQ_REASON, HEADER_DLQ_TOPIC
from cdc.kafka.log import KafkaClientEvents
from sinks.core.delivery import Envelope
from sinks.idempotent.constants import (
    DEAD_LETTER_TIMEOUT_S,
    HEADER_DLQ_CONSUMER,
    HEADER_DLQ_OFFSET,
    HEADER_DLQ_PARTITION,
    MAX_REASON_CHARS,
    SHARED_PREFIXES,
)
from sinks.idempotent.errors import DeadLetterError


class DeadLetters:
    """One consumer's dead-letter producer (created on the first dead letter)."""

    def __init__(self, kafka_config: Mapping[str, Any], *, name: str, topic: str) -> None:
        self._shared = {k: v for k, v in kafka_config.items() if k.startswith(SHARED_PREFIXES)}
        self._name = name
        self._topic = topic
        self._producer: Producer | None = None

    def _client(self) -> Producer:
        if self._producer is None:
            self._producer = Producer(
                {
                    **self._shared,
                    **KafkaClientEvents(f"idempotent.{self._name}.dlq").config(),
                    "partitioner": "murmur2_random",
                    "enable.idempotence": True,
                    "acks": "all",
                }
            )
        return self._producer

    def send(self, record: Envelope, reason: str) -> None:
        """Produce ``record`` to the dead-letter topic and wait for Kafka's acknowledgement."""
        producer = self._client()
        topic = self._topic
        headers: list[tuple[str, str | bytes | None]] = [
            (k, v) for k, v in record.header_list if not k.startswith("dlq.")
        ]
        headers += [
            (HEADER_DLQ_REASON, reason[:MAX_REASON_CHARS].encode(errors="replace")),
            (HEADER_DLQ_TOPIC, record.topic.encode()),
            (HEADER_DLQ_PARTITION, str(record.partition).encode()),
            (HEADER_DLQ_OFFSET, str(record.offset).encode()),
            (HEADER_DLQ_CONSUMER, self._name.encode()),
        ]
        reports: list[KafkaError | None] = []
        try:
            producer.produce(
                topic,
                record.value,
                record.key,
                headers=headers,
                timestamp=max(record.timestamp_ms or 0, 0),  # 0: now, when the record had none
                on_delivery=lambda err, _msg: reports.append(err),
            )
        except (KafkaException, BufferError) as exc:
            raise DeadLetterError(f"dead letter to {topic} refused: {exc}") from exc
        producer.flush(DEAD_LETTER_TIMEOUT_S)
        if not reports:
            raise DeadLetterError(f"dead letter to {topic}: no acknowledgement in time")
        error = reports[0]  # (KafkaError's == with None raises inside C: test identity)
        if error is not None:
            raise DeadLetterError(f"dead letter to {topic} failed: {error.str()}")

    def flush(self) -> None:
        if self._producer is not None:
            self._producer.flush(DEAD_LETTER_TIMEOUT_S)
