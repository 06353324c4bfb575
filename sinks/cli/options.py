"""Options shared by the sink's commands: ``--topic T[:P,..]``, declared and parsed once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from sinks.ops.selection import TopicSelection


def topic_selections(specs: Sequence[str]) -> list[TopicSelection] | None:
    """The ``--topic`` options parsed; ``None`` (the sink's topics) when none was given."""
    from sinks.ops.selection import parse_topic_spec

    return [parse_topic_spec(s) for s in specs] or None


F = TypeVar("F", bound=Callable[..., Any])


def topic_option(help_text: str) -> Callable[[F], F]:
    """``--topic T[:P,..]``, repeatable, into ``topic_specs`` (see :func:`topic_selections`)."""
    return click.option("--topic", "topic_specs", multiple=True, metavar="T[:P,..]", help=help_text)
