"""The engine client at its boundary: every response and transport failure classified.

httpx's MockTransport stands in for the network (the real stub is exercised in
tests/integration/test_engine_stub.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import Awaitable, Callable, Coroutine
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any, TypeVar

import httpx
import pytest

from cdc.settings import Settings
from sinks.core.errors import EngineRejected, EngineUnavailable, SinkError, Unroutable, UserNotFound
from sinks.engine.client import EngineClient, EngineTimeouts, select_proxy, tls_reason
from sinks.shared.routes import QUIZ_ATTEMPTS_SYNC_PATH, USERS_SYNC_PATH, route, user_sync_call

T = TypeVar("T")
API_KEY = "s3cret-key-value"
ATTEMPT = b'{"attempt_id":"a1","user_id":"u1","quiz_id":"q1","score":3}'

Handler = Callable[[httpx.Request], Awaitable[httpx.Response] | httpx.Response]


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def _send_with(handler: Handler, *, event_id: str = "e-1", api_key: str = API_KEY) -> None:
    async with EngineClient(
        base_url="http://engine.test", api_key=api_key, transport=httpx.MockTransport(handler)
    ) as client:
        await client.send(route("QuizAttemptSubmitted", ATTEMPT), event_id=event_id)


def _fails_with(handler: Handler) -> SinkError:
    with pytest.raises(SinkError) as info:
        run(_send_with(handler))
    return info.value


def _respond(status: int, body: object = None, headers: dict[str, str] | None = None) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json=body, headers=headers)

    return handler


def test_2xx_returns_and_the_request_carries_key_idempotency_key_and_compact_json() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"status": "applied"})

    run(_send_with(handler, event_id="evt-42"))
    (request,) = seen
    assert request.method == "POST"
    assert request.url == "http://engine.test/api/internal/quiz-attempts/sync"
    assert request.headers["x-api-key"] == API_KEY
    assert request.headers["idempotency-key"] == "evt-42"
    assert request.headers["content-type"] == "application/json"
    assert json.loads(request.content) == json.loads(ATTEMPT)
    assert b" " not in request.content


def test_duplicate_answer_is_a_success() -> None:
    run(_send_with(_respond(200, {"status": "duplicate"})))


def test_no_api_key_configured_sends_no_api_key_header() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(204)

    run(_send_with(handler, api_key=""))
    assert "x-api-key" not in seen[0].headers


def test_400_rejects_the_record_with_status_and_body_excerpt() -> None:
    error = _fails_with(_respond(400, {"error": "invalid score"}))
    assert isinstance(error, EngineRejected)
    assert not isinstance(error, UserNotFound)
    assert error.spends_attempt and error.retriable
    assert error.status == 400
    assert "invalid score" in error.body_excerpt


def test_401_is_engine_wide_and_never_reveals_the_key() -> None:
    error = _fails_with(_respond(401, {"error": "unauthorized"}))
    assert isinstance(error, EngineUnavailable)
    assert not error.spends_attempt
    assert error.status == 401
    assert API_KEY not in str(error)


def test_403_is_engine_wide() -> None:
    assert isinstance(_fails_with(_respond(403)), EngineUnavailable)


def test_404_user_not_found_names_the_user_to_sync() -> None:
    error = _fails_with(_respond(404, {"error": "user_not_found"}))
    assert isinstance(error, UserNotFound)
    assert error.user_id == "u1"


def test_404_without_user_not_found_is_a_rejection() -> None:
    error = _fails_with(_respond(404, {"error": "no such route"}))
    assert type(error) is EngineRejected


def test_408_is_engine_wide() -> None:
    error = _fails_with(_respond(408))
    assert isinstance(error, EngineUnavailable)
    assert error.retry_after_s is None


def test_429_carries_retry_after_seconds() -> None:
    error = _fails_with(_respond(429, {"error": "slow down"}, {"Retry-After": "12"}))
    assert isinstance(error, EngineUnavailable)
    assert error.retry_after_s == 12.0


def test_503_carries_retry_after_http_date() -> None:
    when = format_datetime(datetime.now(UTC) + timedelta(seconds=60), usegmt=True)
    error = _fails_with(_respond(503, None, {"Retry-After": when}))
    assert isinstance(error, EngineUnavailable)
    assert error.retry_after_s is not None
    assert 55.0 <= error.retry_after_s <= 60.0


def test_500_is_engine_wide() -> None:
    error = _fails_with(_respond(500, {"error": "boom"}))
    assert isinstance(error, EngineUnavailable)
    assert error.status == 500
    assert "boom" in error.reason


def _raise(exc_type: type[httpx.RequestError], message: str) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc_type(message, request=request)

    return handler


@pytest.mark.parametrize(
    "exc_type",
    [
        httpx.ConnectError,
        httpx.ConnectTimeout,
        httpx.ReadTimeout,
        httpx.WriteTimeout,
        httpx.ReadError,
        httpx.RemoteProtocolError,
    ],
)
def test_transport_failures_are_engine_wide_and_chain_the_httpx_cause(
    exc_type: type[httpx.RequestError],
) -> None:
    error = _fails_with(_raise(exc_type, "it broke"))
    assert isinstance(error, EngineUnavailable)
    assert error.status is None
    assert not error.spends_attempt
    assert isinstance(error.__cause__, exc_type)
    assert error.reason == f"{exc_type.__name__}: it broke"


def test_connect_error_reason_says_connection_refused() -> None:
    error = _fails_with(_raise(httpx.ConnectError, "[Errno 111] Connection refused"))
    assert "Connection refused" in error.reason


def test_empty_event_id_is_unroutable_and_nothing_is_sent() -> None:
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200)

    with pytest.raises(Unroutable, match="Idempotency-Key"):
        run(_send_with(handler, event_id=""))
    assert not sent


def test_body_that_is_not_json_is_unroutable() -> None:
    call = user_sync_call("u1")
    call.body["score"] = float("nan")

    async def go() -> None:
        async with EngineClient(transport=httpx.MockTransport(_respond(200))) as client:
            await client.send(call, event_id="e-1")

    with pytest.raises(Unroutable, match="not JSON"):
        run(go())


def test_sync_user_posts_the_user_id_to_users_sync() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200)

    async def go() -> None:
        async with EngineClient(transport=httpx.MockTransport(handler)) as client:
            await client.sync_user("u9", event_id="k-1")

    run(go())
    assert seen[0].url.path == USERS_SYNC_PATH
    assert json.loads(seen[0].content) == {"user_id": "u9"}
    assert seen[0].headers["idempotency-key"] == "k-1"


def test_from_settings_takes_base_url_key_and_timeouts() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200)

    settings = Settings(
        engine_base_url="http://engine.example:9000/",
        internal_api_key="k",
        engine_connect_timeout_s=1.5,
        engine_read_timeout_s=2.5,
    )

    async def go() -> None:
        client = EngineClient.from_settings(settings, transport=httpx.MockTransport(handler))
        try:
            await client.send(route("QuizAttemptSubmitted", ATTEMPT), event_id="e")
        finally:
            await client.aclose()

    run(go())
    assert str(seen[0].url) == f"http://engine.example:9000{QUIZ_ATTEMPTS_SYNC_PATH}"
    assert seen[0].headers["x-api-key"] == "k"
    timeout = seen[0].extensions["timeout"]
    assert (timeout["connect"], timeout["read"], timeout["pool"]) == (1.5, 2.5, None)


def test_default_timeouts_are_2s_connect_and_3s_read() -> None:
    assert EngineTimeouts().as_httpx() == httpx.Timeout(connect=2.0, read=3.0, write=3.0, pool=None)


def test_concurrent_sends_never_exceed_max_in_flight() -> None:
    running = 0
    peak = 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1
        return httpx.Response(200)

    async def go() -> None:
        async with EngineClient(max_in_flight=3, transport=httpx.MockTransport(handler)) as client:
            await asyncio.gather(*(client.sync_user(f"u{n}", event_id=f"e{n}") for n in range(20)))

    run(go())
    assert peak == 3


def test_api_key_never_appears_in_logs_or_repr(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(EngineUnavailable):
        run(_send_with(_respond(503, {"error": "down"})))
    run(_send_with(_respond(200)))
    assert caplog.records  # something was logged
    assert API_KEY not in caplog.text
    client = EngineClient(api_key=API_KEY)
    try:
        assert API_KEY not in repr(client)
    finally:
        run(client.aclose())


def test_max_in_flight_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        EngineClient(max_in_flight=0)


# --- TLS reasons, proxy selection, extra headers (pure) -------------------------


def _ssl_error(reason: str) -> ssl.SSLError:
    error = ssl.SSLError(1, f"[SSL: {reason}] {reason.lower()}")
    error.reason = reason
    return error


def test_tls_reason_for_a_refused_client_certificate_names_the_client_cert_setting() -> None:
    for alert in ("TLSV13_ALERT_CERTIFICATE_REQUIRED", "SSLV3_ALERT_BAD_CERTIFICATE"):
        reason = tls_reason(_ssl_error(alert), "detail")
        assert "ENGINE_CLIENT_CERT" in reason, alert


def test_tls_reason_for_a_plain_http_port_names_the_base_url() -> None:
    assert "ENGINE_BASE_URL" in tls_reason(_ssl_error("WRONG_VERSION_NUMBER"), "d")


def test_tls_reason_for_a_dropped_handshake_names_both_suspects() -> None:
    reason = tls_reason(None, "ConnectionResetError (h:443)")
    assert "ENGINE_CLIENT_CERT" in reason and "ENGINE_BASE_URL" in reason


@pytest.mark.parametrize(
    ("url", "no_proxy", "expected"),
    [
        ("https://engine.internal:8443", "", "http://p:3128"),
        ("https://engine.internal:8443", "*", ""),
        ("https://engine.internal:8443", "internal", ""),
        ("https://engine.internal:8443", ".internal", ""),
        ("https://engine.internal:8443", "engine.internal:8443", ""),
        ("https://engine.internal:8443", "engine.internal:9999", "http://p:3128"),
        ("https://engine.internal:8443", "other.internal, 10.0.0.1", "http://p:3128"),
        ("https://notinternal:8443", "internal", "http://p:3128"),
        ("https://127.0.0.1:8443", "127.0.0.1", ""),
        ("https://[::1]:8443", "::1", ""),
        ("http://engine.internal", "", "http://plain:80"),
    ],
)
def test_select_proxy_reads_the_variables_as_curl_does(
    url: str, no_proxy: str, expected: str
) -> None:
    chosen = select_proxy(
        url, https_proxy="http://p:3128", http_proxy="http://plain:80", no_proxy=no_proxy
    )
    assert chosen == expected


@pytest.mark.parametrize(
    "headers",
    [
        {"x-api-key": "other"},
        {"Idempotency-Key": "other"},
        {"traceparent": "a\r\nx-evil: 1"},
        {"bad name": "v"},
    ],
)
def test_unusable_extra_headers_are_unroutable_and_nothing_is_sent(
    headers: dict[str, str],
) -> None:
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200)

    async def go() -> None:
        async with EngineClient(transport=httpx.MockTransport(handler)) as client:
            await client.send(user_sync_call("u"), event_id="e", headers=headers)

    with pytest.raises(Unroutable):
        run(go())
    assert not sent


def test_extra_headers_are_sent_with_the_request() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200)

    async def go() -> None:
        async with EngineClient(transport=httpx.MockTransport(handler)) as client:
            await client.send(user_sync_call("u"), event_id="e", headers={"tracestate": "k=v"})

    run(go())
    assert seen[0].headers["tracestate"] == "k=v"
    assert seen[0].headers["idempotency-key"] == "e"
