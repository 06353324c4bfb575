"""Errors of the ``sinks`` package: every engine outcome that is not a 2xx, and the ops root.

Every error raised on purpose derives from :class:`SinksError`, the package's
root. Its two branches: :class:`SinkError` for delivery (engine outcomes and the
sink's own failures), and :class:`OpsError` for the group operations of
:mod:`sinks.ops` (lag, replay, redelivery, parking-lot commands, trace). Delivery
loops test the class attributes instead of listing types:

- ``retriable``: sending the same record again may succeed;
- ``spends_attempt``: the failure counts toward the record's ``max_attempts``.

``retriable and not spends_attempt`` means engine-wide trouble: pause the
partitions and probe with backoff; Kafka holds the backlog, nothing is parked::

    SinksError                                          retriable  spends_attempt
    ├── OpsError            an ops command failed           no          -
    │   ├── OpsUsageError       a request that makes no sense    no
    │   ├── GroupActiveError    the group has members            no
    │   ├── UncommittedShiftError  nothing committed to shift    no
    │   └── KafkaOpsError       Kafka did not answer             yes
    └── SinkError           delivery
        ├── EngineUnavailable   refused, timeout, 408,      yes         no
        │   │                   429, 5xx
        │   └── EngineMisconfigured  TLS failure, 401/403,  yes         no
        │                       407, 3xx: a setting must change
        ├── EngineRejected      other 4xx for THIS record   yes         yes  (parked at max)
        │   └── UserNotFound    quiz attempt 404            yes         yes  (sync user first)
        │                       {"error":"user_not_found"}
        └── Unroutable          no route / bad payload /    no          -    (parked now)
                                no idempotency key
"""

from __future__ import annotations


class SinksError(Exception):
    """Root of the package's errors; ``reason`` is fit for a log line and the parking lot."""

    #: Sending the same record again (or running the command again) may succeed.
    retriable: bool = False

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class SinkError(SinksError):
    """Root of the delivery errors: an engine outcome, or a failure of the sink itself."""

    #: The failure counts toward the record's max attempts.
    spends_attempt: bool = True
    #: The engine route (path) of the request that failed; "" when none was sent.
    #: A quiz attempt's delivery may also call ``users/sync``: its failure is that route's.
    endpoint: str = ""


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


class EngineUnavailable(SinkError):  # noqa: N818 - the name is the contract
    """Engine-wide trouble; the record is fine. Pause, probe with backoff, spend no attempt.

    ``retry_after_s`` is the engine's ``Retry-After`` (a floor for the next
    probe) when it sent one; ``status`` is ``None`` when no response arrived.
    """

    retriable = True
    spends_attempt = False

    def __init__(
        self, reason: str, *, status: int | None = None, retry_after_s: float | None = None
    ) -> None:
        super().__init__(reason)
        self.status = status
        self.retry_after_s = retry_after_s


class EngineMisconfigured(EngineUnavailable):
    """The engine cannot be used as configured: no amount of waiting fixes it.

    A TLS failure (certificate not trusted, name mismatch, client certificate
    refused, TLS to a plain-HTTP port), an authentication failure (401/403) or
    a redirect (3xx). As engine-wide trouble it pauses the sink and spends no
    attempt (a fixed setting, or a rotated key at the engine, resumes it);
    ``reason`` says what a person has to fix, naming the setting.
    """


class EngineRejected(SinkError):  # noqa: N818 - the name is the contract
    """A healthy engine refused this record (a 4xx other than the engine-wide ones).

    Spends an attempt; the record is parked after ``max_attempts``.
    ``body_excerpt`` is the start of the response body, for ``last_error``.
    """

    retriable = True
    spends_attempt = True

    def __init__(self, reason: str, *, status: int, body_excerpt: str = "") -> None:
        super().__init__(reason)
        self.status = status
        self.body_excerpt = body_excerpt


class UserNotFound(EngineRejected):
    """A quiz attempt reached the engine before its user: sync ``user_id`` first, then retry."""

    def __init__(self, reason: str, *, user_id: str | None, body_excerpt: str = "") -> None:
        super().__init__(reason, status=404, body_excerpt=body_excerpt)
        self.user_id = user_id


class Unroutable(SinkError):  # noqa: N818 - the name is the contract
    """Bad input: no route for the event type, a malformed payload, no idempotency key.

    Never retried, never dropped: the record is parked at once with ``reason``.
    """

    retriable = False
