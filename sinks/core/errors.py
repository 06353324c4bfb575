"""Errors of the ``sinks`` package: its root, and every engine outcome that is not a 2xx.

Every error raised on purpose derives from :class:`SinksError`, the package's
root. Its two branches: :class:`SinkError` for delivery (engine outcomes and the
sink's own failures, here), and ``OpsError`` for the group operations (lag, replay,
redelivery, parking-lot commands, trace), in :mod:`sinks.ops.errors`. Delivery
loops test the class attributes instead of listing types:

- ``retriable``: sending the same record again may succeed;
- ``spends_attempt``: the failure counts toward the record's ``max_attempts``.

``retriable and not spends_attempt`` means engine-wide trouble: pause the
partitions and probe with backoff; Kafka holds the backlog, nothing is parked::

    SinksError                                          retriable  spends_attempt
    ├── OpsError            an ops command failed (sinks.ops.errors)
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


class EngineUnavailable(SinkError):  # noqa: N818 - the name is the contract
    """Engine-wide trouble; the record is fine. Pause, probe with backoff, spend no attempt.

    ``retry_after_s`` is the engine's ``Retry-After`` (a floor for the next
    probe) when it sent one; ``status`` is ``None`` when no response arrived.
    ``shared``: the trouble is the route's for everyone, not this request's - an
    expired request deadline, or an answer with ``Retry-After`` - set where the
    exception is made (the engine client, the response's classification): the
    route's window is cut (:func:`sinks.runtime.verdicts.route_result`).
    """

    retriable = True
    spends_attempt = False

    def __init__(
        self,
        reason: str,
        *,
        status: int | None = None,
        retry_after_s: float | None = None,
        shared: bool = False,
    ) -> None:
        super().__init__(reason)
        self.status = status
        self.retry_after_s = retry_after_s
        self.shared = shared


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
