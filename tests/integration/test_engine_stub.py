"""The engine stub over real HTTP, driven by the real EngineClient.

Each test starts its own stub on a free 127.0.0.1 port and asserts on what the
stub holds afterwards (``/_stub/applied``, ``/_stub/stats``).
"""

from __future__ import annotations

import asyncio
import select
import socket
import time
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import httpx
import pytest

from sinks.core.errors import EngineRejected, EngineUnavailable, UserNotFound
from sinks.engine import http1
from sinks.engine.client import HTTPX_TRANSPORT, EngineClient, EngineTimeouts
from sinks.shared.routes import (
    QUIZ_ATTEMPTS_SYNC_PATH,
    USERS_SYNC_PATH,
    derived_user_sync_key,
    route,
    user_sync_call,
)
from sinks.stub import server as stub_server
from sinks.stub.server import StubServer

T = TypeVar("T")
API_KEY = "stub-test-key"


def attempt(user_id: str, attempt_id: str = "a1") -> bytes:
    return (
        f'{{"attempt_id":"{attempt_id}","user_id":"{user_id}","quiz_id":"q1","score":5}}'.encode()
    )


@pytest.fixture
def stub() -> Iterator[StubServer]:
    with StubServer(api_key=API_KEY) as server:
        yield server


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def client_for(stub: StubServer, **kwargs: Any) -> EngineClient:
    return EngineClient(base_url=stub.url, api_key=kwargs.pop("api_key", API_KEY), **kwargs)


async def sync_user(stub: StubServer, user_id: str, event_id: str, **kwargs: Any) -> None:
    async with client_for(stub, **kwargs) as client:
        await client.sync_user(user_id, event_id=event_id)


async def send_attempt(stub: StubServer, user_id: str, event_id: str) -> None:
    async with client_for(stub) as client:
        await client.send(route("QuizAttemptSubmitted", attempt(user_id)), event_id=event_id)


def test_user_sync_is_recorded_with_event_id_body_and_time(stub: StubServer) -> None:
    before = time.time()
    run(sync_user(stub, "u1", "e1"))
    applied = stub.applied()
    assert applied["total"] == 1
    (item,) = applied["items"]
    assert (item["path"], item["event_id"], item["user_id"]) == (USERS_SYNC_PATH, "e1", "u1")
    assert item["body"] == {"user_id": "u1"}
    assert before <= item["applied_at"] <= time.time()


def test_same_idempotency_key_twice_is_a_duplicate_applied_once(stub: StubServer) -> None:
    async def twice() -> None:
        async with client_for(stub) as client:
            await client.sync_user("u1", event_id="e1")
            await client.sync_user("u1", event_id="e1")  # 200 duplicate: still a success

    run(twice())
    stats = stub.stats()
    assert stats["applied"] == 1
    assert stats["duplicates"] == 1
    assert stats["conflicts"] == 0
    assert stats["by_status"] == {"200": 2}


def test_a_key_reused_for_another_body_is_counted_as_a_conflict(stub: StubServer) -> None:
    run(sync_user(stub, "u1", "e1"))
    run(sync_user(stub, "u2", "e1"))
    stats = stub.stats()
    assert (stats["applied"], stats["duplicates"], stats["conflicts"]) == (1, 1, 1)


def test_quiz_attempt_before_its_user_is_user_not_found_and_not_applied(
    stub: StubServer,
) -> None:
    with pytest.raises(UserNotFound) as info:
        run(send_attempt(stub, "u1", "q-evt"))
    assert info.value.user_id == "u1"
    assert stub.stats()["applied"] == 0
    # its key was not consumed: after the user sync the same event applies
    run(sync_user(stub, "u1", derived_user_sync_key("q-evt")))
    run(send_attempt(stub, "u1", "q-evt"))
    items = stub.applied()["items"]
    assert [(i["path"], i["event_id"]) for i in items] == [
        (USERS_SYNC_PATH, derived_user_sync_key("q-evt")),
        (QUIZ_ATTEMPTS_SYNC_PATH, "q-evt"),
    ]
    assert items[1]["body"]["attempt_id"] == "a1"


def test_wrong_or_missing_api_key_is_401_engine_unavailable_and_nothing_applied(
    stub: StubServer,
) -> None:
    for key in ("wrong", ""):
        with pytest.raises(EngineUnavailable) as info:
            run(sync_user(stub, "u1", "e1", api_key=key))
        assert info.value.status == 401
    stats = stub.stats()
    assert stats["applied"] == 0
    assert stats["by_status"] == {"401": 2}


def test_stub_without_api_key_accepts_any_key() -> None:
    with StubServer() as open_stub:
        run(sync_user(open_stub, "u1", "e1", api_key="anything"))
        assert open_stub.stats()["applied"] == 1


def test_missing_idempotency_key_is_rejected_with_400(stub: StubServer) -> None:
    response = httpx.post(
        f"{stub.url}{USERS_SYNC_PATH}", json={"user_id": "u1"}, headers={"x-api-key": API_KEY}
    )
    assert response.status_code == 400
    assert response.json() == {"error": "missing_idempotency_key"}


def test_path_status_sequence_is_consumed_one_per_request(stub: StubServer) -> None:
    stub.add_faults({"path": USERS_SYNC_PATH, "statuses": [503, 500]})

    async def until_delivered() -> list[int | None]:
        statuses: list[int | None] = []
        async with client_for(stub) as client:
            while True:
                try:
                    await client.sync_user("u1", event_id="e1")
                except EngineUnavailable as exc:
                    statuses.append(exc.status)
                else:
                    return statuses

    assert run(until_delivered()) == [503, 500]
    stats = stub.stats()
    assert stats["applied"] == 1
    assert stats["faults_injected"] == 2
    assert stats["by_status"] == {"200": 1, "500": 1, "503": 1}
    assert stub.control("GET", "/_stub/faults")["rules"] == []  # used up


def test_event_id_fault_forever_rejects_only_that_event(stub: StubServer) -> None:
    stub.add_faults({"event_id": "bad", "status": 422, "times": -1, "body": {"error": "no"}})

    async def go() -> None:
        async with client_for(stub) as client:
            for _ in range(3):
                with pytest.raises(EngineRejected) as info:
                    await client.sync_user("u1", event_id="bad")
                assert info.value.status == 422
                assert '"no"' in info.value.body_excerpt
            await client.sync_user("u2", event_id="good")

    run(go())
    assert [i["event_id"] for i in stub.applied()["items"]] == ["good"]


def test_event_id_rule_wins_over_a_path_rule(stub: StubServer) -> None:
    stub.add_faults(
        [
            {"path": USERS_SYNC_PATH, "status": 503, "times": 1},
            {"event_id": "e1", "status": 400, "times": 1},
        ]
    )
    with pytest.raises(EngineRejected):
        run(sync_user(stub, "u1", "e1"))
    with pytest.raises(EngineUnavailable):
        run(sync_user(stub, "u1", "e1"))


def test_retry_after_header_of_a_fault_reaches_the_client(stub: StubServer) -> None:
    stub.add_faults({"path": USERS_SYNC_PATH, "statuses": [429], "headers": {"Retry-After": "3"}})
    with pytest.raises(EngineUnavailable) as info:
        run(sync_user(stub, "u1", "e1"))
    assert (info.value.status, info.value.retry_after_s) == (429, 3.0)


def test_fault_with_apply_loses_the_answer_and_the_resend_is_a_duplicate(
    stub: StubServer,
) -> None:
    stub.add_faults({"event_id": "e1", "statuses": [500], "apply": True})
    with pytest.raises(EngineUnavailable):
        run(sync_user(stub, "u1", "e1"))
    run(sync_user(stub, "u1", "e1"))
    stats = stub.stats()
    assert (stats["applied"], stats["duplicates"]) == (1, 1)


def test_latency_delays_every_engine_request(stub: StubServer) -> None:
    stub.add_faults({"latency_ms": 200})
    started = time.perf_counter()
    run(sync_user(stub, "u1", "e1"))
    assert time.perf_counter() - started >= 0.2
    assert stub.stats()["latency_ms"] == 200


def test_latency_beyond_the_read_timeout_is_engine_unavailable_read_timeout(
    stub: StubServer,
) -> None:
    stub.add_faults({"latency_ms": 500})
    with pytest.raises(EngineUnavailable) as info:
        run(sync_user(stub, "u1", "e1", timeouts=EngineTimeouts(connect_s=1.0, read_s=0.1)))
    assert isinstance(info.value.__cause__, http1.ReadTimeout)
    assert info.value.reason == "ReadTimeout: nothing received for 0.1 s"
    assert info.value.status is None


def test_request_abandoned_by_a_timed_out_client_is_still_applied_once(
    stub: StubServer,
) -> None:
    stub.add_faults({"latency_ms": 300})
    with pytest.raises(EngineUnavailable):
        run(sync_user(stub, "u1", "e1", timeouts=EngineTimeouts(connect_s=1.0, read_s=0.05)))
    deadline = time.monotonic() + 5
    while stub.stats()["applied"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    stub.clear_faults()
    run(sync_user(stub, "u1", "e1"))  # the sink's resend
    stats = stub.stats()
    assert (stats["applied"], stats["duplicates"]) == (1, 1)


def _refused(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.parametrize(
    ("transport", "refused"),
    [(None, http1.ConnectError), (HTTPX_TRANSPORT, httpx.ConnectError)],
    ids=["http1", "httpx"],
)
def test_outage_refuses_connections_then_accepts_again_on_the_same_port(
    stub: StubServer, transport: str | None, refused: type[Exception]
) -> None:
    async def scenario() -> float:
        async with client_for(stub, transport=transport) as client:
            await client.sync_user("u0", event_id="before")  # a pooled keep-alive connection
            stub.add_faults({"refuse_connections_s": 1.0})
            started = time.monotonic()
            with pytest.raises(EngineUnavailable) as info:
                await client.sync_user("u1", event_id="during")
            assert isinstance(info.value.__cause__, refused)
            assert info.value.status is None
            if transport is None:
                assert "Connection refused" in info.value.reason
            assert _refused(stub.port)
            while True:  # probe until the listener is back
                try:
                    await client.sync_user("u1", event_id="during")
                except EngineUnavailable:
                    await asyncio.sleep(0.05)
                else:
                    return time.monotonic() - started

    outage_s = run(scenario())
    assert 0.8 <= outage_s < 5.0
    assert [i["event_id"] for i in stub.applied()["items"]] == ["before", "during"]
    assert stub.stats()["refusing_connections"] is False


def _idle_keep_alive(port: int) -> socket.socket:
    """A connection that got one answer and stays open (HTTP/1.1 keep-alive), unread from."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: stub\r\n\r\n")
    answer = b""
    while not answer.endswith(b'{"status":"ok"}'):
        chunk = sock.recv(4096)
        assert chunk, f"closed before the answer: {answer!r}"
        answer += chunk
    return sock


def test_an_outage_is_answered_only_once_its_idle_keep_alive_connections_are_closed(
    stub: StubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interleaving forced: the outage's request looks at the listener on every loop turn
    (``CLOSE_POLL_S = 0``), so it sees it closed on the turn after uvicorn closed it - before
    asyncio closed the idle connections uvicorn closed with it. Answered then, a client
    reusing such a connection sends its request into a socket about to close: a reset, not
    a refusal (httpx's ReadError, seen under load). Their FIN must be out before the answer."""
    monkeypatch.setattr(stub_server, "CLOSE_POLL_S", 0.0)
    idle = [_idle_keep_alive(stub.port) for _ in range(8)]
    listener = stub._listener
    closed = listener.closed
    open_at_answer: list[int] = []

    async def closed_and_looked() -> None:  # on the stub's loop, as the answer is sent
        await closed()
        if listener.refusing:
            readable, _, _ = select.select(idle, [], [], 0)  # the FIN (EOF) waiting
            open_at_answer.append(len(idle) - len(readable))

    monkeypatch.setattr(listener, "closed", closed_and_looked)
    try:
        stub.add_faults({"refuse_connections_s": 5})  # (not waited for: the test ends in it)
        assert all(sock.recv(1) == b"" for sock in idle)
    finally:
        for sock in idle:
            sock.close()
    assert open_at_answer == [0], f"{open_at_answer} idle connections open at the answer"


def test_a_port_taken_during_an_outage_stops_the_stub_with_an_error_naming_it(
    stub: StubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window ends when it says, or the stub fails loudly: never refusing for ever.

    Another socket listening on the port (``SO_REUSEADDR``, as servers bind) when the
    window ends: the stub retries for ``REBIND_TIMEOUT_S``, then stops, and its control
    helpers name the port."""
    monkeypatch.setattr(stub_server, "REBIND_TIMEOUT_S", 0.5)
    stub.add_faults({"refuse_connections_s": 0.2})
    with socket.socket() as intruder:
        intruder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        intruder.bind(("127.0.0.1", stub.port))
        intruder.listen()
        deadline = time.monotonic() + 30
        while not stub.stopped and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stub.stopped, "the stub still waits for its port 30 s after the window"
    with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{stub.port} again"):
        stub.stats()


def test_an_outage_ended_while_the_port_is_still_taken_keeps_the_stub_serving(
    stub: StubServer, caplog: pytest.LogCaptureFixture
) -> None:
    """``end_outage`` arriving while the stub retries its rebind (the port someone else's
    for a moment) replaces that retry: the stub listens again once the port is free (the
    old stub's retry died of the cancellation, and the stub with it)."""
    caplog.set_level("WARNING", logger="sinks.stub")
    stub.add_faults({"refuse_connections_s": 0.2})
    with socket.socket() as intruder:
        intruder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        intruder.bind(("127.0.0.1", stub.port))
        intruder.listen()
        deadline = time.monotonic() + 10
        while "cannot rebind" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "cannot rebind" in caplog.text, "the window never ended"
        stub.end_outage(wait=False)  # while the rebind is retried (this thread holds the port)
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while _refused(stub.port) and time.monotonic() < deadline:
        time.sleep(0.02)
    run(sync_user(stub, "u1", "e1"))
    assert (stub.stats()["applied"], stub.stopped) == (1, False)


def test_end_outage_accepts_connections_before_the_window_ends(stub: StubServer) -> None:
    stub.add_faults({"refuse_connections_s": 60})
    assert _refused(stub.port)
    stub.end_outage()  # returns once the stub listens again: the next call is served
    assert not _refused(stub.port)
    assert stub.stats()["refusing_connections"] is False
    run(sync_user(stub, "u1", "e1"))
    assert stub.stats()["applied"] == 1


def test_reset_forgets_applied_events_keys_and_users(stub: StubServer) -> None:
    run(sync_user(stub, "u1", "e1"))
    stub.reset()
    assert stub.stats()["applied"] == 0
    with pytest.raises(UserNotFound):  # the engine lost its users
        run(send_attempt(stub, "u1", "q1"))
    run(sync_user(stub, "u1", "e1"))  # the key is new again: applied, not a duplicate
    stats = stub.stats()
    assert (stats["applied"], stats["duplicates"]) == (1, 0)


def test_applied_filters_by_user_path_event_and_since(stub: StubServer) -> None:
    run(sync_user(stub, "u1", "e1"))
    run(sync_user(stub, "u2", "e2"))
    run(send_attempt(stub, "u1", "e3"))
    assert [i["event_id"] for i in stub.applied(user_id="u1")["items"]] == ["e1", "e3"]
    assert [i["event_id"] for i in stub.applied(path=QUIZ_ATTEMPTS_SYNC_PATH)["items"]] == ["e3"]
    assert stub.applied(event_id="e2")["count"] == 1
    assert [i["event_id"] for i in stub.applied(since="1")["items"]] == ["e2", "e3"]
    assert stub.applied(limit="1")["count"] == 1
    assert stub.applied()["by_path"] == {USERS_SYNC_PATH: 2, QUIZ_ATTEMPTS_SYNC_PATH: 1}


def test_delete_faults_clears_rules_and_latency(stub: StubServer) -> None:
    stub.add_faults({"status": 503, "times": -1, "latency_ms": 100})
    stub.clear_faults()
    assert stub.control("GET", "/_stub/faults") == {"latency_ms": 0.0, "rules": []}
    run(sync_user(stub, "u1", "e1"))


@pytest.mark.parametrize(
    "instruction",
    [
        {"path": "/nope", "status": 500},
        {"status": 99},
        {"statuses": []},
        {"status": 500, "times": 0},
        {"status": 500, "frobnicate": True},
        {"latency_ms": -1},
        {"status": 500, "headers": {"Retry-After": 3}},
        {"latency_ms": 5, "bogus": 1},
        [{"latency_ms": 5}, {"refuse_connections_s": -1}],
        [{"latency_ms": 5}, {"status": 500, "times": "twice"}],
        "not an object",
    ],
)
def test_invalid_fault_instructions_are_refused_with_400(
    stub: StubServer, instruction: object
) -> None:
    response = httpx.post(f"{stub.url}/_stub/faults", json=instruction)
    assert response.status_code == 400
    assert response.json()["error"]
    assert stub.control("GET", "/_stub/faults") == {"latency_ms": 0.0, "rules": []}  # all or none


def test_healthz_and_unknown_paths(stub: StubServer) -> None:
    assert httpx.get(f"{stub.url}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{stub.url}/nope").status_code == 404
    assert httpx.get(f"{stub.url}{USERS_SYNC_PATH}").status_code == 405


def test_concurrent_deliveries_of_distinct_events_are_all_applied_once(
    stub: StubServer,
) -> None:
    async def burst() -> None:
        async with client_for(stub, max_in_flight=16) as client:
            await asyncio.gather(
                *(client.send(user_sync_call(f"u{n}"), event_id=f"e{n}") for n in range(300)),
                *(client.send(user_sync_call(f"u{n}"), event_id=f"e{n}") for n in range(0, 300, 3)),
            )

    run(burst())
    stats = stub.stats()
    assert (stats["applied"], stats["duplicates"], stats["users"]) == (300, 100, 300)
    assert len({i["event_id"] for i in stub.applied()["items"]}) == 300


def test_many_in_flight_ride_out_an_outage_and_each_event_is_applied_once(
    stub: StubServer,
) -> None:
    """64 deliveries at a time on the default transport; the engine refuses for 0.5 s midway.

    The outage is asked for once 300 events are delivered; the last 500 wait until it
    has begun, so it always meets deliveries (a machine slow to ask for it once let the
    burst end before the window opened, and the stats were asked for inside it).
    """
    events = [f"e{n}" for n in range(1500)]
    held_back = len(events) - 500
    delivered: list[str] = []
    refused: list[str] = []

    async def deliver(client: EngineClient, event_id: str) -> None:
        while True:  # the sink's probe-until-back, in short
            try:
                await client.sync_user(f"u-{event_id}", event_id=event_id)
            except EngineUnavailable as exc:
                refused.append(exc.reason)
                await asyncio.sleep(0.05)
            else:
                delivered.append(event_id)
                return

    async def burst() -> None:
        began = asyncio.Event()
        async with client_for(stub, max_in_flight=64) as client:
            pending = enumerate(events)

            async def worker() -> None:
                for n, event_id in pending:
                    if n >= held_back:
                        await began.wait()
                    await deliver(client, event_id)

            async def outage() -> None:
                while len(delivered) < 300:
                    await asyncio.sleep(0.005)
                await asyncio.to_thread(stub.add_faults, {"refuse_connections_s": 0.5})
                began.set()  # answered: the listener is closed (the window counts from there)

            await asyncio.gather(outage(), *(worker() for _ in range(64)))

    run(burst())
    assert sorted(delivered) == sorted(events)
    stats = stub.stats()  # the held-back events needed the listener back: the window is over
    assert (stats["applied"], stats["refusing_connections"]) == (len(events), False)
    assert {i["event_id"] for i in stub.applied(limit=len(events))["items"]} == set(events)
    assert refused, "the outage was never seen"
    assert all(reason.startswith("ConnectError: ") for reason in refused), set(refused)
    assert "Connection refused" in refused[0]
