"""A tiny HTTP server for ``/metrics``, ``/healthz``, ``/readyz`` and extra GET routes.

Runs in a daemon thread next to a synchronous loop (the relay). ``/healthz``
answers 200 while the loop has ticked recently (liveness); ``/readyz`` answers
200 only while the process does its job (e.g. streaming, not standby), else 503
with the state as the body's first line; :attr:`Liveness.notes` follow it, one a
line (information that never changes the status: the relay's standbys' copies of
its failover slot). An extra route (the relay's ``/backlog``) gets the
query parameters (the last value of each) and answers a :class:`Reply`; a route
that raises answers 500 without the exception's text. Binds the given host
(loopback by default).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import NamedTuple
from urllib.parse import parse_qsl

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

#: A loop that has not ticked for this long is reported dead by /healthz.
LIVENESS_STALE_S = 60.0


class Reply(NamedTuple):
    """What a route answers."""

    status: int
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


#: An extra GET route: the query parameters -> the reply.
Route = Callable[[Mapping[str, str]], Reply]


class Liveness:
    """The loop calls :meth:`tick`; the server reads :attr:`alive` and :attr:`state`."""

    def __init__(self) -> None:
        self._last = time.monotonic()
        self.state = "starting"
        self.ready = False
        #: lines shown after the state by /readyz; never change its status
        self.notes: tuple[str, ...] = ()

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
        self,
        *,
        host: str,
        port: int,
        registry: CollectorRegistry,
        liveness: Liveness,
        routes: Mapping[str, Route] | None = None,
    ) -> None:
        handler = _handler(registry, liveness, routes or {})
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


def _handler(
    registry: CollectorRegistry, liveness: Liveness, extra: Mapping[str, Route]
) -> type[BaseHTTPRequestHandler]:
    routes: dict[str, Route] = {
        "/metrics": lambda _: Reply(200, CONTENT_TYPE_LATEST, generate_latest(registry)),
        "/healthz": lambda _: Reply(
            200 if liveness.alive else 503,
            "text/plain",
            b"ok" if liveness.alive else b"stalled",
        ),
        "/readyz": lambda _: Reply(
            200 if liveness.ready else 503,
            "text/plain",
            "\n".join((liveness.state, *liveness.notes)).encode(),
        ),
        **extra,
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path, _, query = self.path.partition("?")
            route = routes.get(path)
            reply = _answer(route, dict(parse_qsl(query))) if route else _NOT_FOUND
            self.send_response(reply.status)
            self.send_header("Content-Type", reply.content_type)
            self.send_header("Content-Length", str(len(reply.body)))
            for name, value in reply.headers:
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(reply.body)

        def log_message(self, format: str, *args: object) -> None:
            return

    return Handler


_NOT_FOUND = Reply(404, "text/plain", b"not found")


def _answer(route: Route, query: Mapping[str, str]) -> Reply:
    try:
        return route(query)
    except Exception:
        log.exception("health route failed")
        return Reply(500, "text/plain", b"internal error")
