"""A small asyncio HTTP/1.1 client: one origin, a pool of keep-alive connections.

Why it exists (DESIGN names httpx; this is the measured reason to differ): on
the 2-core reference machine, 64 requests in flight to the engine stub in its
own process, httpx costs ~0.6-0.8 ms of client CPU per request and caps the
engine client near 1,100-1,700 requests/s; this pool, an
:class:`asyncio.BufferedProtocol` per connection and llhttp, costs ~45 us per
request (~100 us with the h11 fallback) and reaches ~18,000 requests/s, the
stub's own limit.

Two layers, one module per role, each stating its guarantees. The protocol
layer is pure (no I/O, no clock), fed bytes and tested on bytes:
:mod:`.wire` (origins, a request's bytes: nothing a caller passes can inject a
header or a second request) and :mod:`.parse` (one complete response out,
every part of it bounded). The I/O layer: :mod:`.connection` (one connection,
one request at a time, its read timer), :mod:`.pool` (checkout, expiry, the
stale resend, TLS) and :mod:`.tunnel` (an ``http://`` proxy: ``CONNECT``
tunnel or forwarding). :mod:`.errors` holds the one failure root,
:class:`TransportError`, whose class says what happened.

This package's names are its interface: ``from sinks.engine import http1``
then ``http1.ConnectionPool``, or ``from sinks.engine.http1 import ...``.
"""

from __future__ import annotations

from sinks.engine.http1.connection import READ_BUFFER_BYTES, Connection, PoolTimeouts
from sinks.engine.http1.errors import (
    ConnectError,
    ConnectTimeout,
    ProxyError,
    ReadError,
    ReadTimeout,
    RemoteProtocolError,
    RequestDeadline,
    TLSError,
    TransportError,
    WriteTimeout,
    describe_os_error,
)
from sinks.engine.http1.parse import (
    MAX_BODY_BYTES,
    MAX_HEADER_BYTES,
    MAX_HEADERS,
    PARSER_BACKEND,
    H11ResponseParser,
    HttptoolsResponseParser,
    ParserFactory,
    ResponseParser,
    new_response_parser,
)
from sinks.engine.http1.pool import CLOSE_WAIT_S, ConnectionPool
from sinks.engine.http1.tunnel import (
    Proxy,
    connect_request,
    open_socket,
    open_tunnel,
    parse_connect_response,
    parse_proxy,
)
from sinks.engine.http1.wire import (
    Origin,
    Response,
    encode_headers,
    parse_origin,
    serialize_request,
)

__all__ = [
    "CLOSE_WAIT_S",
    "MAX_BODY_BYTES",
    "MAX_HEADERS",
    "MAX_HEADER_BYTES",
    "PARSER_BACKEND",
    "READ_BUFFER_BYTES",
    "ConnectError",
    "ConnectTimeout",
    "Connection",
    "ConnectionPool",
    "H11ResponseParser",
    "HttptoolsResponseParser",
    "Origin",
    "ParserFactory",
    "PoolTimeouts",
    "Proxy",
    "ProxyError",
    "ReadError",
    "ReadTimeout",
    "RemoteProtocolError",
    "RequestDeadline",
    "Response",
    "ResponseParser",
    "TLSError",
    "TransportError",
    "WriteTimeout",
    "connect_request",
    "describe_os_error",
    "encode_headers",
    "new_response_parser",
    "open_socket",
    "open_tunnel",
    "parse_connect_response",
    "parse_origin",
    "parse_proxy",
    "serialize_request",
]
