"""The operator console without services: its sessions, its views' data, its pages, its routes.

The views are fed the objects the CLI renders (``PipelineLag`` from ``partition_lag``, the
relay's and the sink's real metric registries, ``ParkedEvent`` rows), and the pages are
checked to show exactly their numbers; the routes run in Starlette's test client over a
stand-in of :class:`~sinks.console.sources.ConsoleSources` (pure unit: no service).
"""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from cdc.relay.gaps.periodic_audit import AuditMetrics
from sinks.console import auth
from sinks.console.app import COOKIE, MAX_FORM_BYTES, create_console, with_console
from sinks.console.history import LagHistory, sparkline
from sinks.console.lot_pages import parking_page
from sinks.console.pages import lag_page, overview_fragment
from sinks.console.sources import first_line, registry_samples
from sinks.console.views import (
    FilterError,
    Mode,
    Overview,
    Readout,
    audit_metrics,
    ids_of,
    parked_filter,
    relay_view,
    route_views,
    sort_partitions,
)
from sinks.ops.lag import PipelineLag
from sinks.ops.offsets import OffsetReset, partition_lag
from sinks.parking.lot import ParkedEvent
from sinks.parking.reasons import ReasonCount
from sinks.parking.retrier import RetrySummary
from sinks.runtime.metrics import SinkMetrics

TOKEN = "console-unit-token-0123456789"
NOW_MS = 1_800_000_000_000


# ------------------------------------------------------------------------ sessions
def test_a_session_issued_with_the_token_is_valid_until_its_age_and_never_after() -> None:
    key = auth.session_key(TOKEN)
    cookie = auth.issue_session(key, now_s=1000.0)
    assert TOKEN not in cookie
    assert auth.session_valid(key, cookie, now_s=1000.0)
    assert auth.session_valid(key, cookie, now_s=1000.0 + auth.SESSION_MAX_AGE_S)
    assert not auth.session_valid(key, cookie, now_s=1001.0 + auth.SESSION_MAX_AGE_S)
    assert not auth.session_valid(key, cookie, now_s=1000.0 - auth.CLOCK_SKEW_S - 1)


def test_a_session_of_another_token_or_a_tampered_cookie_is_refused() -> None:
    key = auth.session_key(TOKEN)
    cookie = auth.issue_session(key, now_s=1000.0)
    assert not auth.session_valid(auth.session_key(TOKEN + "x"), cookie, now_s=1000.0)
    issued, nonce, mac = cookie.split(".")
    assert not auth.session_valid(key, f"{int(issued) + 1}.{nonce}.{mac}", now_s=1000.0)
    assert not auth.session_valid(key, f"{issued}.{nonce}x.{mac}", now_s=1000.0)
    assert not auth.session_valid(b"", cookie, now_s=1000.0)
    with pytest.raises(ValueError, match="no admin token"):
        auth.issue_session(b"", now_s=1.0)


@given(st.text(max_size=300))
def test_no_text_but_an_issued_cookie_is_a_session_and_no_csrf_token_but_its_own(
    text: str,
) -> None:
    key = auth.session_key(TOKEN)
    assert not auth.session_valid(key, text, now_s=1000.0)
    cookie = auth.issue_session(key, now_s=1000.0, nonce="n")
    assert auth.csrf_valid(key, cookie, auth.csrf_token(key, cookie))
    assert not auth.csrf_valid(key, cookie, text)


def test_the_login_compares_the_token_and_an_empty_token_matches_nothing() -> None:
    assert auth.token_matches(TOKEN, TOKEN)
    assert not auth.token_matches(TOKEN[:-1], TOKEN)
    assert not auth.token_matches("", "")
    assert not auth.token_matches("\udcff", TOKEN)  # a lone surrogate from a form: refused


# ------------------------------------------------------------------------- history
def test_lag_history_is_bounded_in_points_series_and_time() -> None:
    history = LagHistory(max_points=5, max_series=3, history_ms=60_000)
    for i in range(20):
        history.record(i * 1000, [("t", p, i) for p in range(6)])
    assert len(history) == 3
    assert all(len(history.series("t", p)) <= 5 for p in range(6))
    history.record(200_000, [("t", 9, None)])  # unknown lag: no sample, old ones expire
    assert len(history) == 0


def test_a_sparkline_needs_two_samples_and_stays_in_its_box() -> None:
    assert sparkline([(0, 5)]) == ""
    points = sparkline([(0, 0), (1000, 10), (2000, 5)], width=100, height=20)
    xy = [tuple(map(float, p.split(","))) for p in points.split()]
    assert all(0 <= x <= 100 and 0 <= y <= 20 for x, y in xy)
    assert xy[1][1] < xy[0][1]  # more lag is higher up


# --------------------------------------------------------------------------- views
def test_the_relay_view_reads_state_and_mode_from_readyz() -> None:
    eos = relay_view("http://r", 200, "streaming (exactly-once)", None)
    assert (eos.ready, eos.state, eos.mode) == (True, "streaming", Mode.EXACTLY_ONCE)
    alo = relay_view("http://r", 503, "standby: waiting for slot", None)
    assert (alo.ready, alo.mode) == (False, Mode.AT_LEAST_ONCE)
    gone = relay_view("http://r", None, "", "ConnectError: refused")
    assert not gone.ready and gone.mode is Mode.UNKNOWN and "refused" in gone.state


def test_the_audit_view_reads_the_relays_own_audit_series() -> None:
    registry = CollectorRegistry()
    metrics = AuditMetrics(registry)
    metrics.runs.labels("clean").inc(3)
    metrics.runs.labels("found").inc()
    metrics.missing.set(7)
    metrics.repaired.inc(7)
    view = audit_metrics(generate_latest(registry).decode())
    assert view.runs["clean"] == 3 and view.runs["found"] == 1 and view.total_runs == 4
    assert (view.missing, view.repaired) == (7, 7)


def test_route_views_come_from_the_sinks_registry_and_its_routing() -> None:
    registry = CollectorRegistry()
    metrics = SinkMetrics(registry)
    metrics.route_circuit.labels("/api/internal/users/sync").set(1)
    metrics.route_waiting.labels("/api/internal/users/sync").set(12)
    routed = {"UserRegistered": "/api/internal/users/sync", "Q": "/api/internal/quiz"}
    views = route_views(registry_samples(registry), routed)
    users = next(v for v in views if v.route == "/api/internal/users/sync")
    assert users.circuit_open and users.waiting == 12 and users.types == ("UserRegistered",)
    quiz = next(v for v in views if v.route == "/api/internal/quiz")
    assert not quiz.circuit_open and quiz.waiting == 0  # routed, never used yet


def _partitions() -> list[Any]:
    reset = OffsetReset.EARLIEST
    return [
        partition_lag(
            topic="outbox.event.user",
            partition=0,
            committed=90,
            low=0,
            high=100,
            reset=reset,
            first_ts_ms=NOW_MS - 30_000,
            now_ms=NOW_MS,
        ),
        partition_lag(
            topic="outbox.event.user",
            partition=1,
            committed=50,
            low=0,
            high=50,
            reset=reset,
            first_ts_ms=None,
            now_ms=NOW_MS,
        ),
        partition_lag(
            topic="outbox.event.quiz",
            partition=0,
            committed=None,
            low=0,
            high=7,
            reset=reset,
            first_ts_ms=None,  # an age not read in time: unknown, sorted last
            now_ms=NOW_MS,
        ),
    ]


def _report(**kw: Any) -> PipelineLag:
    defaults: dict[str, Any] = {
        "group": "engine-sync",
        "at_ms": NOW_MS,
        "partitions": tuple(_partitions()),
        "slot": None,
        "parking": {"FAILED": 1, "PENDING": 0, "DONE": 2},
    }
    return PipelineLag(**(defaults | kw))


def test_partitions_sort_by_any_column_with_unknowns_last_and_a_bad_key_by_lag() -> None:
    rows = _partitions()
    by_age, key = sort_partitions(rows, "age", True)
    assert key == "age" and by_age[-1].oldest_unprocessed_age_s is None
    by_lag, key = sort_partitions(rows, "drop table", False)
    assert key == "lag" and [r.lag for r in by_lag] == [10, 7, 0]
    by_topic, _ = sort_partitions(rows, "topic", False)
    assert next(r.topic for r in by_topic) == "outbox.event.quiz"


def test_parking_filters_are_checked_and_name_what_is_wrong() -> None:
    f = parked_filter({"status": "all", "type": "USER_SYNC", "since": "2026-12-04T06:00"})
    assert f.statuses == ("FAILED", "PENDING", "DONE") and f.event_type == "USER_SYNC"
    assert f.since == datetime(2026, 12, 4, 6, tzinfo=UTC)
    with pytest.raises(FilterError, match="status"):
        parked_filter({"status": "LOST"})
    with pytest.raises(FilterError, match="since"):
        parked_filter({"since": "yesterday"})
    with pytest.raises(FilterError, match="until"):
        parked_filter({"since": "2026-12-04T06:00", "until": "2026-12-04T05:00"})
    with pytest.raises(FilterError, match="key"):
        parked_filter({"key": "k" * 201})
    assert ids_of(["3", "1", "3"]) == [1, 3]
    with pytest.raises(FilterError, match="row id"):
        ids_of(["1; DROP"])


def _field(html: str, name: str) -> str:
    match = re.search(rf'data-field="{re.escape(name)}"[^>]*>(.*?)</', html)
    assert match, name
    return re.sub(r"<[^>]+>", "", match.group(1))


def _overview(report: PipelineLag | None, **kw: Any) -> Overview:
    defaults: dict[str, Any] = {
        "at": datetime(2026, 12, 4, 6, tzinfo=UTC),
        "relay": relay_view("http://r", 200, "streaming", None),
        "lag": Readout(report),
        "gaps": Readout([]),
        "parked": Readout({("USER_SYNC", "FAILED"): 2, ("UNROUTABLE", "DONE"): 1}),
        "reasons": Readout([ReasonCount("HTTP 400", 2), ReasonCount("no route for <x>", 1)]),
        "routes": [],
        "sink_state": "consuming",
        "audit": Readout(None, "relay /metrics answered HTTP 404"),
    }
    return Overview(**(defaults | kw))


def test_the_overview_shows_open_rows_by_reason_class_each_linked_to_its_rows() -> None:
    """What ``failed reasons`` counts, in its order, each class a link to the parking page
    filtered by that class exactly; a class is text from the rows, escaped as any value."""
    html = overview_fragment(_overview(_report()))
    assert [_field(html, f"reason-{i}") for i in (0, 1)] == ["HTTP 400", "no route for &lt;x&gt;"]
    assert [_field(html, f"reason-{i}-count") for i in (0, 1)] == ["2", "1"]
    assert '<a href="/console/parking?reason_class=HTTP+400" data-field="reason-0">' in html
    assert 'href="/console/parking?reason_class=no+route+for+%3Cx%3E"' in html
    unread = overview_fragment(_overview(_report(), reasons=Readout(None, "lot busy")))
    assert "lot busy" in unread
    assert 'data-field="reason-0"' not in unread
    empty = overview_fragment(_overview(_report(), reasons=Readout([])))
    assert "no open parked rows" in empty
    blank = overview_fragment(_overview(_report(), reasons=Readout([ReasonCount("", 3)])))
    assert _field(blank, "reason-0") == "(no reason recorded)"
    assert "reason_class=" not in blank  # nothing to filter by


def test_the_parking_filter_takes_a_reason_class_and_keeps_it_in_its_form() -> None:
    f = parked_filter({"reason_class": " HTTP 400 ", "reason": ""})
    assert f.reason_class == "HTTP 400" and f.reason is None
    assert f.query == {"reason_class": " HTTP 400 "}
    assert parked_filter({}).reason_class is None
    with pytest.raises(FilterError, match="reason_class"):
        parked_filter({"reason_class": "x" * 201})


def test_the_overview_shows_the_numbers_of_the_lag_report_it_was_given() -> None:
    report = _report()
    html = overview_fragment(_overview(report))
    totals = report.as_json()["totals"]
    assert isinstance(totals, dict)
    assert _field(html, "lag-total") == str(totals["lag"]) == "17"
    assert _field(html, "lag-partitions") == "2 of 3"
    assert _field(html, "parked-USER_SYNC-FAILED") == "2"
    assert _field(html, "parked-UNROUTABLE-DONE") == "1"
    assert _field(html, "relay-mode") == "at-least-once"
    assert "could not be read: relay /metrics answered HTTP 404" in html


def test_an_unreadable_kafka_is_shown_unknown_never_zero() -> None:
    report = _report(partitions=(), kafka_error="Kafka unreachable: timed out")
    html = overview_fragment(_overview(report))
    assert _field(html, "lag-total") == "unknown"
    assert "Kafka unreachable" in html
    gone = overview_fragment(_overview(None, lag=Readout(None, "GroupNotFoundError: x")))
    assert "could not be read: GroupNotFoundError: x" in gone


def test_the_lag_page_marks_its_sort_and_draws_recent_lag() -> None:
    report = _report()
    history = LagHistory()
    history.record(NOW_MS - 5000, [("outbox.event.user", 0, 4)])
    history.record(NOW_MS, [("outbox.event.user", 0, 10)])
    rows, key = sort_partitions(report.partitions, "lag", True)
    html = lag_page(report, None, rows, sort=key, descending=True, history=history, csrf="c")
    assert 'aria-sort="descending"' in html and "<polyline" in html
    assert _field(html, "lag-outbox.event.user-0") == "10"
    assert "from 4 to 10" in html


def _parked(**kw: Any) -> ParkedEvent:
    at = datetime(2026, 12, 4, 5, tzinfo=UTC)
    defaults: dict[str, Any] = {
        "event_id": 41,
        "event_type": "USER_SYNC",
        "payload_json": '{"user_id": "<script>alert(1)</script>"}',
        "status": "FAILED",
        "retry_count": 2,
        "last_error": "422 user_not_found <b>",
        "next_retry_at": at + timedelta(minutes=5),
        "created_at": at,
        "updated_at": at,
        "outbox_event_id": "0b5c7c2e-6a4f-4d43-9d55-7c5a2a3b1e10",
        "kafka_topic": "outbox.event.user",
        "kafka_partition": 0,
        "kafka_offset": 9,
        "kafka_key": "k<1>",
        "kafka_headers": {"type": "UserRegistered"},
    }
    return ParkedEvent(**(defaults | kw))


def test_the_parking_page_escapes_everything_the_pipeline_wrote() -> None:
    html = parking_page([_parked()], None, parked_filter({}), csrf="tok")
    assert "<b>" not in html and "&lt;b&gt;" in html and "k&lt;1&gt;" in html
    assert 'name="csrf" value="tok"' in html


# -------------------------------------------------------------------------- routes
class FakeSources:
    """What the routes need of ConsoleSources, recorded (pure unit: no service)."""

    def __init__(self) -> None:
        self.history = LagHistory()
        self.last_audit: dict[str, Any] | None = None
        self.retried: list[list[int]] = []
        self.discarded: list[tuple[list[int], str]] = []

    async def overview(self) -> Overview:
        return _overview(_report())

    async def relay_audit(self) -> Readout[Any]:
        return Readout(None, "relay /metrics answered HTTP 404")

    async def lag(self) -> Readout[PipelineLag]:
        return Readout(_report())

    async def parked(self, _: Any) -> Readout[list[ParkedEvent]]:
        return Readout([_parked()])

    async def parked_row(self, event_id: int) -> Readout[ParkedEvent]:
        return Readout(_parked(event_id=event_id))

    async def retry(self, ids: list[int]) -> RetrySummary:
        self.retried.append(ids)
        return RetrySummary(processed_count=len(ids), done_count=len(ids), failed_count=0)

    async def discard(self, ids: list[int], reason: str) -> list[int]:
        self.discarded.append((ids, reason))
        return ids

    async def trace(self, **_: Any) -> Readout[list[Any]]:
        return Readout(None, "TraceNotFound: nothing found")

    async def run_audit(self, **_: Any) -> Readout[dict[str, Any]]:
        raise AssertionError("not in these tests")


class Browser:
    """A synchronous face of httpx's client over the ASGI app (cookies kept), one loop."""

    def __init__(self, app: Any) -> None:
        self._loop = asyncio.new_event_loop()
        transport = httpx.ASGITransport(app=app)
        self._client = httpx.AsyncClient(transport=transport, base_url="http://sink.test")

    def close(self) -> None:
        self._loop.run_until_complete(self._client.aclose())
        self._loop.close()

    def get(self, url: str, **kw: Any) -> httpx.Response:
        return self._loop.run_until_complete(self._client.get(url, **kw))

    def post(self, url: str, **kw: Any) -> httpx.Response:
        return self._loop.run_until_complete(self._client.post(url, **kw))


def _client(token: str = TOKEN) -> tuple[Browser, FakeSources]:
    sources = FakeSources()
    admin_hits: list[str] = []

    async def admin(scope: Any, receive: Any, send: Any) -> None:
        admin_hits.append(scope["path"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    app = with_console(admin, create_console(sources, token=token))  # type: ignore[arg-type]
    client = Browser(app)
    _made.append(client)
    return client, sources


_made: list[Browser] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Any:
    yield
    while _made:
        _made.pop().close()


def _login(client: Browser) -> str:
    answer = client.post("/console/login", data={"token": TOKEN}, follow_redirects=False)
    assert answer.status_code == 303
    page = client.get("/console/").text
    match = re.search(r'name="csrf-token" content="([^"]+)"', page)
    assert match
    return match.group(1)


def test_nothing_without_a_session_and_a_wrong_token_gets_the_login_page() -> None:
    client, _ = _client()
    for path in ("/console/", "/console/lag", "/console/parking", "/console/parking/1"):
        answer = client.get(path, follow_redirects=False)
        assert answer.status_code == 303 and answer.headers["location"] == "/console/login"
    assert client.get("/console/?fragment=1", follow_redirects=False).status_code == 401
    wrong = client.post("/console/login", data={"token": "nope"}, follow_redirects=False)
    assert wrong.status_code == 401 and 'name="token"' in wrong.text
    assert COOKIE not in wrong.cookies
    assert client.get("/api/v1/admin/failed-sync-events").status_code == 204  # admin app


def test_the_session_cookie_is_httponly_strict_and_scoped_to_the_console() -> None:
    client, _ = _client()
    answer = client.post("/console/login", data={"token": TOKEN}, follow_redirects=False)
    header = answer.headers["set-cookie"].lower()
    assert "httponly" in header and "samesite=strict" in header and "path=/console" in header
    assert TOKEN.lower() not in header
    page = client.get("/console/")
    assert (
        page.status_code == 200 and "default-src 'none'" in page.headers["content-security-policy"]
    )
    assert page.headers["cache-control"] == "no-store"


def test_every_action_without_its_csrf_token_is_refused_and_does_nothing() -> None:
    client, sources = _client()
    csrf = _login(client)
    actions = {
        "/console/parking/retry": {"id": "41"},
        "/console/parking/discard": {"id": "41", "reason": "r"},
        "/console/audit/run": {},
        "/console/logout": {},
    }
    for path, form in actions.items():
        assert client.post(path, data=form).status_code == 403, path
        assert client.post(path, data={**form, "csrf": "x" * 64}).status_code == 403, path
    assert sources.retried == [] and sources.discarded == []
    ok = client.post("/console/parking/retry", data={"id": "41", "csrf": csrf})
    assert ok.status_code == 200 and "1 delivered" in ok.text
    by_fetch = client.post(
        "/console/parking/retry", data={"id": "41"}, headers={"X-CSRF-Token": csrf}
    )
    assert by_fetch.status_code == 200
    assert sources.retried == [[41], [41]]


def test_a_discard_needs_a_reason_and_passes_it_on() -> None:
    client, sources = _client()
    csrf = _login(client)
    assert (
        client.post("/console/parking/discard", data={"id": "41", "csrf": csrf}).status_code == 400
    )
    done = client.post(
        "/console/parking/discard", data={"id": "41", "csrf": csrf, "reason": "test data"}
    )
    assert done.status_code == 200 and sources.discarded == [([41], "test data")]


def test_a_repair_asks_for_confirmation_first() -> None:
    client, _ = _client()
    csrf = _login(client)
    audit = client.get("/console/audit")
    assert audit.status_code == 200 and "No audit run from this console yet" in audit.text
    answer = client.post("/console/audit/run", data={"csrf": csrf, "repair": "on"})
    assert answer.status_code == 200 and 'name="confirm" value="yes"' in answer.text


def test_a_form_larger_than_the_bound_is_refused_unread() -> None:
    client, _ = _client()
    _login(client)
    big = client.post("/console/parking/retry", content=b"id=1&" * (MAX_FORM_BYTES // 4))
    assert big.status_code == 413


def test_without_an_admin_token_the_console_is_off() -> None:
    client, _ = _client(token="")
    assert client.get("/console/login").status_code == 503
    assert client.post("/console/login", data={"token": ""}).status_code == 503


def test_first_line_names_the_error_and_no_more() -> None:
    assert first_line(ValueError("one\ntwo")) == "ValueError: one"


def test_every_page_answers_with_a_session_and_escapes_what_it_shows() -> None:
    client, _ = _client()
    _login(client)
    for path, title in {
        "/console/": "Overview",
        "/console/lag?sort=age&dir=asc": "Lag",
        "/console/parking?status=all&key=k": "Parking lot",
        "/console/parking/41": "Parked row 41",
        "/console/audit": "Audit",
    }.items():
        answer = client.get(path)
        assert answer.status_code == 200, path
        assert f"<h1>{title}</h1>" in answer.text, path
        assert "<script>alert" not in answer.text, path
    assert "ascending" in client.get("/console/lag?sort=age&dir=asc").text
    bad = client.get("/console/parking?status=LOST")
    assert bad.status_code == 400 and "status: one of" in bad.text
    traced = client.get("/console/trace?id=0b5c7c2e-6a4f-4d43-9d55-7c5a2a3b1e10")
    assert traced.status_code == 404 and "nothing found" in traced.text
    fragment = client.get("/console/?fragment=1")
    assert fragment.status_code == 200 and "<html" not in fragment.text


def test_the_sinks_app_with_the_console_keeps_the_admin_guard_and_adds_the_console() -> None:
    """``mount_console`` over the real admin app (``outbox-cdc sink``'s wiring): the admin
    API still wants its bearer token; the console answers its login form; a read of an
    unreachable database is shown as could-not-be-read, never a 5xx."""
    from cdc.health import Liveness
    from cdc.settings import Settings
    from sinks.console.app import mount_console
    from sinks.engine.client import EngineClient
    from sinks.http.app import create_app
    from sinks.parking.lot import ParkingLot
    from sinks.parking.retrier import Retrier

    dsn = "postgresql://admin:db-password-xyz@127.0.0.1:1/nowhere?connect_timeout=2"
    settings = Settings(
        pg_dsn=dsn,
        engine_base_url="http://127.0.0.1:1",
        admin_api_token=TOKEN,
        console_relay_url="http://127.0.0.1:1",
    )
    lot = ParkingLot(dsn)
    retrier = Retrier(lot=lot, engine=EngineClient.from_settings(settings), settings=settings)
    registry, liveness = CollectorRegistry(), Liveness()
    admin = create_app(lot=lot, retrier=retrier, token=TOKEN, registry=registry, liveness=liveness)
    app = mount_console(
        admin, settings=settings, lot=lot, retrier=retrier, registry=registry, liveness=liveness
    )
    client = Browser(app)
    _made.append(client)
    assert client.get("/api/v1/admin/failed-sync-events").status_code == 401
    assert client.get("/console/login").status_code == 200
    _login(client)
    parking = client.get("/console/parking")
    assert parking.status_code == 200 and "could not be read" in parking.text
    assert "db-password-xyz" not in parking.text


def test_a_relay_url_without_scheme_is_one_line_naming_the_setting() -> None:
    from pydantic import ValidationError

    from cdc.settings import Settings
    from sinks.console.sources import relay_url

    with pytest.raises(ValidationError, match=r"console_relay_url|CONSOLE_RELAY_URL"):
        Settings(console_relay_url="localhost:9101")
    assert relay_url(Settings(relay_http_port=9301)) == "http://127.0.0.1:9301"
    assert relay_url(Settings(console_relay_url="https://relay.example/")) == (
        "https://relay.example"
    )


def test_the_slot_view_says_failover_and_synced_from_17_and_nothing_before() -> None:
    from cdc.ops import SlotStatus

    slot = SlotStatus(
        slot="outbox_slot",
        exists=True,
        plugin="pgoutput",
        database="outbox",
        active=True,
        active_pid=12,
        holder="walsender 12",
        confirmed_flush_lsn="0/1",
        restart_lsn="0/1",
        current_wal_lsn="0/2",
        wal_lag_bytes=1,
        retained_wal_bytes=2048,
        wal_status="reserved",
        safe_wal_size_bytes=None,
        gap=None,
        failover=True,
        synced=False,
        lag_time_s=0.0,
        oldest_unconfirmed_commit_ts=None,
        lag_time_note="",
    )
    html = overview_fragment(_overview(_report(slot=slot)))
    assert _field(html, "slot-failover") == "yes / no"
    assert _field(html, "slot-retained") == "2.0 KiB"
    before = overview_fragment(_overview(_report(slot={**slot, "failover": None})))
    assert _field(before, "slot-failover") == "\u2013"


def test_an_action_without_a_session_is_refused_before_its_body_is_read() -> None:
    app = create_console(FakeSources(), token=TOKEN)  # type: ignore[arg-type]
    sent: list[dict[str, Any]] = []

    async def must_not_read() -> dict[str, Any]:
        raise AssertionError("the body was read")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/console/parking/retry",
        "raw_path": b"/console/parking/retry",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/x-www-form-urlencoded")],
        "client": ("127.0.0.1", 5000),
        "server": ("sink", 80),
    }
    asyncio.run(app(scope, must_not_read, send))  # type: ignore[arg-type]
    assert sent[0]["status"] == 403
