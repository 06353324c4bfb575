"""Errors of the group operations (:mod:`sinks.ops`, :mod:`sinks.trace`, the ops commands).

An ops command failed or was refused; no record's delivery is involved. They
derive from the package's root, :class:`sinks.core.errors.SinksError`, whose
``retriable`` says whether running the command again may succeed::

    OpsError                    an ops command failed                retriable
    ├── OpsUsageError           a request that makes no sense        no
    ├── GroupActiveError        the group has members                no
    ├── GroupNotFoundError      no members, no committed offsets     no
    ├── UncommittedShiftError   nothing committed to shift           no
    └── KafkaOpsError           Kafka did not answer                 yes
"""

from __future__ import annotations

from sinks.core.errors import SinksError


class OpsError(SinksError):
    """Root of the ops errors (:mod:`sinks.ops`, :mod:`sinks.trace`): the operator's
    command failed or was refused; no record's delivery is involved."""

    spends_attempt = False


class OpsUsageError(OpsError):
    """The operator asked for something that does not make sense (bad topic, bad duration)."""


class GroupActiveError(OpsError):
    """The group has active members: its offsets cannot be changed under it."""

    def __init__(self, group: str, *, state: str, members: int) -> None:
        super().__init__(
            f"consumer group {group} is active ({state}, {members} member(s)): "
            "stop every sink of the group, then run the replay again"
        )
        self.group = group
        self.state = state
        self.members = members


class GroupNotFoundError(OpsError):
    """The group has no members and no committed offsets: a typo, or a sink that never ran."""

    def __init__(self, group: str, *, similar: list[str]) -> None:
        hint = f": did you mean {' or '.join(similar)}?" if similar else ""
        super().__init__(
            f"consumer group {group} does not exist (no members, no committed offsets){hint}"
        )
        self.group = group


class UncommittedShiftError(OpsError):
    """A shift of partitions the group never committed: there is nothing to shift from."""


class KafkaOpsError(OpsError):
    """Kafka did not answer as needed (unreachable, timed out, refused)."""

    retriable = True
