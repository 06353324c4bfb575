"""The engine's HTTP client: one POST per record, every failure classified.

Guarantees:

- :meth:`EngineClient.send` returns only on a 2xx; anything else raises a
  :class:`~sinks.errors.SinkError` chosen by :func:`sinks.retry.classify`, and
  every transport failure (refused, reset, timeout, protocol error) becomes
  :class:`~sinks.errors.EngineUnavailable` with the httpx exception as its cause.
- Every request carries ``Idempotency-Key: <event id>``, so a resend after a
  lost response is applied once; and ``x-api-key`` when a key is configured.
  The key is never logged.
- Connections are pooled: at most ``max_in_flight`` open, all reusable, so the
  sink's concurrency never waits on the pool.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from types import TracebackType

import httpx

from cdc.settings import Settings
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
#: Connections per httpx pool. httpcore scans its whole pool (a poll() per
#: connection) on every request and response: measured with 64 requests in
#: flight against the stub, one pool of 64 gave ~110 req/s, pools of 4 ~900.
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


@dataclass(slots=True)
class _Pool:
    """One httpx client (one connection pool) and the requests it carries now."""

    client: httpx.AsyncClient
    in_flight: int = 0


class EngineClient:
    """Async client of the engine's internal API; use as ``async with`` or call :meth:`aclose`.

    At most ``max_in_flight`` requests run at once (more wait their turn, which
    is not engine trouble). They are spread over pools of
    :data:`CONNECTIONS_PER_POOL` connections, each request to the least busy
    pool; an injected ``transport`` (tests) is used as one pool.
    """

    def __init__(
        self,
        *,
        base_url: str = DEFAULT_BASE_URL,
        api_key: str = "",
        timeouts: EngineTimeouts | None = None,
        max_in_flight: int = 64,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.base_url = base_url.rstrip("/")
        self._headers = {"content-type": "application/json"}
        if api_key:
            self._headers[API_KEY_HEADER] = api_key
        self._timeout = (timeouts or EngineTimeouts()).as_httpx()
        self._ssl_context = httpx.create_ssl_context()  # built once, shared by the pools
        self._slots = asyncio.Semaphore(max_in_flight)
        if transport is not None:
            self._pools = [_Pool(self._client(max_in_flight, transport))]
        else:
            sizes = [CONNECTIONS_PER_POOL] * (max_in_flight // CONNECTIONS_PER_POOL)
            sizes += (
                [max_in_flight % CONNECTIONS_PER_POOL]
                if max_in_flight % CONNECTIONS_PER_POOL
                else []
            )
            self._pools = [_Pool(self._client(size, None)) for size in sizes]

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
            verify=self._ssl_context,
            trust_env=False,  # the engine is an internal service: no proxies from the env
        )

    @classmethod
    def from_settings(
        cls, settings: Settings, *, transport: httpx.AsyncBaseTransport | None = None
    ) -> EngineClient:
        """A client configured by ``ENGINE_BASE_URL``, ``INTERNAL_API_KEY``, timeouts, in-flight."""
        return cls(
            base_url=settings.engine_base_url,
            api_key=settings.internal_api_key,
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
            response = await self._post(call.path, content, event_id)
        except httpx.RequestError as exc:  # transport failures and undecodable responses
            log.debug("engine %s event %s: %r", call.path, event_id, exc)
            raise EngineUnavailable(_transport_reason(exc)) from exc
        outcome = classify(response.status_code, response.content, response.headers)
        log.debug(
            "engine %s event %s -> %s in %.1f ms",
            call.path,
            event_id,
            response.status_code,
            (time.perf_counter() - started) * 1000,
        )
        error = outcome.error(user_id=call.user_id)
        if error is not None:
            raise error

    async def _post(self, path: str, content: bytes, event_id: str) -> httpx.Response:
        async with self._slots:
            pool = min(self._pools, key=_busy)
            pool.in_flight += 1
            try:
                return await pool.client.post(
                    path, content=content, headers={IDEMPOTENCY_HEADER: event_id}
                )
            finally:
                pool.in_flight -= 1

    async def sync_user(self, user_id: str, *, event_id: str) -> None:
        """Make ``user_id`` known to the engine (``users/sync``) under idempotency key ``event_id``.

        For a sync caused by a quiz attempt's ``user_not_found``, pass
        :func:`sinks.routes.derived_user_sync_key` of the attempt's event id.
        """
        await self.send(user_sync_call(user_id), event_id=event_id)

    async def aclose(self) -> None:
        """Close pooled connections."""
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


def _transport_reason(exc: httpx.RequestError) -> str:
    """Why no response arrived, e.g. ``ConnectError: [Errno 111] Connection refused``."""
    detail = str(exc) or "no detail"
    return f"{type(exc).__name__}: {detail}"
