"""tests/tcpfault.py, the tests' one TCP fault proxy, against real loopback servers.

Each fault is held to its docstring's word: bytes pass unchanged both ways;
``silence`` holds bytes without closing and lets new connections through unless
asked; ``resume`` delivers what was held; ``reset`` closes both ends;
``retarget`` moves new connections only; ``close`` ends every thread. Waits for
what must arrive are bounded generously (a loaded machine); "nothing arrives" is
checked over a short window, which load can only make stricter, never flaky.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Iterator

import pytest

from tests.tcpfault import TcpFaultProxy

#: What must arrive arrives within this (generous: the machine is shared).
ARRIVE_S = 10.0
#: What must not arrive is looked for this long (longer than several pump ticks).
QUIET_S = 0.5


class _TagServer:
    """Answers every chunk it reads with its name and the chunk: ``b"A:" + data``."""

    def __init__(self, name: bytes) -> None:
        self.name = name
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self._listener], [], [], 0.05)
            if not ready:
                continue
            conn, _ = self._listener.accept()
            self._conns.append(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError, ValueError):
            while not self._stop.is_set():
                ready, _, _ = select.select([conn], [], [], 0.05)
                if not ready:
                    continue
                data = conn.recv(65536)
                if not data:
                    return
                conn.sendall(self.name + b":" + data)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._listener.close()


@pytest.fixture
def server() -> Iterator[_TagServer]:
    tagged = _TagServer(b"A")
    yield tagged
    tagged.close()


def _connect(proxy: TcpFaultProxy) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=ARRIVE_S)


def _receive(sock: socket.socket, expected: bytes) -> bytes:
    """Bytes until ``expected`` is whole (or the peer closed); bounded by ARRIVE_S."""
    received = b""
    sock.settimeout(ARRIVE_S)
    while len(received) < len(expected):
        chunk = sock.recv(65536)
        if not chunk:
            break
        received += chunk
    return received


def _quiet(sock: socket.socket) -> bool:
    """Nothing to read (no byte, no EOF, no reset) for QUIET_S."""
    ready, _, _ = select.select([sock], [], [], QUIET_S)
    return not ready


def test_bytes_pass_unchanged_both_ways_and_connections_are_counted(server: _TagServer) -> None:
    payload = bytes(range(256)) * 512  # 128 KiB: more than one chunk each way
    with TcpFaultProxy("127.0.0.1", server.port) as proxy:
        with _connect(proxy) as a, _connect(proxy) as b:
            a.sendall(b"one")
            assert _receive(a, b"A:one") == b"A:one"
            b.sendall(payload)
            # one tag per chunk the server read, however many; the payload holds no "A:"
            received = b""
            b.settimeout(ARRIVE_S)
            while len(received.replace(b"A:", b"")) < len(payload):
                chunk = b.recv(65536)
                assert chunk, "the connection closed before the payload came back"
                received += chunk
            assert received.replace(b"A:", b"") == payload
        assert proxy.connections == 2


def test_silence_holds_bytes_without_closing_and_resume_delivers_them(
    server: _TagServer,
) -> None:
    with TcpFaultProxy("127.0.0.1", server.port) as proxy, _connect(proxy) as sock:
        sock.sendall(b"before")
        assert _receive(sock, b"A:before") == b"A:before"
        proxy.silence()
        sock.sendall(b"held")  # the proxy's socket takes it (the kernel ACKs): no error
        assert _quiet(sock), "a silenced connection passed bytes, or was closed"
        proxy.resume()
        assert _receive(sock, b"A:held") == b"A:held"


def test_silence_lets_new_connections_through_unless_asked(server: _TagServer) -> None:
    with TcpFaultProxy("127.0.0.1", server.port) as proxy:
        proxy.silence()
        with _connect(proxy) as fresh:
            fresh.sendall(b"new")
            assert _receive(fresh, b"A:new") == b"A:new"
        proxy.silence(new_connections=True)
        with _connect(proxy) as held:
            held.sendall(b"new")
            assert _quiet(held), "a connection accepted while silenced (new ones too) passed"
            proxy.resume()
            assert _receive(held, b"A:new") == b"A:new"


def test_reset_closes_both_ends(server: _TagServer) -> None:
    with TcpFaultProxy("127.0.0.1", server.port) as proxy, _connect(proxy) as sock:
        sock.sendall(b"x")
        assert _receive(sock, b"A:x") == b"A:x"
        proxy.reset()
        sock.settimeout(ARRIVE_S)
        with contextlib.suppress(ConnectionResetError):  # a reset is a close too
            assert sock.recv(1) == b"", "bytes after a reset"
        with _connect(proxy) as again:  # the proxy itself still accepts
            again.sendall(b"y")
            assert _receive(again, b"A:y") == b"A:y"


def test_retarget_moves_new_connections_only(server: _TagServer) -> None:
    other = _TagServer(b"B")
    try:
        with TcpFaultProxy("127.0.0.1", server.port) as proxy, _connect(proxy) as old:
            old.sendall(b"1")
            assert _receive(old, b"A:1") == b"A:1"
            proxy.retarget(other.port)
            with _connect(proxy) as new:
                new.sendall(b"2")
                assert _receive(new, b"B:2") == b"B:2"
            old.sendall(b"3")
            assert _receive(old, b"A:3") == b"A:3"
    finally:
        other.close()


def test_close_ends_every_thread_and_socket(server: _TagServer) -> None:
    proxy = TcpFaultProxy("127.0.0.1", server.port).start()
    with _connect(proxy) as sock:
        sock.sendall(b"z")
        assert _receive(sock, b"A:z") == b"A:z"
        proxy.silence()
        proxy.close()
        alive = [t.name for t in threading.enumerate() if t.name.startswith("tcpfault-")]
        assert not alive, f"threads left after close: {alive}"
        with pytest.raises(OSError):
            _connect(proxy)
