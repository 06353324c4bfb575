"""Fault injection of the engine stub (pure): rules, their JSON form, the replies they force.

Guarantees: an instruction is validated whole before anything changes (an
unknown key, a status outside 100-599, a malformed header map raise
``ValueError`` naming the problem); the most specific matching rule answers
(an event-id rule, then a path rule, then a catch-all; the first added wins a
tie); a rule used up is removed.

Three modes shape every engine request rather than chosen ones:

- ``rate_limit`` (:class:`TokenBucket`): ``{"rate_per_s": r, "burst": b}``
  admits ``r`` requests a second with bursts of ``b``; a request finding the
  bucket empty is answered ``429`` with ``Retry-After`` = the seconds until
  the next token (decimal, e.g. ``0.004``; ``"retry_after_s": n`` fixes it)
  and is not applied. ``null`` switches it off.
- ``drip`` (:class:`Drip`): ``{"bytes": n, "interval_s": t, "for_s": d}``:
  for ``d`` seconds every answer's body is sent ``n`` bytes every ``t``
  seconds (the request is applied first), as an engine trickling its answers.
- ``reset_after_response`` (:class:`ResetAfterResponse`): ``{"delay_ms": m,
  "for_s": d}``: for ``d`` seconds the connection of every engine answer is
  reset (RST) ``m`` milliseconds after the answer was sent, unless another
  request came on it meanwhile - a keep-alive connection the engine (or a
  load balancer in front) drops between requests. The answer is complete
  and the request applied; only the idle connection dies.

One mode shapes one engine route (path): ``path_latency_ms``
(``{"/api/internal/quiz-attempts/sync": 5000}``) makes every request to that
path wait that long before it is processed (added to ``latency_ms``) - one
route slow past the client's read timeout while the others answer at once;
``0`` removes a path's latency, ``null`` every path's. Every other fault of
one route is a rule with a ``path`` (``{"path": ..., "status": 503,
"times": -1}``).
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sinks.shared.routes import QUIZ_ATTEMPTS_SYNC_PATH, USERS_SYNC_PATH

Headers = tuple[tuple[bytes, bytes], ...]

ENGINE_PATHS = frozenset({USERS_SYNC_PATH, QUIZ_ATTEMPTS_SYNC_PATH})


FAULT_KEYS = frozenset(
    {"path", "event_id", "statuses", "status", "times", "headers", "body", "apply"}
)


CONTROL_KEYS = frozenset(
    {
        "latency_ms",
        "refuse_connections_s",
        "rate_limit",
        "drip",
        "path_latency_ms",
        "reset_after_response",
    }
)


class TokenBucket:
    """Admits ``rate_per_s`` requests a second, ``burst`` at once; pure but for the clock."""

    def __init__(
        self,
        *,
        rate_per_s: float,
        burst: float,
        retry_after_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._tokens = burst
        self._at = clock()
        self.limited = 0  # requests answered 429

    def take(self) -> float | None:
        """``None``: admitted (one token spent); else the seconds until a token is due."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate_per_s)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return None
        self.limited += 1
        if self.retry_after_s is not None:
            return self.retry_after_s
        return (1.0 - self._tokens) / self.rate_per_s

    def describe(self) -> dict[str, object]:
        return {
            "rate_per_s": self.rate_per_s,
            "burst": self.burst,
            "retry_after_s": self.retry_after_s,
            "limited": self.limited,
        }


def throttled_reply(wait_s: float) -> Reply:
    """429 with the wait as Retry-After (milliseconds rounded up, at least 1 ms)."""
    value = f"{max(math.ceil(wait_s * 1000), 1) / 1000:.3f}".rstrip("0").rstrip(".")
    return json_reply(429, {"error": "rate_limited"}, ((b"retry-after", value.encode()),))


@dataclass(frozen=True, slots=True)
class Drip:
    """Answers trickle: ``bytes_per_write`` body bytes every ``interval_s``, until ``until``."""

    bytes_per_write: int
    interval_s: float
    until: float

    def describe(self) -> dict[str, object]:
        return {
            "bytes": self.bytes_per_write,
            "interval_s": self.interval_s,
            "remaining_s": max(0.0, self.until - time.monotonic()),
        }


@dataclass(frozen=True, slots=True)
class ResetAfterResponse:
    """Engine answers' connections are reset ``delay_s`` after the answer, until ``until``."""

    delay_s: float
    until: float

    def describe(self) -> dict[str, object]:
        return {
            "delay_ms": self.delay_s * 1000,
            "remaining_s": max(0.0, self.until - time.monotonic()),
        }


def parse_reset_after_response(value: object) -> ResetAfterResponse | None:
    """``{"delay_ms": m, "for_s": d}`` or ``None``; ValueError else."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"delay_ms", "for_s"}:
        raise ValueError('reset_after_response is {"delay_ms": m, "for_s": d}')
    delay_s = _non_negative(value["delay_ms"]) / 1000
    return ResetAfterResponse(delay_s, time.monotonic() + _non_negative(value["for_s"]))


def parse_rate_limit(value: object) -> TokenBucket | None:
    """``{"rate_per_s": r, "burst": b[, "retry_after_s": s]}`` or ``None``; ValueError else."""
    if value is None:
        return None
    if not isinstance(value, dict) or not set(value) <= {"rate_per_s", "burst", "retry_after_s"}:
        raise ValueError('rate_limit is {"rate_per_s": r, "burst": b[, "retry_after_s": s]}')
    rate = _positive(value.get("rate_per_s"))
    burst = _positive(value.get("burst", rate))
    fixed = value.get("retry_after_s")
    return TokenBucket(
        rate_per_s=rate,
        burst=max(burst, 1.0),
        retry_after_s=None if fixed is None else _non_negative(fixed),
    )


def parse_drip(value: object) -> Drip | None:
    """``{"bytes": n, "interval_s": t, "for_s": d}`` or ``None``; ValueError else."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"bytes", "interval_s", "for_s"}:
        raise ValueError('drip is {"bytes": n, "interval_s": t, "for_s": d}')
    size = value["bytes"]
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError("drip bytes must be a positive integer")
    interval_s = _non_negative(value["interval_s"])
    return Drip(size, interval_s, time.monotonic() + _non_negative(value["for_s"]))


def parse_path_latency(value: object) -> dict[str, float] | None:
    """``{"<engine path>": ms, ...}`` (``0``: that path's latency removed) or ``None``
    (every path's removed); ValueError naming the problem else."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError('path_latency_ms is {"<engine path>": milliseconds, ...} or null')
    unknown = sorted(set(value) - ENGINE_PATHS)
    if unknown:
        raise ValueError(f"path_latency_ms: {unknown} not among {sorted(ENGINE_PATHS)}")
    return {path: _non_negative(ms) for path, ms in value.items()}


def _positive(value: object) -> float:
    number = _non_negative(value)
    if number <= 0:
        raise ValueError(f"{value!r} is not a positive number")
    return number


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
    unknown = set(spec) - FAULT_KEYS
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
        self.path_latency_ms: dict[str, float] = {}  # one route slower than the others
        self.limiter: TokenBucket | None = None
        self.drip: Drip | None = None
        self.reset_after_response: ResetAfterResponse | None = None

    def resetting(self) -> ResetAfterResponse | None:
        """The reset-after-response mode, while it lasts."""
        mode = self.reset_after_response
        if mode is not None and time.monotonic() >= mode.until:
            self.reset_after_response = mode = None
        return mode

    def latency_for(self, path: str) -> float:
        """Milliseconds a request to ``path`` waits before it is processed."""
        return self.latency_ms + self.path_latency_ms.get(path, 0.0)

    def set_path_latency(self, value: dict[str, float] | None) -> None:
        """Per-path latency from :func:`parse_path_latency` (``None``: none at all)."""
        if value is None:
            self.path_latency_ms.clear()
            return
        for path, latency_ms in value.items():
            if latency_ms:
                self.path_latency_ms[path] = latency_ms
            else:
                self.path_latency_ms.pop(path, None)

    def dripping(self) -> Drip | None:
        """The drip mode, while it lasts."""
        drip = self.drip
        if drip is not None and time.monotonic() >= drip.until:
            self.drip = drip = None
        return drip

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
        """No rules, no latency (per path either), no rate limit, no drip, no resets."""
        self.rules.clear()
        self.latency_ms = 0.0
        self.path_latency_ms.clear()
        self.limiter = None
        self.drip = None
        self.reset_after_response = None

    def describe(self) -> dict[str, object]:
        """The faults as JSON."""
        described: dict[str, object] = {
            "latency_ms": self.latency_ms,
            "rules": [r.describe() for r in self.rules],
        }
        drip = self.dripping()
        if self.path_latency_ms:  # the modes are named only while on
            described["path_latency_ms"] = dict(self.path_latency_ms)
        if self.limiter is not None:
            described["rate_limit"] = self.limiter.describe()
        if drip is not None:
            described["drip"] = drip.describe()
        resetting = self.resetting()
        if resetting is not None:
            described["reset_after_response"] = resetting.describe()
        return described


def fault_instructions(body: bytes) -> list[dict[str, Any]]:
    """The body of ``POST /_stub/faults`` as a list of objects with known keys."""
    try:
        spec = json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"body is not JSON: {exc}") from exc
    instructions = spec if isinstance(spec, list) else [spec]
    if not all(isinstance(i, dict) for i in instructions):
        raise ValueError("a fault instruction is a JSON object (or a list of them)")
    for instruction in instructions:
        unknown = set(instruction) - FAULT_KEYS - CONTROL_KEYS
        if unknown:
            raise ValueError(f"unknown fault keys: {sorted(unknown)}")
    return instructions


def control_values(instructions: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """``latency_ms`` and ``refuse_connections_s`` asked for (the last one wins), validated."""
    latency_ms: float | None = None
    outage_s: float | None = None
    for instruction in instructions:
        if "latency_ms" in instruction:
            latency_ms = _non_negative(instruction["latency_ms"])
        if "refuse_connections_s" in instruction:
            outage_s = _non_negative(instruction["refuse_connections_s"])
    return latency_ms, outage_s


def rule_part(instruction: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in instruction.items() if k in FAULT_KEYS}


def _non_negative(value: object) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{value!r} is not a non-negative number")
    return float(value)
