"""A TCP pass-through proxy on 127.0.0.1 that a test can pause, cut and point elsewhere.

Used between a streaming standby and its primary: :meth:`TcpProxy.pause` stops
moving bytes (both ways; what the primary sends stays queued in the proxy's
socket buffers, so the standby receives and flushes nothing more),
:meth:`TcpProxy.cut` closes every connection (what was queued is dropped, as a
crashed primary's unsent WAL would be), :meth:`TcpProxy.retarget` sends new
connections to another port (after a promotion). Threads only; every socket is
closed by :meth:`TcpProxy.close`.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from types import TracebackType

CHUNK_BYTES = 65_536
#: Pumps and the acceptor look at their flags this often.
TICK_S = 0.05


class TcpProxy:
    """``with TcpProxy(target_port) as proxy: connect to proxy.port``."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port: int = self._listener.getsockname()[1]
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        #: held while a pump moves one chunk (pause() waits for it)
        self._moving = threading.Lock()
        self._conns: list[tuple[socket.socket, socket.socket]] = []
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept, name="tcp-proxy", daemon=True)
        self._acceptor.start()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def pause(self) -> None:
        """Stop moving bytes on every connection, present and future. On return no pump
        is moving a chunk: bytes sent to the proxy from now on stay queued."""
        self._flowing.clear()
        with self._moving:
            pass

    def resume(self) -> None:
        self._flowing.set()

    def cut(self) -> None:
        """Close every connection; what was queued in them is dropped."""
        with self._lock:
            conns, self._conns = self._conns, []
        for pair in conns:
            for sock in pair:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def retarget(self, target_port: int) -> None:
        """New connections go to ``target_port``."""
        self.target_port = target_port

    def close(self) -> None:
        self._closed.set()
        self._flowing.set()
        self.cut()
        self._acceptor.join(5)
        self._listener.close()
        for thread in self._threads:
            thread.join(5)

    def _accept(self) -> None:
        while not self._closed.is_set():
            ready, _, _ = select.select([self._listener], [], [], TICK_S)
            if not ready:
                continue
            try:
                client, _ = self._listener.accept()
            except OSError:
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns.append((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                thread = threading.Thread(target=self._pump, args=(src, dst), daemon=True)
                self._threads.append(thread)
                thread.start()
            self._threads = [t for t in self._threads if t.is_alive()]

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self._closed.is_set():
                if not self._flowing.wait(TICK_S):
                    if src.fileno() < 0:
                        return
                    continue
                ready, _, _ = select.select([src], [], [], TICK_S)
                if not ready:
                    continue
                with self._moving:
                    if not self._flowing.is_set():  # paused while waiting: leave it queued
                        continue
                    data = src.recv(CHUNK_BYTES)
                    if data:
                        dst.sendall(data)
                if not data:
                    break
        except (OSError, ValueError):
            pass
        finally:
            self._drop(src, dst)

    def _drop(self, src: socket.socket, dst: socket.socket) -> None:
        with self._lock:
            self._conns = [p for p in self._conns if src not in p]
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
