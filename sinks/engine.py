"""The engine's HTTP client: one POST per record, every failure classified.

Guarantees:

- :meth:`EngineClient.send` returns only on a 2xx; anything else raises a
  :class:`~sinks.errors.SinkError` chosen by :func:`sinks.retry.classify`, and
  every transport failure (refused, reset, timeout, protocol error) becomes
  :class:`~sinks.errors.EngineUnavailable` whose reason is
  ``<failure class>: <detail>`` (e.g. ``ConnectError: [Errno 111] Connection
  refused (127.0.0.1:8081)``, ``ReadTimeout: nothing received for 3 s``) and
  whose cause is the transport's exception (:mod:`sinks.http1` or httpx).
- Every request carries ``Idempotency-Key: <event id>``, so a resend after a
  lost response is applied once; and ``x-api-key`` when a key is configured.
  The key is never logged.
- At most ``max_in_flight`` requests run at once (more wait their turn, which
  is never reported as engine trouble), over at most ``max_in_flight``
  keep-alive connections, reused last-in first-out and closed after
  :data:`KEEPALIVE_EXPIRY_S` idle.
- The transport is :class:`sinks.http1.ConnectionPool` (DESIGN names httpx;
  measured: httpx costs ~0.7 ms of client CPU per request, capping the sink
  near 1,100 deliveries/s on 2 cores; see :mod:`sinks.http1`). A request on a
  keep-alive connection the engine had closed is resent once on a new one
  (safe: the Idempotency-Key). ``transport="httpx"`` selects httpx's own
  network stack instead, an ``httpx.AsyncBaseTransport`` (tests' MockTransport)
  httpx over that transport.
- Proxy variables of the environment are ignored: the engine is internal.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Final, Literal

import httpx

from cdc.settings import Settings
from sinks import http1
from sinks.errors import EngineUnavailable, Unroutable
from sinks.retry import classify
from sinks.routes import EngineCall, user_sync_call

log = logging.getLogger(__name__)

DEFAULT_BASE_URL = "http://localhost:8081"
IDEMPOTENCY_HEADER = "Idempotency-Key"
API_KEY_HEADER = "x-api-key"
#: Idle pooled connections are closed after this; below the usual 5-75 s idle
#: timeouts of servers, so the client never reuses one the server is closing.
KEEPALIVE_EXPIRY_S = 4.0
#: Selects httpx's own network stack (``transport="httpx"``): the former default.
HTTPX_TRANSPORT: Final = "httpx"
USER_AGENT = "outbox-cdc-sink"
#: Connections per httpx pool (``transport="httpx"`` only). httpcore scans its
#: whole pool (a poll() per connection) on every request and response: with 64
#: requests in flight against the stub, one pool of 64 cost ~2.6 ms of client
#: CPU per request (~380 req/s), pools of 4 ~0.86 ms (~1150 req/s).
CONNECTIONS_PER_POOL = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineTimeouts:
    """Per-request limits (DESIGN: 2 s connect, 3 s read); writing shares the read limit."""

    connect_s: float = 2.0
    read_s: float = 3.0

    def as_httpx(self) -> httpx.Timeout:
        # pool=None: the pool holds max_in_flight connections, so waiting for one
        # is the sink's own queueing, bounded by the other limits - not engine trouble.
        return httpx.Timeout(connect=self.connect_s, read=self.read_s, write=self.read_s, pool=None)

    def as_pool(self) -> http1.PoolTimeouts:
        """The same limits for :class:`sinks.http1.ConnectionPool`."""
        return http1.PoolTimeouts(connect_s=self.connect_s, read_s=self.read_s, write_s=self.read_s)


@dataclass(slots=True)
class _Pool:
    """One httpx client (one connection pool) and the requests it carries now."""

    client: httpx.AsyncClient
    in_flight: int = 0


Transport = httpx.AsyncBaseTransport | Literal["httpx"] | None


class EngineClient:
    """Async client of the engine's internal API; use as ``async with`` or call :meth:`aclose`.

    At most ``max_in_flight`` requests run at once (more wait their turn, which
    is not engine trouble). ``transport``: ``None`` (default) is the fast
    :class:`sinks.http1.ConnectionPool` of ``max_in_flight`` connections;
    ``"httpx"`` is httpx's network stack in pools of :data:`CONNECTIONS_PER_POOL`
    connections, each request to the least busy pool; an ``httpx.AsyncBaseTransport``
    (tests) is used by one httpx client.
    """

    def __init__(
        self,
        *,
        base_url: str = DEFAULT_BASE_URL,
        api_key: str = "",
        timeouts: EngineTimeouts | None = None,
        max_in_flight: int = 64,
        transport: Transport = None,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.base_url = base_url.rstrip("/")
        self._headers = {"content-type": "application/json"}
        if api_key:
            self._headers[API_KEY_HEADER] = api_key
        timeouts = timeouts or EngineTimeouts()
        self._timeout = timeouts.as_httpx()
        self._slots = asyncio.Semaphore(max_in_flight)
        self._ssl_context: ssl.SSLContext | None = None  # built once, shared by the pools
        self._pools: list[_Pool] = []
        self._pool: http1.ConnectionPool | None = None
        self._target_prefix = ""
        self._header_block = b""
        if transport is None:
            self._pool = self._fast_pool(max_in_flight, timeouts)
        elif transport == HTTPX_TRANSPORT:
            self._pools = [_Pool(self._client(size, None)) for size in _split(max_in_flight)]
        elif isinstance(transport, httpx.AsyncBaseTransport):
            self._pools = [_Pool(self._client(max_in_flight, transport))]
        else:
            raise ValueError(f"unknown transport {transport!r}")

    def _fast_pool(self, connections: int, timeouts: EngineTimeouts) -> http1.ConnectionPool:
        origin = http1.parse_origin(self.base_url)
        self._target_prefix = origin.path_prefix
        headers = [("user-agent", USER_AGENT), *self._headers.items()]
        self._header_block = http1.encode_headers(headers)
        return http1.ConnectionPool(
            origin,
            max_connections=connections,
            timeouts=timeouts.as_pool(),
            keepalive_expiry_s=KEEPALIVE_EXPIRY_S,
            ssl_context=self._ssl() if origin.scheme == "https" else None,
        )

    def _ssl(self) -> ssl.SSLContext:
        """httpx's TLS defaults (certifi CAs), for either transport."""
        if self._ssl_context is None:
            self._ssl_context = httpx.create_ssl_context()
        return self._ssl_context

    def _client(
        self, connections: int, transport: httpx.AsyncBaseTransport | None
    ) -> httpx.AsyncClient:
        limits = httpx.Limits(
            max_connections=connections,
            max_keepalive_connections=connections,
            keepalive_expiry=KEEPALIVE_EXPIRY_S,
        )
        return httpx.AsyncClient(
            base_url=self.base_url,
            headers=self._headers,
            timeout=self._timeout,
            limits=limits,
            transport=transport,
            follow_redirects=False,
            verify=self._ssl(),
            trust_env=False,  # the engine is an internal service: no proxies from the env
        )

    @classmethod
    def from_settings(cls, settings: Settings, *, transport: Transport = None) -> EngineClient:
        """A client configured by ``ENGINE_BASE_URL``, ``INTERNAL_API_KEY``, timeouts, in-flight."""
        return cls(
            base_url=settings.engine_base_url,
            api_key=settings.internal_api_key.get_secret_value(),
            timeouts=EngineTimeouts(
                connect_s=settings.engine_connect_timeout_s,
                read_s=settings.engine_read_timeout_s,
            ),
            max_in_flight=settings.sink_max_in_flight,
            transport=transport,
        )

    async def send(self, call: EngineCall, *, event_id: str) -> None:
        """POST ``call`` with ``event_id`` as idempotency key; return on 2xx, raise otherwise."""
        if not event_id or not (event_id.isascii() and event_id.isprintable()):
            raise Unroutable(f"event id {event_id!r} cannot be an Idempotency-Key")
        try:
            content = json.dumps(call.body, separators=(",", ":"), allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise Unroutable(f"{call.path}: body is not JSON ({exc})") from exc
        started = time.perf_counter()
        try:
            status, body, headers = await self._post(call.path, content, event_id)
        except (http1.TransportError, httpx.RequestError) as exc:  # incl. undecodable responses
            log.debug("engine %s event %s: %r", call.path, event_id, exc)
            raise EngineUnavailable(_transport_reason(exc)) from exc
        outcome = classify(status, body, headers)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "engine %s event %s -> %s in %.1f ms",
                call.path,
                event_id,
                status,
                (time.perf_counter() - started) * 1000,
            )
        error = outcome.error(user_id=call.user_id)
        if error is not None:
            raise error

    async def _post(
        self, path: str, content: bytes, event_id: str
    ) -> tuple[int, bytes, Mapping[str, str]]:
        """Status, body and headers of the engine's answer; a transport error else."""
        async with self._slots:
            if self._pool is not None:
                # event_id is printable ASCII (checked by send): no CR/LF can reach the head
                key_line = b"%s: %s\r\n" % (IDEMPOTENCY_HEADER.encode(), event_id.encode("ascii"))
                answer = await self._pool.request(
                    "POST",
                    self._target_prefix + path,
                    header_block=self._header_block + key_line,
                    body=content,
                )
                return answer.status, answer.body, answer.headers
            pool = min(self._pools, key=_busy)
            pool.in_flight += 1
            try:
                response = await pool.client.post(
                    path, content=content, headers={IDEMPOTENCY_HEADER: event_id}
                )
            finally:
                pool.in_flight -= 1
            return response.status_code, response.content, response.headers

    async def sync_user(self, user_id: str, *, event_id: str) -> None:
        """Make ``user_id`` known to the engine (``users/sync``) under idempotency key ``event_id``.

        For a sync caused by a quiz attempt's ``user_not_found``, pass
        :func:`sinks.routes.derived_user_sync_key` of the attempt's event id.
        """
        await self.send(user_sync_call(user_id), event_id=event_id)

    async def aclose(self) -> None:
        """Close pooled connections."""
        if self._pool is not None:
            await self._pool.aclose()
        for pool in self._pools:
            await pool.client.aclose()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"EngineClient(base_url={self.base_url!r})"


def _busy(pool: _Pool) -> int:
    return pool.in_flight


def _split(connections: int) -> list[int]:
    """Sizes of httpx pools: as many of CONNECTIONS_PER_POOL as fit, then the rest."""
    full, rest = divmod(connections, CONNECTIONS_PER_POOL)
    return [CONNECTIONS_PER_POOL] * full + ([rest] if rest else [])


def _transport_reason(exc: http1.TransportError | httpx.RequestError) -> str:
    """Why no response arrived, e.g. ``ConnectError: [Errno 111] Connection refused (h:p)``."""
    detail = str(exc) or "no detail"
    return f"{type(exc).__name__}: {detail}"
