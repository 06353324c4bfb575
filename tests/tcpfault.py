"""A TCP pass-through proxy for tests that can make connections go silent.

``TcpFaultProxy(target_host, target_port)`` listens on 127.0.0.1 (a free port,
``proxy.port``) and forwards every accepted connection to the target, bytes
unchanged, both ways, one thread per direction. Faults:

* :meth:`TcpFaultProxy.silence` - the connections open now stop passing bytes
  both ways *without closing*: the proxy stops reading them, so each peer's
  kernel still ACKs what it sends to the proxy's socket (TCP keepalives succeed)
  but nothing arrives at the other end - a half-open path as a lost FIN, a
  dropped NAT/firewall state or a frozen host make it. Connections accepted
  afterwards pass normally (``new_connections=True`` silences them too).
* :meth:`TcpFaultProxy.resume` - silenced connections pass again (what they
  buffered is delivered, as when a path comes back).
* :meth:`TcpFaultProxy.reset` - every open connection is closed at once.

``with TcpFaultProxy(host, port) as proxy:`` starts it and closes every socket
and thread on exit (no ResourceWarning). ``proxy.connections`` counts the
connections accepted so far.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from dataclasses import dataclass, field

#: How often a pump thread looks at the silence flag and the stop flag.
_TICK_S = 0.05
_CHUNK = 65536


@dataclass(eq=False)
class _Link:
    client: socket.socket
    upstream: socket.socket
    silent: threading.Event = field(default_factory=threading.Event)
    closed: threading.Event = field(default_factory=threading.Event)

    def close(self) -> None:
        self.closed.set()
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                sock.close()


class TcpFaultProxy:
    """See the module docstring."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._links: list[_Link] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._silence_new = False
        self.connections = 0

    def __enter__(self) -> TcpFaultProxy:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()

    def start(self) -> TcpFaultProxy:
        self._spawn(self._accept_loop, "tcpfault-accept")
        return self

    def silence(self, *, new_connections: bool = False) -> None:
        """Open connections stop passing bytes (not closed); see the module docstring."""
        with self._lock:
            self._silence_new = new_connections
            for link in self._links:
                link.silent.set()

    def resume(self) -> None:
        with self._lock:
            self._silence_new = False
            for link in self._links:
                link.silent.clear()

    def reset(self) -> None:
        """Close every open connection (both ends see it closed)."""
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.close()

    def close(self) -> None:
        self._stop.set()
        self.reset()
        self._listener.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def _spawn(self, target: object, name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)  # type: ignore[arg-type]
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self._listener], [], [], _TICK_S)
            if not ready:
                continue
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            link = _Link(client, upstream)
            with self._lock:
                self.connections += 1
                if self._silence_new:
                    link.silent.set()
                self._links.append(link)
            self._spawn(self._pump, "tcpfault-up", link, client, upstream)
            self._spawn(self._pump, "tcpfault-down", link, upstream, client)

    def _pump(self, link: _Link, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not (self._stop.is_set() or link.closed.is_set()):
                if link.silent.is_set():
                    link.closed.wait(_TICK_S)  # read nothing: the peer's bytes wait
                    continue
                ready, _, _ = select.select([src], [], [], _TICK_S)
                if not ready:
                    continue
                data = src.recv(_CHUNK)
                if not data:
                    break
                dst.sendall(data)
        except (OSError, ValueError):  # (ValueError: the other pump closed the socket)
            pass
        finally:
            link.close()
