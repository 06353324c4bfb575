"""The backlog guard's pure parts: the verdict, the single-flight cache, the HTTP reply."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping

import pytest
from prometheus_client import CollectorRegistry

from cdc.backlog import (
    Backlog,
    BacklogLimits,
    BacklogState,
    Cached,
    GroupMeasures,
    SlotMeasures,
    backlog_route,
    judge,
    valid_group_name,
)
from cdc.health import HealthServer, Liveness, Reply

LIMITS = BacklogLimits(
    max_relay_age_s=60, max_slot_lag_bytes=1000, max_group_age_s=300, retry_after_s=7
)


def test_within_every_limit_is_ok_and_carries_no_retry_after() -> None:
    backlog = judge(SlotMeasures(relay_age_s=1.5, slot_lag_bytes=200), None, LIMITS)
    assert backlog.state is BacklogState.OK
    assert not backlog.over
    assert backlog.exceeded == ()
    assert backlog.as_json()["retry_after_s"] is None


@pytest.mark.parametrize(
    ("slot", "group", "named"),
    [
        (SlotMeasures(relay_age_s=61, slot_lag_bytes=0), None, "relay_age_s 61 > 60"),
        (SlotMeasures(relay_age_s=0, slot_lag_bytes=1001), None, "slot_lag_bytes 1001 > 1000"),
        (
            SlotMeasures(relay_age_s=0, slot_lag_bytes=0),
            GroupMeasures(group="g", age_s=301),
            "group_age_s 301 > 300",
        ),
    ],
)
def test_any_measure_over_its_limit_is_over_and_names_the_limit(
    slot: SlotMeasures, group: GroupMeasures | None, named: str
) -> None:
    backlog = judge(slot, group, LIMITS)
    assert backlog.state is BacklogState.OVER
    assert backlog.exceeded == (named,)
    assert backlog.retry_after_s == 7
    assert backlog.as_json()["retry_after_s"] == 7


def test_a_measure_that_could_not_be_taken_is_unknown_and_does_not_throttle() -> None:
    slot = SlotMeasures(relay_age_s=None, slot_lag_bytes=10, problems=("no REPLICATION",))
    backlog = judge(slot, GroupMeasures(group="g", age_s=None, problems=("kafka down",)), LIMITS)
    assert backlog.state is BacklogState.UNKNOWN
    assert not backlog.over
    assert backlog.problems == ("no REPLICATION", "kafka down")


def test_a_known_measure_over_its_limit_wins_over_an_unknown_one() -> None:
    slot = SlotMeasures(relay_age_s=None, slot_lag_bytes=5000, problems=("no REPLICATION",))
    assert judge(slot, None, LIMITS).state is BacklogState.OVER


def test_a_limit_of_zero_switches_its_check_off_even_when_unmeasured() -> None:
    limits = BacklogLimits(
        max_relay_age_s=0, max_slot_lag_bytes=0, max_group_age_s=0, retry_after_s=0
    )
    backlog = judge(SlotMeasures(relay_age_s=None, slot_lag_bytes=10**12), None, limits)
    assert backlog.state is BacklogState.OK
    assert backlog.retry_after_s == 1, "Retry-After is at least one second"


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_cache_measures_once_per_ttl() -> None:
    clock = _Clock()
    calls: list[float] = []

    def measure() -> int:
        calls.append(clock.now)
        return len(calls)

    cached = Cached(measure, ttl_s=1.0, clock=clock)
    assert [cached.get() for _ in range(100)] == [1] * 100
    clock.now += 0.99
    assert cached.get() == 1
    clock.now += 0.02
    assert cached.get() == 2
    assert len(calls) == 2


def test_a_stale_value_is_answered_while_another_caller_measures() -> None:
    clock = _Clock()
    release = threading.Event()
    entered = threading.Event()
    values = iter([1, 2])

    def measure() -> int:
        value = next(values)
        if value == 2:
            entered.set()
            assert release.wait(10)
        return value

    cached = Cached(measure, ttl_s=1.0, clock=clock)
    assert cached.get() == 1
    clock.now += 5
    slow = threading.Thread(target=cached.get)
    slow.start()
    assert entered.wait(10)
    assert cached.get() == 1, "the previous measurement, without waiting"
    release.set()
    slow.join(10)
    assert cached.get() == 2


def test_only_the_first_call_waits_and_concurrent_first_calls_measure_once() -> None:
    clock = _Clock()
    calls = []
    gate = threading.Event()

    def measure() -> str:
        calls.append(1)
        assert gate.wait(10)
        return "m"

    cached = Cached(measure, ttl_s=1.0, clock=clock)
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(cached.get())) for _ in range(8)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join(10)
    assert results == ["m"] * 8
    assert len(calls) == 1


@pytest.mark.parametrize("name", ["engine-sync", "a", "g.1_x-2", "x" * 249])
def test_group_names_of_kafka_characters_are_accepted(name: str) -> None:
    assert valid_group_name(name)


@pytest.mark.parametrize("name", ["", "x" * 250, "a b", "g/1", "ü", "a\nb", "g;drop"])
def test_other_group_names_are_refused(name: str) -> None:
    assert not valid_group_name(name)


class _FakeGuard:
    """Stands in for BacklogGuard in the route (the route only calls check)."""

    def __init__(self, backlog: Backlog) -> None:
        self.backlog = backlog
        self.groups: list[str | None] = []

    def check(self, *, group: str | None = None) -> Backlog:
        self.groups.append(group)
        return self.backlog


def _serve(routes: Mapping[str, object]) -> HealthServer:
    return HealthServer(
        host="127.0.0.1",
        port=0,
        registry=CollectorRegistry(),
        liveness=Liveness(),
        routes=routes,  # type: ignore[arg-type]
    ).start()


def _get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_backlog_endpoint_answers_429_with_retry_after_when_over_and_200_when_ok() -> None:
    over = judge(SlotMeasures(relay_age_s=90, slot_lag_bytes=10), None, LIMITS)
    guard = _FakeGuard(over)
    server = _serve({"/backlog": backlog_route(guard)})  # type: ignore[arg-type]
    base = f"http://127.0.0.1:{server.port}"
    try:
        status, headers, body = _get(f"{base}/backlog?group=engine-sync")
        assert status == 429
        assert headers["Retry-After"] == "7"
        assert headers["Content-Type"] == "application/json"
        doc = json.loads(body)
        assert doc["state"] == "over"
        assert doc["exceeded"] == ["relay_age_s 90 > 60"]
        assert guard.groups == ["engine-sync"]

        guard.backlog = judge(SlotMeasures(relay_age_s=0.1, slot_lag_bytes=10), None, LIMITS)
        status, headers, body = _get(f"{base}/backlog")
        assert status == 200
        assert "Retry-After" not in headers
        assert json.loads(body)["state"] == "ok"
        assert guard.groups[-1] is None

        status, _, body = _get(f"{base}/backlog?group=bad%20name")
        assert status == 400
        assert "group" in json.loads(body)["error"]
        assert guard.groups == ["engine-sync", None], "a bad name is never measured"
    finally:
        server.stop()


def test_a_failing_route_answers_500_without_its_exception_text() -> None:
    def broken(query: Mapping[str, str]) -> Reply:
        raise RuntimeError("secret detail password=hunter2")

    server = _serve({"/broken": broken})
    try:
        status, _, body = _get(f"http://127.0.0.1:{server.port}/broken")
        assert status == 500
        assert b"hunter2" not in body
        status, _, _ = _get(f"http://127.0.0.1:{server.port}/healthz")
        assert status == 200, "the server keeps serving"
    finally:
        server.stop()
