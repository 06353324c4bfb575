"""Retry policy: status classification, Retry-After, probing backoff, parking-lot schedule."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sinks.core.backoff import Backoff, Jitter
from sinks.core.errors import (
    EngineMisconfigured,
    EngineRejected,
    EngineUnavailable,
    SinkError,
    UserNotFound,
)
from sinks.core.machine import Result, ResultKind
from sinks.core.schedule import PARKING_RETRY_CAP_S, next_retry_at, retry_delay_s
from sinks.core.statuses import RETRY_AFTER_MAX_S, OutcomeKind, classify, parse_retry_after
from sinks.engine.client import EngineClient, _transport_error
from sinks.engine.dispatch import deliver
from sinks.engine.http1 import RequestDeadline
from sinks.runtime.verdicts import route_result
from sinks.shared.routes import QUIZ_ATTEMPTS_SYNC_PATH, USERS_SYNC_PATH

NOW_S = 1_750_000_000.0


@pytest.mark.parametrize("status", [200, 201, 202, 204])
def test_2xx_is_delivered_and_has_no_error(status: int) -> None:
    outcome = classify(status, b'{"status":"duplicate"}', {})
    assert outcome.kind is OutcomeKind.DELIVERED
    assert outcome.delivered
    assert outcome.error() is None


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 504, 100])
def test_engine_wide_statuses_are_unavailable_and_spend_no_attempt(status: int) -> None:
    outcome = classify(status, b"", {})
    assert outcome.kind is OutcomeKind.UNAVAILABLE
    error = outcome.error()
    assert isinstance(error, EngineUnavailable)
    assert not isinstance(error, EngineMisconfigured)
    assert error.retriable and not error.spends_attempt
    assert error.status == status


@pytest.mark.parametrize("status", [401, 403, 407, 300, 301, 302, 303, 304, 307, 308])
def test_auth_failures_and_redirects_are_misconfiguration_spending_no_attempt(
    status: int,
) -> None:
    outcome = classify(status, b"", {})
    assert outcome.kind is OutcomeKind.MISCONFIGURED
    error = outcome.error()
    assert isinstance(error, EngineMisconfigured)
    assert isinstance(error, EngineUnavailable)  # the consumer pauses and probes
    assert error.retriable and not error.spends_attempt
    assert error.status == status


def test_redirect_reason_names_the_target_and_the_setting() -> None:
    reason = classify(301, b"", {"Location": "https://engine.example/api"}).reason
    assert "https://engine.example/api" in reason
    assert "ENGINE_BASE_URL" in reason


def test_403_reason_points_at_the_key_and_the_client_certificate() -> None:
    reason = classify(403, b"", {}).reason
    assert "INTERNAL_API_KEY" in reason
    assert "ENGINE_CLIENT_CERT" in reason


@pytest.mark.parametrize("status", [400, 404, 405, 409, 410, 413, 415, 422])
def test_other_4xx_reject_the_record_and_spend_an_attempt(status: int) -> None:
    outcome = classify(status, b'{"error":"bad"}', {})
    assert outcome.kind is OutcomeKind.REJECTED
    error = outcome.error()
    assert isinstance(error, EngineRejected)
    assert error.spends_attempt
    assert error.status == status
    assert error.body_excerpt == '{"error":"bad"}'
    assert f"HTTP {status}" in error.reason


def test_404_user_not_found_asks_for_a_user_sync() -> None:
    outcome = classify(404, b'{"error": "user_not_found"}', {})
    assert outcome.kind is OutcomeKind.USER_NOT_FOUND
    error = outcome.error(user_id="u-1")
    assert isinstance(error, UserNotFound)
    assert isinstance(error, EngineRejected)
    assert error.user_id == "u-1"
    assert error.status == 404


def test_404_with_another_error_is_a_plain_rejection() -> None:
    assert classify(404, b'{"error": "quiz_not_found"}', {}).kind is OutcomeKind.REJECTED
    assert classify(404, b"not json", {}).kind is OutcomeKind.REJECTED


def test_401_reason_points_at_the_api_key_setting() -> None:
    assert "INTERNAL_API_KEY" in classify(401, b"", {}).reason


def test_body_excerpt_is_truncated_for_logs() -> None:
    outcome = classify(400, b"x" * 5000, {})
    assert len(outcome.body_excerpt) < 250
    assert outcome.body_excerpt.endswith("...")


def test_retry_after_seconds_is_read_from_a_429_case_insensitively() -> None:
    assert classify(429, b"", {"Retry-After": "7"}).retry_after_s == 7.0
    assert classify(503, b"", {"retry-after": "1.5"}).retry_after_s == 1.5
    assert classify(503, b"", {}).retry_after_s is None


def test_retry_after_http_date_is_seconds_from_now() -> None:
    when = datetime.fromtimestamp(NOW_S, UTC) + timedelta(seconds=30)
    value = format_datetime(when, usegmt=True)
    assert parse_retry_after(value, now_s=NOW_S) == pytest.approx(30.0)
    outcome = classify(503, b"", {"Retry-After": value}, now_s=NOW_S)
    assert outcome.retry_after_s == pytest.approx(30.0)


def test_retry_after_in_the_past_is_zero_and_garbage_is_ignored() -> None:
    past = format_datetime(datetime.fromtimestamp(NOW_S - 60, UTC), usegmt=True)
    assert parse_retry_after(past, now_s=NOW_S) == 0.0
    assert parse_retry_after("soon", now_s=NOW_S) is None
    assert parse_retry_after("-5") is None
    assert parse_retry_after("") is None
    assert parse_retry_after(None) is None


def test_retry_after_is_capped_at_an_hour() -> None:
    assert parse_retry_after("999999") == RETRY_AFTER_MAX_S


def test_no_jitter_backoff_grows_by_factor_up_to_the_cap() -> None:
    backoff = Backoff(base_s=1.0, cap_s=10.0, factor=2.0, jitter=Jitter.NONE)
    assert [backoff.next_delay_s() for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert backoff.attempts == 6


def test_reset_starts_the_backoff_over() -> None:
    backoff = Backoff(base_s=1.0, cap_s=10.0, jitter=Jitter.NONE)
    for _ in range(4):
        backoff.next_delay_s()
    backoff.reset()
    assert backoff.attempts == 0
    assert backoff.next_delay_s() == 1.0


def test_full_jitter_draws_between_zero_and_the_growing_ceiling() -> None:
    bounds: list[tuple[float, float]] = []

    def rand(low: float, high: float) -> float:
        bounds.append((low, high))
        return high

    backoff = Backoff(base_s=0.5, cap_s=3.0, factor=2.0, jitter=Jitter.FULL, rand=rand)
    for _ in range(4):
        backoff.next_delay_s()
    assert bounds == [(0.0, 0.5), (0.0, 1.0), (0.0, 2.0), (0.0, 3.0)]


def test_retry_after_is_a_floor_for_the_next_probe() -> None:
    backoff = Backoff(base_s=1.0, cap_s=10.0, jitter=Jitter.NONE)
    assert backoff.next_delay_s(retry_after_s=30.0) == 30.0
    assert backoff.next_delay_s(retry_after_s=0.5) == 2.0


def test_backoff_rejects_nonsense_parameters() -> None:
    with pytest.raises(ValueError, match="base_s"):
        Backoff(base_s=0.0)
    with pytest.raises(ValueError, match="base_s"):
        Backoff(base_s=5.0, cap_s=1.0)
    with pytest.raises(ValueError, match="factor"):
        Backoff(factor=0.5)


@settings(deadline=None)
@given(
    draws=st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=1, max_size=60),
    jitter=st.sampled_from(list(Jitter)),
)
def test_every_delay_stays_within_zero_and_the_cap(draws: list[float], jitter: Jitter) -> None:
    it = iter(draws * 2)

    def rand(low: float, high: float) -> float:
        return low + (high - low) * next(it, 0.5)

    backoff = Backoff(base_s=0.2, cap_s=5.0, factor=3.0, jitter=jitter, rand=rand)
    for _ in draws:
        delay = backoff.next_delay_s()
        assert 0.0 <= delay <= 5.0
        if jitter is Jitter.DECORRELATED:
            assert delay >= 0.2


def test_many_probes_never_overflow() -> None:
    backoff = Backoff(base_s=1.0, cap_s=60.0, factor=1e6, jitter=Jitter.NONE)
    assert all(backoff.next_delay_s() <= 60.0 for _ in range(10_000))


def test_parking_lot_delay_doubles_per_retry() -> None:
    assert [retry_delay_s(n, 60.0) for n in range(5)] == [60.0, 120.0, 240.0, 480.0, 960.0]


def test_parking_lot_delay_is_capped_at_a_day_even_for_huge_retry_counts() -> None:
    assert retry_delay_s(30, 60.0) == PARKING_RETRY_CAP_S
    assert retry_delay_s(10**9, 60.0) == PARKING_RETRY_CAP_S
    assert retry_delay_s(3, 60.0, cap_s=100.0) == 100.0


def test_next_retry_at_is_now_plus_the_delay_in_utc() -> None:
    now = datetime(2025, 1, 1, tzinfo=UTC)
    assert next_retry_at(2, 60.0, now=now) == now + timedelta(seconds=240)
    assert next_retry_at(0, 60.0).tzinfo is not None


def test_negative_retry_count_is_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        retry_delay_s(-1, 60.0)


# -- issue 35: what the sink's core is told, per engine route ------------------------------


def _failure_of(status: int, headers: dict[str, str] | None = None) -> EngineUnavailable:
    error = classify(status, b"{}", headers or {}, now_s=NOW_S).error()
    assert isinstance(error, EngineUnavailable)
    error.endpoint = QUIZ_ATTEMPTS_SYNC_PATH
    return error


@pytest.mark.parametrize(
    ("status", "headers", "kind", "shared"),
    [
        (500, None, ResultKind.SERVER_ERROR, False),  # blamed only with per-route evidence
        (503, None, ResultKind.SERVER_ERROR, False),
        (503, {"Retry-After": "2"}, ResultKind.UNAVAILABLE, True),  # the route sheds load
        (429, {"Retry-After": "1"}, ResultKind.THROTTLED, False),
        (408, None, ResultKind.UNAVAILABLE, False),  # never the record's own
        (401, None, ResultKind.UNAVAILABLE, False),  # EngineMisconfigured: never an attempt
        (403, None, ResultKind.UNAVAILABLE, False),
        (307, None, ResultKind.UNAVAILABLE, False),
    ],
)
def test_every_answer_that_says_nothing_about_the_record_is_trouble_of_its_route(
    status: int, headers: dict[str, str] | None, kind: ResultKind, shared: bool
) -> None:
    result = route_result(_failure_of(status, headers))
    assert (result.kind, result.shared) == (kind, shared)
    assert result.endpoint == QUIZ_ATTEMPTS_SYNC_PATH


def test_a_transport_failure_or_an_expired_deadline_is_trouble_of_its_route() -> None:
    refused = EngineUnavailable("ConnectError: [Errno 111] Connection refused")
    refused.endpoint = USERS_SYNC_PATH
    assert route_result(refused) == Result(
        ResultKind.UNAVAILABLE, refused.reason, endpoint=USERS_SYNC_PATH
    )
    assert not refused.shared
    # the client says the trouble is shared where it makes the exception (issue 51 item 6)
    late = _transport_error(RequestDeadline("no complete answer within 10 s"))
    assert late.shared and late.__cause__ is None
    assert route_result(late).shared, "a slow route: its window is cut, nothing spent"


def _engine(answers: dict[str, list[int]]) -> EngineClient:
    """A client whose engine answers each path with the given statuses, in turn."""

    def handler(request: httpx.Request) -> httpx.Response:
        status = answers[request.url.path].pop(0)
        body = {"error": "user_not_found"} if status == 404 else {}
        return httpx.Response(status, json=body)

    return EngineClient(base_url="http://engine.test", transport=httpx.MockTransport(handler))


ATTEMPT_PAYLOAD = b'{"attempt_id":"a1","user_id":"u1","quiz_id":"q1","score":3}'


def test_a_failed_user_sync_of_a_quiz_attempt_is_trouble_of_the_users_route() -> None:
    async def go() -> SinkError:
        engine = _engine({QUIZ_ATTEMPTS_SYNC_PATH: [404], USERS_SYNC_PATH: [503]})
        async with engine:
            with pytest.raises(SinkError) as info:
                await deliver(
                    engine, event_type="QuizAttemptSubmitted", payload=ATTEMPT_PAYLOAD, event_id="e"
                )
        return info.value

    error = asyncio.run(go())
    assert isinstance(error, EngineUnavailable)
    assert error.endpoint == USERS_SYNC_PATH, "the users route failed, not the quiz route"
    assert route_result(error).endpoint == USERS_SYNC_PATH


def test_a_delivery_names_every_route_that_answered_2xx() -> None:
    async def go() -> list[str]:
        engine = _engine({QUIZ_ATTEMPTS_SYNC_PATH: [404, 200], USERS_SYNC_PATH: [200]})
        answered: list[str] = []
        async with engine:
            await deliver(
                engine,
                event_type="QuizAttemptSubmitted",
                payload=ATTEMPT_PAYLOAD,
                event_id="e",
                answered=answered,
            )
        return answered

    assert asyncio.run(go()) == [USERS_SYNC_PATH, QUIZ_ATTEMPTS_SYNC_PATH]


def test_a_rejection_names_the_route_that_rejected() -> None:
    async def go() -> SinkError:
        engine = _engine({QUIZ_ATTEMPTS_SYNC_PATH: [422]})
        async with engine:
            with pytest.raises(SinkError) as info:
                await deliver(
                    engine, event_type="QuizAttemptSubmitted", payload=ATTEMPT_PAYLOAD, event_id="e"
                )
        return info.value

    error = asyncio.run(go())
    assert isinstance(error, EngineRejected)
    assert error.endpoint == QUIZ_ATTEMPTS_SYNC_PATH
