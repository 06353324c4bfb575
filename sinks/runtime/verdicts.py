"""What the sink's consumer makes of a record and of an engine answer, for the core. Pure.

* :func:`classifier` - a record's routing verdict: skipped (the relay's checkpoint
  topic, ``SINK_IGNORED_TYPES``), deliverable on an engine route, or bad input to
  park at once (whatever the routing refuses, with its reason);
* :func:`route_result` - an engine route's trouble as the core's
  :class:`~sinks.core.machine.Result`, by its meaning (DESIGN "Sink invariants" 2, 3);
* :func:`failure_result` - any failed delivery as the core's result: unroutable,
  the route's trouble, the record's rejection, or (our own bug) trouble of the
  route that spends no attempt.
"""

from __future__ import annotations

from collections.abc import Callable

from sinks.core.delivery import Envelope
from sinks.core.errors import EngineMisconfigured, EngineUnavailable, SinkError, Unroutable
from sinks.core.machine import Disposition, Result, ResultKind, Verdict
from sinks.shared.routes import Routing

#: The engine sheds load: slow down, whatever else succeeds (DESIGN "Sink invariants" 2).
RATE_LIMITED = 429
#: Statuses that blame a record only with per-route evidence (DESIGN "Sink invariants" 3).
SERVER_ERRORS = range(500, 600)
CHECKPOINT_RECORD = "the relay's checkpoint topic, CDC_CHECKPOINT_TOPIC"  #: (a pattern took it)


def classifier(
    routing: Routing, is_checkpoint: Callable[[str], bool] = lambda _topic: False
) -> Callable[[Envelope], Verdict]:
    """A record's routing verdict: skipped (``is_checkpoint``: a topic of the relays'
    checkpoints), deliverable, or bad input to park at once."""

    def classify(record: Envelope) -> Verdict:
        if is_checkpoint(record.topic):
            return Verdict(Disposition.IGNORE, CHECKPOINT_RECORD)
        if routing.is_ignored(record.topic, record.event_type):
            return Verdict(Disposition.IGNORE, "SINK_IGNORED_TYPES")
        try:
            call = routing.route_envelope(record)
        except Unroutable as exc:
            return Verdict(Disposition.PARK, exc.reason)
        return Verdict(Disposition.DELIVER, endpoint=call.path)

    return classify


def route_result(exc: EngineUnavailable) -> Result:
    """The core's result for trouble of an engine route (``exc.endpoint``).

    429: THROTTLED. A Retry-After on another status, or an expired request
    deadline: UNAVAILABLE ``shared`` (the route is slow for everyone). Another
    5xx: SERVER_ERROR (the core blames the record only with per-route
    evidence). The rest - refused, reset, timeouts, 408, 401/403 and 3xx
    (:class:`~sinks.core.errors.EngineMisconfigured`): UNAVAILABLE, never the record's.
    """
    endpoint = exc.endpoint
    if exc.status == RATE_LIMITED:
        return Result(ResultKind.THROTTLED, exc.reason, exc.retry_after_s, endpoint=endpoint)
    shared = exc.shared  # (set where the exception was made: the client, the status)
    server_error = (
        not shared
        and not isinstance(exc, EngineMisconfigured)
        and exc.status is not None
        and SERVER_ERRORS.start <= exc.status < SERVER_ERRORS.stop
    )
    kind = ResultKind.SERVER_ERROR if server_error else ResultKind.UNAVAILABLE
    return Result(kind, exc.reason, exc.retry_after_s, shared=shared, endpoint=endpoint)


def failure_result(exc: Exception) -> Result:
    """The core's result for a delivery that raised ``exc``."""
    if isinstance(exc, Unroutable):
        return Result(ResultKind.UNROUTABLE, exc.reason)
    if isinstance(exc, EngineUnavailable):
        return route_result(exc)
    if isinstance(exc, SinkError):
        return Result(ResultKind.REJECTED, exc.reason, endpoint=exc.endpoint)
    return Result(ResultKind.UNAVAILABLE, f"internal error: {type(exc).__name__}")
