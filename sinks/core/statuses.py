"""What an engine response means: every HTTP status to one outcome. Pure.

Guarantees:

- :func:`classify` maps every HTTP status to exactly one :class:`OutcomeKind`;
  only a 4xx other than 401/403/407/408/429 blames the record (spends an attempt),
  so an engine that is down, overloaded, misconfigured or unauthorised never
  gets a record parked. Statuses outside 2xx/4xx (1xx, 3xx, 5xx) are engine-wide.
  401/403/407 and 3xx are :attr:`OutcomeKind.MISCONFIGURED` (an
  :class:`~sinks.core.errors.EngineMisconfigured` whose reason names the setting
  to fix): waiting does not help, a person does.
- :func:`parse_retry_after` reads a ``Retry-After`` (delta-seconds or HTTP-date),
  capped at :data:`RETRY_AFTER_MAX_S`.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC
from email.utils import parsedate_to_datetime
from enum import Enum

from sinks.core.errors import (
    EngineMisconfigured,
    EngineRejected,
    EngineUnavailable,
    SinkError,
    UserNotFound,
)

#: A Retry-After beyond an hour is read as an hour: a typo or a hostile value
#: must not silence the sink for days; an hour still honours real maintenance.
RETRY_AFTER_MAX_S = 3600.0
#: Response bytes kept for ``last_error``: enough for a JSON error object,
#: small enough for a log line and a table column.
BODY_EXCERPT_BYTES = 200
#: 4xx that say nothing about the record: the engine times out, sheds load or
#: does not accept our API key - trouble shared by every record.
ENGINE_WIDE_4XX = frozenset({401, 403, 407, 408, 429})
#: Statuses only a changed setting (or key) fixes: the engine's authentication,
#: and a forwarding proxy's (407; the engine never sends it).
AUTH_FAILURES = frozenset({401, 403, 407})
#: A Location header is quoted in a reason up to this many characters.
LOCATION_EXCERPT_CHARS = 200

_DELTA_SECONDS = re.compile(r"\d+(\.\d+)?")


class OutcomeKind(Enum):
    """What one engine response means for the record that was sent."""

    DELIVERED = "delivered"  # 2xx: applied now or earlier (duplicate); the record is done
    UNAVAILABLE = "unavailable"  # engine-wide trouble: pause and probe, spend no attempt
    MISCONFIGURED = "misconfigured"  # 401/403/3xx: engine-wide, and a setting must change
    REJECTED = "rejected"  # a healthy engine refused this record: spend an attempt
    USER_NOT_FOUND = "user_not_found"  # quiz attempt before its user: sync the user, retry


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """A classified engine response; :meth:`error` turns a failure into its exception."""

    kind: OutcomeKind
    status: int
    reason: str
    retry_after_s: float | None = None
    body_excerpt: str = ""

    @property
    def delivered(self) -> bool:
        """True for a 2xx."""
        return self.kind is OutcomeKind.DELIVERED

    def error(self, *, user_id: str | None = None) -> SinkError | None:
        """The exception this outcome stands for; ``None`` when delivered.

        ``user_id`` names the user of a :class:`~sinks.core.errors.UserNotFound`.
        """
        if self.kind is OutcomeKind.MISCONFIGURED:
            return EngineMisconfigured(self.reason, status=self.status)
        if self.kind is OutcomeKind.UNAVAILABLE:
            return EngineUnavailable(
                self.reason,
                status=self.status,
                retry_after_s=self.retry_after_s,
                shared=self.retry_after_s is not None,  # the engine asks everyone to wait
            )
        if self.kind is OutcomeKind.REJECTED:
            return EngineRejected(self.reason, status=self.status, body_excerpt=self.body_excerpt)
        if self.kind is OutcomeKind.USER_NOT_FOUND:
            return UserNotFound(self.reason, user_id=user_id, body_excerpt=self.body_excerpt)
        return None


def classify(
    status: int, body: bytes, headers: Mapping[str, str], *, now_s: float | None = None
) -> Outcome:
    """Classify one engine response (``now_s`` dates an HTTP-date ``Retry-After``)."""
    if 200 <= status < 300:
        return Outcome(kind=OutcomeKind.DELIVERED, status=status, reason=f"HTTP {status}")
    excerpt = body_excerpt(body)
    if status == 404 and _is_user_not_found(body):
        return Outcome(
            kind=OutcomeKind.USER_NOT_FOUND,
            status=status,
            reason="HTTP 404 user_not_found",
            body_excerpt=excerpt,
        )
    if 400 <= status < 500 and status not in ENGINE_WIDE_4XX:
        return Outcome(
            kind=OutcomeKind.REJECTED,
            status=status,
            reason=f"HTTP {status}: {excerpt}" if excerpt else f"HTTP {status}",
            body_excerpt=excerpt,
        )
    if status in AUTH_FAILURES or 300 <= status < 400:
        return Outcome(
            kind=OutcomeKind.MISCONFIGURED,
            status=status,
            reason=_misconfigured_reason(status, _header(headers, "location")),
            body_excerpt=excerpt,
        )
    retry_after_s = parse_retry_after(_header(headers, "retry-after"), now_s=now_s)
    return Outcome(
        kind=OutcomeKind.UNAVAILABLE,
        status=status,
        reason=_unavailable_reason(status, excerpt),
        retry_after_s=retry_after_s,
        body_excerpt=excerpt,
    )


def parse_retry_after(value: str | None, *, now_s: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` value (delta-seconds or HTTP-date).

    ``None`` when absent or unparseable; a date in the past is 0; the result
    is capped at :data:`RETRY_AFTER_MAX_S`.
    """
    if value is None or not value.strip():
        return None
    text = value.strip()
    if _DELTA_SECONDS.fullmatch(text):
        return min(float(text), RETRY_AFTER_MAX_S)
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    now = time.time() if now_s is None else now_s
    return min(max(0.0, when.timestamp() - now), RETRY_AFTER_MAX_S)


def body_excerpt(body: bytes) -> str:
    """The start of a response body as text, for logs and ``last_error``."""
    text = body[:BODY_EXCERPT_BYTES].decode("utf-8", errors="replace").strip()
    return text + "..." if len(body) > BODY_EXCERPT_BYTES else text


def _is_user_not_found(body: bytes) -> bool:
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, ValueError):
        return False
    return isinstance(value, dict) and value.get("error") == "user_not_found"


def _unavailable_reason(status: int, excerpt: str) -> str:
    return f"HTTP {status}: {excerpt}" if excerpt else f"HTTP {status}"


def _misconfigured_reason(status: int, location: str | None) -> str:
    """What a person must fix for a 401, 403 or 3xx (the key itself is never quoted)."""
    if status == 401:
        return (
            "HTTP 401: the engine refuses our API key: set INTERNAL_API_KEY to the key "
            "the engine expects"
        )
    if status == 407:
        return (
            "HTTP 407: the proxy wants credentials: put them in HTTP_PROXY/HTTPS_PROXY "
            "(http://user:password@proxy:port)"
        )
    if status == 403:
        return (
            "HTTP 403: the engine forbids this client: check INTERNAL_API_KEY and, with "
            "mTLS, the client certificate (ENGINE_CLIENT_CERT)"
        )
    target = (location or "").strip()[:LOCATION_EXCERPT_CHARS]
    where = f" to {target}" if target else ""
    return (
        f"HTTP {status}: the engine redirects{where}; redirects are not followed: "
        "set ENGINE_BASE_URL to the engine's real address"
    )


def _header(headers: Mapping[str, str], name: str) -> str | None:
    """Case-insensitive header lookup that also works on a plain ``dict``."""
    value = headers.get(name)
    if value is not None:
        return value
    for key, item in headers.items():
        if key.lower() == name:
            return item
    return None
