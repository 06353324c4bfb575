"""Pure parts of issue 22 items 7/8 and issue 24: stall watch, connection
defaults, the outbox layout by column name, exact JSON checks."""

from __future__ import annotations

import time

import pytest
from psycopg.conninfo import conninfo_to_dict

from cdc.jsontext import object_error, object_members
from cdc.pgconn import CLIENT_DEFAULTS, Use, conninfo
from cdc.relay.health.stall import StallWatch
from cdc.router import BrokenOutbox, OutboxLayout, outbox_layout


def test_a_stall_shows_only_after_the_threshold_with_work_waiting_and_clears_on_an_ack() -> None:
    watch = StallWatch(10.0, now=0.0)
    idle = {"in_flight": 0, "pending": 0, "acked": 0, "confirmable": 1}
    assert watch.observe(100.0, **idle) is None, "nothing waits: never stalled"
    waiting = {**idle, "in_flight": 5}
    assert watch.observe(101.0, **waiting) is None
    assert watch.observe(110.5, **waiting) is None, "a blip shorter than the threshold"
    reason = watch.observe(111.5, **waiting)
    assert reason is not None and reason.startswith("no record acknowledged for 10s")
    assert watch.observe(112.0, **{**waiting, "acked": 1}) is None, "an ack clears it"
    assert watch.observe(121.0, **{**waiting, "acked": 1}) is None
    assert watch.observe(122.5, **{**waiting, "acked": 1}) is not None
    assert watch.observe(123.0, **{**waiting, "in_flight": 4, "acked": 1}) is None


def test_connection_defaults_fill_in_without_overriding_the_dsn() -> None:
    dsn = "postgresql://u:p%40ss@db:5433/app?keepalives_idle=3&connect_timeout=2"
    params = conninfo_to_dict(conninfo(dsn, Use.CLI))
    assert params["keepalives_idle"] == "3" and params["connect_timeout"] == "2"
    assert params["password"] == "p@ss" and params["host"] == "db" and params["port"] == "5433"
    for name in ("keepalives", "keepalives_interval", "keepalives_count", "tcp_user_timeout"):
        assert params[name] == CLIENT_DEFAULTS[name]


COLS = [
    ("id", 2950),
    ("aggregatetype", 25),
    ("aggregateid", 1043),
    ("type", 25),
    ("payload", 3802),
    ("created_at", 1184),
    ("tracingspancontext", 25),
]


def test_columns_are_found_by_name_and_an_absent_one_is_never_a_position() -> None:
    layout = outbox_layout("public.outbox", COLS)
    assert isinstance(layout, OutboxLayout)
    assert (layout.type, layout.payload, layout.trace, layout.payload_jsonb) == (3, 4, 6, True)
    no_trace = outbox_layout("public.outbox", COLS[:-1])
    assert isinstance(no_trace, OutboxLayout) and no_trace.trace is None
    renamed = [("event_type", t) if n == "type" else (n, t) for n, t in COLS]
    broken = outbox_layout("app.outbox", renamed)
    assert isinstance(broken, BrokenOutbox)
    assert broken.problem == "outbox table app.outbox has no column type (renamed or dropped?)"
    assert "type" not in broken.positions
    retyped = [(n, 23) if n == "payload" else (n, t) for n, t in COLS]
    problem = outbox_layout("app.outbox", retyped)
    assert isinstance(problem, BrokenOutbox) and "column payload has type oid 23" in problem.problem


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (b'{"n": 18446744073709551616, "e": 1.5e400}', None),
        (b' {"a": [1, {"b": null}]} ', None),
        (b"{}", None),
        (b"[1]", "not a JSON object"),
        (b"not json", "not JSON"),
        (b'{"n": NaN}', "not JSON"),
        (b'{"n": Infinity}', "not JSON"),
        (b'{"a": 1} {}', "not JSON"),
        (b'{"a": "\xff"}', "not JSON"),
        (b'{"a": 1,}', "not JSON"),
    ],
)
def test_object_error_checks_without_converting_numbers(text: bytes, error: str | None) -> None:
    found = object_error(text)
    assert (found is None) if error is None else (found is not None and found.startswith(error))


def test_members_keep_their_exact_text() -> None:
    text = '{"id": 7, "payload" :  {"x": 1.50e400, "y": "\\u00e9"} , "payload2": []}'
    members = object_members(text)
    assert members["payload"][1] == '{"x": 1.50e400, "y": "\\u00e9"}'
    assert members["id"] == ("7", "7")


def test_a_silent_stream_ends_the_session_counted_with_its_cause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No message while listening for CDC_REPLICATION_SILENCE_S and the walsender seen
    idle at two looks: StreamError (the session loop then reconnects, /readyz saying
    ``reconnecting: <this reason>``), the silence counted, the abandoned walsender
    ended; status updates asked for a reply."""
    from cdc.errors import StreamError
    from cdc.relay.health import silence as silence_mod
    from cdc.relay.health import silent_session as silent_mod
    from cdc.relay.stream import loop as relay_mod
    from cdc.relay.stream.loop import Relay
    from cdc.settings import Settings
    from cdc.wal.looks import WalsenderSample
    from cdc.wal.lsn import LsnTracker
    from tests.unit.test_relay_routing import FakeTopics, RecordingProducer

    class Silent:
        backend_pid = 4242
        wal_sender_timeout_ms = 0

        def server_dsn(self, dsn: str) -> str:
            return dsn

        def wait_readable(self, timeout_s: float) -> bool:
            return False  # (the last chance: nothing arrives)

        def __init__(self) -> None:
            self.replies: list[bool] = []

        def send_status(
            self, lsn: int, *, reply_requested: bool = False, ask_raise: bool = True
        ) -> int:
            self.replies.append(reply_requested)
            return lsn  # (a stream without a limit)

        def get_nowait(self) -> tuple[int, None]:
            return 0, None

        def read(self, timeout_s: float) -> None:
            return None

    ended: list[int] = []
    looks: list[int] = []

    def look(dsn: str, slot: str, pid: int, timeout_s: float) -> WalsenderSample:
        looks.append(pid)
        return WalsenderSample(
            at_s=time.monotonic(),
            found=True,
            state="active",
            wait_event_type="Client",
            wait_event="WalSenderWaitForWAL",
            sent_lsn=100,
        )

    monkeypatch.setattr(silent_mod, "look_at_walsender", look)
    monkeypatch.setattr(silence_mod, "LOOK_EVERY_S", 0.3)
    monkeypatch.setattr(relay_mod, "TopicManager", lambda **_: FakeTopics())
    monkeypatch.setattr(
        silent_mod, "end_walsender", lambda dsn, slot, pid, t: ended.append(pid) or True
    )
    monkeypatch.setattr(silent_mod, "REPLY_REQUEST_AFTER_S", 0.1)
    relay = Relay(
        Settings(
            pg_dsn="postgresql://x",
            kafka_bootstrap_servers="127.0.0.1:9",
            replication_silence_s=1.5,
        ),
        serve_http=False,
    )
    relay._producer = RecordingProducer()  # type: ignore[assignment]
    stream = Silent()
    from cdc.relay.health.state import Session

    sess = Session(stream=stream, tracker=LsnTracker(0))  # type: ignore[arg-type]
    with pytest.raises(StreamError, match="replication connection silent for"):
        relay._stream_loop(sess)
    assert ended == [4242]
    assert looks == [4242, 4242], "ended only when seen idle at two looks"
    assert (
        relay.registry.get_sample_value("outbox_relay_walsender_looks_total", {"verdict": "end"})
        == 1
    )
    assert relay.registry.get_sample_value("outbox_relay_replication_silences_total") == 1
    assert True in stream.replies, "a quiet stream asks the server for a reply"
