"""The admin API's pure parts and its ASGI guard, driven in-process (no services).

The guard and the app are called as ASGI callables with scripted ``receive``
functions, so a test can count exactly which body bytes were pulled; the
retry-body parser and the served JSON Schema are checked against each other.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import jsonschema_rs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from starlette.responses import PlainTextResponse
from starlette.routing import Mount

from cdc.errors import ConfigError
from cdc.health import Liveness
from cdc.settings import Settings
from sinks.engine.client import EngineClient
from sinks.http.app import create_app
from sinks.http.guard import (
    MAX_HEADER_BYTES,
    MAX_HEADER_COUNT,
    Access,
    RequestGuard,
    check_access,
    declared_length,
    error_response,
    headers_too_large,
    token_digest,
)
from sinks.http.schema import (
    MAX_EVENT_ID,
    RequestBodyError,
    RetryRequest,
    is_json,
    parse_retry_request,
    quote,
)
from sinks.parking.lot import ParkingLot
from sinks.parking.retrier import Retrier, retry_message

TOKEN = "s3cret-admin-token"
DIGEST = token_digest(TOKEN)
RETRY = "/api/v1/admin/failed-sync-events/retry"
LIST = "/api/v1/admin/failed-sync-events"
#: Nothing listens on port 1: the parking lot's database is unreachable.
UNREACHABLE_DSN = "postgresql://admin:db-password-xyz@127.0.0.1:1/nowhere?connect_timeout=2"


def _app(*, token: str = TOKEN, max_body_bytes: int = 1024 * 1024, extra_routes: Any = ()) -> Any:
    settings = Settings(pg_dsn=UNREACHABLE_DSN, engine_base_url="http://127.0.0.1:1")
    lot = ParkingLot(UNREACHABLE_DSN)
    engine = EngineClient.from_settings(settings)
    return create_app(
        lot=lot,
        retrier=Retrier(lot=lot, engine=engine, settings=settings),
        token=token,
        registry=CollectorRegistry(),
        liveness=Liveness(),
        max_body_bytes=max_body_bytes,
        extra_routes=extra_routes,
    )


def _scope(path: str, headers: list[tuple[bytes, bytes]], method: str = "POST") -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 9102),
    }


class _Sent:
    """Collects what the app sends."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    async def __call__(self, message: dict[str, Any]) -> None:
        self.messages.append(message)

    @property
    def status(self) -> int:
        return int(self.messages[0]["status"])

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self.messages[0]["headers"])

    @property
    def json(self) -> Any:
        return json.loads(b"".join(m.get("body", b"") for m in self.messages[1:]))


def _call(
    app: Any, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]]
) -> _Sent:
    sent = _Sent()
    asyncio.run(app(scope, receive, sent))
    return sent


class _EndlessBody:
    """A body that never ends, in 64 KiB chunks; counts what was pulled."""

    chunk = b"x" * 65536

    def __init__(self) -> None:
        self.pulled_bytes = 0
        self.calls = 0

    async def __call__(self) -> dict[str, Any]:
        self.calls += 1
        self.pulled_bytes += len(self.chunk)
        return {"type": "http.request", "body": self.chunk, "more_body": True}


async def _must_not_read() -> dict[str, Any]:
    raise AssertionError("the body was read")


# --- check_access ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([f"Bearer {TOKEN}".encode()], Access.GRANTED),
        ([f"bearer {TOKEN}".encode()], Access.GRANTED),
        ([f"BEARER   {TOKEN}  ".encode()], Access.GRANTED),
        ([], Access.MISSING),
        ([b"Bearer"], Access.MISSING),
        ([b"Bearer "], Access.MISSING),
        ([TOKEN.encode()], Access.MISSING),
        ([f"Basic {TOKEN}".encode()], Access.MISSING),
        ([b"Bearer wrong"], Access.WRONG),
        ([f"Bearer {TOKEN[:-1]}".encode()], Access.WRONG),
        ([f"Bearer {TOKEN}x".encode()], Access.WRONG),
        ([f"Bearer {TOKEN} x".encode()], Access.WRONG),
        ([f"Bearer {TOKEN}".encode(), f"Bearer {TOKEN}".encode()], Access.WRONG),
        ([b"Bearer \xff\xfe"], Access.WRONG),
    ],
)
def test_check_access_grants_only_the_one_bearer_token(
    values: list[bytes], expected: Access
) -> None:
    assert check_access(values, DIGEST) is expected


def test_without_a_configured_token_access_is_disabled_even_for_an_empty_bearer() -> None:
    assert token_digest("") == b""
    for values in ([], [b"Bearer "], [b"Bearer x"]):
        assert check_access(values, b"") is Access.DISABLED


def test_the_token_is_compared_in_constant_time_over_equal_length_digests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr("sinks.http.guard.hmac.compare_digest", spy)
    for presented in ("", "x", TOKEN[:-1], TOKEN, TOKEN + "x", "y" * 10_000):
        check_access([f"Bearer {presented}".encode()], DIGEST)
    assert calls == [(32, 32)] * 5, "every presented token goes through compare_digest"


# --- headers and lengths ---------------------------------------------------------------


def test_declared_length_reads_content_length_only_when_it_is_a_number() -> None:
    assert declared_length([(b"content-length", b"12")]) == 12
    assert declared_length([(b"host", b"x")]) is None
    assert declared_length([(b"content-length", b"-1")]) is None


def test_header_limits_count_fields_and_bytes() -> None:
    assert not headers_too_large(b"/", [(b"x-%d" % i, b"a") for i in range(MAX_HEADER_COUNT)])
    assert headers_too_large(b"/", [(b"x-%d" % i, b"a") for i in range(MAX_HEADER_COUNT + 1)])
    line = b"a" * (MAX_HEADER_BYTES - 1 - 5 - 4)  # target "/" + "x-big" + ": " + CRLF
    assert not headers_too_large(b"/", [(b"x-big", line)])
    assert headers_too_large(b"/", [(b"x-big", line + b"a")])


# --- the guard in front of the real app -------------------------------------------------


def test_an_unauthenticated_request_is_refused_without_reading_one_body_byte() -> None:
    app = _app()
    for headers in ([], [(b"authorization", b"Bearer nope")]):
        sent = _call(app, _scope(RETRY, [(b"content-length", b"99"), *headers]), _must_not_read)
        assert sent.status == 401
        assert sent.headers[b"www-authenticate"].startswith(b"Bearer realm=")
        assert sent.json["success"] is False


def test_with_no_token_configured_every_admin_request_is_503_unread() -> None:
    sent = _call(_app(token=""), _scope(RETRY, [(b"authorization", b"Bearer x")]), _must_not_read)
    assert sent.status == 503
    assert "ADMIN_API_TOKEN" in sent.json["message"]


def test_a_streamed_body_is_cut_off_one_chunk_past_the_limit() -> None:
    limit = 200_000
    app = _app(max_body_bytes=limit)
    body = _EndlessBody()
    headers = [
        (b"authorization", f"Bearer {TOKEN}".encode()),
        (b"content-type", b"application/json"),
    ]
    sent = _call(app, _scope(RETRY, headers), body)
    assert sent.status == 413
    assert limit < body.pulled_bytes <= limit + len(body.chunk)


def test_a_declared_oversize_body_is_413_without_reading_it() -> None:
    headers = [
        (b"authorization", f"Bearer {TOKEN}".encode()),
        (b"content-length", b"1048577"),
    ]
    sent = _call(_app(), _scope(RETRY, headers), _must_not_read)
    assert sent.status == 413


def test_a_body_limit_below_one_byte_is_refused_when_the_app_is_built() -> None:
    for limit in (0, -1):
        with pytest.raises(ConfigError, match="ADMIN_API_MAX_BODY_BYTES"):
            _app(max_body_bytes=limit)
        with pytest.raises(ConfigError, match="ADMIN_API_MAX_BODY_BYTES"):
            RequestGuard(_app(), token=TOKEN, max_body_bytes=limit, public_paths=())


def test_an_unreachable_database_is_a_503_that_names_no_secret() -> None:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://sink") as client:
            return await client.get(LIST, headers={"Authorization": f"Bearer {TOKEN}"})

    response = asyncio.run(run())
    assert response.status_code == 503
    assert "db-password-xyz" not in response.text
    assert response.json()["success"] is False


def test_the_body_limit_setting_comes_from_the_environment() -> None:
    assert Settings().admin_api_max_body_bytes == 1024 * 1024
    env = {"ADMIN_API_MAX_BODY_BYTES": "4096"}
    assert Settings.from_env(env).admin_api_max_body_bytes == 4096


# --- the retry body -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b'{"event_ids": [NaN]}', 422),
        (b'{"event_ids": [1e400]}', 422),
        (b'{"retry_all": -Infinity}', 422),
        (b'{"\\ud800": 1}', 400),
        (b'{"event_ids": ["\\udfff"]}', 400),
        (b'{"\xed\xa0\x80": 1}', 400),
        (b'{"x": "\xc3"}', 400),
        (b"[" * 100_000, 400),
        (b'{"event_ids": ["1"]}', 422),
        (b'{"event_ids": [true]}', 422),
        (b'{"retry_all": "yes"}', 422),
        (b'{"retry_all": 1}', 422),
        (b'{"event_ids": [], "retry_all": false}', 422),
    ],
)
def test_hostile_bodies_are_refused_with_an_answer_that_renders(raw: bytes, status: int) -> None:
    with pytest.raises(RequestBodyError) as caught:
        parse_retry_request(raw)
    assert caught.value.status_code == status
    rendered = error_response(status, caught.value.reason, caught.value.errors)
    assert json.loads(rendered.body)["data"]["errors"]


def test_quote_escapes_lone_surrogates_and_cuts_long_names() -> None:
    assert quote("\ud800abc") == "\\ud800abc"
    assert quote("k" * 1000) == "k" * 64
    assert quote("é" * 3) == "ééé"


@pytest.mark.parametrize(
    ("content_type", "ok"),
    [
        ("application/json", True),
        ("Application/JSON; charset=UTF-8", True),
        ('application/json; charset="utf-8"', True),
        (None, False),
        ("text/plain", False),
        ("application/json; charset=latin-1", False),
        ("application/jsonx", False),
        ("application/problem+json", False),
    ],
)
def test_is_json_takes_application_json_in_utf8_only(content_type: str | None, ok: bool) -> None:
    assert is_json(content_type) is ok


JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([0.0, 1.0, 2.0, float(MAX_EVENT_ID), 2.0**53, 1.5])
    | st.text(max_size=5)
)
ID_LISTS = st.lists(
    st.integers(min_value=-2, max_value=MAX_EVENT_ID + 2) | JSON_SCALARS, max_size=4
) | st.lists(st.just(1), min_size=999, max_size=1002)
BODIES = st.one_of(
    JSON_SCALARS,
    st.lists(JSON_SCALARS, max_size=3),
    st.fixed_dictionaries(
        {},
        optional={
            "event_ids": ID_LISTS | JSON_SCALARS,
            "retry_all": JSON_SCALARS,
            "other": JSON_SCALARS,
        },
    ),
)
SCHEMA = jsonschema_rs.validator_for(RetryRequest.model_json_schema())


@settings(max_examples=300, derandomize=True, database=None)
@given(BODIES)
def test_the_model_accepts_exactly_what_its_json_schema_accepts(body: object) -> None:
    raw = json.dumps(body).encode()
    try:
        parse_retry_request(raw)
        accepted = True
    except RequestBodyError as exc:
        assert exc.status_code == 422, exc.errors
        accepted = False
    assert accepted == SCHEMA.is_valid(body), raw[:200]


def test_a_retry_message_names_at_most_20_unknown_ids() -> None:
    assert retry_message([]) == "Retry failed sync events finished"
    assert retry_message([7, 9]).endswith("unknown or not open: [7, 9]")
    message = retry_message(list(range(1, 1001)))
    assert message.endswith(f"{list(range(1, 21))} and 980 more")


def test_unknown_paths_and_methods_answer_in_the_same_envelope() -> None:
    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=_app())
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(transport=transport, base_url="http://sink") as client:
            return [
                await client.put(RETRY, headers=auth),
                await client.get("/api/v1/admin/nothing-here", headers=auth),
            ]

    wrong_method, unknown = asyncio.run(run())
    assert wrong_method.status_code == 405
    assert wrong_method.headers["allow"] == "POST"
    assert unknown.status_code == 404
    for response in (wrong_method, unknown):
        assert response.json()["success"] is False


def test_a_mounted_app_plugs_in_with_one_route_behind_the_same_token() -> None:
    """What an operator console at /console/ needs: one item of ``extra_routes``."""

    async def console(scope: Any, receive: Any, send: Any) -> None:
        await PlainTextResponse(f"console {scope['path']}")(scope, receive, send)

    async def run() -> list[httpx.Response]:
        app = _app(extra_routes=[Mount("/console", app=console)])
        transport = httpx.ASGITransport(app=app)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(transport=transport, base_url="http://sink") as client:
            return [
                await client.get("/console/", headers=auth),
                await client.get("/console/"),
                await client.get("/readyz"),
            ]

    served, unauthenticated, probe = asyncio.run(run())
    assert served.status_code == 200 and served.text.startswith("console")
    assert unauthenticated.status_code == 401
    assert probe.status_code in (200, 503)  # (public: the liveness decides, not the token)
