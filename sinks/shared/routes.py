"""Routing: the Kafka ``type`` header and payload -> the engine call, or a skip. Pure.

Guarantees: every event type of the catalog maps to exactly one engine path;
anything else - an unknown type, a payload that is not a JSON object, a
missing or empty ``user_id`` - raises :class:`~sinks.core.errors.Unroutable` with a
reason, so the record is parked, never dropped and never sent half-formed.

=====================  =================================  ==============================
type header            engine path                        body
=====================  =================================  ==============================
UserRegistered         /api/internal/users/sync           ``{"user_id": payload.user_id}``
QuizAttemptSubmitted   /api/internal/quiz-attempts/sync   the payload (with ``user_id``)
=====================  =================================  ==============================

:class:`Routing` adds the operator's configuration to the catalog:

* ``SINK_ROUTES`` (``Type=USER_SYNC,Other=QUIZ_SYNC``) routes more event types
  onto one of the engine's two calls (a catalog type cannot be re-routed);
* ``SINK_IGNORED_TYPES`` (``UserEmailChanged,Audit*,outbox.event.report:*``)
  names types the sink deliberately skips - ``fnmatch`` globs, optionally
  ``topic-glob:type-glob``; a pattern for every topic that would skip a
  routed type is refused (one scoped to topics is taken as meant);
* :attr:`Routing.fingerprint` changes whenever either does, so the parking
  lot's scheduler knows when an ``UNROUTABLE`` row deserves another try.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from fnmatch import fnmatchcase
from typing import Any

import orjson

from cdc.errors import ConfigError
from cdc.jsontext import TOO_DEEP, object_members, too_deep
from cdc.settings import Settings
from sinks.core.delivery import Envelope
from sinks.core.errors import Unroutable

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
    #: The bytes to send: the payload's own JSON text, exactly as Kafka held it (the
    #: relay's pass-through rule: never re-encoded); None: ``body`` encoded.
    content: bytes | None = None

    @property
    def user_id(self) -> str | None:
        """The user the call is about (every catalog body carries one)."""
        value = self.body.get("user_id")
        return value if isinstance(value, str) else None


def route(event_type: str, payload: bytes | None) -> EngineCall:
    """The catalog's engine call for one record (:meth:`Routing.route`)."""
    return CATALOG.route(event_type, payload)


def sync_type_for(event_type: str) -> SyncType | None:
    """The parking lot's ``event_type`` of a catalog event type, ``None`` when unknown."""
    return CATALOG.sync_type_for(event_type)


def user_sync_call(user_id: str) -> EngineCall:
    """The ``users/sync`` call for ``user_id`` (what a ``UserRegistered`` routes to)."""
    if not user_id:
        raise Unroutable("empty user_id")
    return EngineCall(path=USERS_SYNC_PATH, body={"user_id": user_id}, sync_type=SyncType.USER_SYNC)


def route_envelope(envelope: Envelope) -> EngineCall:
    """The catalog's engine call for a Kafka record (:meth:`Routing.route_envelope`)."""
    return CATALOG.route_envelope(envelope)


def derived_user_sync_key(event_id: str) -> str:
    """Idempotency key for a user sync the sink makes because of event ``event_id``.

    Distinct from ``event_id`` (which stays the key of the quiz attempt itself),
    and the same on every redelivery of that event.
    """
    return str(uuid.uuid5(_DERIVED_KEY_NAMESPACE, f"user-sync:{event_id}"))


def _payload_object(event_type: str, payload: bytes | None) -> dict[str, Any]:
    """The payload's members, read for routing only (what is sent is the payload's own
    text, :attr:`EngineCall.content`): one JSON object (RFC 8259, UTF-8, no NaN or
    Infinity) nested at most :data:`cdc.jsontext.MAX_DEPTH` levels - the relay's rule.
    Numbers a double cannot hold are read as their text (:func:`cdc.jsontext.object_members`),
    never refused and never rounded on the way to the engine."""
    if payload is None:
        raise Unroutable(f"{event_type}: no payload (tombstone record)")
    if too_deep(payload):
        raise Unroutable(f"{event_type}: payload {TOO_DEEP}")
    try:
        value = _loads(payload)  # one C parse for the common case
    except _JSONDecodeError:
        value = _exact_members(event_type, payload)  # what orjson declines (1e400, \ud800 ...)
    if not isinstance(value, dict):
        raise Unroutable(f"{event_type}: payload is a JSON {_json_type(value)}, not an object")
    return value


def _exact_members(event_type: str, payload: bytes) -> dict[str, Any]:
    try:
        members = object_members(payload.decode())
    except UnicodeDecodeError as exc:
        raise Unroutable(f"{event_type}: payload is not valid JSON (not UTF-8: {exc})") from exc
    except ValueError as exc:
        raise Unroutable(f"{event_type}: payload is not valid JSON ({exc})") from exc
    return {name: value for name, (value, _text) in members.items()}


def _json_type(value: Any) -> str:
    return {list: "list", str: "str", bool: "bool", type(None): "null"}.get(type(value), "number")


_loads, _JSONDecodeError = orjson.loads, orjson.JSONDecodeError


def _required_user_id(event_type: str, body: dict[str, Any]) -> str:
    user_id = body.get("user_id")
    if not isinstance(user_id, str) or not user_id:
        raise Unroutable(f"{event_type}: payload has no user_id string")
    return user_id


def _user_registered(body: dict[str, Any]) -> EngineCall:
    return user_sync_call(_required_user_id(EVENT_USER_REGISTERED, body))


def _quiz_attempt_submitted(body: dict[str, Any], content: bytes | None = None) -> EngineCall:
    _required_user_id(EVENT_QUIZ_ATTEMPT_SUBMITTED, body)
    return EngineCall(
        path=QUIZ_ATTEMPTS_SYNC_PATH, body=body, sync_type=SyncType.QUIZ_SYNC, content=content
    )


def _user_registered_call(body: dict[str, Any], _content: bytes | None = None) -> EngineCall:
    return _user_registered(body)


#: Builds an engine call from the payload's members and its own text.
_Builder = Callable[[dict[str, Any], bytes | None], EngineCall]

_ROUTES: dict[str, _Builder] = {
    EVENT_USER_REGISTERED: _user_registered_call,
    EVENT_QUIZ_ATTEMPT_SUBMITTED: _quiz_attempt_submitted,
}
_SYNC_TYPES: dict[str, SyncType] = {
    EVENT_USER_REGISTERED: SyncType.USER_SYNC,
    EVENT_QUIZ_ATTEMPT_SUBMITTED: SyncType.QUIZ_SYNC,
}


@dataclass(frozen=True, slots=True)
class IgnoreRule:
    """One ``SINK_IGNORED_TYPES`` pattern: a type glob, on topics matching a topic glob."""

    type_glob: str
    topic_glob: str = "*"

    def matches(self, topic: str, event_type: str) -> bool:
        return fnmatchcase(event_type, self.type_glob) and fnmatchcase(topic, self.topic_glob)

    def __str__(self) -> str:
        return self.type_glob if self.topic_glob == "*" else f"{self.topic_glob}:{self.type_glob}"


_BUILDERS: dict[SyncType, _Builder] = {
    SyncType.USER_SYNC: _user_registered_call,
    SyncType.QUIZ_SYNC: _quiz_attempt_submitted,
}


class Routing:
    """The catalog, the configured routes and the ignored types; see the module docstring."""

    def __init__(
        self,
        *,
        extra_routes: Mapping[str, SyncType] | None = None,
        ignored: Sequence[IgnoreRule] = (),
    ) -> None:
        extra = dict(extra_routes or {})
        clash = sorted(set(extra) & set(_ROUTES))
        if clash:
            raise ConfigError(f"SINK_ROUTES cannot re-route catalog event types: {clash}")
        self._sync_types = {**_SYNC_TYPES, **extra}
        self._routes = {t: _ROUTES.get(t) or _BUILDERS[s] for t, s in self._sync_types.items()}
        self._ignored = tuple(ignored)
        for rule in self._ignored:
            if rule.topic_glob != "*":
                continue  # scoped to topics on purpose: e.g. everything on a report topic
            hidden = sorted(t for t in self._sync_types if fnmatchcase(t, rule.type_glob))
            if hidden:
                raise ConfigError(
                    f"SINK_IGNORED_TYPES pattern {str(rule)!r} would skip routed types {hidden}"
                )

    @classmethod
    def from_config(cls, *, routes: str = "", ignored_types: str = "") -> Routing:
        """From the ``SINK_ROUTES`` and ``SINK_IGNORED_TYPES`` texts (comma-separated)."""
        return cls(extra_routes=_parse_routes(routes), ignored=_parse_ignored(ignored_types))

    @classmethod
    def from_settings(cls, settings: Settings) -> Routing:
        return cls.from_config(
            routes=settings.sink_routes, ignored_types=settings.sink_ignored_types
        )

    @property
    def routed_types(self) -> dict[str, SyncType]:
        """Every routed event type and the engine call it becomes."""
        return dict(self._sync_types)

    @property
    def ignored(self) -> tuple[IgnoreRule, ...]:
        return self._ignored

    @property
    def fingerprint(self) -> str:
        """Changes exactly when the routes or the ignored types change."""
        text = json.dumps(
            {"routes": sorted(self._sync_types.items()), "ignored": sorted(map(str, self._ignored))}
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def is_ignored(self, topic: str, event_type: str) -> bool:
        """True for a type the sink skips on ``topic`` (never a routed type)."""
        return any(rule.matches(topic, event_type) for rule in self._ignored)

    def route(self, event_type: str, payload: bytes | None) -> EngineCall:
        """The engine call for one record; :class:`Unroutable` with the reason otherwise."""
        builder = self._routes.get(event_type)
        if builder is None:
            raise Unroutable(f"no route for event type {event_type!r}")
        return builder(_payload_object(event_type, payload), payload)

    def route_envelope(self, envelope: Envelope) -> EngineCall:
        """The engine call for a Kafka record; :class:`Unroutable` also without a usable id.

        The ``id`` header is the idempotency key, read once into its canonical text
        (:attr:`Envelope.event_id`): without one that holds a uuid (missing, ``evt-1``,
        a uuid in braces or ``urn:uuid:`` - the forms :func:`cdc.records.uuid_bytes`
        refuses) the record is no outbox event and cannot be delivered safely: it is
        parked (as ``UNROUTABLE``: never sent under another key); so is a record whose
        headers could not be read at all (:attr:`Envelope.unreadable`).
        """
        if envelope.unreadable:
            raise Unroutable(f"record {envelope.position}: {envelope.unreadable}")
        if not envelope.event_id:
            raw = envelope.raw_id
            if not raw:
                raise Unroutable(f"record {envelope.position} has no 'id' header (idempotency key)")
            if not (raw.isascii() and raw.isprintable()):
                raise Unroutable(f"record {envelope.position} has an 'id' header unfit for HTTP")
            raise Unroutable(f"record {envelope.position}: id is not a uuid ({raw[:64]!r})")
        return self.route(envelope.event_type, envelope.value)

    def sync_type_for(self, event_type: str) -> SyncType | None:
        """The parking lot's ``event_type`` of a routed type, ``None`` when unknown."""
        return self._sync_types.get(event_type)


def _parse_routes(text: str) -> dict[str, SyncType]:
    routes: dict[str, SyncType] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        event_type, sep, target = item.partition("=")
        try:
            sync_type = SyncType(target.strip().upper())
        except ValueError:
            sync_type = None
        if not sep or not event_type.strip() or sync_type is None:
            raise ConfigError(
                f"SINK_ROUTES item {item!r}: expected Type=USER_SYNC or Type=QUIZ_SYNC"
            )
        routes[event_type.strip()] = sync_type
    return routes


def _parse_ignored(text: str) -> list[IgnoreRule]:
    rules = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        topic_glob, sep, type_glob = item.rpartition(":")
        if sep and not (topic_glob and type_glob):
            raise ConfigError(f"SINK_IGNORED_TYPES item {item!r}: expected type or topic:type")
        rules.append(IgnoreRule(type_glob=type_glob, topic_glob=topic_glob or "*"))
    return rules


#: The catalog alone: what every caller gets unless the sink's settings add to it.
CATALOG = Routing()
