"""A small asyncio HTTP/1.1 client: one origin, a pool of keep-alive connections.

Why it exists (DESIGN names httpx; this is the measured reason to differ): on
the 2-core reference machine, 64 requests in flight to the engine stub in its
own process, httpx costs ~0.6-0.8 ms of client CPU per request and caps the
engine client near 1,100-1,700 requests/s; this pool, an
:class:`asyncio.BufferedProtocol` per connection and llhttp, costs ~45 us per
request (~100 us with the h11 fallback) and reaches ~18,000 requests/s, the
stub's own limit.

The module has two layers. The protocol layer is pure (no I/O, no clock):
:func:`parse_origin`, :func:`encode_headers`, :func:`serialize_request` and the
response parsers (:func:`new_response_parser`), fed bytes and tested on bytes.
The I/O layer is :class:`ConnectionPool`.

Guarantees of the protocol layer:

- A request is ``METHOD target HTTP/1.1``, ``host``, the caller's headers, a
  ``content-length`` and the body. Methods and header names must be tokens,
  targets start with ``/`` and hold no whitespace or control byte, header
  values hold no CR, LF or NUL: nothing a caller passes can inject a header
  or a second request (:class:`ValueError` instead).
- A response is framed by ``Content-Length``, by chunked transfer-encoding
  (extensions and trailers accepted, trailers dropped) or by the close of the
  connection, and is returned once, complete. Interim 1xx responses are
  skipped; ``101 Switching Protocols`` is an error (no upgrade was asked for).
- The head (status lines and headers, interim responses and trailers
  included) is limited to ``max_header_bytes`` and :data:`MAX_HEADERS` fields,
  the body to ``max_body_bytes``; beyond is :class:`RemoteProtocolError`.
- ``Response.keep_alive`` is false after ``Connection: close``, an HTTP/1.0
  answer without keep-alive, a close-delimited body, or any byte after the
  response (no pipelining: such bytes can only be garbage).
- Header names are lower-cased; a repeated header's values are joined by ``", "``.
- The parser is ``httptools`` (llhttp) when installed, else ``h11``; both
  pass the same tests. HEAD and CONNECT are not supported (their responses
  are framed differently) and no content coding is undone (none is asked for).

Guarantees of :class:`ConnectionPool`:

- At most ``max_connections`` requests run at once, over at most that many
  connections; one request per connection at a time. Idle connections are
  reused last-in first-out, so a quiet period lets the cold ones expire: a
  connection idle for ``keepalive_expiry_s`` is closed instead of reused, as
  is one the server closed, or sent anything on, while it was idle.
- Every idle connection is checked again at checkout (:meth:`_Connection.stale`):
  one already closed, whose transport is closing (asyncio read a reset or EOF
  and has not reported it to the protocol yet), or whose socket is readable
  (the server's FIN, RST or stray bytes waiting unread) is dropped unused and
  the next one tried (``stale_checkouts`` counts them).
- A request sent on a reused connection that the server had closed - EOF or
  reset before any byte of *this* request's response (the connection's
  earlier responses do not count) - is sent once more on a new connection.
  That resend is only safe because every request of the sink is idempotent
  (``Idempotency-Key``); a request on a new connection, or one whose response
  had begun, is never resent.
- Timeouts (:class:`PoolTimeouts`): ``connect_s`` for the TCP (and TLS)
  connect, ``read_s`` for the longest silence while awaiting the response (a
  slow but steady response is not cut), ``write_s`` while the socket buffer
  is full. The caller bounds a whole request (:class:`RequestDeadline`): a
  response trickling a few bytes at a time never trips ``read_s``.
- A complete response that arrives while the request body is still being
  written (the server answered early, e.g. 413, and stopped reading) is
  returned, and the connection closed: the rest of the body is never sent.
- Every failure is a :class:`TransportError` whose class says what happened
  (:class:`ConnectError`, :class:`ConnectTimeout`, :class:`ReadTimeout`,
  :class:`WriteTimeout`, :class:`ReadError`, :class:`RemoteProtocolError`)
  and whose message says it for a log line; e.g.
  ``[Errno 111] Connection refused (127.0.0.1:8081)``. A connection that
  failed, or whose request was cancelled, is closed, never reused.
- :meth:`ConnectionPool.aclose` closes every connection, in use or idle;
  requests after it raise :class:`RuntimeError`.
- TLS: an ``https`` origin is reached with the pool's :class:`ssl.SSLContext`
  (SNI and name check against the origin's host); any TLS failure, in the
  handshake or later (a server's alert such as "certificate required"), is a
  :class:`TLSError` carrying the :class:`ssl.SSLError`.
- Proxy (:class:`Proxy`, an ``http://`` proxy): an ``https`` origin is reached
  through a ``CONNECT host:port`` tunnel, TLS end to end; an ``http`` origin by
  sending absolute-form requests (``POST http://host/path``) to the proxy. The
  proxy's credentials go in ``Proxy-Authorization`` (Basic) and never into a
  message. A refused ``CONNECT`` is a :class:`ProxyError` with the status.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import os
import re
import select
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol, cast
from urllib.parse import unquote, urlsplit

import h11

#: Status line plus header fields of a response (interim responses and
#: trailers included); beyond is a protocol error. h11 and httpx use 64 KiB.
MAX_HEADER_BYTES = 64 * 1024
#: Header fields in a response head.
MAX_HEADERS = 100
#: Response body; the engine answers with small JSON objects.
MAX_BODY_BYTES = 4 * 1024 * 1024
#: Bytes a connection reads at once (its own buffer, reused).
READ_BUFFER_BYTES = 32 * 1024
#: How long :meth:`ConnectionPool.aclose` waits for closed sockets to be released.
CLOSE_WAIT_S = 1.0
#: What makes an idle socket unfit for a request: anything to read (EOF, stray
#: bytes), the peer's half-close (Linux), and - always reported - error and hang-up.
_IDLE_TROUBLE = select.POLLIN | getattr(select, "POLLRDHUP", 0) | select.POLLERR | select.POLLHUP

PARSER_BACKEND = "httptools" if importlib.util.find_spec("httptools") is not None else "h11"

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FIELD_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
_TARGET = re.compile(r"/[\x21-\x7e]*")
_ERRNO = re.compile(r"\[Errno (-?\d+)\]")
#: Set by serialize_request / the pool, so a caller cannot send them twice.
_RESERVED_HEADERS = frozenset({"host", "content-length", "transfer-encoding"})


# --- errors -----------------------------------------------------------------


class TransportError(Exception):
    """No usable response: the class names the failure, the message is for a log line."""


class ConnectError(TransportError):
    """The connection could not be made (refused, unreachable, DNS, TLS)."""


class TLSError(ConnectError):
    """The TLS handshake or session failed: an untrusted or misnamed certificate, a
    client certificate the server refused, or a server that does not speak TLS.

    ``ssl_error`` is the :class:`ssl.SSLError` (its ``reason`` names the failure),
    or ``None`` when the server reset the connection during the handshake (as
    asyncio's TLS server does when it refuses a client certificate).
    """

    def __init__(self, message: str, *, ssl_error: ssl.SSLError | None) -> None:
        super().__init__(message)
        self.ssl_error = ssl_error


class ProxyError(ConnectError):
    """The proxy refused to open a tunnel to the origin; ``status`` is its answer."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


class ConnectTimeout(TransportError):  # noqa: N818 - httpx's names, kept in reasons
    """The connection was not made within the connect timeout."""


class ReadTimeout(TransportError):  # noqa: N818 - httpx's names, kept in reasons
    """The server was silent for the read timeout while a response was due."""


class WriteTimeout(TransportError):  # noqa: N818 - httpx's names, kept in reasons
    """The request could not be written within the write timeout."""


class RequestDeadline(TransportError):  # noqa: N818 - named like the timeouts above
    """No complete response within the request's overall deadline (a trickling answer)."""


class ReadError(TransportError):
    """The connection broke (reset, closed locally) while a response was due."""


class RemoteProtocolError(TransportError):
    """The server closed early or sent bytes that are not a valid HTTP/1.1 response."""


# --- the protocol layer: pure -------------------------------------------------


@dataclass(frozen=True, slots=True)
class Origin:
    """Where requests go: scheme, host and port, the ``Host`` header, a path prefix."""

    scheme: str
    host: str
    port: int
    authority: str  # the Host header: host[:port] as written in the URL
    path_prefix: str  # the URL's path without its trailing "/": prepended to targets


@dataclass(frozen=True, slots=True)
class Response:
    """A complete final response; ``keep_alive`` says whether its connection may be reused."""

    status: int
    headers: Mapping[str, str]  # lower-cased names
    body: bytes
    keep_alive: bool


@dataclass(frozen=True, slots=True)
class Proxy:
    """An ``http://`` proxy: where it is and the ``Proxy-Authorization`` line, if any."""

    host: str
    port: int
    authority: str
    authorization: bytes = b""  # a complete header line; never printed (repr=False below)

    def __repr__(self) -> str:
        return f"Proxy({self.authority!r}, credentials={'yes' if self.authorization else 'no'})"


def parse_proxy(url: str) -> Proxy:
    """The :class:`Proxy` of ``http://[user:password@]host[:port]`` (port 80 by default)."""
    try:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        port = parts.port or 80
    except ValueError:
        raise ValueError("the proxy URL is not a valid URL") from None
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"only http:// proxies with a host are supported (got {parts.scheme}://)")
    authorization = b""
    if parts.username is not None:
        credentials = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        token = base64.b64encode(credentials.encode("utf-8"))
        authorization = b"proxy-authorization: Basic " + token + b"\r\n"
    authority = parts.netloc.rpartition("@")[2].lower()
    return Proxy(parts.hostname, port, authority, authorization)


def connect_request(origin: Origin, proxy: Proxy) -> bytes:
    """The ``CONNECT`` request that opens a tunnel to ``origin`` through ``proxy``."""
    target = (
        f"{origin.host}:{origin.port}"
        if ":" not in origin.host
        else f"[{origin.host}]:{origin.port}"
    )
    return b"CONNECT %s HTTP/1.1\r\nhost: %s\r\n%s\r\n" % (
        target.encode("ascii"),
        target.encode("ascii"),
        proxy.authorization,
    )


def parse_connect_response(head: bytes, proxy: Proxy) -> None:
    """Check a proxy's answer to ``CONNECT`` (the head up to its blank line).

    A 2xx opens the tunnel; anything else is a :class:`ProxyError` with the status.
    """
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise RemoteProtocolError(f"invalid answer to CONNECT from proxy {proxy.authority}")
    status = int(parts[1])
    if not 200 <= status < 300:
        text = parts[2] if len(parts) > 2 else ""
        raise ProxyError(
            f"proxy {proxy.authority} answered CONNECT with {status} {text}".rstrip(),
            status=status,
        )


def parse_origin(url: str) -> Origin:
    """The :class:`Origin` of an ``http://`` or ``https://`` base URL; :class:`ValueError` else."""
    parts = urlsplit(url)
    if parts.scheme not in {"http", "https"} or not parts.hostname:
        raise ValueError(f"not an http(s) URL with a host: {url!r}")
    if parts.query or parts.fragment or parts.username is not None:
        raise ValueError(f"a base URL has no query, fragment or credentials: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    authority = parts.netloc.lower()
    path_prefix = parts.path.rstrip("/")
    if path_prefix and not _TARGET.fullmatch(path_prefix):
        raise ValueError(f"invalid path in base URL: {url!r}")
    return Origin(parts.scheme, parts.hostname, port, authority, path_prefix)


def encode_headers(headers: Iterable[tuple[str, str]]) -> bytes:
    """``name: value\\r\\n`` lines (latin-1) for :func:`serialize_request`, validated.

    Names must be tokens and must not be ``host``, ``content-length`` or
    ``transfer-encoding`` (the serializer sets them); values must not hold
    CR, LF or NUL. Encode constant headers once and reuse the bytes.
    """
    lines = []
    for name, value in headers:
        if not _TOKEN.fullmatch(name) or name.lower() in _RESERVED_HEADERS:
            raise ValueError(f"invalid or reserved header name {name!r}")
        if not _FIELD_VALUE.fullmatch(value):
            raise ValueError(f"invalid value for header {name!r}")
        lines.append(f"{name}: {value.strip()}\r\n")
    return "".join(lines).encode("latin-1")


def serialize_request(
    method: str,
    target: str,
    *,
    authority: str,
    header_block: bytes = b"",
    body: bytes = b"",
    absolute_prefix: str = "",
) -> bytes:
    """A complete HTTP/1.1 request; ``header_block`` comes from :func:`encode_headers`.

    ``absolute_prefix`` (``http://host:port``) makes the target absolute-form,
    as a request sent to a forwarding proxy must be.
    """
    if not _TOKEN.fullmatch(method) or method in {"HEAD", "CONNECT"}:
        raise ValueError(f"unsupported method {method!r}")
    if not _TARGET.fullmatch(target):
        raise ValueError(f"invalid request target {target!r}")
    if not _TOKEN.fullmatch(authority.replace(":", "").replace("[", "").replace("]", "")):
        raise ValueError(f"invalid host {authority!r}")
    return b"%s %s%s HTTP/1.1\r\nhost: %s\r\n%scontent-length: %d\r\n\r\n%s" % (
        method.encode("ascii"),
        absolute_prefix.encode("ascii"),
        target.encode("ascii"),
        authority.encode("ascii"),
        header_block,
        len(body),
        body,
    )


class ResponseParser(Protocol):
    """Incremental parser of one response; :meth:`renew` gives the next one's."""

    @property
    def bytes_received(self) -> int:
        """Bytes fed so far: 0 means the server has said nothing yet."""

    def feed(self, data: bytes) -> Response | None:
        """Take the next bytes; the response once complete, else ``None``."""

    def feed_eof(self) -> Response:
        """The server closed: the response if now complete, else :class:`RemoteProtocolError`."""

    def renew(self) -> ResponseParser:
        """A parser for the next response on the same connection.

        After a complete keep-alive response it may be this one, reset; after
        anything else it is a new one.
        """


ParserFactory = Callable[[], ResponseParser]


class _ResponseBuilder:
    """Bookkeeping shared by both parsers: limits, headers, body, the finished response."""

    def __init__(self, *, max_header_bytes: int, max_body_bytes: int) -> None:
        self._max_header_bytes = max_header_bytes
        self._max_body_bytes = max_body_bytes
        self._reset()

    def _reset(self) -> None:
        """The state before a response's first byte."""
        self._received = 0
        self._head_bytes = 0
        self._fields = 0
        self._status = 0
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._in_body = False  # the final response's head is complete
        self._response: Response | None = None

    @property
    def bytes_received(self) -> int:
        """Bytes fed so far: 0 means the server has said nothing yet."""
        return self._received

    def _take(self, data: bytes) -> None:
        if self._response is not None:
            raise RuntimeError("the response is already complete")
        self._received += len(data)

    def _check_head(self) -> None:
        """Bytes fed before the head is complete are all head."""
        if not self._in_body and self._received > self._max_header_bytes:
            raise RemoteProtocolError(f"response head exceeds {self._max_header_bytes} bytes")

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > self._max_header_bytes:
            raise RemoteProtocolError(f"response head exceeds {self._max_header_bytes} bytes")

    def _add_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        self._fields += 1
        if self._fields > MAX_HEADERS:
            raise RemoteProtocolError(f"response has more than {MAX_HEADERS} header fields")
        if self._in_body:
            return  # a trailer: counted, not kept
        key = name.lower().decode("latin-1")
        text = value.strip().decode("latin-1")
        previous = self._headers.get(key)
        self._headers[key] = text if previous is None else f"{previous}, {text}"

    def _begin_head(self, status: int) -> None:
        """The head's fields are in: check the status and the framing."""
        if status == 101:
            raise RemoteProtocolError("unexpected 101 Switching Protocols")
        if "transfer-encoding" in self._headers and "content-length" in self._headers:
            raise RemoteProtocolError("both Transfer-Encoding and Content-Length")
        self._status = status
        self._in_body = status >= 200

    def _add_body(self, chunk: bytes) -> None:
        self._body_bytes += len(chunk)
        if self._body_bytes > self._max_body_bytes:
            raise RemoteProtocolError(f"response body exceeds {self._max_body_bytes} bytes")
        self._body.append(chunk)

    def _finish(self, *, keep_alive: bool) -> Response | None:
        """End of a message: an interim one is forgotten, a final one becomes the response."""
        if not self._in_body:
            self._headers = {}  # an interim response's fields
            return None
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._response = Response(self._status, self._headers, body, keep_alive)
        return self._response

    def _close_delimited(self) -> bool:
        """The final head is in and says the body ends when the connection does."""
        if not self._in_body or "content-length" in self._headers:
            return False
        coding = self._headers.get("transfer-encoding", "").rsplit(",", 1)[-1]
        return coding.strip().lower() != "chunked"

    def _eof(self) -> Response:
        if self._response is not None:
            return self._response
        if self._received == 0:
            raise RemoteProtocolError("server disconnected without sending a response")
        if self._close_delimited():
            response = self._finish(keep_alive=False)
            assert response is not None  # _close_delimited implies the final head
            return response
        raise RemoteProtocolError(
            f"server disconnected before the response was complete ({self._received} bytes)"
        )

    def _after_error(self, exc: Exception) -> Response:
        """A parse error: fine after a complete response (trailing garbage), fatal before."""
        if self._response is None:
            raise (
                exc
                if isinstance(exc, RemoteProtocolError)
                else RemoteProtocolError(f"invalid response: {exc}")
            ) from exc
        self._response = replace(self._response, keep_alive=False)
        return self._response


class HttptoolsResponseParser(_ResponseBuilder):
    """:class:`ResponseParser` on ``httptools`` (llhttp, C)."""

    def __init__(
        self, *, max_header_bytes: int = MAX_HEADER_BYTES, max_body_bytes: int = MAX_BODY_BYTES
    ) -> None:
        import httptools  # noqa: PLC0415 - optional: the h11 parser stands in without it

        super().__init__(max_header_bytes=max_header_bytes, max_body_bytes=max_body_bytes)
        self._parser = httptools.HttpResponseParser(self)
        self._parse_errors = (httptools.HttpParserError, httptools.HttpParserUpgrade)
        self._error: RemoteProtocolError | None = None

    def feed(self, data: bytes) -> Response | None:
        """Take the next bytes; the response once complete, else ``None``."""
        self._take(data)
        try:
            self._parser.feed_data(data)
        except self._parse_errors as exc:
            return self._after_error(self._error or exc)
        self._check_head()
        return self._response

    def feed_eof(self) -> Response:
        """The server closed: the response if now complete, else :class:`RemoteProtocolError`."""
        return self._eof()

    def renew(self) -> ResponseParser:
        """This parser reset after a complete keep-alive response (llhttp is then at the
        start of the next message: a byte after the response would have cleared
        ``keep_alive``); a new one after anything else."""
        response = self._response
        if response is None or not response.keep_alive or self._error is not None:
            return HttptoolsResponseParser(
                max_header_bytes=self._max_header_bytes, max_body_bytes=self._max_body_bytes
            )
        self._reset()
        return self

    # llhttp callbacks; an exception raised here stops the parser
    def _fail(self, exc: RemoteProtocolError) -> None:
        self._error = exc
        raise exc

    def on_message_begin(self) -> None:
        if self._response is not None:
            self._fail(RemoteProtocolError("bytes after the response"))

    def on_status(self, status: bytes) -> None:
        try:
            self._count_head(len(status) + 15)  # + "HTTP/1.1 200 \r\n"
        except RemoteProtocolError as exc:
            self._fail(exc)

    def on_header(self, name: bytes, value: bytes) -> None:
        try:
            self._add_header(name, value)
        except RemoteProtocolError as exc:
            self._fail(exc)

    def on_headers_complete(self) -> None:
        try:
            self._begin_head(self._parser.get_status_code())
        except RemoteProtocolError as exc:
            self._fail(exc)

    def on_body(self, body: bytes) -> None:
        try:
            self._add_body(body)
        except RemoteProtocolError as exc:
            self._fail(exc)

    def on_message_complete(self) -> None:
        self._finish(keep_alive=self._parser.should_keep_alive())


class H11ResponseParser(_ResponseBuilder):
    """:class:`ResponseParser` on ``h11`` (pure Python; installed with httpx)."""

    def __init__(
        self, *, max_header_bytes: int = MAX_HEADER_BYTES, max_body_bytes: int = MAX_BODY_BYTES
    ) -> None:
        super().__init__(max_header_bytes=max_header_bytes, max_body_bytes=max_body_bytes)
        # h11's own buffer limit is a backstop; the builder's head limit speaks first.
        self._conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=2 * max_header_bytes)
        # h11 parses a response only after a request: declare one (its bytes are not sent).
        self._conn.send(h11.Request(method="POST", target="/", headers=[("host", "origin")]))
        self._conn.send(h11.EndOfMessage())

    def feed(self, data: bytes) -> Response | None:
        """Take the next bytes; the response once complete, else ``None``."""
        self._take(data)
        self._conn.receive_data(data)
        response = self._events()
        if response is None:
            self._check_head()
        return response

    def feed_eof(self) -> Response:
        """The server closed: the response if now complete, else :class:`RemoteProtocolError`."""
        return self._eof()  # every body byte was taken already: frame the end ourselves

    def renew(self) -> ResponseParser:
        """A new parser (h11's connection would need its request cycle restarted)."""
        return H11ResponseParser(
            max_header_bytes=self._max_header_bytes, max_body_bytes=self._max_body_bytes
        )

    def _events(self) -> Response | None:
        while True:
            try:
                event = self._conn.next_event()
            except h11.RemoteProtocolError as exc:
                return self._after_error(exc)
            if event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
                return None
            if isinstance(event, h11.InformationalResponse | h11.Response):
                self._head(event)
            elif isinstance(event, h11.Data):
                self._add_body(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return self._end(event)

    def _head(self, event: h11.InformationalResponse | h11.Response) -> None:
        self._count_head(len(event.reason) + 15)
        for name, value in event.headers:
            self._add_header(name, value)
        self._begin_head(event.status_code)
        if isinstance(event, h11.InformationalResponse):
            self._finish(keep_alive=True)  # h11 ends an interim response without EndOfMessage

    def _end(self, event: h11.EndOfMessage) -> Response | None:
        for name, value in event.headers:  # trailers
            self._add_header(name, value)
        trailing, _closed = self._conn.trailing_data
        keep_alive = self._conn.their_state is h11.DONE and not trailing
        return self._finish(keep_alive=keep_alive)


def new_response_parser(
    *,
    max_header_bytes: int = MAX_HEADER_BYTES,
    max_body_bytes: int = MAX_BODY_BYTES,
    backend: str = PARSER_BACKEND,
) -> ResponseParser:
    """A parser for one response: ``httptools`` when installed, else ``h11``."""
    if backend == "httptools":
        return HttptoolsResponseParser(
            max_header_bytes=max_header_bytes, max_body_bytes=max_body_bytes
        )
    if backend == "h11":
        return H11ResponseParser(max_header_bytes=max_header_bytes, max_body_bytes=max_body_bytes)
    raise ValueError(f"unknown parser backend {backend!r}")


def describe_os_error(exc: OSError, authority: str) -> str:
    """``[Errno 111] Connection refused (host:port)`` for a failed connect.

    asyncio words a refusal ``Connect call failed``, or ``Multiple exceptions``
    when a name has several addresses: the errno they share is spelled out.
    """
    if not isinstance(exc, ssl.SSLError):  # its errno is not an OS error number
        codes = {exc.errno} if exc.errno else {int(code) for code in _ERRNO.findall(str(exc))}
        if len(codes) == 1 and (code := next(iter(codes))) > 0:
            return f"[Errno {code}] {os.strerror(code)} ({authority})"
    return f"{str(exc) or type(exc).__name__} ({authority})"


# --- the I/O layer --------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolTimeouts:
    """Seconds: connect (TCP and TLS), read (longest silence), write (full socket buffer)."""

    connect_s: float = 2.0
    read_s: float = 3.0
    write_s: float = 3.0


class _Connection(asyncio.BufferedProtocol):
    """One TCP connection: one request at a time, each response fed to its parser
    (the last one's, renewed).

    Transitions: connecting -> idle <-> busy -> closed. Bytes, EOF or a reset
    while idle close it; any failure while busy fails the request's waiter.
    Reads land in a buffer of its own (asyncio's default allocates 256 KiB per
    read: ~15 us of page faults per small response).

    The read timeout is one timer that outlives a request: armed when a
    response is awaited and none is armed, it fires no later than the read
    timeout after the wait began, then fails the request if the connection has
    been silent that long, sleeps for the rest of the silence if not, and
    disarms if no response is awaited. A fast exchange schedules no timer.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, new_parser: ParserFactory) -> None:
        self._read_buffer = memoryview(bytearray(READ_BUFFER_BYTES))
        self._loop = loop
        self._new_parser = new_parser
        self._transport: asyncio.Transport | None = None
        self._parser: ResponseParser | None = None
        self._waiter: asyncio.Future[Response] | None = None
        self._drain_waiter: asyncio.Future[None] | None = None
        self._read_timer: asyncio.TimerHandle | None = None
        self._read_s = 0.0
        self._awaiting_response = False  # the request is written: read_s applies
        self._last_read = 0.0
        self._closed_locally = False
        self.closed = False
        self.lost: asyncio.Future[None] = loop.create_future()
        self.requests = 0  # responses received on this connection
        self.idle_since = 0.0

    @property
    def response_started(self) -> bool:
        """Some byte of the current request's response arrived (the last one's, between)."""
        return self._parser is not None and self._parser.bytes_received > 0

    def stale(self) -> bool:
        """This idle connection must not carry a request: closed, its transport closing
        (a reset or EOF asyncio read but has not reported yet), or its socket readable
        (a FIN, RST or stray bytes the loop has not read yet). One ``poll`` call."""
        transport = self._transport
        if self.closed or transport is None or transport.is_closing():
            return True
        sock = transport.get_extra_info("socket")
        if sock is None:
            return False
        fd = sock.fileno()
        if fd < 0:
            return True
        poller = select.poll()
        poller.register(fd, _IDLE_TROUBLE)
        return bool(poller.poll(0))

    async def roundtrip(self, request: bytes, timeouts: PoolTimeouts) -> Response:
        """Write ``request``, await its response (raises a :class:`TransportError`)."""
        # A fresh parser first: response_started then speaks of this request only, so a
        # connection found closed here is resent, whatever its last response was.
        parser = self._parser
        self._parser = self._new_parser() if parser is None else parser.renew()
        transport = self._transport
        if self.closed or transport is None or transport.is_closing():
            raise ReadError("connection closed")
        waiter: asyncio.Future[Response] = self._loop.create_future()
        self._waiter = waiter
        try:
            transport.write(request)
            if self._drain_waiter is not None:
                early = await self._drain(self._drain_waiter, waiter, timeouts.write_s)
                if early is not None:  # answered before the body was written: never reusable
                    self.abort()
                    self.requests += 1
                    return early
            self._last_read = now = self._loop.time()
            self._read_s = read_s = timeouts.read_s
            self._awaiting_response = True
            timer = self._read_timer
            if timer is None or timer.when() > now + read_s:
                if timer is not None:
                    timer.cancel()
                self._read_timer = self._loop.call_at(now + read_s, self._read_timeout)
            response = await waiter
        finally:
            self._awaiting_response = False
            self._waiter = None
            if not waiter.done():
                waiter.cancel()
        self.requests += 1
        return response

    async def _drain(
        self, drained: asyncio.Future[None], response: asyncio.Future[Response], timeout_s: float
    ) -> Response | None:
        """Wait until the request is written; a complete early response instead ends it."""
        done, _ = await asyncio.wait(
            (drained, response), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if response in done and response.exception() is None:
            if drained.done():
                drained.exception()  # retrieved: the early answer is what counts
            return response.result()
        if drained in done:
            if response.done():
                response.exception()  # retrieved: the write's failure is reported
            drained.result()  # the connection was lost while writing: raises its ReadError
            return None
        if response in done:
            response.result()  # raises the response's failure
        self.abort()
        raise WriteTimeout(f"request not written within {timeout_s:g} s")

    def close(self) -> None:
        """Close after pending writes (idempotent)."""
        self._closed_locally = True
        self.closed = True
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        """Close now, dropping pending writes (idempotent)."""
        self._closed_locally = True
        self.closed = True
        if self._transport is not None:
            self._transport.abort()

    def _fail(self, exc: TransportError) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        self.abort()

    def _read_timeout(self) -> None:
        self._read_timer = None
        waiter = self._waiter
        if not self._awaiting_response or waiter is None or waiter.done() or self.closed:
            return  # disarmed: the next wait for a response arms it
        read_s = self._read_s
        silent_s = self._loop.time() - self._last_read
        if silent_s < read_s:  # bytes arrived, or the wait began, meanwhile: the rest of it
            self._read_timer = self._loop.call_later(read_s - silent_s, self._read_timeout)
            return
        self._fail(ReadTimeout(f"nothing received for {read_s:g} s"))

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._read_buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(bytes(self._read_buffer[:nbytes]))

    def data_received(self, data: bytes) -> None:
        waiter, parser = self._waiter, self._parser
        if waiter is None or parser is None or waiter.done():
            self.abort()  # bytes nobody asked for (e.g. a 408 before an idle close)
            return
        self._last_read = self._loop.time()
        try:
            response = parser.feed(data)
        except RemoteProtocolError as exc:
            self._fail(exc)
            return
        if response is not None:
            waiter.set_result(response)

    def eof_received(self) -> bool:
        self.closed = True
        self._settle_at_eof()
        return False  # let the transport close

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            if isinstance(exc, ssl.SSLError):  # e.g. the server's alert: certificate required
                waiter.set_exception(TLSError(str(exc), ssl_error=exc))
            elif exc is not None:
                waiter.set_exception(ReadError(str(exc) or type(exc).__name__))
            elif self._closed_locally:
                waiter.set_exception(ReadError("connection closed by the client"))
            else:
                self._settle_at_eof()
        self._wake_writer(ReadError("connection lost"))
        if not self.lost.done():
            self.lost.set_result(None)

    def pause_writing(self) -> None:
        if self._drain_waiter is None:
            self._drain_waiter = self._loop.create_future()

    def resume_writing(self) -> None:
        self._wake_writer(None)

    def _wake_writer(self, exc: TransportError | None) -> None:
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is None or waiter.done():
            return
        if exc is None:
            waiter.set_result(None)
        else:
            waiter.set_exception(exc)
            waiter.exception()  # retrieved: nobody may be draining

    def _settle_at_eof(self) -> None:
        waiter, parser = self._waiter, self._parser
        if waiter is None or waiter.done() or parser is None:
            return
        try:
            waiter.set_result(parser.feed_eof())
        except RemoteProtocolError as exc:
            waiter.set_exception(exc)


class ConnectionPool:
    """Keep-alive HTTP/1.1 connections to one :class:`Origin`; see the module's guarantees.

    Bound to the event loop of its first request. ``connects``, ``stale_checkouts``
    and ``stale_retries`` count new connections, idle connections found dead at
    checkout (dropped unused), and resends after a server-side close.
    """

    def __init__(
        self,
        origin: Origin,
        *,
        max_connections: int = 64,
        timeouts: PoolTimeouts | None = None,
        keepalive_expiry_s: float = 4.0,
        ssl_context: ssl.SSLContext | None = None,
        parser_factory: ParserFactory = new_response_parser,
        proxy: Proxy | None = None,
    ) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        if origin.scheme == "https" and ssl_context is None:
            ssl_context = ssl.create_default_context()
        self.origin = origin
        self.proxy = proxy
        self._ssl = ssl_context if origin.scheme == "https" else None
        #: Forwarding through a proxy (plain http): absolute-form targets, credentials per request.
        self._forward = proxy is not None and origin.scheme == "http"
        self._absolute_prefix = f"http://{origin.authority}" if self._forward else ""
        self._proxy_auth = proxy.authorization if proxy is not None and self._forward else b""
        self._timeouts = timeouts or PoolTimeouts()
        self._expiry_s = keepalive_expiry_s
        self._new_parser = parser_factory
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: deque[_Connection] = deque()  # right end = most recently used
        self._connections: set[_Connection] = set()
        self._closed = False
        self.connects = 0
        self.stale_checkouts = 0
        self.stale_retries = 0

    @property
    def open_connections(self) -> int:
        """Connections not (yet) closed, idle or in use."""
        return sum(1 for conn in self._connections if not conn.closed)

    @property
    def idle_connections(self) -> int:
        """Idle connections kept for reuse."""
        return sum(1 for conn in self._idle if not conn.closed)

    async def request(
        self, method: str, target: str, *, header_block: bytes = b"", body: bytes = b""
    ) -> Response:
        """Send one request, return its response (any status); :class:`TransportError` else."""
        if self._closed:
            raise RuntimeError("the connection pool is closed")
        data = serialize_request(
            method,
            target,
            authority=self.origin.authority,
            header_block=header_block + self._proxy_auth,
            body=body,
            absolute_prefix=self._absolute_prefix,
        )
        async with self._slots:
            conn = self._checkout()
            if conn is not None:
                try:
                    return await self._exchange(conn, data)
                except (ReadError, RemoteProtocolError):
                    if conn.response_started or self._closed:
                        raise
                    self.stale_retries += 1  # closed by the server while idle: resend once
            return await self._exchange(await self._connect(), data)

    async def aclose(self) -> None:
        """Close every connection and refuse further requests (idempotent)."""
        self._closed = True
        self._idle.clear()
        connections = list(self._connections)
        for conn in connections:
            conn.abort()
        if connections:
            await asyncio.wait([conn.lost for conn in connections], timeout=CLOSE_WAIT_S)

    async def _exchange(self, conn: _Connection, data: bytes) -> Response:
        try:
            response = await conn.roundtrip(data, self._timeouts)
        except BaseException:  # failed or cancelled: the connection's state is unknown
            conn.abort()
            raise
        if response.keep_alive and not conn.closed and not self._closed:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
            self._expire(conn.idle_since)
        else:
            conn.close()
        return response

    async def _tunnel(self, loop: asyncio.AbstractEventLoop, proxy: Proxy) -> socket.socket:
        """A TCP socket to ``proxy`` on which ``CONNECT`` to the origin succeeded."""
        sock = await _open_socket(loop, proxy.host, proxy.port)
        try:
            await loop.sock_sendall(sock, connect_request(self.origin, proxy))
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = await loop.sock_recv(sock, READ_BUFFER_BYTES)
                if not chunk:
                    raise RemoteProtocolError(f"proxy {proxy.authority} closed during CONNECT")
                head += chunk
                if len(head) > MAX_HEADER_BYTES:
                    raise RemoteProtocolError(f"proxy {proxy.authority}: CONNECT answer too long")
            head, _, rest = head.partition(b"\r\n\r\n")
            parse_connect_response(head, proxy)
            if rest:  # the origin speaks only after our TLS hello: nothing may be here
                raise RemoteProtocolError(f"proxy {proxy.authority} sent bytes after CONNECT")
        except BaseException:
            sock.close()
            raise
        return sock

    def _checkout(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if now - conn.idle_since >= self._expiry_s:
                conn.close()
            elif conn.stale():
                self.stale_checkouts += 1
                conn.abort()  # reset or closed by the server: nothing of ours to flush
            else:
                return conn
        return None

    def _expire(self, now: float) -> None:
        """Close the connections idle for longer than the expiry (the oldest are on the left)."""
        while self._idle and (
            self._idle[0].closed or now - self._idle[0].idle_since >= self._expiry_s
        ):
            self._idle.popleft().close()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        origin, timeout_s = self.origin, self._timeouts.connect_s
        proxy = self.proxy
        where = origin.authority if proxy is None else f"{origin.authority} via {proxy.authority}"
        try:
            async with asyncio.timeout(timeout_s):
                if proxy is None or self._forward:
                    host, port = (
                        (origin.host, origin.port) if proxy is None else (proxy.host, proxy.port)
                    )
                    _, conn = await loop.create_connection(
                        lambda: _Connection(loop, self._new_parser), host, port, ssl=self._ssl
                    )
                else:
                    sock = await self._tunnel(loop, proxy)
                    try:
                        _, conn = await loop.create_connection(
                            lambda: _Connection(loop, self._new_parser),
                            sock=sock,
                            ssl=self._ssl,
                            server_hostname=origin.host if self._ssl is not None else None,
                        )
                    except BaseException:
                        sock.close()
                        raise
        except TimeoutError:
            raise ConnectTimeout(f"no connection to {where} within {timeout_s:g} s") from None
        except ssl.SSLError as exc:
            raise TLSError(describe_os_error(exc, where), ssl_error=exc) from exc
        except (ConnectionResetError, BrokenPipeError) as exc:
            if self._ssl is None:
                raise ConnectError(describe_os_error(exc, where)) from exc
            # TCP was up (a refused connect is ConnectionRefusedError): the handshake broke
            raise TLSError(describe_os_error(exc, where), ssl_error=None) from exc
        except OSError as exc:
            raise ConnectError(describe_os_error(exc, where)) from exc
        self.connects += 1
        self._connections.add(conn)
        conn.lost.add_done_callback(lambda _: self._connections.discard(conn))
        if self._closed:  # aclose() ran while connecting
            conn.abort()
            raise RuntimeError("the connection pool is closed")
        return conn


async def _open_socket(loop: asyncio.AbstractEventLoop, host: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket to ``host:port`` (each address tried in turn)."""
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    error: OSError = OSError(f"no address for {host}")
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, address)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        except BaseException:
            sock.close()
            raise
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    raise error
