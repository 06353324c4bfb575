"""Option parsing shared by the sink's commands (``--topic T[:P,..]``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sinks.ops.selection import TopicSelection


def topic_selections(specs: Sequence[str]) -> list[TopicSelection] | None:
    """The ``--topic`` options parsed; ``None`` (the sink's topics) when none was given."""
    from sinks.ops.selection import parse_topic_spec

    return [parse_topic_spec(s) for s in specs] or None
