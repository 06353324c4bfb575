"""What the engine stub knows: applied events, idempotency keys, users, counters - its rules.

Guarantees, as the real engine's contract (DESIGN "Engine API"):

- ``POST /api/internal/users/sync`` and ``/api/internal/quiz-attempts/sync``
  apply an event at most once per ``Idempotency-Key``: a key already applied
  answers ``200 {"status":"duplicate"}`` and changes nothing (counted; a reused
  key with another path or body is also counted as a conflict).
- A quiz attempt whose user was never synced answers
  ``404 {"error":"user_not_found"}`` and is not applied (its key stays free).
- With an API key configured, a request without the right ``x-api-key`` gets
  401 before anything else. A request without ``Idempotency-Key`` gets 400.
- With a rate limit set (``faults.limiter``, a token bucket), a request over
  it gets 429 + ``Retry-After`` and is neither applied nor matched to rules.
- Everything applied is recorded in order, per path, with event id, body (parsed,
  and ``body_text``: the bytes as received), time and the request's W3C trace
  headers (``trace``: ``traceparent``/``tracestate``).

Pure: no I/O; used from the server's event loop only (not thread-safe).
"""

from __future__ import annotations

import hmac
import json
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sinks.shared.routes import QUIZ_ATTEMPTS_SYNC_PATH, USERS_SYNC_PATH
from sinks.stub.faults import Faults, Reply, json_reply, throttled_reply


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
        limiter = self.faults.limiter
        if limiter is not None:
            wait_s = limiter.take()
            if wait_s is not None:
                return throttled_reply(wait_s)
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
                "body_text": body.decode("utf-8", "replace"),  # as received, byte for byte
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
