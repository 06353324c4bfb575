"""Reaching the origin through an ``http://`` proxy: the proxy's URL, the ``CONNECT`` tunnel.

The request and the answer's check are pure (tested on bytes);
:func:`open_tunnel` is the I/O. Guarantees:

- Proxy (:class:`Proxy`, an ``http://`` proxy): an ``https`` origin is reached
  through a ``CONNECT host:port`` tunnel, TLS end to end (the pool starts TLS
  on the tunnel's socket; the proxy sees no request); an ``http`` origin by
  sending absolute-form requests (``POST http://host/path``) to the proxy.
- The proxy's credentials go in ``Proxy-Authorization`` (Basic) and never
  into a message or a ``repr``.
- A refused ``CONNECT`` is a :class:`~.errors.ProxyError` with the status; an
  answer that is not HTTP/1.x, longer than :data:`~.parse.MAX_HEADER_BYTES`,
  cut short, or followed by bytes before our TLS hello is a
  :class:`~.errors.RemoteProtocolError`. The socket is closed on every failure.
"""

from __future__ import annotations

import asyncio
import base64
import socket
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from sinks.engine.http1.connection import READ_BUFFER_BYTES
from sinks.engine.http1.errors import ProxyError, RemoteProtocolError
from sinks.engine.http1.parse import MAX_HEADER_BYTES
from sinks.engine.http1.wire import Origin


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


async def open_tunnel(
    loop: asyncio.AbstractEventLoop, origin: Origin, proxy: Proxy
) -> socket.socket:
    """A TCP socket to ``proxy`` on which ``CONNECT`` to the origin succeeded."""
    sock = await open_socket(loop, proxy.host, proxy.port)
    try:
        await loop.sock_sendall(sock, connect_request(origin, proxy))
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


async def open_socket(loop: asyncio.AbstractEventLoop, host: str, port: int) -> socket.socket:
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
