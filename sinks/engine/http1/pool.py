"""The connection pool: checkout, expiry, the stale resend, TLS - the transport's I/O face.

Guarantees of :class:`ConnectionPool`:

- At most ``max_connections`` requests run at once, over at most that many
  connections; one request per connection at a time. Idle connections are
  reused last-in first-out, so a quiet period lets the cold ones expire: a
  connection idle for ``keepalive_expiry_s`` is closed instead of reused, as
  is one the server closed, or sent anything on, while it was idle.
- Every idle connection is checked again at checkout
  (:meth:`~.connection.Connection.stale`): one already closed, whose transport
  is closing (asyncio read a reset or EOF and has not reported it to the
  protocol yet), or whose socket is readable (the server's FIN, RST or stray
  bytes waiting unread) is dropped unused and the next one tried
  (``stale_checkouts`` counts them).
- A request sent on a reused connection that the server had closed - EOF or
  reset before any byte of *this* request's response (the connection's
  earlier responses do not count) - is sent once more on a new connection.
  That resend is only safe because every request of the sink is idempotent
  (``Idempotency-Key``); a request on a new connection, or one whose response
  had begun, is never resent.
- ``connect_s`` (:class:`~.connection.PoolTimeouts`) bounds the TCP (and TLS)
  connect, through the proxy tunnel included; a failure is a
  :class:`~.errors.ConnectError`, :class:`~.errors.ConnectTimeout` or
  :class:`~.errors.TLSError` naming where it tried.
- TLS: an ``https`` origin is reached with the pool's :class:`ssl.SSLContext`
  (SNI and name check against the origin's host).
- :meth:`ConnectionPool.aclose` closes every connection, in use or idle;
  requests after it raise :class:`RuntimeError`.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque

from sinks.engine.http1.connection import Connection, PoolTimeouts
from sinks.engine.http1.errors import (
    ConnectError,
    ConnectTimeout,
    ReadError,
    RemoteProtocolError,
    TLSError,
    describe_os_error,
)
from sinks.engine.http1.parse import ParserFactory, new_response_parser
from sinks.engine.http1.tunnel import Proxy, open_tunnel
from sinks.engine.http1.wire import Origin, Response, serialize_request

#: How long :meth:`ConnectionPool.aclose` waits for closed sockets to be released.
CLOSE_WAIT_S = 1.0


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
        self._idle: deque[Connection] = deque()  # right end = most recently used
        self._connections: set[Connection] = set()
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

    async def _exchange(self, conn: Connection, data: bytes) -> Response:
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

    def _checkout(self) -> Connection | None:
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

    async def _connect(self) -> Connection:
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
                        lambda: Connection(loop, self._new_parser), host, port, ssl=self._ssl
                    )
                else:
                    sock = await open_tunnel(loop, self.origin, proxy)
                    try:
                        _, conn = await loop.create_connection(
                            lambda: Connection(loop, self._new_parser),
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
