"""A tiny HTTP server for ``/metrics``, ``/healthz`` and ``/readyz``.

Runs in a daemon thread next to a synchronous loop (the relay). ``/healthz``
answers 200 while the loop has ticked recently (liveness); ``/readyz`` answers
200 only while the process does its job (e.g. streaming, not standby), else 503
with the state as the body. Binds the given host (loopback by default).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

#: A loop that has not ticked for this long is reported dead by /healthz.
LIVENESS_STALE_S = 60.0


class Liveness:
    """The loop calls :meth:`tick`; the server reads :attr:`alive` and :attr:`state`."""

    def __init__(self) -> None:
        self._last = time.monotonic()
        self.state = "starting"
        self.ready = False

    def tick(self) -> None:
        self._last = time.monotonic()

    def set(self, state: str, *, ready: bool) -> None:
        self.state = state
        self.ready = ready

    @property
    def alive(self) -> bool:
        return time.monotonic() - self._last < LIVENESS_STALE_S


class HealthServer:
    """Serves the registry and the liveness in a background thread."""

    def __init__(
        self, *, host: str, port: int, registry: CollectorRegistry, liveness: Liveness
    ) -> None:
        handler = _handler(registry, liveness)
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="health", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> HealthServer:
        self._thread.start()
        log.info("health server on port %d (/metrics /healthz /readyz)", self.port)
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(registry: CollectorRegistry, liveness: Liveness) -> type[BaseHTTPRequestHandler]:
    routes: dict[str, Callable[[], tuple[int, str, bytes]]] = {
        "/metrics": lambda: (200, CONTENT_TYPE_LATEST, generate_latest(registry)),
        "/healthz": lambda: (
            200 if liveness.alive else 503,
            "text/plain",
            b"ok" if liveness.alive else b"stalled",
        ),
        "/readyz": lambda: (200 if liveness.ready else 503, "text/plain", liveness.state.encode()),
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            route = routes.get(self.path.split("?", 1)[0])
            status, ctype, body = route() if route else (404, "text/plain", b"not found")
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return

    return Handler
