"""Trace context: W3C ``traceparent`` parsing (pure) and optional OpenTelemetry spans.

Guarantees:

* :func:`parse_traceparent` accepts exactly the W3C Trace Context form
  (``00-<32 hex trace id>-<16 hex span id>-<2 hex flags>``, ids not all zero,
  version not ``ff``; a future version may carry more fields after the flags)
  and also the Debezium ``tracingspancontext`` form (``java.util.Properties``
  text holding ``traceparent=...`` and maybe ``tracestate=...``). Anything else
  is ``None``: a malformed value never reaches a span, a header or a log line.
* Tracing is off unless configured with the standard OpenTelemetry variables
  (:func:`tracing_enabled`): ``OTEL_SDK_DISABLED`` is not ``true`` and either
  ``OTEL_TRACES_EXPORTER`` names an exporter other than ``none`` or an OTLP
  endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT`` /
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set. Off, nothing of
  OpenTelemetry is imported and :func:`relay_tracing` returns ``None``, so the
  relay's hot path pays one ``is None`` test per record.
* On (the ``otel`` extra installed), the relay opens one PRODUCER span per
  Kafka record, from ``produce`` to its delivery report, as a child of the
  application's span named by the record's ``traceparent`` header (the outbox
  row's ``tracingspancontext``); a record without one starts a new trace.
  Spans are exported by the SDK's batch processor, off the hot path; an
  exporter failure is the SDK's to log and never stops the pipeline.
* A configuration the process cannot honour (``otlp`` asked, exporter package
  missing; an unknown exporter name) raises :class:`~cdc.errors.ConfigError`
  at start-up naming the variable, instead of running silently untraced.
"""

# OpenTelemetry is an optional extra, imported only when tracing is on.
# ruff: noqa: PLC0415

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cdc import constants as c
from cdc.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Tracer

#: ``tracestate`` header name (W3C Trace Context).
HEADER_TRACESTATE = "tracestate"
#: W3C: at most 32 list members of at most 256 characters; 512 is what
#: implementations must propagate at least. Longer values are not forwarded.
TRACESTATE_MAX_CHARS = 512
#: ``OTEL_TRACES_EXPORTER`` values this package wires itself.
EXPORTERS = ("otlp", "console", "none")
#: ``service.name`` of each process when ``OTEL_SERVICE_NAME`` is not set.
RELAY_SERVICE_NAME = "outbox-cdc-relay"
SINK_SERVICE_NAME = "outbox-cdc-sink"
#: Instrumentation scope of the spans.
TRACER_NAME = "outbox-cdc"

_TRACEPARENT = re.compile(
    r"(?P<version>[0-9a-f]{2})-(?P<trace_id>[0-9a-f]{32})-(?P<span_id>[0-9a-f]{16})"
    r"-(?P<flags>[0-9a-f]{2})(?P<rest>-[\x21-\x7e]*)?"
)
#: W3C tracestate: list members ``key=value`` separated by commas; printable
#: ASCII without ``=`` or ``,`` in values; checked loosely (no CR/LF/NUL, bounded).
_TRACESTATE = re.compile(r"[\x20-\x2b\x2d-\x7e]+(,[\x20-\x2b\x2d-\x7e]+)*")
_PROPERTY_LINE = re.compile(r"^\s*(traceparent|tracestate)\s*[=:]\s*(.*?)\s*$", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class TraceParent:
    """A parsed W3C ``traceparent``: ids as lower-case hex, flags as an int."""

    trace_id: str
    span_id: str
    flags: int

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 0x01)

    @property
    def header(self) -> str:
        """The canonical version-00 header value."""
        return f"00-{self.trace_id}-{self.span_id}-{self.flags:02x}"


def parse_traceparent(text: str | bytes | None) -> TraceParent | None:
    """The trace context in a ``traceparent`` or Debezium ``tracingspancontext`` value."""
    value = _text(text)
    if value is None:
        return None
    value = value.strip()
    if "traceparent" in value:
        found = dict(_PROPERTY_LINE.findall(value))
        value = found.get("traceparent", "")
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return None
    version, trace_id, span_id = match["version"], match["trace_id"], match["span_id"]
    if version == "ff" or (version == "00" and match["rest"]):
        return None
    if trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return TraceParent(trace_id, span_id, int(match["flags"], 16))


def parse_tracestate(text: str | bytes | None) -> str | None:
    """A ``tracestate`` value safe to forward (bounded, no control characters), else None.

    Also finds ``tracestate=`` in a Debezium ``tracingspancontext`` value.
    """
    value = _text(text)
    if value is None:
        return None
    if "tracestate" in value and ("\n" in value or value.lstrip().startswith("tracestate")):
        value = dict(_PROPERTY_LINE.findall(value)).get("tracestate", "")
    value = value.strip()
    if not value or len(value) > TRACESTATE_MAX_CHARS or not _TRACESTATE.fullmatch(value):
        return None
    return value


def _text(value: str | bytes | None) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            return value.decode("ascii")
        except UnicodeDecodeError:
            return None
    return value


def trace_headers(headers: Mapping[str, str | bytes | None]) -> dict[str, str] | None:
    """The W3C trace headers (``traceparent``, ``tracestate``) worth forwarding, or None.

    ``tracestate`` is forwarded only with a valid ``traceparent`` (W3C: without
    one it must be ignored). The ``traceparent`` is forwarded in its canonical
    form, also when the record carried a Debezium ``tracingspancontext``.
    """
    parent = parse_traceparent(headers.get(c.HEADER_TRACEPARENT))
    if parent is None:
        return None
    out = {c.HEADER_TRACEPARENT: parent.header}
    state = parse_tracestate(headers.get(HEADER_TRACESTATE))
    raw = _text(headers.get(c.HEADER_TRACEPARENT)) or ""
    if state is None and "tracestate" in raw:  # a Debezium value may hold both
        state = parse_tracestate(raw)
    if state is not None:
        out[HEADER_TRACESTATE] = state
    return out


# --- configuration ---------------------------------------------------------------------------


def _is_true(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def tracing_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether the standard ``OTEL_*`` variables ask for traces (see the module docstring)."""
    env = os.environ if env is None else env
    if _is_true(env.get("OTEL_SDK_DISABLED")):
        return False
    exporter = (env.get("OTEL_TRACES_EXPORTER") or "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def _exporters(env: Mapping[str, str]) -> list[SpanExporter]:
    names = [n.strip().lower() for n in (env.get("OTEL_TRACES_EXPORTER") or "otlp").split(",")]
    out: list[SpanExporter] = []
    for name in names:
        if name == "none" or not name:
            continue
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            out.append(ConsoleSpanExporter())
        elif name == "otlp":
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )
            except ImportError as exc:
                raise ConfigError(
                    "OTEL_TRACES_EXPORTER=otlp needs the OTLP exporter:"
                    " pip install 'outbox-cdc[otel]'"
                ) from exc
            out.append(OTLPSpanExporter())  # endpoint, headers, timeout: OTEL_EXPORTER_OTLP_*
        else:
            raise ConfigError(
                f"OTEL_TRACES_EXPORTER={name!r} is not supported (one of {', '.join(EXPORTERS)})"
            )
    return out


def make_tracer(
    service_name: str,
    *,
    env: Mapping[str, str] | None = None,
    exporters: Sequence[SpanExporter] | None = None,
) -> Tracer:
    """A tracer of a provider of its own (the global provider is left alone).

    ``exporters`` (tests: the SDK's ``InMemorySpanExporter``) are wired with a
    simple processor; otherwise the exporters named by ``OTEL_TRACES_EXPORTER``
    get a batch processor. ``OTEL_SERVICE_NAME``/``OTEL_RESOURCE_ATTRIBUTES``
    and ``OTEL_TRACES_SAMPLER`` are honoured by the SDK itself.
    """
    env = os.environ if env is None else env
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError as exc:
        raise ConfigError(
            "OTEL_* variables ask for traces but OpenTelemetry is not installed:"
            " pip install 'outbox-cdc[otel]'"
        ) from exc
    attributes = {} if env.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    provider = TracerProvider(resource=Resource.create(attributes))
    if exporters is not None:
        for exporter in exporters:
            provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        for exporter in _exporters(env):
            provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider.get_tracer(TRACER_NAME)


def parent_context(traceparent: str | bytes | None, tracestate: str | bytes | None = None) -> Any:
    """An OpenTelemetry context whose remote parent is ``traceparent`` (None: a new trace)."""
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

    parent = parse_traceparent(traceparent)
    if parent is None:
        return None
    state = parse_tracestate(tracestate)
    entries: list[tuple[str, str]] = []
    for member in (state or "").split(","):
        key, sep, value = member.strip().partition("=")
        if sep and key and value:
            entries.append((key, value))
    try:
        trace_state = TraceState(entries)
    except ValueError:
        trace_state = TraceState()
    span_context = SpanContext(
        trace_id=int(parent.trace_id, 16),
        span_id=int(parent.span_id, 16),
        is_remote=True,
        trace_flags=TraceFlags(parent.flags & 0xFF),
        trace_state=trace_state,
    )
    return trace.set_span_in_context(NonRecordingSpan(span_context))


# --- relay -----------------------------------------------------------------------------------

#: The relay's delivery callback: ``(err, msg)`` once librdkafka reported the record.
DeliveryCallback = Callable[[Any, Any], None]


class RelayTracing:
    """PRODUCER spans around the relay's ``produce`` calls (see the module docstring)."""

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer

    def produce(
        self,
        topic: str,
        key: bytes,
        headers: Sequence[tuple[str, bytes]],
        event_id: bytes,
        callback: DeliveryCallback,
    ) -> DeliveryCallback:
        """Start the span of one record; the returned callback ends it, then calls ``callback``."""
        from opentelemetry.trace import SpanKind, Status, StatusCode

        traceparent = tracestate = None
        for name, value in headers:
            if name == c.HEADER_TRACEPARENT:
                traceparent = value
            elif name == HEADER_TRACESTATE:
                tracestate = value
        span = self._tracer.start_span(
            f"{topic} publish",
            context=parent_context(traceparent, tracestate),
            kind=SpanKind.PRODUCER,
            attributes={
                "messaging.system": "kafka",
                "messaging.operation.type": "publish",
                "messaging.destination.name": topic,
                "messaging.message.id": event_id.decode("utf-8", "replace"),
                "messaging.kafka.message.key": key.decode("utf-8", "replace"),
            },
        )

        def on_delivery(err: Any, msg: Any) -> None:
            try:
                if err is None:
                    span.set_attribute("messaging.destination.partition.id", str(msg.partition()))
                    span.set_attribute("messaging.kafka.offset", int(msg.offset()))
                else:
                    span.set_status(Status(StatusCode.ERROR, str(err.str())))
                span.end()
            finally:
                callback(err, msg)

        return on_delivery


def relay_tracing(env: Mapping[str, str] | None = None) -> RelayTracing | None:
    """The relay's tracing when ``OTEL_*`` asks for it, else None (nothing imported)."""
    if not tracing_enabled(env):
        return None
    return RelayTracing(make_tracer(RELAY_SERVICE_NAME, env=env))
