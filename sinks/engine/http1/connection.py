"""One keep-alive TCP connection: one request at a time, with its read timer.

Guarantees:

- Transitions: connecting -> idle <-> busy -> closed. Bytes, EOF or a reset
  while idle close it; any failure while busy fails the request's waiter with
  a :class:`~.errors.TransportError`; a connection that failed, or whose
  request was cancelled, is closed, never reused.
- Timeouts (:class:`PoolTimeouts`): ``read_s`` is the longest silence while
  awaiting the response (a slow but steady response is not cut), ``write_s``
  the longest wait while the socket buffer is full; ``connect_s`` is the
  pool's. A response trickling a few bytes at a time never trips ``read_s``:
  the caller bounds a whole request (:class:`~.errors.RequestDeadline`).
- A complete response that arrives while the request body is still being
  written (the server answered early, e.g. 413, and stopped reading) is
  returned, and the connection closed: the rest of the body is never sent.
- :meth:`Connection.stale` tells, with one ``poll`` call, whether an idle
  connection is unfit for a request (closed, closing, or readable).
"""

from __future__ import annotations

import asyncio
import select
import ssl
from dataclasses import dataclass
from typing import cast

from sinks.engine.http1.errors import (
    ReadError,
    ReadTimeout,
    RemoteProtocolError,
    TLSError,
    TransportError,
    WriteTimeout,
)
from sinks.engine.http1.parse import ParserFactory, ResponseParser
from sinks.engine.http1.wire import Response

#: Bytes a connection reads at once (its own buffer, reused).
READ_BUFFER_BYTES = 32 * 1024
#: What makes an idle socket unfit for a request: anything to read (EOF, stray
#: bytes), the peer's half-close (Linux), and - always reported - error and hang-up.
_IDLE_TROUBLE = select.POLLIN | getattr(select, "POLLRDHUP", 0) | select.POLLERR | select.POLLHUP


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolTimeouts:
    """Seconds: connect (TCP and TLS), read (longest silence), write (full socket buffer)."""

    connect_s: float = 2.0
    read_s: float = 3.0
    write_s: float = 3.0


class Connection(asyncio.BufferedProtocol):
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
