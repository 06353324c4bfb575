"""The engine's HTTP client: one POST per record, every failure classified.

Guarantees:

- :meth:`EngineClient.send` returns only on a 2xx; anything else raises a
  :class:`~sinks.core.errors.SinkError` chosen by :func:`sinks.core.statuses.classify`, and
  every transport failure (refused, reset, timeout, protocol error) becomes
  :class:`~sinks.core.errors.EngineUnavailable` whose reason is
  ``<failure class>: <detail>`` (e.g. ``ConnectError: [Errno 111] Connection
  refused (127.0.0.1:8081)``, ``ReadTimeout: nothing received for 3 s``) and
  whose cause is the transport's exception (:mod:`sinks.engine.http1` or httpx).
- Configuration errors are not outages: a TLS failure (untrusted or misnamed
  certificate, client certificate refused, TLS to a plain-HTTP port), a 401/403
  and a 3xx raise :class:`~sinks.core.errors.EngineMisconfigured` (still engine-wide:
  the sink pauses, spends no attempt) whose reason names the setting to fix.
- Every error raised by :meth:`EngineClient.send` names the engine route (path)
  of its request in ``endpoint``: trouble is judged per route.
- Every request carries ``Idempotency-Key: <event id>``, so a resend after a
  lost response is applied once; and ``x-api-key`` when a key is configured.
  The key is never logged. ``send(..., headers=...)`` adds request headers
  (e.g. ``traceparent``); they cannot replace the client's own.
- TLS (:class:`EngineTLS`): the system's CAs, or only those of
  ``ENGINE_CA_FILE``; a client certificate for mTLS (``ENGINE_CLIENT_CERT`` /
  ``ENGINE_CLIENT_KEY``); ``ENGINE_TLS_VERIFY=false`` turns verification off
  and is logged as a warning whenever a client is built that way. Unreadable
  files are a :class:`~cdc.errors.ConfigError` naming the variable, at start-up.
- Proxies: the standard ``HTTPS_PROXY`` / ``HTTP_PROXY`` / ``NO_PROXY`` (either
  case) choose an HTTP proxy for the engine's URL (:func:`select_proxy`):
  an ``https://`` engine is reached through a ``CONNECT`` tunnel (TLS end to
  end, the proxy sees no request), a plain ``http://`` engine by sending the
  requests to the proxy. Credentials in the proxy URL go in
  ``Proxy-Authorization`` and are never logged.
- At most ``max_in_flight`` requests run at once (more wait their turn, which
  is never reported as engine trouble), each bounded by a deadline
  (``ENGINE_REQUEST_DEADLINE_S``: a trickling answer raises
  :class:`~sinks.core.errors.EngineUnavailable` ``RequestDeadline: ...``), over at
  most ``max_in_flight`` keep-alive connections, reused last-in first-out and closed after
  :data:`KEEPALIVE_EXPIRY_S` idle.
- The transport is :class:`sinks.engine.http1.ConnectionPool`, chosen by measurement
  over httpx and aiohttp (``make bench``, tests/bench/test_transport_bench.py:
  client CPU per request and requests/s, plain HTTP and TLS). A request on a
  keep-alive connection the engine had closed is resent once on a new one
  (safe: the Idempotency-Key). ``transport="httpx"`` selects httpx's own
  network stack instead; an ``httpx.AsyncBaseTransport`` (tests' MockTransport)
  runs httpx over that transport.
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
from urllib.parse import urlsplit

import httpx

from cdc.errors import ConfigError
from cdc.settings import Settings
from cdc.settings.values import redact_url
from sinks.core.errors import EngineMisconfigured, EngineUnavailable, Unroutable
from sinks.core.statuses import classify
from sinks.engine import http1
from sinks.engine.deadlines import Deadlines
from sinks.shared.routes import EngineCall, user_sync_call

log = logging.getLogger("sinks.engine")  # the name operators filter on: kept across moves

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
#: Headers the client sets itself; ``send(headers=...)`` cannot replace them.
OWN_HEADERS = frozenset({"content-type", "user-agent", "x-api-key", "idempotency-key"})
TLS_UNVERIFIED_WARNING = (
    "ENGINE_TLS_VERIFY=false: the engine's TLS certificate is NOT verified; anyone "
    "on the network path can pose as the engine and read INTERNAL_API_KEY and every "
    "event. Use ENGINE_CA_FILE for a private CA instead; never run this in production."
)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineTimeouts:
    """Per-request limits (DESIGN: 2 s connect, 3 s read); writing shares the read limit.

    ``deadline_s`` bounds a whole request (connect, write, every read): an
    engine trickling its answer a few bytes at a time never trips ``read_s``.
    """

    connect_s: float = 2.0
    read_s: float = 3.0
    deadline_s: float = 10.0

    def as_httpx(self) -> httpx.Timeout:
        # pool=None: the pool holds max_in_flight connections, so waiting for one
        # is the sink's own queueing, bounded by the other limits - not engine trouble.
        return httpx.Timeout(connect=self.connect_s, read=self.read_s, write=self.read_s, pool=None)

    def as_pool(self) -> http1.PoolTimeouts:
        """The same limits for :class:`sinks.engine.http1.ConnectionPool`."""
        return http1.PoolTimeouts(connect_s=self.connect_s, read_s=self.read_s, write_s=self.read_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineTLS:
    """How the client checks the engine and proves itself (PEM file paths)."""

    #: Trust only the CAs of this bundle ("" = the system's CAs).
    ca_file: str = ""
    #: Client certificate (chain) and its unencrypted key, for mTLS ("" = none).
    client_cert: str = ""
    client_key: str = ""
    #: False: no certificate check at all (a loud warning; never in production).
    verify: bool = True

    @classmethod
    def from_settings(cls, settings: Settings) -> EngineTLS:
        return cls(
            ca_file=settings.engine_ca_file,
            client_cert=settings.engine_client_cert,
            client_key=settings.engine_client_key,
            verify=settings.engine_tls_verify,
        )

    def context(self) -> ssl.SSLContext:
        """The client context; :class:`ConfigError` naming the variable of a bad file."""
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file or None)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            raise ConfigError(f"ENGINE_CA_FILE={self.ca_file!r}: {_file_error(exc)}") from None
        if bool(self.client_cert) != bool(self.client_key):
            raise ConfigError("ENGINE_CLIENT_CERT and ENGINE_CLIENT_KEY are set together")
        if self.client_cert:
            try:
                ctx.load_cert_chain(self.client_cert, self.client_key)
            except (OSError, ValueError) as exc:
                raise ConfigError(
                    f"ENGINE_CLIENT_CERT={self.client_cert!r} / ENGINE_CLIENT_KEY="
                    f"{self.client_key!r}: {_file_error(exc)}"
                ) from None
        if not self.verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx


def _file_error(exc: BaseException) -> str:
    """An error about a PEM file without the file's content (the key must not leak)."""
    if isinstance(exc, FileNotFoundError | PermissionError | IsADirectoryError):
        return exc.strerror or type(exc).__name__
    if isinstance(exc, ssl.SSLError):
        return f"not a usable PEM file ({exc.reason or exc.library or 'ssl error'})"
    return f"not a usable PEM file ({type(exc).__name__})"


def select_proxy(
    base_url: str, *, https_proxy: str = "", http_proxy: str = "", no_proxy: str = ""
) -> str:
    """The proxy URL for ``base_url`` ("" = connect directly), as curl reads the variables.

    ``https://`` engines use ``https_proxy``, ``http://`` ones ``http_proxy``;
    ``no_proxy`` is a comma-separated list of host names, domain suffixes
    (``.internal`` or ``internal``), IP addresses, ``host:port`` entries, or
    ``*`` (no proxy at all).
    """
    parts = urlsplit(base_url)
    proxy = https_proxy if parts.scheme == "https" else http_proxy
    host = (parts.hostname or "").lower()
    if not proxy or not host:
        return ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    for raw in no_proxy.split(","):
        entry = raw.strip().lower()
        if not entry:
            continue
        if entry == "*":
            return ""
        name, _, entry_port = entry.rpartition(":") if _has_port(entry) else (entry, "", "")
        if entry_port and entry_port != str(port):
            continue
        name = name.strip("[]").lstrip("*").lstrip(".")
        if host == name or host.endswith("." + name):
            return ""
    return proxy


def _has_port(entry: str) -> bool:
    """``host:port`` or ``[v6]:port`` (a bare IPv6 address has colons but no port)."""
    if entry.startswith("["):
        return "]:" in entry
    return entry.count(":") == 1


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
    :class:`sinks.engine.http1.ConnectionPool` of ``max_in_flight`` connections;
    ``"httpx"`` is httpx's network stack in pools of :data:`CONNECTIONS_PER_POOL`
    connections, each request to the least busy pool; an ``httpx.AsyncBaseTransport``
    (tests) is used by one httpx client. ``tls`` applies to ``https://`` engines;
    ``proxy`` is an ``http://`` proxy URL (see :func:`select_proxy`).
    """

    def __init__(
        self,
        *,
        base_url: str = DEFAULT_BASE_URL,
        api_key: str = "",
        timeouts: EngineTimeouts | None = None,
        max_in_flight: int = 64,
        transport: Transport = None,
        tls: EngineTLS | None = None,
        proxy: str = "",
    ) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.base_url = base_url.rstrip("/")
        self._headers = {"content-type": "application/json"}
        if api_key:
            self._headers[API_KEY_HEADER] = api_key
        timeouts = timeouts or EngineTimeouts()
        self._timeout = timeouts.as_httpx()
        self._deadlines = Deadlines(timeouts.deadline_s)
        self._slots = asyncio.Semaphore(max_in_flight)
        self._tls = tls or EngineTLS()
        self._ssl_context: ssl.SSLContext | None = None  # built once, shared by the pools
        self._proxy = proxy
        self._pools: list[_Pool] = []
        self._pool: http1.ConnectionPool | None = None
        self._target_prefix = ""
        self._header_block = b""
        if self.base_url.startswith("https:"):
            self._ssl()  # a bad CA or key file fails now, not at the first event
            if not self._tls.verify:
                log.warning(TLS_UNVERIFIED_WARNING, extra={"state": "tls_unverified"})
        if transport is None:
            self._pool = self._fast_pool(max_in_flight, timeouts)
        elif transport == HTTPX_TRANSPORT:
            self._pools = [_Pool(self._client(size, None)) for size in _split(max_in_flight)]
        elif isinstance(transport, httpx.AsyncBaseTransport):
            self._pools = [_Pool(self._client(max_in_flight, transport))]
        else:
            raise ValueError(f"unknown transport {transport!r}")
        if proxy:
            log.info(
                "engine %s through proxy %s",
                self.base_url,
                redact_url(proxy),
                extra={"proxy": True},
            )

    def _fast_pool(self, connections: int, timeouts: EngineTimeouts) -> http1.ConnectionPool:
        origin = http1.parse_origin(self.base_url)
        self._target_prefix = origin.path_prefix
        headers = [("user-agent", USER_AGENT), *self._headers.items()]
        self._header_block = http1.encode_headers(headers)
        try:
            proxy = http1.parse_proxy(self._proxy) if self._proxy else None
        except ValueError as exc:
            raise ConfigError(f"HTTPS_PROXY/HTTP_PROXY: {exc}") from None
        return http1.ConnectionPool(
            origin,
            max_connections=connections,
            timeouts=timeouts.as_pool(),
            keepalive_expiry_s=KEEPALIVE_EXPIRY_S,
            ssl_context=self._ssl() if origin.scheme == "https" else None,
            proxy=proxy,
        )

    def _ssl(self) -> ssl.SSLContext:
        """The TLS context of :class:`EngineTLS`, for either transport."""
        if self._ssl_context is None:
            self._ssl_context = self._tls.context()
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
            verify=self._ssl() if self.base_url.startswith("https:") else True,
            proxy=self._proxy or None,
            trust_env=False,  # proxies come from the settings (select_proxy), not httpx's reading
        )

    @classmethod
    def from_settings(cls, settings: Settings, *, transport: Transport = None) -> EngineClient:
        """A client configured by ``ENGINE_*``, ``INTERNAL_API_KEY``, the proxy variables."""
        return cls(
            base_url=settings.engine_base_url,
            api_key=settings.internal_api_key.get_secret_value(),
            timeouts=EngineTimeouts(
                connect_s=settings.engine_connect_timeout_s,
                read_s=settings.engine_read_timeout_s,
                deadline_s=settings.engine_request_deadline_s,
            ),
            max_in_flight=settings.sink_max_in_flight,
            transport=transport,
            tls=EngineTLS.from_settings(settings),
            proxy=select_proxy(
                settings.engine_base_url,
                https_proxy=settings.https_proxy.get_secret_value(),
                http_proxy=settings.http_proxy.get_secret_value(),
                no_proxy=settings.no_proxy,
            ),
        )

    async def send(
        self, call: EngineCall, *, event_id: str, headers: Mapping[str, str] | None = None
    ) -> bool:
        """POST ``call`` with ``event_id`` as idempotency key; return on 2xx, raise otherwise.

        Returns whether the engine answered that it had applied this key before
        (``2xx {"status":"duplicate"}``: :func:`is_duplicate`).

        ``headers`` are sent too (names other than the client's own; values
        without CR, LF or NUL, else :class:`Unroutable`).
        """
        if not event_id or not (event_id.isascii() and event_id.isprintable()):
            raise Unroutable(f"event id {event_id!r} cannot be an Idempotency-Key")
        extra = _extra_header_block(headers) if headers else b""
        content = call.content  # the payload's own text: never re-encoded
        if content is None:
            try:
                content = json.dumps(call.body, separators=(",", ":"), allow_nan=False).encode()
            except (TypeError, ValueError) as exc:
                raise Unroutable(f"{call.path}: body is not JSON ({exc})") from exc
        started = time.perf_counter()
        try:
            status, body, response_headers = await self._post(
                call.path, content, event_id, extra, headers
            )
        except (http1.TransportError, httpx.RequestError) as exc:  # incl. undecodable responses
            log.debug("engine %s event %s: %r", call.path, event_id, exc)
            failure = _transport_error(exc)
            failure.endpoint = call.path
            raise failure from exc
        outcome = classify(status, body, response_headers)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "engine %s event %s -> %s in %.1f ms",
                call.path,
                event_id,
                status,
                (time.perf_counter() - started) * 1000,
                extra={"event_id": event_id, "status": status},
            )
        error = outcome.error(user_id=call.user_id)
        if error is not None:
            error.endpoint = call.path  # the route the failure belongs to
            raise error
        return is_duplicate(body)

    async def _post(
        self,
        path: str,
        content: bytes,
        event_id: str,
        extra_block: bytes,
        extra: Mapping[str, str] | None,
    ) -> tuple[int, bytes, Mapping[str, str]]:
        """Status, body and headers of the engine's answer; a transport error else.

        The whole exchange is bounded by the request deadline (not the wait for a slot).
        """
        async with self._slots:
            try:
                with self._deadlines.bound():
                    return await self._exchange(path, content, event_id, extra_block, extra)
            except TimeoutError:
                raise http1.RequestDeadline(
                    f"no complete answer within {self._deadlines.timeout_s:g} s"
                ) from None

    async def _exchange(
        self,
        path: str,
        content: bytes,
        event_id: str,
        extra_block: bytes,
        extra: Mapping[str, str] | None,
    ) -> tuple[int, bytes, Mapping[str, str]]:
        """One request on either transport, unbounded: :meth:`_post` bounds it."""
        if self._pool is not None:
            # event_id is printable ASCII (checked by send): no CR/LF can reach the head
            key_line = b"%s: %s\r\n" % (IDEMPOTENCY_HEADER.encode(), event_id.encode("ascii"))
            answer = await self._pool.request(
                "POST",
                self._target_prefix + path,
                header_block=self._header_block + key_line + extra_block,
                body=content,
            )
            return answer.status, answer.body, answer.headers
        pool = min(self._pools, key=_busy)
        pool.in_flight += 1
        try:
            response = await pool.client.post(
                path, content=content, headers={**(extra or {}), IDEMPOTENCY_HEADER: event_id}
            )
        finally:
            pool.in_flight -= 1
        return response.status_code, response.content, response.headers

    async def sync_user(self, user_id: str, *, event_id: str) -> None:
        """Make ``user_id`` known to the engine (``users/sync``) under idempotency key ``event_id``.

        For a sync caused by a quiz attempt's ``user_not_found``, pass
        :func:`sinks.shared.routes.derived_user_sync_key` of the attempt's event id.
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


def _extra_header_block(headers: Mapping[str, str]) -> bytes:
    """The caller's extra headers as head lines; :class:`Unroutable` when one is unusable."""
    own = [name for name in headers if name.lower() in OWN_HEADERS]
    if own:
        raise Unroutable(f"headers {own} are set by the engine client itself")
    try:
        return http1.encode_headers(headers.items())
    except ValueError as exc:
        raise Unroutable(f"cannot send header: {exc}") from exc


#: A proxy refusing a CONNECT with these wants a setting changed, not time.
PROXY_REFUSALS = frozenset({403, 405, 407})


def _transport_error(exc: http1.TransportError | httpx.RequestError) -> EngineUnavailable:
    """The exception for a request that got no response: TLS trouble is misconfiguration."""
    if isinstance(exc, http1.TLSError):
        return EngineMisconfigured(tls_reason(exc.ssl_error, str(exc)))
    if isinstance(exc, http1.ProxyError) and exc.status in PROXY_REFUSALS:
        fix = (
            "put the right credentials in HTTPS_PROXY/HTTP_PROXY (http://user:password@host:port)"
            if exc.status == 407
            else "the proxy does not allow the engine: check HTTPS_PROXY/HTTP_PROXY and NO_PROXY"
        )
        return EngineMisconfigured(f"{exc}: {fix}", status=exc.status)
    ssl_error = _ssl_error(exc)
    if ssl_error is not None:
        return EngineMisconfigured(tls_reason(ssl_error, str(exc)))
    # the request deadline expired: the route is slow for everyone, not this request's
    return EngineUnavailable(_transport_reason(exc), shared=isinstance(exc, http1.RequestDeadline))


def _ssl_error(exc: BaseException) -> ssl.SSLError | None:
    """The :class:`ssl.SSLError` behind an httpx transport error, if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ssl.SSLError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


#: ssl error reasons (OpenSSL's names) that say the server refused our client certificate.
_CLIENT_CERT_REFUSED = (
    "CERTIFICATE_REQUIRED",
    "BAD_CERTIFICATE",
    "UNKNOWN_CA",
    "CERTIFICATE_UNKNOWN",
    "ACCESS_DENIED",
    "CERTIFICATE_EXPIRED",
    "CERTIFICATE_REVOKED",
)
#: ... that say the other end does not speak TLS (an http:// port, a proxy's error page).
_NOT_TLS = ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG")


def tls_reason(error: ssl.SSLError | None, detail: str) -> str:
    """What a person must fix after the TLS failure ``error`` (``detail``: its message).

    ``None`` (or an EOF) means the engine dropped the connection mid-handshake.
    """
    if error is None or isinstance(error, ssl.SSLEOFError):
        return (
            f"TLS: the engine closed the connection during the handshake ({detail}): it "
            "refuses our client certificate (ENGINE_CLIENT_CERT/ENGINE_CLIENT_KEY) or "
            "does not accept TLS here (ENGINE_BASE_URL)"
        )
    reason = (error.reason or "").upper()
    if isinstance(error, ssl.SSLCertVerificationError):
        message = error.verify_message or "certificate verify failed"
        if "hostname" in message.lower() or "ip address mismatch" in message.lower():
            fix = "the host of ENGINE_BASE_URL is not a name in the engine's certificate"
        else:
            fix = (
                "the engine's certificate is not trusted: "
                "set ENGINE_CA_FILE to the CA that signed it"
            )
        return f"TLS: {message} ({detail}): {fix}"
    if any(name in reason for name in _CLIENT_CERT_REFUSED):
        return (
            f"TLS: the engine refused our client certificate ({detail}): set "
            "ENGINE_CLIENT_CERT/ENGINE_CLIENT_KEY to a certificate its CA accepts"
        )
    if any(name in reason for name in _NOT_TLS):
        return (
            f"TLS: the engine's port does not speak TLS ({detail}): check the scheme and port "
            "of ENGINE_BASE_URL"
        )
    return (
        f"TLS handshake with the engine failed ({detail}): check ENGINE_BASE_URL, "
        "ENGINE_CA_FILE and ENGINE_CLIENT_CERT/ENGINE_CLIENT_KEY"
    )


def _transport_reason(exc: http1.TransportError | httpx.RequestError) -> str:
    """Why no response arrived, e.g. ``ConnectError: [Errno 111] Connection refused (h:p)``."""
    detail = str(exc) or "no detail"
    return f"{type(exc).__name__}: {detail}"


#: A duplicate answer is short: a longer 2xx body is not read for it.
_DUPLICATE_BODY_MAX = 256


def is_duplicate(body: bytes) -> bool:
    """Whether a 2xx body says the key was applied before: ``{"status": "duplicate"}``
    (the engine's answer to a reused Idempotency-Key, as the stub gives it)."""
    if len(body) > _DUPLICATE_BODY_MAX or b"duplicate" not in body:
        return False
    try:
        doc = json.loads(body)
    except ValueError:
        return False
    return isinstance(doc, dict) and doc.get("status") == "duplicate"
