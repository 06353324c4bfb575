"""The group member's Kafka settings: librdkafka's configuration and the subscription.

What it is for: the one place the sink's consumer configuration is written, so
the consumer (:mod:`sinks.runtime.sink`) and the group operations
(:mod:`sinks.ops.offsets`: the reset policy a replay must respect) read the same
values. Guarantees: offsets are never committed or stored by librdkafka on its
own (the core says when); the assignment is cooperative-sticky; the
operator's ``KAFKA_CONFIG_*`` overrides win over every default here; the
subscription is a regex (``^...``) over the outbox topics, so new topics of
the prefix are picked up without a restart.
"""

from __future__ import annotations

import re
from typing import Any

from cdc.settings import Settings


def consumer_config(settings: Settings) -> dict[str, Any]:
    config: dict[str, Any] = {
        "bootstrap.servers": settings.kafka_bootstrap_servers,
        "group.id": settings.sink_group_id,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "partition.assignment.strategy": "cooperative-sticky",
        "session.timeout.ms": 10_000,
        "heartbeat.interval.ms": 2_000,
        "topic.metadata.refresh.interval.ms": 5_000,
        "fetch.wait.max.ms": 50,
        # librdkafka's default, stated: records of aborted (exactly-once) relay
        # transactions are never delivered; ids stay the idempotency keys either way
        "isolation.level": "read_committed",
    }
    config.update(settings.kafka_config)
    return config


def subscription(settings: Settings) -> list[str]:
    """A regex subscription (``^...``) over the outbox topics."""
    pattern = settings.sink_topics_pattern or f"^{re.escape(settings.topic_prefix)}.*"
    return [pattern if pattern.startswith("^") else f"^{pattern}"]
