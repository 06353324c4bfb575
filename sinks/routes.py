"""Routing: the Kafka ``type`` header and payload -> the engine call. Pure.

Guarantees: every event type of the catalog maps to exactly one engine path;
anything else - an unknown type, a payload that is not a JSON object, a
missing or empty ``user_id`` - raises :class:`~sinks.errors.Unroutable` with a
reason, so the record is parked, never dropped and never sent half-formed.

=====================  =================================  ==============================
type header            engine path                        body
=====================  =================================  ==============================
UserRegistered         /api/internal/users/sync           ``{"user_id": payload.user_id}``
QuizAttemptSubmitted   /api/internal/quiz-attempts/sync   the payload (with ``user_id``)
=====================  =================================  ==============================
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sinks.delivery import Envelope
from sinks.errors import Unroutable

USERS_SYNC_PATH = "/api/internal/users/sync"
QUIZ_ATTEMPTS_SYNC_PATH = "/api/internal/quiz-attempts/sync"
EVENT_USER_REGISTERED = "UserRegistered"
EVENT_QUIZ_ATTEMPT_SUBMITTED = "QuizAttemptSubmitted"

#: Namespace of the idempotency keys the sink derives for user syncs it makes
#: on its own (a quiz attempt answered ``user_not_found``); fixed forever so a
#: redelivered attempt derives the same key.
_DERIVED_KEY_NAMESPACE = uuid.UUID("6f1d3c9e-2a4b-5c8d-9e0f-a1b2c3d4e5f6")


class SyncType(StrEnum):
    """The parking lot's ``event_type``: which engine sync a record stands for."""

    USER_SYNC = "USER_SYNC"  # a user made known to the engine
    QUIZ_SYNC = "QUIZ_SYNC"  # a quiz attempt scored by the engine


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineCall:
    """One POST to the engine: ``path`` under the base URL, JSON ``body``."""

    path: str
    body: dict[str, Any]
    sync_type: SyncType

    @property
    def user_id(self) -> str | None:
        """The user the call is about (every catalog body carries one)."""
        value = self.body.get("user_id")
        return value if isinstance(value, str) else None


def route(event_type: str, payload: bytes | None) -> EngineCall:
    """The engine call for one record; :class:`Unroutable` with the reason otherwise."""
    builder = _ROUTES.get(event_type)
    if builder is None:
        raise Unroutable(f"no route for event type {event_type!r}")
    return builder(_payload_object(event_type, payload))


def sync_type_for(event_type: str) -> SyncType | None:
    """The parking lot's ``event_type`` of a catalog event type, ``None`` when unknown."""
    return _SYNC_TYPES.get(event_type)


def user_sync_call(user_id: str) -> EngineCall:
    """The ``users/sync`` call for ``user_id`` (what a ``UserRegistered`` routes to)."""
    if not user_id:
        raise Unroutable("empty user_id")
    return EngineCall(path=USERS_SYNC_PATH, body={"user_id": user_id}, sync_type=SyncType.USER_SYNC)


def route_envelope(envelope: Envelope) -> EngineCall:
    """The engine call for a Kafka record; :class:`Unroutable` also when it has no usable id.

    The ``id`` header is the idempotency key: without one (or with one that is
    not printable ASCII, so not an HTTP header value) the record cannot be
    delivered safely and is parked.
    """
    event_id = envelope.event_id
    if not event_id:
        raise Unroutable(f"record {envelope.position} has no 'id' header (idempotency key)")
    if not (event_id.isascii() and event_id.isprintable()):
        raise Unroutable(f"record {envelope.position} has an 'id' header unfit for HTTP")
    return route(envelope.event_type, envelope.value)


def derived_user_sync_key(event_id: str) -> str:
    """Idempotency key for a user sync the sink makes because of event ``event_id``.

    Distinct from ``event_id`` (which stays the key of the quiz attempt itself),
    and the same on every redelivery of that event.
    """
    return str(uuid.uuid5(_DERIVED_KEY_NAMESPACE, f"user-sync:{event_id}"))


def _payload_object(event_type: str, payload: bytes | None) -> dict[str, Any]:
    if payload is None:
        raise Unroutable(f"{event_type}: no payload (tombstone record)")
    try:
        value = json.loads(payload, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise Unroutable(f"{event_type}: payload is not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise Unroutable(f"{event_type}: payload is a JSON {type(value).__name__}, not an object")
    return value


def _reject_constant(name: str) -> Any:
    """``NaN`` and ``Infinity`` parse in Python but are not JSON: the engine would refuse them."""
    raise ValueError(f"{name} is not JSON")


def _required_user_id(event_type: str, body: dict[str, Any]) -> str:
    user_id = body.get("user_id")
    if not isinstance(user_id, str) or not user_id:
        raise Unroutable(f"{event_type}: payload has no user_id string")
    return user_id


def _user_registered(body: dict[str, Any]) -> EngineCall:
    return user_sync_call(_required_user_id(EVENT_USER_REGISTERED, body))


def _quiz_attempt_submitted(body: dict[str, Any]) -> EngineCall:
    _required_user_id(EVENT_QUIZ_ATTEMPT_SUBMITTED, body)
    return EngineCall(path=QUIZ_ATTEMPTS_SYNC_PATH, body=body, sync_type=SyncType.QUIZ_SYNC)


_ROUTES: dict[str, Callable[[dict[str, Any]], EngineCall]] = {
    EVENT_USER_REGISTERED: _user_registered,
    EVENT_QUIZ_ATTEMPT_SUBMITTED: _quiz_attempt_submitted,
}
_SYNC_TYPES: dict[str, SyncType] = {
    EVENT_USER_REGISTERED: SyncType.USER_SYNC,
    EVENT_QUIZ_ATTEMPT_SUBMITTED: SyncType.QUIZ_SYNC,
}
