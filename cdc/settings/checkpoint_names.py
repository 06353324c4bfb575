"""The names of exactly-once mode's checkpoint topics (no I/O).

Guarantees: :func:`default_checkpoint_topic` never names a topic that starts with a
non-empty topic prefix (the sink's subscription, the audit and the tail reads take
every topic that does for an outbox topic), only characters Kafka allows, at most
:data:`MAX_TOPIC_CHARS`; one per slot (each relay's own), or without a slot the
topic every relay of a prefix shared before.
"""

from __future__ import annotations

import re

#: The default checkpoint topic's name begins with this (Kafka's ``__`` marks a topic as
#: not an application's own: tools hide it, MirrorMaker 2 does not copy it by default).
CHECKPOINT_TOPIC_BASE = "__outbox_cdc_checkpoints"
#: The base used instead when ``CDC_TOPIC_PREFIX`` is itself a beginning of
#: :data:`CHECKPOINT_TOPIC_BASE` (``_``, ``__outbox``...): its first character differs.
CHECKPOINT_TOPIC_OTHER_BASE = "outbox-cdc-checkpoints"
#: Kafka's longest topic name.
MAX_TOPIC_CHARS = 249
_NOT_TOPIC_CHAR = re.compile(r"[^A-Za-z0-9._-]")


def default_checkpoint_topic(topic_prefix: str, slot: str = "") -> str:
    """``__outbox_cdc_checkpoints.<prefix>.<slot>`` (the prefix without its trailing
    dots, any character Kafka does not allow as ``_``; without ``slot``: the topic every
    relay of the prefix shared before each had its own): never a name that starts with
    a non-empty ``topic_prefix`` (the sink's subscription, the audit and the tail reads
    take every topic that does for an outbox topic). A long prefix is cut, the slot kept."""
    tail = _NOT_TOPIC_CHAR.sub("_", topic_prefix.rstrip("."))
    own = f".{_NOT_TOPIC_CHAR.sub('_', slot)}" if slot else ""
    for base in (CHECKPOINT_TOPIC_BASE, CHECKPOINT_TOPIC_OTHER_BASE):
        name = f"{base}.{tail}"[: MAX_TOPIC_CHARS - len(own)] if tail else base
        name += own
        if not topic_prefix or not name.startswith(topic_prefix):
            break
    return name
