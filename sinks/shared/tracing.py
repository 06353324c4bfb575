"""Trace context from a Kafka record to the engine request, and the sink's delivery span.

Guarantees:

* The engine request of a record carries the record's W3C ``traceparent``
  (and ``tracestate``, only with a valid ``traceparent``), chosen by
  :func:`cdc.tracing.trace_headers`: validated, canonical, never a malformed
  value. A record without trace context sends no trace headers.
* With tracing off (the default, see :mod:`cdc.tracing`) :meth:`SinkTracing.delivery`
  only forwards those headers: no OpenTelemetry import, no span.
* With tracing on, each delivery is one CONSUMER span (``<topic> process``),
  a child of the application's span named by the record's ``traceparent``; the
  engine request then carries the *delivery span's* ``traceparent`` (same
  trace, the engine's work nests under the delivery), and the record's
  ``tracestate``. A delivery that raises marks the span as an error with the
  failure class and re-raises: tracing never changes what the sink does.

The consumer loop uses it around its delivery call::

    with self.tracing.delivery(env) as trace_headers:
        await deliver(self.engine, event_type=env.event_type, payload=env.value,
                      event_id=env.event_id, headers=trace_headers)
"""

# OpenTelemetry is an optional extra, imported only when tracing is on.
# ruff: noqa: PLC0415

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING

from cdc import constants as c
from cdc.tracing import (
    HEADER_TRACESTATE,
    SINK_SERVICE_NAME,
    make_tracer,
    parent_context,
    trace_headers,
    tracing_enabled,
)
from sinks.core.delivery import Envelope

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

__all__ = ["SinkTracing", "engine_trace_headers"]


def engine_trace_headers(headers: Mapping[str, str | bytes | None]) -> dict[str, str] | None:
    """The trace headers to send to the engine for a record (or a parked row's headers)."""
    return trace_headers(headers)


class _Forward:
    """Tracing off: the record's own trace headers, no span."""

    __slots__ = ("headers",)

    def __init__(self, headers: dict[str, str] | None) -> None:
        self.headers = headers

    def __enter__(self) -> dict[str, str] | None:
        return self.headers

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None


class _DeliverySpan:
    """Tracing on: a CONSUMER span around one delivery; yields the headers to send."""

    __slots__ = ("_env", "_span", "_tracer")

    def __init__(self, tracer: Tracer, env: Envelope) -> None:
        self._tracer = tracer
        self._env = env
        self._span: Span | None = None

    def __enter__(self) -> dict[str, str] | None:
        from opentelemetry.trace import SpanKind

        env = self._env
        headers = env.headers
        span = self._tracer.start_span(
            f"{env.topic} process",
            context=parent_context(
                headers.get(c.HEADER_TRACEPARENT), headers.get(HEADER_TRACESTATE)
            ),
            kind=SpanKind.CONSUMER,
            attributes={
                "messaging.system": "kafka",
                "messaging.operation.type": "process",
                "messaging.destination.name": env.topic,
                "messaging.destination.partition.id": str(env.partition),
                "messaging.kafka.offset": env.offset,
                "messaging.message.id": env.event_id,
                "outbox.event_type": env.event_type,
            },
        )
        self._span = span
        ctx = span.get_span_context()
        traceparent = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
        out = {c.HEADER_TRACEPARENT: traceparent}
        forwarded = trace_headers(headers)
        if forwarded is not None and HEADER_TRACESTATE in forwarded:
            out[HEADER_TRACESTATE] = forwarded[HEADER_TRACESTATE]
        return out

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        from opentelemetry.trace import Status, StatusCode

        span = self._span
        assert span is not None
        if exc is not None:
            reason = getattr(exc, "reason", None) or str(exc)
            span.set_attribute("error.type", type(exc).__name__)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {reason}"))
        span.end()


class SinkTracing:
    """Per-delivery trace context; ``tracer=None`` means tracing is off."""

    def __init__(self, tracer: Tracer | None = None) -> None:
        self._tracer = tracer

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SinkTracing:
        """On when the standard ``OTEL_*`` variables ask for traces (see :mod:`cdc.tracing`)."""
        if not tracing_enabled(env):
            return cls(None)
        return cls(make_tracer(SINK_SERVICE_NAME, env=env))

    def delivery(self, env: Envelope) -> AbstractContextManager[dict[str, str] | None]:
        """A context manager around one delivery of ``env``; yields the engine's trace headers."""
        if self._tracer is None:
            return _Forward(trace_headers(env.headers))
        return _DeliverySpan(self._tracer, env)
