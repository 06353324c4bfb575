"""A small HTTP proxy on 127.0.0.1 for tests: CONNECT tunnels and forwarding.

``CONNECT host:port`` answers 200 and pipes bytes both ways (TLS passes
through untouched); any other request is forwarded to the host of its
absolute-form target and the connection is then piped as is. With
``credentials`` set, a request without the matching ``Proxy-Authorization``
gets 407. Every request head the proxy received is kept in :attr:`seen`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import threading
from dataclasses import dataclass, field
from types import TracebackType
from urllib.parse import urlsplit

HEAD_LIMIT_BYTES = 64 * 1024
START_TIMEOUT_S = 10.0


@dataclass
class Seen:
    """One request head received by the proxy."""

    method: str
    target: str
    head: bytes


@dataclass
class ProxyServer:
    """Run with ``with ProxyServer() as proxy: ... proxy.url``."""

    credentials: str = ""  # "user:password" to require
    seen: list[Seen] = field(default_factory=list)
    port: int = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _ready: threading.Event = field(default_factory=threading.Event)
    _stop: asyncio.Event | None = None

    @property
    def url(self) -> str:
        auth = f"{self.credentials}@" if self.credentials else ""
        return f"http://{auth}127.0.0.1:{self.port}"

    def __enter__(self) -> ProxyServer:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise RuntimeError("test proxy did not start")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(START_TIMEOUT_S)

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stop.wait()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            writer.close()
            return
        method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
        self.seen.append(Seen(method, target, head))
        if self.credentials and not self._authorized(head):
            writer.write(
                b"HTTP/1.1 407 Proxy Authentication Required\r\n"
                b'proxy-authenticate: Basic realm="test"\r\ncontent-length: 0\r\n\r\n'
            )
            await writer.drain()
            writer.close()
            return
        if method == "CONNECT":
            host, _, port = target.rpartition(":")
            upstream_reader, upstream_writer = await asyncio.open_connection(host, int(port))
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:
            parts = urlsplit(target)
            upstream_reader, upstream_writer = await asyncio.open_connection(
                parts.hostname, parts.port or 80
            )
            upstream_writer.write(head)
        await asyncio.gather(
            _pipe(reader, upstream_writer), _pipe(upstream_reader, writer), return_exceptions=True
        )

    def _authorized(self, head: bytes) -> bool:
        token = base64.b64encode(self.credentials.encode())
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"proxy-authorization":
                scheme, _, presented = value.strip().partition(b" ")
                return scheme.lower() == b"basic" and presented.strip() == token
        return False


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        with contextlib.suppress(OSError):
            writer.close()
