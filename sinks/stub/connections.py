"""The stub's open connections, for ``reset_after_response`` (a real reset: ``SO_LINGER``
0, then close - the client gets an RST).

:class:`Connections` keeps the open connections' transports by peer address, through a
subclass of the uvicorn protocol class the stub serves with (:func:`tracked_protocol`,
given to ``uvicorn.Config(http=<class>)``) that only registers ``connection_made`` /
``connection_lost``. State lives on the server's event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Any

from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

Peer = tuple[str, int]


def _peer(address: object) -> Peer | None:
    if isinstance(address, list | tuple) and len(address) >= 2:
        return (str(address[0]), int(address[1]))
    return None


class Connections:
    """The stub's open connections by peer address; resets them on request (on the loop).

    ``reset_when_idle`` comes from the engine endpoints after an answer: the reset
    happens only if no byte arrived on that connection since (it is idle, as a
    keep-alive connection dropped between requests; a request the server began to
    read is never cut, so it is never applied *and* resent).
    """

    def __init__(self) -> None:
        self._open: dict[Peer, asyncio.BaseTransport] = {}
        self._reads: dict[Peer, int] = {}  # reads per open connection
        self.resets = 0

    def opened(self, transport: asyncio.BaseTransport) -> None:
        peer = _peer(transport.get_extra_info("peername"))
        if peer is not None:
            self._open[peer] = transport
            self._reads[peer] = 0

    def closed(self, transport: asyncio.BaseTransport) -> None:
        peer = _peer(transport.get_extra_info("peername"))
        if peer is not None and self._open.get(peer) is transport:
            del self._open[peer]
            self._reads.pop(peer, None)

    def received(self, transport: asyncio.BaseTransport) -> None:
        peer = _peer(transport.get_extra_info("peername"))
        if peer is not None and peer in self._reads:
            self._reads[peer] += 1

    def reset_when_idle(self, client: object, delay_s: float) -> None:
        peer = _peer(client)
        if peer is None or peer not in self._open:
            return
        seen = self._reads[peer]
        asyncio.get_running_loop().call_later(delay_s, self._reset_if_idle, peer, seen)

    def _reset_if_idle(self, peer: Peer, seen: int) -> None:
        transport = self._open.get(peer)
        if transport is None or self._reads.get(peer) != seen:
            return  # closed meanwhile, or another request arrives
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()  # type: ignore[attr-defined]
        self.resets += 1


def tracked_protocol(name: str, connections: Connections) -> type[asyncio.Protocol]:
    """uvicorn's protocol class ``name`` (httptools, h11), telling ``connections`` of its
    connections: made, read from, lost."""
    base: Any = import_from_string(HTTP_PROTOCOLS[name])

    class Tracked(base):  # type: ignore[misc]
        _stub_transport: asyncio.BaseTransport | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self._stub_transport = transport
            connections.opened(transport)
            super().connection_made(transport)

        def data_received(self, data: bytes) -> None:
            if self._stub_transport is not None:
                connections.received(self._stub_transport)
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._stub_transport is not None:
                connections.closed(self._stub_transport)
            super().connection_lost(exc)

    return Tracked
