"""Issue 47 items 1, 2 and 7: how the sink reads a record, pure (no Kafka, no engine).

* every record is classified before it is tracked, and whatever the reading raises
  (a ``RecursionError`` too) makes it bad input: parked with the reason, its offset
  settles, the partition moves on;
* one depth rule: a payload nested deeper than the relay's ``MAX_DEPTH`` is parked;
* the event id is read once into its canonical text; an ``id`` that holds no uuid
  (missing, ``evt-1``, braces, ``urn:uuid:``) is never a key: parked as unroutable;
* the quiz body is the payload's own text (numbers beyond a double, ``1e400``);
* ``user_not_found`` right after a successful user sync is the engine's: no attempt.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import httpx
import pytest

from cdc.jsontext import MAX_DEPTH, TOO_DEEP
from cdc.records import canonical_id
from sinks.core.backoff import Backoff
from sinks.core.delivery import Envelope
from sinks.core.errors import EngineUnavailable, Unroutable
from sinks.core.machine import Disposition, Park, SinkCore, Verdict
from sinks.engine.client import EngineClient
from sinks.engine.dispatch import deliver
from sinks.runtime.verdicts import classifier
from sinks.shared.routes import (
    CATALOG,
    QUIZ_ATTEMPTS_SYNC_PATH,
    USERS_SYNC_PATH,
    route,
    route_envelope,
)

USER = "7b0c6f1e-0000-4000-8000-000000000001"
EVENT = uuid.UUID("0b8f3a52-52a4-4b8e-9d0c-6f1e2a3b4c5d")


def _nested(levels: int) -> bytes:
    return b'{"user_id": "' + USER.encode() + b'", "x": ' + b"[" * levels + b"]" * levels + b"}"


def _envelope(offset: int, value: bytes, event_id: bytes | None = None) -> Envelope:
    headers = {"type": b"QuizAttemptSubmitted"}
    if event_id is not None:
        headers["id"] = event_id
    return Envelope(
        topic="quiz", partition=0, offset=offset, key=b"k", value=value, headers=headers
    )


def _core(classify: Any) -> SinkCore:
    return SinkCore(
        max_in_flight=4,
        max_buffered=100,
        inline_attempts=2,
        inline_backoff_s=0.1,
        backoff=lambda: Backoff(base_s=0.5, cap_s=2.0),
        commit_interval_s=0.0,
        classify=classify,
    )


# -- item 1: classified before tracked; any exception while reading is bad input ---------
def test_a_reading_that_raises_recursion_error_parks_the_record_and_the_partition_moves_on() -> (
    None
):
    def classify(record: Envelope) -> Verdict:
        if record.offset == 1:
            raise RecursionError("maximum recursion depth exceeded while decoding")
        return Verdict(Disposition.IGNORE, "fine")

    core = _core(classify)
    core.assign([("quiz", 0)])
    verdicts = [core.consumed(_envelope(o, b"{}"), now_ms=0) for o in range(3)]
    assert verdicts[1] is not None and verdicts[1].disposition is Disposition.PARK
    assert verdicts[1].reason.startswith("unreadable record: RecursionError: maximum recursion")
    parks = [a for a in core.actions(now=0.0) if isinstance(a, Park)]
    assert [i.record.offset for p in parks for i in p.items] == [1]
    core.parked(parks[0].items[0].record)
    assert core.committable("quiz", 0) == 3, "past the bad record and the good one after it"


def test_a_5000_level_payload_is_bad_input_never_an_exception() -> None:
    deep = _envelope(0, _nested(5_000), EVENT.bytes.hex().encode())
    with pytest.raises(Unroutable, match=TOO_DEEP):
        route_envelope(deep)
    verdict = classifier(CATALOG)(deep)
    assert verdict.disposition is Disposition.PARK and TOO_DEEP in verdict.reason


def test_the_depth_rule_is_the_relays_max_depth() -> None:
    at_limit = _nested(MAX_DEPTH - 1)  # (the payload object is one level)
    assert route("QuizAttemptSubmitted", at_limit).content == at_limit
    with pytest.raises(Unroutable, match=TOO_DEEP):
        route("QuizAttemptSubmitted", _nested(MAX_DEPTH))


# -- item 2: the event's own id, canonical, read once --------------------------------------
@pytest.mark.parametrize(
    "raw",
    [
        str(EVENT).encode(),
        str(EVENT).upper().encode(),
        EVENT.hex.encode(),
        EVENT.hex.upper().encode(),
    ],
    ids=["canonical", "upper-case", "32-hex", "32-hex-upper"],
)
def test_a_uuid_id_is_read_once_into_its_canonical_text(raw: bytes) -> None:
    payload = json.dumps({"user_id": USER}).encode()
    assert canonical_id(raw) == str(EVENT)
    assert _envelope(0, payload, raw).event_id == str(EVENT)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (None, "no 'id' header"),
        (b"", "no 'id' header"),
        (b"evt-1", "id is not a uuid"),
        (b"{" + str(EVENT).encode() + b"}", "id is not a uuid"),
        (b"urn:uuid:" + str(EVENT).encode(), "id is not a uuid"),
        (b"\xff\xfe", "unfit for HTTP"),
    ],
    ids=["missing", "empty", "evt-1", "braces", "urn", "not-utf8"],
)
def test_an_id_that_holds_no_uuid_is_no_key_the_record_is_parked(
    raw: bytes | None, reason: str
) -> None:
    record = _envelope(0, json.dumps({"user_id": USER}).encode(), raw)
    assert record.event_id == ""
    with pytest.raises(Unroutable, match=reason):
        route_envelope(record)
    assert classifier(CATALOG)(record).disposition is Disposition.PARK


# -- item 7: the quiz body is the payload's own text ----------------------------------------
@pytest.mark.parametrize(
    "payload",
    [
        b'{"user_id": "%s", "score": 12345678901234567890.5}',
        b'{"user_id": "%s", "score": 1e400}',
        b'{"user_id": "%s", "n": 123456789012345678901234567890, "x": 0.10000000000000000000001}',
        b'{ "user_id" : "%s" ,\n "note": "\\ud800 kept as written" }',
    ],
    ids=["beyond-a-double", "1e400", "big-int-and-precision", "spacing-and-escapes"],
)
def test_the_quiz_body_is_the_payloads_own_text_never_re_encoded(payload: bytes) -> None:
    payload = payload.replace(b"%s", USER.encode())
    call = route("QuizAttemptSubmitted", payload)
    assert call.content == payload
    assert call.user_id == USER

    sent: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.content)
        return httpx.Response(200, json={"status": "applied"})

    async def send() -> None:
        async with EngineClient(transport=httpx.MockTransport(handler)) as client:
            await client.send(call, event_id=str(EVENT))

    asyncio.run(send())
    assert sent == [payload]


def test_nan_and_non_utf8_payloads_are_still_refused() -> None:
    for payload in (b'{"user_id": "u", "s": NaN}', b'{"user_id": "\xff"}'):
        with pytest.raises(Unroutable, match="not valid JSON"):
            route("QuizAttemptSubmitted", payload)


# -- item 7: user_not_found after a successful heal is the engine's -------------------------
def test_user_not_found_right_after_a_successful_user_sync_spends_no_attempt() -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == QUIZ_ATTEMPTS_SYNC_PATH:
            return httpx.Response(404, json={"error": "user_not_found"})
        return httpx.Response(200, json={"status": "applied"})

    async def run() -> None:
        async with EngineClient(transport=httpx.MockTransport(handler)) as client:
            await deliver(
                client,
                event_type="QuizAttemptSubmitted",
                payload=json.dumps({"user_id": USER}).encode(),
                event_id=str(EVENT),
            )

    with pytest.raises(EngineUnavailable, match="right after its users/sync") as info:
        asyncio.run(run())
    assert info.value.spends_attempt is False
    assert info.value.endpoint == QUIZ_ATTEMPTS_SYNC_PATH
    assert calls == [QUIZ_ATTEMPTS_SYNC_PATH, USERS_SYNC_PATH, QUIZ_ATTEMPTS_SYNC_PATH]
