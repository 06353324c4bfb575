"""The tests' one TCP fault proxy: a pass-through on 127.0.0.1 that can go silent, cut, move.

``TcpFaultProxy(target_host, target_port)`` listens on 127.0.0.1 (a free port,
``proxy.port``) and forwards every accepted connection to the target, bytes
unchanged, both ways, one thread per direction. Faults:

* :meth:`TcpFaultProxy.silence` - the connections open now stop passing bytes
  both ways *without closing*: the proxy stops reading them, so each peer's
  kernel still ACKs what it sends to the proxy's socket (TCP keepalives succeed)
  but nothing arrives at the other end - a half-open path as a lost FIN, a
  dropped NAT/firewall state or a frozen host make it; or, between a streaming
  standby and its primary, WAL held back (what the primary sends stays queued
  in the socket buffers). On return no pump is moving a chunk: nothing sent
  from then on passes (a pump still writing after :data:`JOIN_TIMEOUT_S`, to
  a peer that does not read, is a :class:`RuntimeError`). Connections
  accepted afterwards pass normally; ``new_connections=True`` silences them too.
* :meth:`TcpFaultProxy.resume` - silenced connections pass again (what they
  buffered is delivered, as when a path comes back); new ones pass.
* :meth:`TcpFaultProxy.reset` - every open connection is shut down and closed at
  once, both ends see it closed, what was queued is dropped (a crashed peer's
  unsent bytes).
* :meth:`TcpFaultProxy.retarget` - new connections go to another address (after
  a promotion); open ones keep theirs.

``with TcpFaultProxy(host, port) as proxy:`` starts it and closes every socket
and thread on exit (no ResourceWarning); without ``with``, :meth:`start` and
:meth:`close`. ``proxy.connections`` counts the connections accepted so far.
Threads only; ``tests/unit/test_tcpfault.py`` holds each fault to its word.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from dataclasses import dataclass, field
from types import TracebackType

#: How often a pump thread and the acceptor look at their flags.
TICK_S = 0.05
CHUNK_BYTES = 65_536
#: Connecting to the target waits at most this long.
CONNECT_TIMEOUT_S = 10.0
#: Joining a thread at close, and silence() waiting for a chunk in flight, at most this long.
JOIN_TIMEOUT_S = 5.0


@dataclass(eq=False)
class _Link:
    client: socket.socket
    upstream: socket.socket
    silent: threading.Event = field(default_factory=threading.Event)
    closed: threading.Event = field(default_factory=threading.Event)
    #: held while a pump moves one chunk of this link (silence() waits for it)
    moving: threading.Lock = field(default_factory=threading.Lock)

    def close(self) -> None:
        """Shut down and close both sockets (idempotent): both peers see the close."""
        self.closed.set()
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
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

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> TcpFaultProxy:
        self._spawn(self._accept_loop, "tcpfault-accept")
        return self

    def silence(self, *, new_connections: bool = False) -> None:
        """Open connections stop passing bytes (not closed); see the module docstring."""
        with self._lock:
            self._silence_new = new_connections
            links = list(self._links)
            for link in links:
                link.silent.set()
        for link in links:  # a chunk in flight finishes; none starts after this
            if not link.moving.acquire(timeout=JOIN_TIMEOUT_S):
                raise RuntimeError(
                    f"a pump of the proxy on port {self.port} is still writing after"
                    f" {JOIN_TIMEOUT_S:g} s: its peer does not read"
                )
            link.moving.release()

    def resume(self) -> None:
        with self._lock:
            self._silence_new = False
            for link in self._links:
                link.silent.clear()

    def reset(self) -> None:
        """Shut down and close every open connection (both ends see it closed)."""
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.close()

    def retarget(self, target_port: int, target_host: str | None = None) -> None:
        """New connections go to ``target_host:target_port`` (the host unchanged if None)."""
        self.target = (target_host or self.target[0], target_port)

    def close(self) -> None:
        self._stop.set()
        self.reset()
        for thread in self._threads:
            thread.join(timeout=JOIN_TIMEOUT_S)
        self._listener.close()

    def _spawn(self, target: object, name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)  # type: ignore[arg-type]
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self._listener], [], [], TICK_S)
            if not ready:
                continue
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=CONNECT_TIMEOUT_S)
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
                    link.closed.wait(TICK_S)  # read nothing: the peer's bytes wait
                    continue
                ready, _, _ = select.select([src], [], [], TICK_S)
                if not ready:
                    continue
                with link.moving:
                    if link.silent.is_set():  # silenced while waiting: leave it queued
                        continue
                    data = src.recv(CHUNK_BYTES)
                    if data:
                        dst.sendall(data)
                if not data:
                    break
        except (OSError, ValueError):  # (ValueError: the other pump closed the socket)
            pass
        finally:
            link.close()
            with self._lock:
                if link in self._links:
                    self._links.remove(link)
