"""Response parsing: bytes in, one complete :class:`~.wire.Response` out.

Pure (no I/O, no clock), fed bytes and tested on bytes. Guarantees:

- A response is framed by ``Content-Length``, by chunked transfer-encoding
  (extensions and trailers accepted, trailers dropped) or by the close of the
  connection, and is returned once, complete. Interim 1xx responses are
  skipped; ``101 Switching Protocols`` is an error (no upgrade was asked for).
- The head (status lines and headers, interim responses and trailers
  included) is limited to ``max_header_bytes`` and :data:`MAX_HEADERS` fields,
  the body to ``max_body_bytes``; beyond is :class:`~.errors.RemoteProtocolError`.
- ``Response.keep_alive`` is false after ``Connection: close``, an HTTP/1.0
  answer without keep-alive, a close-delimited body, or any byte after the
  response (no pipelining: such bytes can only be garbage).
- Header names are lower-cased; a repeated header's values are joined by ``", "``.
- The parser is ``httptools`` (llhttp) when installed, else ``h11``; both
  pass the same tests. No content coding is undone (none is asked for).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import h11

from sinks.engine.http1.errors import RemoteProtocolError
from sinks.engine.http1.wire import Response

#: Status line plus header fields of a response (interim responses and
#: trailers included); beyond is a protocol error. h11 and httpx use 64 KiB.
MAX_HEADER_BYTES = 64 * 1024
#: Header fields in a response head.
MAX_HEADERS = 100
#: Response body; the engine answers with small JSON objects.
MAX_BODY_BYTES = 4 * 1024 * 1024

PARSER_BACKEND = "httptools" if importlib.util.find_spec("httptools") is not None else "h11"


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
