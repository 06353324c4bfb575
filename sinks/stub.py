"""The engine stub: a real HTTP server standing in for the gamification engine.

Guarantees, as the real engine's contract (DESIGN "Engine API"):

- ``POST /api/internal/users/sync`` and ``/api/internal/quiz-attempts/sync``
  apply an event at most once per ``Idempotency-Key``: a key already applied
  answers ``200 {"status":"duplicate"}`` and changes nothing (counted; a reused
  key with another path or body is also counted as a conflict).
- A quiz attempt whose user was never synced answers
  ``404 {"error":"user_not_found"}`` and is not applied (its key stays free).
- With an API key configured, a request without the right ``x-api-key`` gets
  401 before anything else. A request without ``Idempotency-Key`` gets 400.
- Everything applied is recorded in order, per path, with event id, body, time
  and the request's W3C trace headers (``trace``: ``traceparent``/``tracestate``).
- Like a real engine, a request whose client gave up while the stub was
  delaying it (latency beyond the client's read timeout) is still applied:
  the resend is then a duplicate - the at-least-once case made visible.

Fault injection (``/_stub/faults``) makes it fail on purpose: status sequences
per path or per event id, extra headers (``Retry-After``), fixed latency, and
outage windows during which the listening socket is really closed, so clients
get ``connection refused``, then reopened on the same port.

Control API (JSON; never behind the API key)::

    GET    /healthz                       {"status": "ok"}
    GET    /_stub/applied                 ?user_id= &path= &event_id= &since=<seq> &limit=
    GET    /_stub/stats                   counters: applied, duplicates, rejected, by status ...
    GET    /_stub/requests                requests received per Idempotency-Key (any answer)
    POST   /_stub/reset                   forget applied events, keys, users, counters
    GET    /_stub/faults                  active faults
    POST   /_stub/faults                  add a fault instruction (object or list of objects)
    DELETE /_stub/faults                  clear rules and latency

TLS: given a certificate and key (:class:`StubTLS`; ``ENGINE_STUB_TLS_CERT`` /
``ENGINE_STUB_TLS_KEY`` for ``outbox-cdc engine-stub``) the stub serves HTTPS,
and with a client CA (``ENGINE_STUB_CLIENT_CA``) it requires a client
certificate signed by that CA (mTLS) - the handshake fails without one (in
mTLS mode the stub speaks TLS 1.2: see :func:`build_server`). The listener
reopened after an outage window serves TLS the same way.

The app is raw ASGI (no framework) on uvicorn - ``httptools`` when installed,
else ``h11`` - because the sink's benchmarks need thousands of requests per
second from one core. State lives on the server's event loop only; other
threads reach it over HTTP (:class:`StubServer` helpers do that).
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.util
import json
import logging
import socket
import ssl
import threading
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs

import httpx
import uvicorn

from sinks.routes import QUIZ_ATTEMPTS_SYNC_PATH, USERS_SYNC_PATH

log = logging.getLogger(__name__)

Scope = Mapping[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = tuple[tuple[bytes, bytes], ...]

ENGINE_PATHS = frozenset({USERS_SYNC_PATH, QUIZ_ATTEMPTS_SYNC_PATH})
#: Request bodies above this are refused with 413: catalog payloads are < 1 KiB.
MAX_BODY_BYTES = 1 << 20
#: Idle keep-alive connections live this long (nginx's default), longer than
#: the client's pool expiry, so the client never reuses a closing connection.
KEEP_ALIVE_S = 75
#: Listen backlog: a burst of the sink's max in-flight connections never overflows it.
LISTEN_BACKLOG = 1024
#: How long StubServer.start waits for the listener before giving up.
STARTUP_TIMEOUT_S = 10.0
#: While an outage window ends but the port cannot be bound again, retry this often.
REBIND_RETRY_S = 0.2
_FAULT_KEYS = frozenset(
    {"path", "event_id", "statuses", "status", "times", "headers", "body", "apply"}
)
_CONTROL_KEYS = frozenset({"latency_ms", "refuse_connections_s"})


@dataclass(frozen=True, slots=True)
class Reply:
    """An HTTP response: status, JSON body bytes, extra headers."""

    status: int
    body: bytes
    headers: Headers = ()


def json_reply(status: int, value: object, headers: Headers = ()) -> Reply:
    """A compact JSON reply."""
    return Reply(status, json.dumps(value, separators=(",", ":")).encode(), headers)


class FaultRule:
    """One injected failure: which requests it hits and the statuses it answers.

    Matching, most specific first: a rule naming an ``event_id``, then one
    naming a ``path``, then one naming neither (every engine request). Each
    matching request consumes one status of ``statuses``; ``forever_status``
    answers every match once ``statuses`` is used up. With ``apply`` the
    request is processed normally and only the answer is replaced (the engine
    applied it, the response was lost).
    """

    def __init__(
        self,
        *,
        path: str | None = None,
        event_id: str | None = None,
        statuses: Iterable[int] = (),
        forever_status: int | None = None,
        reply: tuple[object, Headers, bool] = ({"error": "injected_fault"}, (), False),
    ) -> None:
        self.path = path
        self.event_id = event_id
        self.statuses = deque(statuses)
        self.forever_status = forever_status
        self.body, self.headers, self.apply = reply

    @property
    def rank(self) -> int:
        """0 for an event-id rule, 1 for a path rule, 2 for a catch-all."""
        if self.event_id is not None:
            return 0
        return 1 if self.path is not None else 2

    @property
    def exhausted(self) -> bool:
        """No status left to answer."""
        return not self.statuses and self.forever_status is None

    def matches(self, path: str, event_id: str) -> bool:
        """Whether a request to ``path`` with key ``event_id`` hits this rule."""
        if self.event_id is not None and self.event_id != event_id:
            return False
        return self.path is None or self.path == path

    def take(self) -> Reply:
        """Consume the next status and build its reply."""
        status = self.statuses.popleft() if self.statuses else self.forever_status
        assert status is not None  # never taken when exhausted
        return json_reply(status, self.body, self.headers)

    def describe(self) -> dict[str, object]:
        """The rule as JSON for ``GET /_stub/faults``."""
        return {
            "path": self.path,
            "event_id": self.event_id,
            "statuses": list(self.statuses),
            "forever_status": self.forever_status,
            "headers": {k.decode(): v.decode() for k, v in self.headers},
            "body": self.body,
            "apply": self.apply,
        }


def parse_fault_rule(spec: Mapping[str, Any]) -> FaultRule:
    """A rule from its JSON form; ``ValueError`` naming the problem.

    ``{"path"|"event_id": ..., "statuses": [503, 503]}`` answers those in turn;
    ``{"status": 400, "times": n}`` answers n times (``-1``: forever); optional
    ``"headers": {"Retry-After": "2"}``, ``"body": <json>``, ``"apply": true``.
    """
    unknown = set(spec) - _FAULT_KEYS
    if unknown:
        raise ValueError(f"unknown fault keys: {sorted(unknown)}")
    path = _optional_str(spec, "path")
    if path is not None and path not in ENGINE_PATHS:
        raise ValueError(f"path must be one of {sorted(ENGINE_PATHS)}")
    statuses, forever = _parse_statuses(spec)
    reply = (spec.get("body", {"error": "injected_fault"}), _parse_headers(spec), _apply(spec))
    return FaultRule(
        path=path,
        event_id=_optional_str(spec, "event_id"),
        statuses=statuses,
        forever_status=forever,
        reply=reply,
    )


def _optional_str(spec: Mapping[str, Any], key: str) -> str | None:
    value = spec.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{key} must be a string")
    return value


def _status(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 100 <= value <= 599:
        raise ValueError(f"status {value!r} is not an HTTP status code")
    return value


def _parse_statuses(spec: Mapping[str, Any]) -> tuple[list[int], int | None]:
    if "statuses" in spec:
        if "status" in spec or not isinstance(spec["statuses"], list) or not spec["statuses"]:
            raise ValueError("statuses must be a non-empty list (and not combined with status)")
        return [_status(s) for s in spec["statuses"]], None
    if "status" not in spec:
        raise ValueError("a fault rule needs statuses or status")
    status = _status(spec["status"])
    times = spec.get("times", 1)
    if not isinstance(times, int) or times < -1 or times == 0:
        raise ValueError("times must be a positive integer or -1 (forever)")
    return ([], status) if times == -1 else ([status] * times, None)


def _parse_headers(spec: Mapping[str, Any]) -> Headers:
    headers = spec.get("headers", {})
    if not isinstance(headers, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
    ):
        raise ValueError("headers must map strings to strings")
    return tuple((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items())


def _apply(spec: Mapping[str, Any]) -> bool:
    value = spec.get("apply", False)
    if not isinstance(value, bool):
        raise ValueError("apply must be true or false")
    return value


class Faults:
    """The active fault rules and the fixed latency of every engine request."""

    def __init__(self, *, latency_ms: float = 0.0) -> None:
        self.rules: list[FaultRule] = []
        self.latency_ms = latency_ms

    def take(self, path: str, event_id: str) -> FaultRule | None:
        """The most specific rule hitting this request (first added wins a tie), or ``None``."""
        best: FaultRule | None = None
        for rule in self.rules:
            if rule.matches(path, event_id) and (best is None or rule.rank < best.rank):
                best = rule
        return best

    def consume(self, rule: FaultRule) -> Reply:
        """The rule's next reply; a rule used up is removed."""
        reply = rule.take()
        if rule.exhausted:
            self.rules.remove(rule)
        return reply

    def clear(self) -> None:
        """No rules, no latency."""
        self.rules.clear()
        self.latency_ms = 0.0

    def describe(self) -> dict[str, object]:
        """The faults as JSON."""
        return {"latency_ms": self.latency_ms, "rules": [r.describe() for r in self.rules]}


@dataclass(slots=True)
class _Applied:
    path: str
    body: bytes  # as received: a reused key with another body is a conflict


class StubEngine:
    """What the engine knows: applied events, idempotency keys, users, counters.

    Not thread-safe: used from the server's event loop only.
    """

    def __init__(self, *, api_key: str = "", latency_ms: float = 0.0) -> None:
        self._api_key = api_key.encode()
        self.faults = Faults(latency_ms=latency_ms)
        self.reset()

    def reset(self) -> None:
        """Forget everything applied and every counter (an engine that lost its data)."""
        self.applied: list[dict[str, Any]] = []
        self._keys: dict[str, _Applied] = {}
        self._users: set[str] = set()
        self._by_path: Counter[str] = Counter()
        self._by_status: Counter[int] = Counter()
        self._counts: Counter[str] = Counter()
        self._by_key: Counter[str] = Counter()

    def handle(self, path: str, headers: Mapping[bytes, bytes], body: bytes) -> Reply:
        """Answer one engine request (after the latency); counts it."""
        reply = self._answer(path, headers, body)
        self._counts["requests"] += 1
        self._by_status[reply.status] += 1
        if reply.status >= 300:
            self._counts["rejected"] += 1
        return reply

    def _answer(self, path: str, headers: Mapping[bytes, bytes], body: bytes) -> Reply:
        presented = headers.get(b"x-api-key", b"")
        if self._api_key and not hmac.compare_digest(presented, self._api_key):
            return json_reply(401, {"error": "unauthorized"})
        event_id = headers.get(b"idempotency-key", b"").decode("latin-1")
        self._by_key[event_id] += 1
        rule = self.faults.take(path, event_id)
        trace = _trace_of(headers)
        if rule is None:
            return self._apply(path, event_id, body, trace)
        self._counts["faults_injected"] += 1
        if rule.apply:
            self._apply(path, event_id, body, trace)
        return self.faults.consume(rule)

    def _apply(self, path: str, event_id: str, body: bytes, trace: dict[str, str]) -> Reply:
        if not event_id:
            return json_reply(400, {"error": "missing_idempotency_key"})
        seen = self._keys.get(event_id)
        if seen is not None:
            self._counts["duplicates"] += 1
            if seen.path != path or seen.body != body:
                self._counts["conflicts"] += 1
            return json_reply(200, {"status": "duplicate"})
        payload = _json_object(body)
        user_id = None if payload is None else payload.get("user_id")
        if payload is None or not isinstance(user_id, str) or not user_id:
            return json_reply(400, {"error": "invalid_body", "detail": "need a user_id string"})
        if path == QUIZ_ATTEMPTS_SYNC_PATH and user_id not in self._users:
            return json_reply(404, {"error": "user_not_found"})
        self._record(path, event_id, user_id, payload, body, trace)
        return json_reply(200, {"status": "applied", "seq": len(self.applied)})

    def _record(
        self,
        path: str,
        event_id: str,
        user_id: str,
        payload: dict[str, Any],
        body: bytes,
        trace: dict[str, str],
    ) -> None:
        if path == USERS_SYNC_PATH:
            self._users.add(user_id)
        self._keys[event_id] = _Applied(path, body)
        self._by_path[path] += 1
        self.applied.append(
            {
                "seq": len(self.applied) + 1,
                "path": path,
                "event_id": event_id,
                "user_id": user_id,
                "body": payload,
                "applied_at": time.time(),
                "trace": trace,
            }
        )

    def applied_view(self, query: Mapping[str, str]) -> dict[str, Any]:
        """``GET /_stub/applied``: items matching the filters, and counts."""
        items: Iterable[dict[str, Any]] = self.applied
        since = int(query.get("since", "0"))
        if since:
            items = self.applied[since:]
        for field in ("user_id", "path", "event_id"):
            if field in query:
                items = [i for i in items if i[field] == query[field]]
        selected = list(items)
        if "limit" in query:
            selected = selected[: int(query["limit"])]
        return {
            "count": len(selected),
            "total": len(self.applied),
            "by_path": dict(self._by_path),
            "users": len(self._users),
            "items": selected,
        }

    def requests_view(self) -> dict[str, Any]:
        """``GET /_stub/requests``: authenticated requests per Idempotency-Key, any answer."""
        return {"by_key": dict(self._by_key)}

    def stats_view(self) -> dict[str, Any]:
        """``GET /_stub/stats``: counters since start or the last reset."""
        return {
            "requests": self._counts["requests"],
            "applied": len(self.applied),
            "applied_by_path": dict(self._by_path),
            "users": len(self._users),
            "duplicates": self._counts["duplicates"],
            "conflicts": self._counts["conflicts"],
            "rejected": self._counts["rejected"],
            "faults_injected": self._counts["faults_injected"],
            "by_status": {str(k): v for k, v in sorted(self._by_status.items())},
            "latency_ms": self.faults.latency_ms,
        }


#: Request headers the stub records with an applied event (trace context).
_TRACE_HEADERS = (b"traceparent", b"tracestate")


def _trace_of(headers: Mapping[bytes, bytes]) -> dict[str, str]:
    """The request's trace headers, as received."""
    return {
        name.decode(): headers[name].decode("latin-1") for name in _TRACE_HEADERS if name in headers
    }


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


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
    """The stub's listening socket; closes it for an outage window and reopens it.

    Transitions (on the server's loop)::

        LISTENING --refuse_for(s)--> REFUSING --s elapsed (or reopen_now)--> LISTENING

    Refusing closes the listening socket (new connections: ``ECONNREFUSED``)
    and closes idle keep-alive connections; requests in progress finish.
    """

    def __init__(self, *, server: uvicorn.Server, host: str, port: int) -> None:
        self._server = server
        self.host = host
        self.port = port
        self._task: asyncio.Task[None] | None = None

    @property
    def state(self) -> ListenerState:
        """REFUSING while an outage window is open (until the socket is bound again)."""
        if self._task is not None and not self._task.done():
            return ListenerState.REFUSING
        return ListenerState.LISTENING

    @property
    def refusing(self) -> bool:
        """An outage window is open."""
        return self.state is ListenerState.REFUSING

    def refuse_for(self, window_s: float) -> None:
        """Stop accepting connections now, for ``window_s`` seconds (a new window replaces one)."""
        if self._task is not None:
            self._task.cancel()
        for server in self._server.servers:
            server.close()
        for connection in list(self._server.server_state.connections):
            connection.shutdown()
        self._task = asyncio.get_running_loop().create_task(self._reopen_after(window_s))
        log.info(
            "engine stub %s:%s refuses connections for %.1f s",
            self.host,
            self.port,
            window_s,
            extra={"state": ListenerState.REFUSING.value},
        )

    def reopen_now(self) -> None:
        """End the outage window early."""
        if self.refusing:
            assert self._task is not None
            self._task.cancel()
            self._task = asyncio.get_running_loop().create_task(self._reopen_after(0.0))

    async def _reopen_after(self, window_s: float) -> None:
        await asyncio.sleep(window_s)
        while not self._server.should_exit:
            try:
                sock = bind_socket(self.host, self.port)
            except OSError as exc:
                log.warning("engine stub cannot rebind %s:%s: %s", self.host, self.port, exc)
                await asyncio.sleep(REBIND_RETRY_S)
                continue
            loop = asyncio.get_running_loop()
            server = await loop.create_server(
                self._protocol, sock=sock, backlog=LISTEN_BACKLOG, ssl=self._server.config.ssl
            )
            self._server.servers.append(server)
            log.info(
                "engine stub %s:%s accepts connections again",
                self.host,
                self.port,
                extra={"state": ListenerState.LISTENING.value},
            )
            return

    def _protocol(self) -> asyncio.Protocol:
        """A connection protocol exactly as uvicorn's own listener makes them."""
        config = self._server.config
        protocol: asyncio.Protocol = config.http_protocol_class(  # type: ignore[call-arg]
            config=config, server_state=self._server.server_state, app_state={}
        )
        return protocol


class StubApp:
    """The raw ASGI application: engine endpoints and the ``/_stub`` control API."""

    def __init__(self, *, engine: StubEngine) -> None:
        self.engine = engine
        self.listener: Listener | None = None
        self._control: dict[tuple[str, str], Callable[[Mapping[str, str], bytes], Reply]] = {
            ("GET", "/healthz"): lambda _q, _b: json_reply(200, {"status": "ok"}),
            ("GET", "/_stub/applied"): self._get_applied,
            ("GET", "/_stub/stats"): self._get_stats,
            ("GET", "/_stub/requests"): self._get_requests,
            ("POST", "/_stub/reset"): self._post_reset,
            ("GET", "/_stub/faults"): self._get_faults,
            ("POST", "/_stub/faults"): self._post_faults,
            ("DELETE", "/_stub/faults"): self._delete_faults,
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = await _read_body(receive)
        if body is None:
            reply = json_reply(413, {"error": "body_too_large"})
        else:
            reply = await self._dispatch(scope, body)
        await send(
            {
                "type": "http.response.start",
                "status": reply.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(reply.body)).encode()),
                    *reply.headers,
                ],
            }
        )
        await send({"type": "http.response.body", "body": reply.body})

    async def _dispatch(self, scope: Scope, body: bytes) -> Reply:
        path: str = scope["path"]
        method: str = scope["method"]
        if path in ENGINE_PATHS:
            if method != "POST":
                return json_reply(405, {"error": "method_not_allowed"})
            latency_ms = self.engine.faults.latency_ms
            if latency_ms > 0:
                await asyncio.sleep(latency_ms / 1000)
            return self.engine.handle(path, dict(scope["headers"]), body)
        handler = self._control.get((method, path))
        if handler is None:
            return json_reply(404, {"error": "not_found", "path": path})
        try:
            reply = handler(_query(scope), body)
        except ValueError as exc:
            return json_reply(400, {"error": str(exc)})
        # One loop turn before answering: connections a handler closed (an
        # outage) are really closed before the caller hears it has begun.
        await asyncio.sleep(0)
        return reply

    def _get_applied(self, query: Mapping[str, str], _body: bytes) -> Reply:
        return json_reply(200, self.engine.applied_view(query))

    def _get_stats(self, _query: Mapping[str, str], _body: bytes) -> Reply:
        stats = self.engine.stats_view()
        stats["refusing_connections"] = self.listener is not None and self.listener.refusing
        return json_reply(200, stats)

    def _get_requests(self, _query: Mapping[str, str], _body: bytes) -> Reply:
        return json_reply(200, self.engine.requests_view())

    def _post_reset(self, _query: Mapping[str, str], _body: bytes) -> Reply:
        self.engine.reset()
        return json_reply(200, {"status": "reset"})

    def _get_faults(self, _query: Mapping[str, str], _body: bytes) -> Reply:
        return json_reply(200, self.engine.faults.describe())

    def _delete_faults(self, _query: Mapping[str, str], _body: bytes) -> Reply:
        self.engine.faults.clear()
        if self.listener is not None:
            self.listener.reopen_now()
        return json_reply(200, self.engine.faults.describe())

    def _post_faults(self, _query: Mapping[str, str], body: bytes) -> Reply:
        """Validate every instruction first; then add rules, set latency, start an outage."""
        instructions = _fault_instructions(body)
        rules = [parse_fault_rule(_rule_part(i)) for i in instructions if set(i) & _FAULT_KEYS]
        latency_ms, outage_s = _control_values(instructions)
        if outage_s is not None and self.listener is None:
            raise ValueError("this stub has no listener to close")
        self.engine.faults.rules.extend(rules)
        if latency_ms is not None:
            self.engine.faults.latency_ms = latency_ms
        if outage_s is not None and self.listener is not None:
            self.listener.refuse_for(outage_s)
        return json_reply(200, self.engine.faults.describe())


def _fault_instructions(body: bytes) -> list[dict[str, Any]]:
    """The body of ``POST /_stub/faults`` as a list of objects with known keys."""
    try:
        spec = json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"body is not JSON: {exc}") from exc
    instructions = spec if isinstance(spec, list) else [spec]
    if not all(isinstance(i, dict) for i in instructions):
        raise ValueError("a fault instruction is a JSON object (or a list of them)")
    for instruction in instructions:
        unknown = set(instruction) - _FAULT_KEYS - _CONTROL_KEYS
        if unknown:
            raise ValueError(f"unknown fault keys: {sorted(unknown)}")
    return instructions


def _control_values(instructions: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """``latency_ms`` and ``refuse_connections_s`` asked for (the last one wins), validated."""
    latency_ms: float | None = None
    outage_s: float | None = None
    for instruction in instructions:
        if "latency_ms" in instruction:
            latency_ms = _non_negative(instruction["latency_ms"])
        if "refuse_connections_s" in instruction:
            outage_s = _non_negative(instruction["refuse_connections_s"])
    return latency_ms, outage_s


def _rule_part(instruction: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in instruction.items() if k in _FAULT_KEYS}


def _non_negative(value: object) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{value!r} is not a non-negative number")
    return float(value)


def _query(scope: Scope) -> dict[str, str]:
    raw: bytes = scope.get("query_string", b"")
    return {k: v[-1] for k, v in parse_qs(raw.decode("latin-1")).items()}


async def _read_body(receive: Receive) -> bytes | None:
    """The request body, or ``None`` when it exceeds :data:`MAX_BODY_BYTES`."""
    message = await receive()
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        return body
    chunks = [body]
    size = len(body)
    while message.get("more_body", False):
        message = await receive()
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


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
) -> tuple[uvicorn.Server, socket.socket, Listener]:
    """The uvicorn server of a stub, its bound socket and the listener that can close it.

    uvicorn's own log lines go to the process's logging set-up (``log_config=None``),
    so they come out in its format, text or JSON.
    """
    sock = bind_socket(host, port)
    app = StubApp(engine=engine)
    config = uvicorn.Config(
        app,
        http=http_implementation(),
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
    server = uvicorn.Server(config)
    listener = app.listener = Listener(server=server, host=host, port=sock.getsockname()[1])
    return server, sock, listener


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
    server, sock, _ = build_server(
        host=host, port=port, engine=engine, log_level=log_level, tls=tls
    )
    log.info(
        "engine stub on %s://%s:%s (%s, %s, api key %s)",
        "https" if tls else "http",
        host,
        sock.getsockname()[1],
        http_implementation(),
        tls.describe() if tls else "no TLS",
        "required" if api_key else "not required",
    )
    server.run(sockets=[sock])


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
        self._server, self._sock, self._listener = build_server(
            host="127.0.0.1", port=port, engine=self._engine, tls=tls
        )
        self.port: int = self._sock.getsockname()[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self._control_verify: ssl.SSLContext | bool = control_ssl or True
        self._thread = threading.Thread(target=self._run, name=f"engine-stub-{self.port}")
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> StubServer:
        """Start serving; returns once the server accepts connections."""
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"engine stub did not start: {self._error!r}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop serving and wait for the thread (idempotent)."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=STARTUP_TIMEOUT_S)
        self._sock.close()

    def end_outage(self) -> None:
        """Accept connections again now (the control API is unreachable while refusing)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._listener.reopen_now)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by start(); a thread must not die loudly
            self._error = exc

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._server.serve(sockets=[self._sock])

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
        """Call the control API; the decoded JSON answer (raises on non-2xx)."""
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
