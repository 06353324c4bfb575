"""The engine stub's server: uvicorn's public API, outage windows, TLS, a test helper.

Guarantees:

- The stub is served by ``uvicorn.Server`` through its public API only
  (``Config``, ``Server.serve(sockets=...)``, ``started``, ``should_exit``), on
  ``httptools`` when installed, else ``h11``.
- An outage window (``refuse_connections_s``) really closes the listening
  socket, so clients get ``connection refused``: the serving ``Server`` is
  asked to exit (uvicorn closes the listener, shuts idle keep-alive
  connections and lets requests in progress finish); after the window a new
  ``Server`` serves a socket bound to the same port. The engine's state lives
  outside the servers and carries over. The window is counted from the moment
  the listener is closed (uvicorn notices ``should_exit`` within its 0.1 s
  tick, later on a busy loop), so ``refuse_connections_s: s`` refuses for ``s``
  seconds however long the close took. Every wait of a window is bounded: the
  close (:data:`CLOSE_WAIT_S`), the window, the rebind after it
  (:data:`REBIND_TIMEOUT_S`: a port someone else took stops the stub with an
  error naming it, instead of refusing for ever).
- TLS: given a certificate and key (:class:`StubTLS`; ``ENGINE_STUB_TLS_CERT`` /
  ``ENGINE_STUB_TLS_KEY`` for ``outbox-cdc engine-stub``) the stub serves
  HTTPS, and with a client CA (``ENGINE_STUB_CLIENT_CA``) it requires a client
  certificate signed by that CA (mTLS) - the handshake fails without one (in
  mTLS mode the stub speaks TLS 1.2: see :func:`build_server`). The listener
  reopened after an outage window serves TLS the same way.
- ``reset_after_response`` really resets the connection (``SO_LINGER`` 0, then
  close: the client gets an RST): :mod:`sinks.stub.connections`.
- State lives on the server's event loop only; other threads reach it over
  HTTP (:class:`StubServer` helpers do that).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from types import TracebackType
from typing import Any

import httpx
import uvicorn

from sinks.stub.app import StubApp
from sinks.stub.connections import Connections, tracked_protocol
from sinks.stub.engine import StubEngine

log = logging.getLogger("sinks.stub")

#: Idle keep-alive connections live this long (nginx's default), longer than
#: the client's pool expiry, so the client never reuses a closing connection.
KEEP_ALIVE_S = 75
#: Listen backlog: a burst of the sink's max in-flight connections never overflows it.
LISTEN_BACKLOG = 1024
#: How long StubServer.start waits for the listener before giving up.
STARTUP_TIMEOUT_S = 10.0
#: A stop gives requests in progress this long, then cancels them (an outage window
#: lets them finish: only the final stop is bounded).
STOP_GRACE_S = 2
#: While an outage window ends but the port cannot be bound again, retry this often.
REBIND_RETRY_S = 0.2
#: ... and give up after this long: the port is someone else's (the stub stops, naming it).
REBIND_TIMEOUT_S = 10.0
#: How often an outage looks whether the listener is closed yet (uvicorn looks at
#: ``should_exit`` every 0.1 s).
CLOSE_POLL_S = 0.005
#: The longest an outage waits for the serving ``Server`` to close its listener before
#: its window starts anyway (uvicorn's tick is 0.1 s; a loop starved for seconds is slower).
CLOSE_WAIT_S = 10.0
#: How often :meth:`StubServer.end_outage` looks whether the stub listens again.
END_OUTAGE_POLL_S = 0.01


class ListenerState(Enum):
    """Whether the stub accepts TCP connections."""

    LISTENING = "listening"  # the listening socket is open: connections are accepted
    REFUSING = "refusing"  # an outage window: no listening socket, connect() is refused


@dataclass(frozen=True, slots=True)
class StubTLS:
    """PEM files for serving HTTPS; ``client_ca`` set: client certificates are required."""

    certfile: str
    keyfile: str
    client_ca: str = ""

    def uvicorn_options(self) -> dict[str, Any]:
        """The ``uvicorn.Config`` keywords that serve TLS this way."""
        return {
            "ssl_certfile": self.certfile,
            "ssl_keyfile": self.keyfile,
            "ssl_ca_certs": self.client_ca or None,
            "ssl_cert_reqs": ssl.CERT_REQUIRED if self.client_ca else ssl.CERT_NONE,
        }

    def describe(self) -> str:
        """How the stub serves, for its start-up log line."""
        return "TLS, client certificates required" if self.client_ca else "TLS"


class Listener:
    """The stub's listening periods, each one ``uvicorn.Server``, and the outage windows between.

    Transitions (on the server's loop)::

        LISTENING --refuse_for(s)--> REFUSING --s elapsed (or reopen_now)--> LISTENING

    Refusing asks the serving ``Server`` to exit: it closes the listening socket
    (new connections: ``ECONNREFUSED``) and idle keep-alive connections;
    requests in progress finish, while the next ``Server`` may already serve.
    One task per window (:meth:`_window`): it waits for that close (bounded),
    one loop turn more (the idle connections closed with the listener are
    closed then: asyncio closes a transport's socket on the turn after
    ``close()``), marks the window open (:meth:`closed` returns from then on),
    sleeps ``s`` and listens again (the rebind bounded too). A new window or
    :meth:`reopen_now` replaces the task; the close is never waited for twice.
    """

    def __init__(
        self, *, config: uvicorn.Config, sock: socket.socket, host: str, port: int
    ) -> None:
        self._config = config
        self._sock = sock
        self.host = host
        self.port = port
        self._server = uvicorn.Server(config)
        self._reopen: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        #: the current window's listener is closed and its idle connections too
        self._window_open = False

    @property
    def started(self) -> bool:
        """The first listening period has begun (connections are served)."""
        return self._server.started

    @property
    def state(self) -> ListenerState:
        """REFUSING while an outage window is open (until the socket is bound again)."""
        if self._reopen is not None and not self._reopen.done():
            return ListenerState.REFUSING
        return ListenerState.LISTENING

    @property
    def refusing(self) -> bool:
        """An outage window is open."""
        return self.state is ListenerState.REFUSING

    async def serve(self) -> None:
        """Serve until :meth:`stop`: listening periods, and the outage windows between them."""
        self._loop = asyncio.get_running_loop()
        self._listen(self._server, self._sock)
        while self._serving:
            done, _ = await asyncio.wait(self._serving, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                self._serving.discard(task)
                task.result()

    def stop(self) -> None:
        """Stop serving and end any outage window (callable from any thread)."""
        self._stopping = True
        self._exit_current()
        if self._loop is not None:  # again on the loop: a listener reopened meanwhile exits too
            with contextlib.suppress(RuntimeError):  # (the loop has ended)
                self._loop.call_soon_threadsafe(self._stop_here)

    def _stop_here(self) -> None:
        self._exit_current()
        if self._reopen is not None:
            self._reopen.cancel()

    def _exit_current(self) -> None:
        self._server.config.timeout_graceful_shutdown = STOP_GRACE_S
        self._server.should_exit = True

    def release(self) -> None:
        """Close the listening socket (after :meth:`stop`; uvicorn has closed it when it served)."""
        self._sock.close()

    def refuse_for(self, window_s: float) -> None:
        """Stop accepting connections now, for ``window_s`` seconds counted from the close of
        the listener (a new window replaces one)."""
        self._server.should_exit = True
        self._start_window(window_s)
        log.info(
            "engine stub %s:%s refuses connections for %.1f s",
            self.host,
            self.port,
            window_s,
            extra={"state": ListenerState.REFUSING.value},
        )

    async def closed(self) -> None:
        """One loop turn; during an outage, until its listener and idle connections are closed."""
        await asyncio.sleep(0)
        while self.refusing and not self._window_open:  # bounded: CLOSE_WAIT_S in _window
            await asyncio.sleep(CLOSE_POLL_S)

    def reopen_now(self) -> None:
        """End the outage window early (once the listener it closes is closed)."""
        if self.refusing:
            self._start_window(0.0)

    def _start_window(self, window_s: float) -> None:
        if self._reopen is not None:
            self._reopen.cancel()  # (a window already open stays open: no close to wait for)
        self._reopen = asyncio.get_running_loop().create_task(self._window(window_s))
        self._serving.add(self._reopen)

    def _listen(self, server: uvicorn.Server, sock: socket.socket) -> None:
        self._server, self._sock = server, sock
        self._window_open = False
        server.should_exit = self._stopping
        self._serving.add(asyncio.get_running_loop().create_task(server.serve(sockets=[sock])))

    async def _window(self, window_s: float) -> None:
        try:
            if not self._window_open:
                await self._wait_closed()
                self._window_open = True
            await asyncio.sleep(window_s)
            await self._listen_again()
        except asyncio.CancelledError:
            return  # replaced by another window, ended early, or stopped (rebinding too)

    async def _wait_closed(self) -> None:
        """Until the serving ``Server`` closed its listener (bounded), then one loop turn."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CLOSE_WAIT_S
        while self._sock.fileno() != -1 and loop.time() < deadline:
            await asyncio.sleep(CLOSE_POLL_S)
        if self._sock.fileno() != -1:
            log.warning(
                "engine stub %s:%s: the listener is still open %.0f s after the outage began",
                self.host,
                self.port,
                CLOSE_WAIT_S,
            )
        await asyncio.sleep(0)  # the transports closed with the listener close their sockets

    async def _listen_again(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REBIND_TIMEOUT_S
        while not self._stopping:
            try:
                sock = bind_socket(self.host, self.port)
            except OSError as exc:
                if loop.time() >= deadline:
                    raise RuntimeError(
                        f"engine stub cannot listen on {self.host}:{self.port} again after an"
                        f" outage window: {exc} (for {REBIND_TIMEOUT_S:g} s; is the port"
                        " someone else's now?)"
                    ) from exc
                log.warning("engine stub cannot rebind %s:%s: %s", self.host, self.port, exc)
                await asyncio.sleep(REBIND_RETRY_S)
                continue
            self._listen(uvicorn.Server(self._config), sock)
            log.info(
                "engine stub %s:%s accepts connections again",
                self.host,
                self.port,
                extra={"state": ListenerState.LISTENING.value},
            )
            return


def http_implementation() -> str:
    """``httptools`` when installed (several times faster), else ``h11``."""
    return "httptools" if importlib.util.find_spec("httptools") is not None else "h11"


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``port=0``: a free one), reusable after close."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose
    # proto says TCP (accepted ones inherit it); without it every response
    # written in two parts waits ~40 ms for the peer's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def build_server(
    *,
    host: str,
    port: int,
    engine: StubEngine,
    log_level: str = "warning",
    tls: StubTLS | None = None,
) -> Listener:
    """The stub's listener on a bound socket, ready to :meth:`~Listener.serve`.

    uvicorn's own log lines go to the process's logging set-up (``log_config=None``),
    so they come out in its format, text or JSON.
    """
    sock = bind_socket(host, port)
    app = StubApp(engine=engine)
    app.connections = connections = Connections()
    config = uvicorn.Config(
        app.asgi,
        http=tracked_protocol(http_implementation(), connections),
        lifespan="off",
        ws="none",
        interface="asgi3",
        access_log=False,
        log_config=None,
        log_level=log_level,
        timeout_keep_alive=KEEP_ALIVE_S,
        backlog=LISTEN_BACKLOG,
        **(tls.uvicorn_options() if tls is not None else {}),
    )
    if tls is not None and tls.client_ca:
        config.load()  # builds config.ssl
        assert config.ssl is not None
        # asyncio's TLS server closes without sending the alert when it refuses a
        # client certificate; under TLS 1.3 that happens after the client's
        # handshake is done, so the client would see a bare disconnect. Under
        # TLS 1.2 the refusal is part of the handshake the client still waits on.
        config.ssl.maximum_version = ssl.TLSVersion.TLSv1_2
    listener = app.listener = Listener(
        config=config, sock=sock, host=host, port=sock.getsockname()[1]
    )
    return listener


def run_stub(
    host: str = "127.0.0.1",
    port: int = 8081,
    api_key: str = "",
    *,
    latency_ms: float = 0.0,
    log_level: str = "info",
    tls: StubTLS | None = None,
) -> None:
    """Serve the engine stub until SIGINT/SIGTERM (what ``outbox-cdc engine-stub`` runs)."""
    engine = StubEngine(api_key=api_key, latency_ms=latency_ms)
    listener = build_server(host=host, port=port, engine=engine, log_level=log_level, tls=tls)
    log.info(
        "engine stub on %s://%s:%s (%s, %s, api key %s)",
        "https" if tls else "http",
        host,
        listener.port,
        http_implementation(),
        tls.describe() if tls else "no TLS",
        "required" if api_key else "not required",
    )
    asyncio.run(listener.serve())


class StubServer:
    """The stub on 127.0.0.1 in a background thread, for tests::

    with StubServer(api_key="k") as stub:
        client = EngineClient(base_url=stub.url, api_key="k")
        ...
        assert stub.stats()["applied"] == 1
    """

    def __init__(
        self,
        *,
        api_key: str = "",
        port: int = 0,
        latency_ms: float = 0.0,
        tls: StubTLS | None = None,
        control_ssl: ssl.SSLContext | None = None,
    ) -> None:
        """``tls`` serves HTTPS; ``control_ssl`` is the context the control helpers connect with."""
        self._engine = StubEngine(api_key=api_key, latency_ms=latency_ms)
        self._listener = build_server(host="127.0.0.1", port=port, engine=self._engine, tls=tls)
        self.port: int = self._listener.port
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self._control_verify: ssl.SSLContext | bool = control_ssl or True
        # (a daemon: a stub a test forgot, or one whose stop timed out, never holds the
        # interpreter's exit - CI once waited on one after every test had passed)
        self._thread = threading.Thread(
            target=self._run, name=f"engine-stub-{self.port}", daemon=True
        )
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> StubServer:
        """Start serving; returns once the server accepts connections."""
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._listener.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"engine stub did not start: {self._error!r}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop serving and wait for the thread (idempotent)."""
        self._listener.stop()
        if self._thread.is_alive():
            self._thread.join(timeout=STARTUP_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning(
                "engine stub on port %d did not stop in %.0fs", self.port, STARTUP_TIMEOUT_S
            )
        self._listener.release()

    @property
    def stopped(self) -> bool:
        """The server's thread has ended (stopped, or failed: the control helpers say why)."""
        return self._thread.ident is not None and not self._thread.is_alive()

    def end_outage(self, *, wait: bool = True) -> None:
        """Accept connections again now (the control API is unreachable while refusing);
        returns once the stub listens again (``wait=False``: at once) - the window's
        close and the rebind are bounded (:data:`CLOSE_WAIT_S`, :data:`REBIND_TIMEOUT_S`),
        so is this wait. (It returned at once: a control call right after it - a test's
        next wait - met the listener still closed, ``connection refused``, on a loaded CI
        machine.)"""
        loop = self._loop
        if loop is None:
            return
        if not wait:
            loop.call_soon_threadsafe(self._listener.reopen_now)
            return
        ran = threading.Event()
        loop.call_soon_threadsafe(self._listener.reopen_now)
        loop.call_soon_threadsafe(ran.set)  # (callbacks run in order: reopen_now has run)
        deadline = time.monotonic() + CLOSE_WAIT_S + REBIND_TIMEOUT_S + STARTUP_TIMEOUT_S
        ran.wait(STARTUP_TIMEOUT_S)
        while self._listener.refusing and not self.stopped:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"engine stub on port {self.port} still refuses connections after its"
                    " outage was ended"
                )
            time.sleep(END_OUTAGE_POLL_S)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by start(); a thread must not die loudly
            self._error = exc

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._listener.serve()

    def __enter__(self) -> StubServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # --- the control API over HTTP (thread-safe: the state stays on the server's loop)

    def control(
        self,
        method: str,
        endpoint: str,
        body: object = None,
        *,
        query: Mapping[str, str] | None = None,
    ) -> Any:
        """Call the control API; the decoded JSON answer (raises on non-2xx; RuntimeError
        naming the cause when the server has failed)."""
        if self._error is not None:
            raise RuntimeError(f"engine stub on port {self.port} failed: {self._error}")
        with httpx.Client(
            base_url=self.url,
            timeout=STARTUP_TIMEOUT_S,
            verify=self._control_verify,
            trust_env=False,
        ) as client:
            response = client.request(method, endpoint, json=body, params=query)
        response.raise_for_status()
        return response.json()

    def applied(self, **filters: str | int) -> dict[str, Any]:
        """``GET /_stub/applied`` filtered by user_id, path, event_id, since, limit."""
        query = {k: str(v) for k, v in filters.items()}
        result: dict[str, Any] = self.control("GET", "/_stub/applied", query=query)
        return result

    def stats(self) -> dict[str, Any]:
        """``GET /_stub/stats``."""
        result: dict[str, Any] = self.control("GET", "/_stub/stats")
        return result

    def requests(self) -> dict[str, int]:
        """``GET /_stub/requests``: requests received per Idempotency-Key."""
        result: dict[str, int] = self.control("GET", "/_stub/requests")["by_key"]
        return result

    def reset(self) -> None:
        """``POST /_stub/reset``: the engine forgets everything it applied."""
        self.control("POST", "/_stub/reset")

    def add_faults(self, instruction: object) -> dict[str, Any]:
        """``POST /_stub/faults``; returns the active faults."""
        result: dict[str, Any] = self.control("POST", "/_stub/faults", instruction)
        return result

    def clear_faults(self) -> None:
        """``DELETE /_stub/faults``: no rules, no latency."""
        self.control("DELETE", "/_stub/faults")
