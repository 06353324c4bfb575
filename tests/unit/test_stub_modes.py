"""The engine stub's rate-limit, drip and per-route latency modes, pure: the token bucket,
the 429, the parsing."""

from __future__ import annotations

import pytest

from sinks.shared.routes import QUIZ_ATTEMPTS_SYNC_PATH, USERS_SYNC_PATH
from sinks.stub.engine import StubEngine
from sinks.stub.faults import (
    Faults,
    TokenBucket,
    parse_drip,
    parse_path_latency,
    parse_rate_limit,
    throttled_reply,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_bucket_admits_its_burst_then_its_rate_and_says_when_the_next_token_is_due() -> None:
    clock = Clock()
    bucket = TokenBucket(rate_per_s=10, burst=3, clock=clock)
    assert [bucket.take() for _ in range(3)] == [None, None, None]
    wait = bucket.take()
    assert wait == pytest.approx(0.1)
    clock.now += 0.11
    assert bucket.take() is None
    clock.now += 10  # refills to the burst, never beyond
    assert [bucket.take() is None for _ in range(4)] == [True, True, True, False]
    assert bucket.limited == 2


def test_a_fixed_retry_after_is_answered_as_set() -> None:
    bucket = TokenBucket(rate_per_s=1, burst=1, retry_after_s=2.0, clock=Clock())
    assert bucket.take() is None
    assert bucket.take() == 2.0


def test_the_429_carries_the_wait_rounded_up_to_the_millisecond() -> None:
    reply = throttled_reply(0.0041)
    assert reply.status == 429
    assert dict(reply.headers) == {b"retry-after": b"0.005"}
    assert dict(throttled_reply(0.0).headers) == {b"retry-after": b"0.001"}
    assert dict(throttled_reply(2.0).headers) == {b"retry-after": b"2"}


def test_a_throttled_request_is_not_applied() -> None:
    engine = StubEngine()
    engine.faults.limiter = TokenBucket(rate_per_s=1, burst=1, clock=Clock())
    headers = {b"idempotency-key": b"k1"}
    body = b'{"user_id": "u1"}'
    assert engine.handle("/api/internal/users/sync", headers, body).status == 200
    headers = {b"idempotency-key": b"k2"}
    assert engine.handle("/api/internal/users/sync", headers, body).status == 429
    assert [a["event_id"] for a in engine.applied] == ["k1"]


@pytest.mark.parametrize(
    "value",
    [{"rate_per_s": 0}, {"rate_per_s": -1}, {"burst": 3}, {"rate_per_s": 5, "x": 1}, 7],
)
def test_a_bad_rate_limit_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match=r"rate_limit|number"):
        parse_rate_limit(value)


@pytest.mark.parametrize(
    "value",
    [{"bytes": 0, "interval_s": 1, "for_s": 1}, {"bytes": 4, "interval_s": 1}, "drip"],
)
def test_a_bad_drip_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match="drip"):
        parse_drip(value)


def test_modes_switch_off_with_null() -> None:
    assert parse_rate_limit(None) is None
    assert parse_drip(None) is None
    drip = parse_drip({"bytes": 4, "interval_s": 0.5, "for_s": 10})
    assert drip is not None and (drip.bytes_per_write, drip.interval_s) == (4, 0.5)


def test_one_route_can_be_made_slow_while_the_others_answer_at_once() -> None:
    faults = Faults(latency_ms=10)
    faults.set_path_latency(parse_path_latency({QUIZ_ATTEMPTS_SYNC_PATH: 5000}))
    assert faults.latency_for(QUIZ_ATTEMPTS_SYNC_PATH) == 5010
    assert faults.latency_for(USERS_SYNC_PATH) == 10
    assert faults.describe()["path_latency_ms"] == {QUIZ_ATTEMPTS_SYNC_PATH: 5000}
    faults.set_path_latency(parse_path_latency({QUIZ_ATTEMPTS_SYNC_PATH: 0}))
    assert faults.latency_for(QUIZ_ATTEMPTS_SYNC_PATH) == 10
    assert "path_latency_ms" not in faults.describe()
    faults.set_path_latency(parse_path_latency({USERS_SYNC_PATH: 1}))
    faults.set_path_latency(parse_path_latency(None))
    assert faults.path_latency_ms == {}


@pytest.mark.parametrize(
    "value", [{"/api/internal/other": 5}, {QUIZ_ATTEMPTS_SYNC_PATH: -1}, [5], "slow"]
)
def test_a_bad_path_latency_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match=r"path_latency_ms|number"):
        parse_path_latency(value)
