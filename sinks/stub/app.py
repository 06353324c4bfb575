"""The engine stub's HTTP face: Starlette routes for the engine endpoints and the control API.

Guarantees: every answer is JSON, errors included (unknown path or a control
path asked with another method: 404 ``not_found``; an engine path asked with
anything but POST: 405; a body over :data:`MAX_BODY_BYTES`: 413; a control
request that makes no sense: 400 naming the problem). An engine request waits
the configured latency, then :class:`~sinks.stub.engine.StubEngine` answers
it; a request whose client gave up meanwhile is still applied. A control
request that opens an outage window is answered only once the listening
socket and the idle keep-alive connections are closed.

Control API (JSON; never behind the API key)::

    GET    /healthz                       {"status": "ok"}
    GET    /_stub/applied                 ?user_id= &path= &event_id= &since=<seq> &limit=
    GET    /_stub/stats                   counters: applied, duplicates, rejected, by status ...
    GET    /_stub/requests                requests received per Idempotency-Key (any answer)
    POST   /_stub/reset                   forget applied events, keys, users, counters
    GET    /_stub/faults                  active faults
    POST   /_stub/faults                  add a fault instruction (object or list of objects):
                                          rules, latency_ms, refuse_connections_s,
                                          rate_limit (429 + Retry-After), drip,
                                          path_latency_ms (one route slow),
                                          reset_after_response (RST idle keep-alives)
    DELETE /_stub/faults                  clear rules and latency
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol
from urllib.parse import parse_qs

from starlette.routing import Route, Router
from starlette.types import Receive, Scope, Send

from sinks.stub.engine import StubEngine
from sinks.stub.faults import (
    ENGINE_PATHS,
    FAULT_KEYS,
    Drip,
    Reply,
    control_values,
    fault_instructions,
    json_reply,
    parse_drip,
    parse_fault_rule,
    parse_path_latency,
    parse_rate_limit,
    parse_reset_after_response,
    rule_part,
)

#: Request bodies above this are refused with 413: catalog payloads are < 1 KiB.
MAX_BODY_BYTES = 1 << 20


class Listener(Protocol):
    """What the control API asks of the listening socket (:class:`sinks.stub.server.Listener`)."""

    @property
    def refusing(self) -> bool: ...

    def refuse_for(self, window_s: float) -> None: ...

    def reopen_now(self) -> None: ...

    async def closed(self) -> None: ...


class Connections(Protocol):
    """What the engine endpoints ask of the open connections
    (:class:`sinks.stub.connections.Connections`): reset one after an answer."""

    resets: int

    def reset_when_idle(self, client: object, delay_s: float) -> None: ...


#: A control handler: the query and the body -> the reply (ValueError: 400).
ControlHandler = Callable[[Mapping[str, str], bytes], Reply]


async def _send_reply(send: Send, reply: Reply, drip: Drip | None = None) -> None:
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
    if drip is None:
        await send({"type": "http.response.body", "body": reply.body})
        return
    body, step = reply.body, drip.bytes_per_write
    for start in range(0, len(body), step):
        await asyncio.sleep(drip.interval_s)
        more = start + step < len(body)
        await send(
            {"type": "http.response.body", "body": body[start : start + step], "more_body": more}
        )


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


def _query(scope: Scope) -> dict[str, str]:
    raw: bytes = scope.get("query_string", b"")
    return {k: v[-1] for k, v in parse_qs(raw.decode("latin-1")).items()}


class _Endpoint:
    """One route's ASGI endpoint: the body read (413 above the bound), then ``answer``.

    A class, not a function, so Starlette's ``Route`` hands it the raw ASGI call
    (no request or response objects on the engine's hot path) for every method:
    the method is checked here, so a wrong one still answers JSON.
    """

    def __init__(
        self,
        answer: Callable[[Scope, bytes], Awaitable[Reply]],
        drip: Callable[[], Drip | None] = lambda: None,
        after: Callable[[Scope], None] = lambda _scope: None,
    ) -> None:
        self._answer = answer
        self._drip = drip
        self._after = after

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_body(receive)
        if body is None:
            reply = json_reply(413, {"error": "body_too_large"})
        else:
            reply = await self._answer(scope, body)
        await _send_reply(send, reply, self._drip())
        self._after(scope)


class StubApp:
    """The engine endpoints and the ``/_stub`` control API over one :class:`StubEngine`."""

    def __init__(self, *, engine: StubEngine) -> None:
        self.engine = engine
        #: the listener an outage closes (set by the server that serves this app)
        self.listener: Listener | None = None
        #: the open connections, for reset_after_response (set by the server too)
        self.connections: Connections | None = None
        self._control: dict[tuple[str, str], ControlHandler] = {
            ("GET", "/healthz"): lambda _q, _b: json_reply(200, {"status": "ok"}),
            ("GET", "/_stub/applied"): self._get_applied,
            ("GET", "/_stub/stats"): self._get_stats,
            ("GET", "/_stub/requests"): self._get_requests,
            ("POST", "/_stub/reset"): self._post_reset,
            ("GET", "/_stub/faults"): self._get_faults,
            ("POST", "/_stub/faults"): self._post_faults,
            ("DELETE", "/_stub/faults"): self._delete_faults,
        }
        engine_call = _Endpoint(self._engine_call, engine.faults.dripping, self._answered)
        control_call = _Endpoint(self._control_call)
        routes = [Route(path, engine_call) for path in sorted(ENGINE_PATHS)]
        routes += [Route(path, control_call) for path in sorted({p for _, p in self._control})]
        #: the ASGI application uvicorn serves: Starlette's router, no middleware
        self.asgi = Router(routes=routes, redirect_slashes=False, default=_Endpoint(_not_found))

    async def _engine_call(self, scope: Scope, body: bytes) -> Reply:
        if scope["method"] != "POST":
            return json_reply(405, {"error": "method_not_allowed"})
        latency_ms = self.engine.faults.latency_for(scope["path"])
        if latency_ms > 0:
            await asyncio.sleep(latency_ms / 1000)
        return self.engine.handle(scope["path"], dict(scope["headers"]), body)

    def _answered(self, scope: Scope) -> None:
        """An engine answer was sent: reset its connection later, if asked to."""
        mode = self.engine.faults.resetting()
        if mode is not None and self.connections is not None:
            self.connections.reset_when_idle(scope.get("client"), mode.delay_s)

    async def _control_call(self, scope: Scope, body: bytes) -> Reply:
        handler = self._control.get((scope["method"], scope["path"]))
        if handler is None:
            return await _not_found(scope, body)
        try:
            reply = handler(_query(scope), body)
        except ValueError as exc:
            return json_reply(400, {"error": str(exc)})
        if self.listener is not None:
            # connections an outage closes are really closed before the caller hears it began
            await self.listener.closed()
        else:
            await asyncio.sleep(0)
        return reply

    def _get_applied(self, query: Mapping[str, str], _body: bytes) -> Reply:
        return json_reply(200, self.engine.applied_view(query))

    def _get_stats(self, _query: Mapping[str, str], _body: bytes) -> Reply:
        stats = self.engine.stats_view()
        stats["refusing_connections"] = self.listener is not None and self.listener.refusing
        stats["connections_reset"] = self.connections.resets if self.connections else 0
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
        instructions = fault_instructions(body)
        rules = [parse_fault_rule(rule_part(i)) for i in instructions if set(i) & FAULT_KEYS]
        latency_ms, outage_s = control_values(instructions)
        limiters = [parse_rate_limit(i["rate_limit"]) for i in instructions if "rate_limit" in i]
        drips = [parse_drip(i["drip"]) for i in instructions if "drip" in i]
        slow = [
            parse_path_latency(i["path_latency_ms"]) for i in instructions if "path_latency_ms" in i
        ]
        resets = [
            parse_reset_after_response(i["reset_after_response"])
            for i in instructions
            if "reset_after_response" in i
        ]
        if outage_s is not None and self.listener is None:
            raise ValueError("this stub has no listener to close")
        if limiters:
            self.engine.faults.limiter = limiters[-1]
        if drips:
            self.engine.faults.drip = drips[-1]
        for value in slow:
            self.engine.faults.set_path_latency(value)
        if resets:
            self.engine.faults.reset_after_response = resets[-1]
        self.engine.faults.rules.extend(rules)
        if latency_ms is not None:
            self.engine.faults.latency_ms = latency_ms
        if outage_s is not None and self.listener is not None:
            self.listener.refuse_for(outage_s)
        return json_reply(200, self.engine.faults.describe())


async def _not_found(scope: Scope, _body: bytes) -> Reply:
    return json_reply(404, {"error": "not_found", "path": scope["path"]})
