"""The request guard of the sink's HTTP server: the token first, then a bounded body.

Guarantees (for every HTTP request, before any route runs):

* a request for a path outside ``public_paths`` is answered by the guard itself,
  **before one byte of its body is read**, unless it carries
  ``Authorization: Bearer <token>`` with the configured token: 401 with a
  ``WWW-Authenticate: Bearer`` challenge when the credentials are missing or
  wrong, 503 when no token is configured (the admin API is off, never open);
  the token is compared in constant time (digests of equal length), and neither
  the header nor the token is ever logged;
* a request whose header section passes :data:`MAX_HEADER_BYTES` or
  :data:`MAX_HEADER_COUNT` is a 431 (before the token check: it is the server's
  limit, not the admin API's); the server itself (uvicorn's h11, configured in
  :mod:`sinks.runtime.service`) already refuses with 400 any header section that has not
  ended within :data:`MAX_HEADER_BYTES`, so no more than one socket read of
  headers is ever buffered;
* a body larger than ``max_body_bytes`` is a 413: refused on its declared
  ``Content-Length`` before the route runs, or as soon as the streamed bytes pass
  the limit, so no more than the limit plus one chunk is ever held in memory;
* every answer the guard gives is the reference envelope
  ``{"success": false, "message": ..., "data": {"errors": []}}`` (:class:`ErrorResponse`).

The decisions are pure functions (:func:`check_access`, :func:`declared_length`);
:class:`RequestGuard` is the thin ASGI shell around them. Header sections are
bounded one level lower, by the HTTP server (see :data:`MAX_HEADER_BYTES`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterable, Mapping, Sequence
from enum import Enum
from typing import Literal

from pydantic import BaseModel, Field
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cdc.errors import ConfigError
from sinks.core.errors import SinkError

log = logging.getLogger("sinks.guard")

#: Largest request target plus header section (h11's default buffer, made
#: explicit): ample for a bearer token and any client's usual headers.
MAX_HEADER_BYTES = 16 * 1024
#: Most header fields one request may carry (Apache httpd's LimitRequestFields).
MAX_HEADER_COUNT = 100
#: Default largest request body: a retry of the largest id list is ~20 KiB.
DEFAULT_MAX_BODY_BYTES = 1024 * 1024
#: The challenge sent with every 401 (RFC 6750, section 3).
BEARER_CHALLENGE = 'Bearer realm="outbox-cdc admin"'


class Access(Enum):
    """What a request's credentials amount to."""

    #: The bearer token is the configured one.
    GRANTED = "granted"
    #: No ``Authorization: Bearer`` credentials at all.
    MISSING = "missing"
    #: Credentials were given and are not the token (or several were given).
    WRONG = "wrong"
    #: No token is configured: the admin API is switched off.
    DISABLED = "disabled"


class BodyTooLarge(SinkError):  # noqa: N818 - named after the condition, as the other errors
    """The request body passed the configured limit while it was being read."""

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(f"request body larger than {limit_bytes} bytes")
        self.limit_bytes = limit_bytes


class ErrorDetail(BaseModel):
    """One reason a request was refused; never a copy of the request's values."""

    loc: list[str | int] = Field(
        description="Where: field names (cut to 64 characters, escaped) and list indexes."
    )
    type: str = Field(description="Machine-readable kind, e.g. `int_type`, `json_invalid`.")
    msg: str = Field(description="Human-readable reason.")


class ErrorData(BaseModel):
    errors: list[ErrorDetail] = Field(
        description="Validation errors (the first 20); empty for other refusals."
    )


class ErrorResponse(BaseModel):
    """The reference envelope of a refusal: ``success`` is false and ``data`` holds why."""

    success: Literal[False]
    message: str
    data: ErrorData


def error_response(
    status_code: int,
    message: str,
    errors: Sequence[ErrorDetail] = (),
    *,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """A JSON refusal in the reference envelope."""
    body = ErrorResponse(success=False, message=message, data=ErrorData(errors=list(errors)))
    return JSONResponse(body.model_dump(mode="json"), status_code=status_code, headers=headers)


def token_digest(token: str) -> bytes:
    """The digest a presented token is compared with (empty when no token is configured)."""
    return hashlib.sha256(token.encode()).digest() if token else b""


def check_access(authorization: Sequence[bytes], digest: bytes) -> Access:
    """Judge the ``Authorization`` header values of a request against the token's digest.

    Comparing fixed-length digests with :func:`hmac.compare_digest` keeps the
    time independent of where, and of whether the lengths, differ.
    """
    if not digest:
        return Access.DISABLED
    if not authorization:
        return Access.MISSING
    if len(authorization) > 1:
        return Access.WRONG
    scheme, _, credentials = authorization[0].strip().partition(b" ")
    credentials = credentials.strip()
    if scheme.lower() != b"bearer" or not credentials:
        return Access.MISSING
    given = hashlib.sha256(credentials).digest()
    return Access.GRANTED if hmac.compare_digest(given, digest) else Access.WRONG


def header_section_bytes(target: bytes, headers: Sequence[tuple[bytes, bytes]]) -> int:
    """Bytes of the request target and header lines as sent (``name: value CRLF``)."""
    return len(target) + sum(len(name) + len(value) + 4 for name, value in headers)


def headers_too_large(target: bytes, headers: Sequence[tuple[bytes, bytes]]) -> bool:
    """Whether the header section passes :data:`MAX_HEADER_BYTES` or :data:`MAX_HEADER_COUNT`."""
    return (
        len(headers) > MAX_HEADER_COUNT or header_section_bytes(target, headers) > MAX_HEADER_BYTES
    )


def checked_body_limit(max_body_bytes: int) -> int:
    """The body limit, or :class:`ConfigError` when it is below one byte."""
    if max_body_bytes < 1:
        raise ConfigError(f"ADMIN_API_MAX_BODY_BYTES={max_body_bytes} must be at least 1")
    return max_body_bytes


def declared_length(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    """The request's ``Content-Length`` (the server has already refused malformed ones)."""
    for name, value in headers:
        if name == b"content-length" and value.strip().isdigit():
            return int(value)
    return None


def _refusal(access: Access) -> JSONResponse:
    if access is Access.DISABLED:
        return error_response(503, "admin API disabled: set ADMIN_API_TOKEN")
    challenge = BEARER_CHALLENGE
    if access is Access.WRONG:
        challenge += ', error="invalid_token"'
    return error_response(
        401,
        "missing or wrong admin token: send Authorization: Bearer <ADMIN_API_TOKEN>",
        headers={"WWW-Authenticate": challenge},
    )


def _too_large(limit_bytes: int) -> JSONResponse:
    return error_response(413, f"request body larger than {limit_bytes} bytes")


class _BoundedReceive:
    """``receive`` that raises :class:`BodyTooLarge` once the body passes the limit."""

    def __init__(self, receive: Receive, limit_bytes: int) -> None:
        self._receive = receive
        self._limit_bytes = limit_bytes
        self.received_bytes = 0

    async def __call__(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.request":
            self.received_bytes += len(message.get("body", b""))
            if self.received_bytes > self._limit_bytes:
                raise BodyTooLarge(self._limit_bytes)
        return message


class _TrackedSend:
    """``send`` that remembers whether the response has started."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)


class RequestGuard:
    """ASGI middleware: token check for non-public paths, then the body limit."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        token: str,
        max_body_bytes: int,
        public_paths: Iterable[str],
    ) -> None:
        self.app = app
        self._digest = token_digest(token)
        self._max_body_bytes = checked_body_limit(max_body_bytes)
        self._public_paths = frozenset(public_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        target = (scope.get("raw_path") or b"") + scope["query_string"]
        if headers_too_large(target, headers):
            await error_response(
                431,
                f"header section larger than {MAX_HEADER_BYTES} bytes"
                f" or more than {MAX_HEADER_COUNT} fields",
            )(scope, receive, send)
            return
        if scope["path"] not in self._public_paths:
            access = check_access([v for k, v in headers if k == b"authorization"], self._digest)
            if access is not Access.GRANTED:
                log.info(
                    "admin request refused: %s %r",
                    scope["method"],
                    scope["path"][:100],
                    extra={"state": access.value},
                )
                await _refusal(access)(scope, receive, send)
                return
        declared = declared_length(headers)
        if declared is not None and declared > self._max_body_bytes:
            await _too_large(self._max_body_bytes)(scope, receive, send)
            return
        bounded = _BoundedReceive(receive, self._max_body_bytes)
        tracked = _TrackedSend(send)
        try:
            await self.app(scope, bounded, tracked)
        except BodyTooLarge:
            if tracked.started:
                raise
            await _too_large(self._max_body_bytes)(scope, receive, send)
