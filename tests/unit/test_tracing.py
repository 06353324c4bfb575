"""Trace context: parsing, header selection, and the optional OpenTelemetry spans.

Spans are checked with the SDK's InMemorySpanExporter (no collector needed);
the engine side with httpx's MockTransport (the real stub over HTTP is in
tests/integration/test_observability.py).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from cdc.errors import ConfigError
from cdc.tracing import (
    RelayTracing,
    make_tracer,
    parse_traceparent,
    parse_tracestate,
    relay_tracing,
    trace_headers,
    tracing_enabled,
)
from sinks.core.delivery import Envelope
from sinks.core.errors import EngineUnavailable, Unroutable
from sinks.engine.client import EngineClient
from sinks.engine.dispatch import deliver
from sinks.shared.tracing import SinkTracing, engine_trace_headers

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{SPAN_ID}-01"


# --- parsing -----------------------------------------------------------------------------------


def test_parse_traceparent_reads_the_w3c_form() -> None:
    parent = parse_traceparent(TRACEPARENT)
    assert parent is not None
    assert (parent.trace_id, parent.span_id, parent.flags, parent.sampled) == (
        TRACE_ID,
        SPAN_ID,
        1,
        True,
    )
    assert parent.header == TRACEPARENT
    assert parse_traceparent(TRACEPARENT.encode()) == parent


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "garbage",
        f"00-{'0' * 32}-{SPAN_ID}-01",  # all-zero trace id
        f"00-{TRACE_ID}-{'0' * 16}-01",  # all-zero span id
        f"ff-{TRACE_ID}-{SPAN_ID}-01",  # forbidden version
        f"00-{TRACE_ID}-{SPAN_ID}-01-extra",  # version 00 has exactly four fields
        f"00-{TRACE_ID.upper()}-{SPAN_ID}-01",  # upper-case hex is invalid
        f"00-{TRACE_ID}-{SPAN_ID}-01\r\nx-evil: 1",  # header injection
        b"\xff\xfe",
    ],
)
def test_parse_traceparent_refuses_malformed_values(value: Any) -> None:
    assert parse_traceparent(value) is None


def test_parse_traceparent_accepts_a_future_version_with_more_fields() -> None:
    parent = parse_traceparent(f"01-{TRACE_ID}-{SPAN_ID}-00-more")
    assert parent is not None and parent.sampled is False
    assert parent.header == f"00-{TRACE_ID}-{SPAN_ID}-00"


def test_debezium_tracingspancontext_properties_are_understood() -> None:
    value = (
        f"#Mon Nov 30 10:00:00 UTC 2026\ntraceparent={TRACEPARENT}\ntracestate=congo=t61rcWkgMzE\n"
    )
    parent = parse_traceparent(value)
    assert parent is not None and parent.header == TRACEPARENT
    assert parse_tracestate(value) == "congo=t61rcWkgMzE"


def test_tracestate_is_bounded_and_free_of_control_characters() -> None:
    assert parse_tracestate("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE") == (
        "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"
    )
    assert parse_tracestate("a=b\r\nx: y") is None
    assert parse_tracestate("k=" + "v" * 600) is None
    assert parse_tracestate("") is None


def test_trace_headers_forward_a_valid_traceparent_with_its_tracestate() -> None:
    headers = {"traceparent": TRACEPARENT.encode(), "tracestate": b"congo=t61rcWkgMzE", "id": b"x"}
    assert trace_headers(headers) == {"traceparent": TRACEPARENT, "tracestate": "congo=t61rcWkgMzE"}


def test_trace_headers_drop_tracestate_without_a_valid_traceparent() -> None:
    assert trace_headers({"tracestate": b"congo=t61rcWkgMzE"}) is None
    assert trace_headers({"traceparent": b"nonsense", "tracestate": b"a=b"}) is None
    assert trace_headers({}) is None


def test_parked_row_headers_as_text_select_the_same() -> None:
    assert engine_trace_headers({"traceparent": TRACEPARENT, "type": "UserRegistered"}) == {
        "traceparent": TRACEPARENT
    }


# --- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "enabled"),
    [
        ({}, False),
        ({"OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_SERVICE_NAME": "relay"}, False),  # a name alone asks for nothing
    ],
)
def test_tracing_is_off_unless_the_otel_variables_ask(env: dict[str, str], enabled: bool) -> None:
    assert tracing_enabled(env) is enabled
    assert (relay_tracing(env) is not None) is enabled
    assert SinkTracing.from_env(env).enabled is enabled


def test_an_unknown_exporter_is_a_config_error_naming_the_variable() -> None:
    with pytest.raises(ConfigError, match="OTEL_TRACES_EXPORTER='zipkin'"):
        make_tracer("x", env={"OTEL_TRACES_EXPORTER": "zipkin"})


# --- relay spans -------------------------------------------------------------------------------


class _Msg:
    def partition(self) -> int:
        return 2

    def offset(self) -> int:
        return 41


class _Err:
    def str(self) -> str:
        return "Broker: Message size too large"


def _relay(exporter: InMemorySpanExporter) -> RelayTracing:
    return RelayTracing(make_tracer("outbox-cdc-relay", env={}, exporters=[exporter]))


def test_relay_produce_span_is_a_child_of_the_applications_span_and_ends_on_ack() -> None:
    exporter = InMemorySpanExporter()
    calls: list[tuple[Any, Any]] = []
    callback = _relay(exporter).produce(
        "outbox.event.user",
        b"user-1",
        [("id", b"evt-1"), ("traceparent", TRACEPARENT.encode())],
        b"evt-1",
        lambda err, msg: calls.append((err, msg)),
    )
    assert exporter.get_finished_spans() == ()  # open until Kafka reports the record
    msg = _Msg()
    callback(None, msg)
    assert calls == [(None, msg)]
    (span,) = exporter.get_finished_spans()
    assert span.name == "outbox.event.user publish"
    assert span.kind is SpanKind.PRODUCER
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.parent is not None and format(span.parent.span_id, "016x") == SPAN_ID
    assert span.attributes is not None
    assert span.attributes["messaging.message.id"] == "evt-1"
    assert span.attributes["messaging.destination.partition.id"] == "2"
    assert span.attributes["messaging.kafka.offset"] == 41
    assert span.status.status_code is StatusCode.UNSET


def test_relay_span_of_a_refused_record_is_an_error_and_the_callback_still_runs() -> None:
    exporter = InMemorySpanExporter()
    calls: list[Any] = []
    err = _Err()
    callback = _relay(exporter).produce(
        "t", b"k", [("id", b"e")], b"e", lambda e, m: calls.append(e)
    )
    callback(err, _Msg())
    assert calls == [err]
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert span.parent is None  # no traceparent: a trace of its own


# --- sink spans and engine headers -------------------------------------------------------------


def _envelope(headers: dict[str, bytes]) -> Envelope:
    return Envelope(
        topic="outbox.event.user",
        partition=1,
        offset=7,
        key=b"u1",
        value=b'{"user_id":"u1"}',
        headers={"id": b"evt-7", "type": b"UserRegistered", **headers},
        timestamp_ms=1,
    )


def test_sink_tracing_off_forwards_the_records_trace_headers_without_a_span() -> None:
    tracing = SinkTracing(None)
    with tracing.delivery(_envelope({"traceparent": TRACEPARENT.encode()})) as headers:
        assert headers == {"traceparent": TRACEPARENT}
    with tracing.delivery(_envelope({})) as headers:
        assert headers is None


def test_sink_delivery_span_is_a_child_of_the_app_and_the_engine_gets_its_context() -> None:
    exporter = InMemorySpanExporter()
    tracing = SinkTracing(make_tracer("outbox-cdc-sink", env={}, exporters=[exporter]))
    env = _envelope({"traceparent": TRACEPARENT.encode(), "tracestate": b"congo=t61rcWkgMzE"})
    with tracing.delivery(env) as headers:
        assert headers is not None
    (span,) = exporter.get_finished_spans()
    assert span.kind is SpanKind.CONSUMER
    assert span.parent is not None and format(span.parent.span_id, "016x") == SPAN_ID
    own = f"00-{TRACE_ID}-{span.context.span_id:016x}-01"
    assert headers == {"traceparent": own, "tracestate": "congo=t61rcWkgMzE"}
    assert span.attributes is not None and span.attributes["messaging.kafka.offset"] == 7


def test_a_failed_delivery_marks_its_span_and_is_re_raised() -> None:
    exporter = InMemorySpanExporter()
    tracing = SinkTracing(make_tracer("outbox-cdc-sink", env={}, exporters=[exporter]))
    with (
        pytest.raises(EngineUnavailable),
        tracing.delivery(_envelope({"traceparent": TRACEPARENT.encode()})),
    ):
        raise EngineUnavailable("ConnectError: refused")
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "EngineUnavailable: ConnectError: refused"


def _recording_engine(seen: list[httpx.Request], statuses: list[int]) -> EngineClient:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        status = statuses.pop(0) if statuses else 200
        body = {"error": "user_not_found"} if status == 404 else {"status": "applied"}
        return httpx.Response(status, json=body)

    return EngineClient(base_url="http://engine.test", transport=httpx.MockTransport(handler))


def test_deliver_sends_the_trace_headers_with_every_request_of_the_delivery() -> None:
    seen: list[httpx.Request] = []
    attempt = json.dumps({"attempt_id": "a1", "user_id": "u1", "quiz_id": "q", "score": 1})

    async def go() -> None:
        async with _recording_engine(seen, [404]) as engine:
            await deliver(
                engine,
                event_type="QuizAttemptSubmitted",
                payload=attempt.encode(),
                event_id="evt-1",
                headers={"traceparent": TRACEPARENT},
            )

    asyncio.run(go())
    # the attempt (404 user_not_found), the user sync, the attempt again
    assert [r.url.path for r in seen] == [
        "/api/internal/quiz-attempts/sync",
        "/api/internal/users/sync",
        "/api/internal/quiz-attempts/sync",
    ]
    assert all(r.headers["traceparent"] == TRACEPARENT for r in seen)
    assert seen[0].headers["idempotency-key"] == "evt-1"


@pytest.mark.parametrize(
    "headers",
    [
        {"Idempotency-Key": "other"},  # may not replace the client's own headers
        {"x-api-key": "stolen"},
        {"traceparent": "a\r\nx-evil: 1"},  # no header injection
        {"bad name": "v"},
    ],
)
def test_engine_refuses_extra_headers_that_would_replace_or_inject(
    headers: dict[str, str],
) -> None:
    seen: list[httpx.Request] = []

    async def go() -> None:
        async with _recording_engine(seen, []) as engine:
            await deliver(
                engine,
                event_type="UserRegistered",
                payload=b'{"user_id":"u1"}',
                event_id="evt-1",
                headers=headers,
            )

    with pytest.raises(Unroutable):
        asyncio.run(go())
    assert seen == []
