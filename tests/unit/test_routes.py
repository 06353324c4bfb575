"""Routing on the ``type`` header: catalog events map to engine calls, the rest is Unroutable."""

from __future__ import annotations

import json

import pytest

from cdc.errors import ConfigError
from sinks.core.delivery import Envelope
from sinks.core.errors import Unroutable
from sinks.shared.routes import (
    QUIZ_ATTEMPTS_SYNC_PATH,
    USERS_SYNC_PATH,
    Routing,
    SyncType,
    derived_user_sync_key,
    route,
    route_envelope,
    sync_type_for,
)

USER = {
    "user_id": "7b0c6f1e-0000-4000-8000-000000000001",
    "email": "a@example.org",
    "display_name": "A",
    "registered_at": "2025-01-01T00:00:00Z",
}
ATTEMPT = {
    "attempt_id": "a1",
    "user_id": USER["user_id"],
    "quiz_id": "q1",
    "score": 7,
    "submitted_at": "2025-01-01T00:01:00Z",
}


def _bytes(value: object) -> bytes:
    return json.dumps(value).encode()


def test_user_registered_routes_to_users_sync_with_only_the_user_id() -> None:
    call = route("UserRegistered", _bytes(USER))
    assert call.path == USERS_SYNC_PATH
    assert call.body == {"user_id": USER["user_id"]}
    assert call.sync_type is SyncType.USER_SYNC
    assert call.sync_type == "USER_SYNC"
    assert call.user_id == USER["user_id"]


def test_quiz_attempt_routes_to_quiz_attempts_sync_with_the_whole_payload() -> None:
    call = route("QuizAttemptSubmitted", _bytes(ATTEMPT))
    assert call.path == QUIZ_ATTEMPTS_SYNC_PATH
    assert call.body == ATTEMPT
    assert call.sync_type == "QUIZ_SYNC"


def test_unknown_event_type_is_unroutable_and_names_the_type() -> None:
    with pytest.raises(Unroutable, match="no route for event type 'OrderPlaced'") as info:
        route("OrderPlaced", _bytes(USER))
    assert info.value.retriable is False


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[1, 2]", "JSON list, not an object"),
        (b'"text"', "JSON str, not an object"),
        (b"{}", "no user_id string"),
        (b'{"user_id": ""}', "no user_id string"),
        (b'{"user_id": 42}', "no user_id string"),
        (b'{"user_id": "u", "score": NaN}', "not valid JSON"),
        (None, "tombstone"),
    ],
)
def test_malformed_payload_is_unroutable_with_the_reason(
    payload: bytes | None, reason: str
) -> None:
    for event_type in ("UserRegistered", "QuizAttemptSubmitted"):
        with pytest.raises(Unroutable, match=reason):
            route(event_type, payload)


def test_sync_type_for_known_types_and_none_for_unknown() -> None:
    assert sync_type_for("UserRegistered") is SyncType.USER_SYNC
    assert sync_type_for("QuizAttemptSubmitted") is SyncType.QUIZ_SYNC
    assert sync_type_for("Other") is None


def _envelope(headers: dict[str, bytes], value: bytes | None = None) -> Envelope:
    return Envelope(
        topic="outbox.event.user",
        partition=0,
        offset=5,
        key=b"k",
        value=_bytes(USER) if value is None else value,
        headers=headers,
    )


EVENT_ID = b"0b8f3a52-52a4-4b8e-9d0c-6f1e2a3b4c5d"


def test_route_envelope_uses_the_type_header_and_value() -> None:
    call = route_envelope(_envelope({"id": EVENT_ID, "type": b"UserRegistered"}))
    assert call.body == {"user_id": USER["user_id"]}


def test_record_without_id_header_is_unroutable_because_it_has_no_idempotency_key() -> None:
    with pytest.raises(Unroutable, match="no 'id' header"):
        route_envelope(_envelope({"type": b"UserRegistered"}))


def test_record_whose_id_is_not_ascii_is_unroutable() -> None:
    with pytest.raises(Unroutable, match="unfit for HTTP"):
        route_envelope(_envelope({"id": "é".encode(), "type": b"UserRegistered"}))


def test_record_without_type_header_is_unroutable() -> None:
    with pytest.raises(Unroutable, match="no route for event type ''"):
        route_envelope(_envelope({"id": EVENT_ID}))


@pytest.mark.parametrize("event_id", [b"e-1", b"1", b"0b8f3a52-52a4-4b8e-9d0c", b"not-a-uuid!" * 9])
def test_record_whose_id_is_not_a_uuid_is_unroutable_it_is_no_outbox_event(
    event_id: bytes,
) -> None:
    with pytest.raises(Unroutable, match="id is not a uuid"):
        route_envelope(_envelope({"id": event_id, "type": b"UserRegistered"}))


def test_derived_user_sync_key_is_stable_and_differs_from_the_event_id() -> None:
    key = derived_user_sync_key("e-1")
    assert key == derived_user_sync_key("e-1")
    assert key != "e-1"
    assert key != derived_user_sync_key("e-2")


# --- Routing: configured routes and ignored types -------------------------------


def test_configured_routes_put_more_types_onto_the_engines_calls() -> None:
    routing = Routing.from_config(routes="UserEmailChanged=USER_SYNC, Retake=quiz_sync")
    call = routing.route("UserEmailChanged", _bytes(USER))
    assert call.path == USERS_SYNC_PATH
    assert call.body == {"user_id": USER["user_id"]}
    assert routing.route("Retake", _bytes(ATTEMPT)).path == QUIZ_ATTEMPTS_SYNC_PATH
    assert routing.sync_type_for("Retake") is SyncType.QUIZ_SYNC
    assert routing.route("UserRegistered", _bytes(USER)).path == USERS_SYNC_PATH
    with pytest.raises(Unroutable):
        Routing().route("UserEmailChanged", _bytes(USER))


@pytest.mark.parametrize(
    ("routes", "message"),
    [
        ("UserEmailChanged", "expected Type=USER_SYNC"),
        ("UserEmailChanged=ORDER_SYNC", "expected Type=USER_SYNC"),
        ("=USER_SYNC", "expected Type=USER_SYNC"),
        ("UserRegistered=QUIZ_SYNC", "cannot re-route catalog event types"),
    ],
)
def test_a_bad_route_setting_is_a_config_error_naming_it(routes: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Routing.from_config(routes=routes)


def test_ignored_types_match_globs_and_optional_topics() -> None:
    routing = Routing.from_config(ignored_types="UserEmailChanged, Audit*, outbox.event.report:*")
    assert routing.is_ignored("outbox.event.user", "UserEmailChanged")
    assert routing.is_ignored("outbox.event.user", "AuditTrailWritten")
    assert routing.is_ignored("outbox.event.report", "AnythingAtAll")
    assert not routing.is_ignored("outbox.event.user", "AnythingAtAll")
    assert not routing.is_ignored("outbox.event.user", "UserRegistered")
    assert [str(r) for r in routing.ignored] == [
        "UserEmailChanged",
        "Audit*",
        "outbox.event.report:*",
    ]


def test_an_ignore_pattern_that_would_skip_a_routed_type_is_refused() -> None:
    with pytest.raises(ConfigError, match="would skip routed types \\['QuizAttemptSubmitted'\\]"):
        Routing.from_config(ignored_types="Quiz*")
    with pytest.raises(ConfigError, match="would skip routed types \\['Extra'\\]"):
        Routing.from_config(routes="Extra=USER_SYNC", ignored_types="Ex*")
    scoped = Routing.from_config(ignored_types="outbox.event.audit:*")  # taken as meant
    assert scoped.is_ignored("outbox.event.audit", "UserRegistered")
    with pytest.raises(ConfigError, match="expected type or topic:type"):
        Routing.from_config(ignored_types="outbox.event.x:")


def test_the_fingerprint_changes_exactly_with_the_routing() -> None:
    base = Routing().fingerprint
    assert Routing.from_config().fingerprint == base
    assert Routing.from_config(ignored_types="A, B").fingerprint == (
        Routing.from_config(ignored_types="B,A").fingerprint
    )
    assert Routing.from_config(ignored_types="A").fingerprint != base
    assert Routing.from_config(routes="A=USER_SYNC").fingerprint != base
    assert Routing.from_config(routes="A=USER_SYNC").fingerprint != (
        Routing.from_config(routes="A=QUIZ_SYNC").fingerprint
    )
