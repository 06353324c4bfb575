"""The admin API of the real sink process, over real HTTP, on a real parking lot.

One sink (with the engine stub) serves the module; its database is private to
the module and seeded with parked rows the engine accepts, rejects, or cannot
route. Schemathesis fuzzes every operation with all its checks; the hostile
requests of issue 15 are explicit tests. Every test asserts the status and, where
a request could have changed something, what the parking lot holds afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from xml.etree import ElementTree

import httpx
import jsonschema_rs
import psycopg
import pytest

from cdc.migrate import migrate
from sinks.http.admin import RETRY_DEADLINE_S
from sinks.stub.faults import USERS_SYNC_PATH
from sinks.stub.server import StubServer
from tests.conftest import create_database, drop_database
from tests.harness import Proc, RelayConfig, SinkConfig, start_sink

pytestmark = pytest.mark.integration

API_KEY = "admin-test-key"
TOKEN = "admin-test-token-" + "x" * 16
LIST = "/api/v1/admin/failed-sync-events"
RETRY = "/api/v1/admin/failed-sync-events/retry"
MAX_BODY_BYTES = 1024 * 1024
#: Examples per operation (fuzzing phase); deterministic generation, so every run
#: sends the same requests. ADMIN_FUZZ_EXAMPLES raises it for a deeper run.
SCHEMATHESIS_EXAMPLES = int(os.environ.get("ADMIN_FUZZ_EXAMPLES", "200"))


@dataclass
class AdminSink:
    """A running sink with its parking lot."""

    base: str
    dsn: str = field(repr=False)  # holds the password
    proc: Proc
    accepted_ids: list[int]
    rejected_ids: list[int]
    unroutable_ids: list[int]

    def url(self, path: str) -> str:
        return f"{self.base}{path}"

    def rows(self) -> dict[int, tuple[str, int]]:
        """event_id -> (status, retry_count) of every row."""
        with psycopg.connect(self.dsn) as conn:
            found = conn.execute(
                "SELECT event_id, status, retry_count FROM failed_sync_events"
            ).fetchall()
        return {r[0]: (r[1], r[2]) for r in found}


def _park(conn: psycopg.Connection, *, sync_type: str, event_type: str, payload: str) -> int:  # type: ignore[type-arg]
    event_id = str(uuid.uuid4())
    row = conn.execute(
        "INSERT INTO failed_sync_events (event_type, payload_json, status, retry_count,"
        " last_error, outbox_event_id, kafka_topic, kafka_partition, kafka_offset,"
        " kafka_headers) VALUES (%s, %s, 'FAILED', 0, 'seeded', %s, 'outbox.event.user', 0, 1,"
        " %s::jsonb) RETURNING event_id",
        (sync_type, payload, event_id, json.dumps({"id": event_id, "type": event_type})),
    ).fetchone()
    assert row is not None
    return int(row[0])


def _seed(dsn: str, stub: StubServer) -> tuple[list[int], list[int], list[int]]:
    """Rows the engine accepts, rows it rejects forever (400), rows without a route."""
    accepted, rejected, unroutable = [], [], []
    with psycopg.connect(dsn) as conn:
        for _ in range(10):
            payload = json.dumps({"user_id": str(uuid.uuid4())})
            accepted.append(
                _park(conn, sync_type="USER_SYNC", event_type="UserRegistered", payload=payload)
            )
        for _ in range(10):
            payload = json.dumps({"user_id": str(uuid.uuid4())})
            rejected.append(
                _park(conn, sync_type="USER_SYNC", event_type="UserRegistered", payload=payload)
            )
        for _ in range(5):
            unroutable.append(
                _park(conn, sync_type="UNROUTABLE", event_type="NoSuchType", payload="{}")
            )
        outbox_ids = conn.execute(
            "SELECT outbox_event_id::text FROM failed_sync_events WHERE event_id = ANY(%s)",
            (rejected,),
        ).fetchall()
    for (outbox_id,) in outbox_ids:
        stub.add_faults({"event_id": outbox_id, "status": 400, "times": -1})
    return accepted, rejected, unroutable


def _start(
    dsn: str, kafka: str, stub: StubServer, tmp: Path, *, token: str, name: str
) -> tuple[Proc, str]:
    relay = RelayConfig(db_dsn=dsn, kafka=kafka, unique=uuid.uuid4().hex[:10])
    config = SinkConfig(relay=relay, engine_url=stub.url, api_key=API_KEY, admin_token=token)
    proc, port = start_sink(config, tmp, name=name)
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def admin_stub() -> Iterator[StubServer]:
    with StubServer(api_key=API_KEY) as server:
        yield server


@pytest.fixture(scope="module")
def admin_db(pg_server: str) -> Iterator[str]:
    dsn = create_database(pg_server, "cdc_admin")
    migrate(dsn)
    yield dsn
    drop_database(pg_server, dsn)


@pytest.fixture(scope="module")
def admin_sink(
    admin_db: str,
    kafka_bootstrap: str,
    admin_stub: StubServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[AdminSink]:
    accepted, rejected, unroutable = _seed(admin_db, admin_stub)
    tmp = tmp_path_factory.mktemp("admin")
    proc, base = _start(admin_db, kafka_bootstrap, admin_stub, tmp, token=TOKEN, name="sink")
    try:
        yield AdminSink(base, admin_db, proc, accepted, rejected, unroutable)
    finally:
        proc.close()
    log = proc.log_path.read_text(errors="replace")
    assert TOKEN not in log, "the admin token reached the log"
    assert API_KEY not in log, "the engine key reached the log"
    assert "Traceback" not in log, f"the sink logged a traceback:\n{proc.log_tail(80)}"


AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {"content-type": "application/json"}

# --- schemathesis -------------------------------------------------------------


def test_schemathesis_finds_no_failure_with_every_check_on(
    admin_sink: AdminSink, tmp_path: Path
) -> None:
    """Every phase (examples, coverage, fuzzing, stateful), every check, a fixed seed."""
    report = tmp_path / "schemathesis.xml"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "schemathesis.cli",
            "run",
            admin_sink.url("/openapi.json"),
            "--checks=all",
            f"--max-examples={SCHEMATHESIS_EXAMPLES}",
            "--generation-deterministic",
            "--workers=1",
            "--request-timeout=30",
            "--no-color",
            f"--header=Authorization: Bearer {TOKEN}",
            "--report=junit",
            f"--report-junit-path={report}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-12000:] + proc.stderr[-4000:]
    assert _junit_cases(report) == {f"GET {LIST}": "passed", f"POST {RETRY}": "passed"}
    print(proc.stdout[proc.stdout.find("SUMMARY") :])


def _junit_cases(report: Path) -> dict[str, str]:
    """testcase name -> outcome ('passed', 'failure', 'error', 'skipped')."""
    root = ElementTree.parse(report).getroot()
    out = {}
    for case in root.iter("testcase"):
        outcome = next((child.tag for child in case), "passed")
        out[case.attrib["name"]] = outcome
    return out


# --- helpers for the explicit cases ---------------------------------------------


def _post(
    sink: AdminSink, content: bytes, *, headers: dict[str, str] | None = None
) -> httpx.Response:
    merged = {**AUTH, **JSON, **(headers or {})}
    return httpx.post(sink.url(RETRY), content=content, headers=merged, timeout=60)


def _assert_refusal(response: httpx.Response, status: int) -> dict:  # type: ignore[type-arg]
    """The status, and the reference envelope of a refusal."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    body = response.json()
    assert set(body) == {"success", "message", "data"}
    assert body["success"] is False
    assert isinstance(body["data"]["errors"], list)
    return body  # type: ignore[no-any-return]


def _raw_request(port: int, head: bytes, body: bytes = b"", read_timeout_s: float = 60) -> bytes:
    """Send bytes as they are and return the response head (the server may reset after it)."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout_s) as sock:
        with contextlib.suppress(OSError):  # the server answered and closed mid-send
            sock.sendall(head + body)
        received = b""
        try:
            while b"\r\n\r\n" not in received:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                received += chunk
        except ConnectionResetError:
            pass  # what it sent before the reset is still what we read
    return received


def _status_of(response_head: bytes) -> int:
    assert response_head.startswith(b"HTTP/1.1 "), response_head[:200]
    return int(response_head.split(b" ", 2)[1])


def _port(sink: AdminSink) -> int:
    return int(sink.base.rsplit(":", 1)[1])


def _fresh_rows(sink: AdminSink, stub: StubServer) -> tuple[int, int]:
    """One new row the engine accepts and one it rejects forever (fuzzing may have
    retried the seeded ones already)."""
    with psycopg.connect(sink.dsn) as conn:
        good = _park(
            conn,
            sync_type="USER_SYNC",
            event_type="UserRegistered",
            payload=json.dumps({"user_id": str(uuid.uuid4())}),
        )
        bad = _park(
            conn,
            sync_type="USER_SYNC",
            event_type="UserRegistered",
            payload=json.dumps({"user_id": str(uuid.uuid4())}),
        )
        row = conn.execute(
            "SELECT outbox_event_id::text FROM failed_sync_events WHERE event_id = %s", (bad,)
        ).fetchone()
    assert row is not None
    stub.add_faults({"event_id": row[0], "status": 400, "times": -1})
    return good, bad


# --- authentication first ---------------------------------------------------------

HOSTILE_BODIES = {
    "valid": b'{"retry_all": true}',
    "malformed": b'{"event_ids": [1',
    "invalid-utf8": b'{"event_ids": ["\xff\xfe"]}',
    "surrogate-bytes": b'{"\xed\xa0\x80": 1}',
    "surrogate-escape": b'{"event_ids": ["\\ud800"]}',
    "nan": b'{"event_ids": [NaN], "retry_all": Infinity}',
    "deep-1000": b"[" * 1000 + b"]" * 1000,
    "ten-megabytes": b'{"retry_all": true, "pad": "' + b"x" * (10 * 1024 * 1024) + b'"}',
}
BAD_CREDENTIALS = {
    "none": {},
    "wrong-token": {"Authorization": "Bearer not-the-token"},
    "token-prefix": {"Authorization": f"Bearer {TOKEN[:-1]}"},
    "token-plus-one": {"Authorization": f"Bearer {TOKEN}x"},
    "empty-bearer": {"Authorization": "Bearer"},
    "basic-scheme": {"Authorization": f"Basic {TOKEN}"},
    "bare-token": {"Authorization": TOKEN},
    "other-header": {"X-Admin-Token": TOKEN},
}


@pytest.mark.parametrize("credentials", list(BAD_CREDENTIALS), ids=list(BAD_CREDENTIALS))
def test_without_a_valid_token_every_request_gets_401_whatever_its_body(
    admin_sink: AdminSink, credentials: str
) -> None:
    before = admin_sink.rows()
    for name, body in HOSTILE_BODIES.items():
        response = httpx.post(
            admin_sink.url(RETRY),
            content=body,
            headers={**JSON, **BAD_CREDENTIALS[credentials]},
            timeout=60,
        )
        _assert_refusal(response, 401)
        assert response.headers["WWW-Authenticate"].startswith("Bearer "), name
    for method, path in [("GET", LIST), ("GET", RETRY), ("DELETE", LIST), ("GET", "/api/v1/x")]:
        response = httpx.request(
            method, admin_sink.url(path), headers=BAD_CREDENTIALS[credentials], timeout=60
        )
        _assert_refusal(response, 401)
    assert admin_sink.rows() == before, "a refused request changed the parking lot"


def test_two_authorization_headers_are_refused_even_when_one_holds_the_token(
    admin_sink: AdminSink,
) -> None:
    response = httpx.get(
        admin_sink.url(LIST),
        headers=[("Authorization", f"Bearer {TOKEN}"), ("Authorization", "Bearer other")],
    )
    _assert_refusal(response, 401)


def test_the_token_is_checked_before_the_body_is_read(admin_sink: AdminSink) -> None:
    """The request announces 10 MiB and sends none of it: only a server that answers
    before reading the body can answer at all."""
    head = (
        f"POST {RETRY} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {10 * 1024 * 1024}\r\n\r\n"
    ).encode()
    assert _status_of(_raw_request(_port(admin_sink), head)) == 401


# --- body limits -------------------------------------------------------------------


def test_a_body_of_exactly_the_limit_is_read_and_one_byte_more_is_413(
    admin_sink: AdminSink,
) -> None:
    body = b'{"event_ids": [999999999]}'
    exact = body + b" " * (MAX_BODY_BYTES - len(body))
    response = _post(admin_sink, exact)
    assert response.status_code == 200, response.text[:300]
    assert "999999999" in response.json()["message"]
    _assert_refusal(_post(admin_sink, exact + b" "), 413)


def test_a_declared_oversize_body_is_413_before_it_is_sent(admin_sink: AdminSink) -> None:
    head = (
        f"POST {RETRY} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {10 * 1024 * 1024}\r\n\r\n"
    ).encode()
    assert _status_of(_raw_request(_port(admin_sink), head)) == 413


def test_a_streamed_body_without_length_is_cut_off_at_the_limit_with_413(
    admin_sink: AdminSink,
) -> None:
    sent = 0

    def chunks() -> Iterator[bytes]:
        nonlocal sent
        yield b'{"retry_all": true, "pad": "'
        for _ in range(160):  # 10 MiB in 64 KiB chunks, no Content-Length
            sent += 65536
            yield b"x" * 65536
        yield b'"}'

    before = admin_sink.rows()
    response = _post(admin_sink, chunks())  # type: ignore[arg-type]
    _assert_refusal(response, 413)
    assert admin_sink.rows() == before
    assert admin_sink.proc.alive()


# --- header limits -----------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param(b"X-Big: " + b"a" * 100_000 + b"\r\n", id="100KB-line"),
        pytest.param(b"X-Big: " + b"a" * 1_000_000 + b"\r\n", id="1MB-line"),
        pytest.param(b"".join(b"X-%d: a\r\n" % i for i in range(10_000)), id="10000-headers"),
        pytest.param(b"".join(b"X-%d: a\r\n" % i for i in range(101)), id="101-headers"),
    ],
)
@pytest.mark.parametrize("with_token", [True, False], ids=["token", "no-token"])
def test_oversize_header_sections_are_refused_with_431_or_400(
    admin_sink: AdminSink, headers: bytes, with_token: bool
) -> None:
    auth = f"Authorization: Bearer {TOKEN}\r\n".encode() if with_token else b""
    for request_line in (f"GET {LIST}".encode(), b"GET /metrics"):
        head = request_line + b" HTTP/1.1\r\nHost: x\r\n" + auth + headers + b"\r\n"
        assert _status_of(_raw_request(_port(admin_sink), head)) in {400, 431}
    assert admin_sink.proc.alive()


def test_a_header_section_within_the_limits_is_served(admin_sink: AdminSink) -> None:
    headers = {f"X-{i}": "a" * 100 for i in range(90)}
    response = httpx.get(admin_sink.url(LIST), headers={**AUTH, **headers})
    assert response.status_code == 200


# --- hostile bodies with a valid token ---------------------------------------------

#: body -> the status it must get; none of them may change a row.
REFUSED_BODIES: dict[str, tuple[bytes, int]] = {
    "nan-in-ids": (b'{"event_ids": [NaN]}', 422),
    "infinity-in-ids": (b'{"event_ids": [Infinity]}', 422),
    "minus-infinity-in-ids": (b'{"event_ids": [-Infinity]}', 422),
    "1e400-in-ids": (b'{"event_ids": [1e400]}', 422),
    "nan-as-retry-all": (b'{"retry_all": NaN}', 422),
    "infinity-under-unknown-key": (b'{"retry_all": true, "x": Infinity}', 422),
    "1e400-under-unknown-key": (b'{"retry_all": true, "x": [1e400]}', 422),
    "nan-top-level": (b"NaN", 422),
    "surrogate-escape-key": (b'{"\\ud800": 1}', 400),
    "surrogate-escape-value": (b'{"event_ids": ["\\udc00"]}', 400),
    "surrogate-bytes-key": (b'{"\xed\xa0\x80": 1}', 400),
    "surrogate-bytes-value": (b'{"event_ids": ["\xed\xa0\x80"]}', 400),
    "invalid-utf8": (b'{"retry_all": true, "x": "\xff"}', 400),
    "bom": (b'\xef\xbb\xbf{"retry_all": true}', 400),
    "deep-arrays-1000": (b"[" * 1000 + b"]" * 1000, 400),
    "deep-objects-1000": (b'{"a":' * 1000 + b"1" + b"}" * 1000, 400),
    "deep-arrays-500000": (b"[" * 500_000, 400),
    "malformed": (b'{"event_ids": [1,]}', 400),
    "trailing-garbage": (b'{"retry_all": true} x', 400),
    "empty": (b"", 400),
    "string-id": (b'{"event_ids": ["1"]}', 422),
    "padded-string-id": (b'{"event_ids": [" 2 "]}', 422),
    "bool-id": (b'{"event_ids": [true]}', 422),
    "fraction-id": (b'{"event_ids": [1.5]}', 422),
    "zero-id": (b'{"event_ids": [0]}', 422),
    "negative-id": (b'{"event_ids": [-1]}', 422),
    "id-past-2^53": (b'{"event_ids": [9007199254740992]}', 422),
    "id-past-bigint": (b'{"event_ids": [100000000000000000000000000000]}', 422),
    "too-many-ids": (b'{"event_ids": [' + b",".join([b"1"] * 1001) + b"]}", 422),
    "retry-all-yes": (b'{"retry_all": "yes"}', 422),
    "retry-all-on": (b'{"retry_all": "on"}', 422),
    "retry-all-true-string": (b'{"retry_all": "true"}', 422),
    "retry-all-one": (b'{"retry_all": 1}', 422),
    "retry-all-null": (b'{"retry_all": null}', 422),
    "ids-null": (b'{"event_ids": null, "retry_all": true}', 422),
    "empty-ids-no-retry-all": (b'{"event_ids": [], "retry_all": false}', 422),
    "empty-object": (b"{}", 422),
    "retry-all-false": (b'{"retry_all": false}', 422),
    "unknown-key": (b'{"retry_all": true, "event_id": [1]}', 422),
    "array-top-level": (b"[1, 2]", 422),
    "number-top-level": (b"1", 422),
    "null-top-level": (b"null", 422),
}


@pytest.mark.parametrize("case", list(REFUSED_BODIES), ids=list(REFUSED_BODIES))
def test_hostile_bodies_with_the_token_get_a_4xx_and_change_nothing(
    admin_sink: AdminSink, case: str
) -> None:
    body, status = REFUSED_BODIES[case]
    before = admin_sink.rows()
    answer = _assert_refusal(_post(admin_sink, body), status)
    assert answer["data"]["errors"], "a refusal of a body says why"
    assert admin_sink.rows() == before
    assert admin_sink.proc.alive()


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "application/json; charset=latin-1"],
)
def test_a_body_not_declared_as_json_is_415(
    admin_sink: AdminSink, content_type: str | None
) -> None:
    headers = dict(AUTH)
    if content_type is not None:
        headers["content-type"] = content_type
    before = admin_sink.rows()
    response = httpx.post(admin_sink.url(RETRY), content=b'{"retry_all": true}', headers=headers)
    _assert_refusal(response, 415)
    assert admin_sink.rows() == before


def test_error_answers_never_echo_the_body(admin_sink: AdminSink) -> None:
    marker = f"MARKER-{uuid.uuid4().hex}"
    bodies = [
        f'{{"event_ids": ["{marker}"]}}',
        f'{{"retry_all": "{marker}"}}',
        f'{{"retry_all": true, "{"k" * 100}{marker}": 1}}',
        f'{{"event_ids": [1], "x": "{marker * 10_000}"}}',
        f'{{"event_ids": ["{marker}"',
        f"{marker}",
    ]
    for body in bodies:
        response = _post(admin_sink, body.encode())
        assert response.status_code in {400, 422}, body[:100]
        assert marker not in response.text, f"the answer to {body[:80]!r} echoes the body"
        assert len(response.content) < 4096


def test_an_unknown_key_is_named_cut_to_64_characters(admin_sink: AdminSink) -> None:
    key = "k" * 5000
    answer = _assert_refusal(_post(admin_sink, f'{{"retry_all": true, "{key}": 1}}'.encode()), 422)
    assert answer["data"]["errors"][0]["loc"] == ["body", "k" * 64]
    assert answer["data"]["errors"][0]["type"] == "extra_forbidden"


def test_at_most_20_errors_are_reported_for_a_body_full_of_them(admin_sink: AdminSink) -> None:
    body = b'{"event_ids": [' + b",".join([b'"x"'] * 900) + b"]}"
    answer = _assert_refusal(_post(admin_sink, body), 422)
    assert len(answer["data"]["errors"]) == 20
    assert "900 error(s)" in answer["message"]


# --- what is accepted, and the answer's shape -----------------------------------------


def test_retry_answers_the_reference_envelope_and_the_rows_change_accordingly(
    admin_sink: AdminSink, admin_stub: StubServer
) -> None:
    good, bad = _fresh_rows(admin_sink, admin_stub)
    before = admin_sink.rows()
    response = _post(admin_sink, json.dumps({"event_ids": [good, bad, 999_999_999]}).encode())
    assert response.status_code == 200
    answer = response.json()
    assert set(answer) == {"success", "message", "data"}
    assert answer["success"] is True
    assert answer["data"] == {"processed_count": 2, "done_count": 1, "failed_count": 1}
    assert answer["message"].startswith("Retry failed sync events finished")
    assert "999999999" in answer["message"]
    after = admin_sink.rows()
    assert after[good] == ("DONE", 0)
    assert after[bad] == ("FAILED", before[bad][1] + 1)


def test_a_retry_longer_than_its_deadline_answers_in_time_naming_the_rows_not_tried(
    admin_sink: AdminSink, admin_stub: StubServer
) -> None:
    """Edge: a retry whose engine calls outlast the request's deadline (issue 47): the
    users route answers after 1.5 s each (well within the engine client's 3 s read
    timeout), 20 rows are asked for - about 30 s of calls against the admin API's 20 s.
    No row is started after the deadline: the answer comes (200, the reference
    envelope), says it stopped at its deadline and names the rows it did not try; those
    are untouched (FAILED, no attempt spent), the others DONE."""
    with psycopg.connect(admin_sink.dsn) as conn:
        ids = sorted(
            _park(
                conn,
                sync_type="USER_SYNC",
                event_type="UserRegistered",
                payload=json.dumps({"user_id": str(uuid.uuid4())}),
            )
            for _ in range(20)
        )
    admin_stub.add_faults({"path_latency_ms": {USERS_SYNC_PATH: 1500}})
    try:
        response = _post(admin_sink, json.dumps({"event_ids": ids}).encode())
    finally:
        admin_stub.add_faults({"path_latency_ms": None})
    assert response.status_code == 200, response.text[:500]
    answer = response.json()
    assert answer["success"] is True
    message = answer["message"]
    assert message.startswith(
        f"Retry failed sync events stopped at its deadline ({RETRY_DEADLINE_S:g} s)"
    ), message
    tried = answer["data"]["processed_count"]
    assert 0 < tried < len(ids), answer
    assert answer["data"]["done_count"] == tried
    untried = ids[tried:]  # (rows are tried in id order)
    assert f"not tried before the deadline: {untried}" in message, message
    rows = admin_sink.rows()
    assert all(rows[i] == ("DONE", 0) for i in ids[:tried]), rows
    assert all(rows[i] == ("FAILED", 0) for i in untried), rows


def test_an_integral_number_written_with_a_fraction_is_the_same_id(
    admin_sink: AdminSink, admin_stub: StubServer
) -> None:
    """JSON has one number type and the schema says ``integer``: 7.0 is the id 7."""
    good, _ = _fresh_rows(admin_sink, admin_stub)
    response = _post(admin_sink, f'{{"event_ids": [{good}.0]}}'.encode())
    assert response.status_code == 200
    assert response.json()["data"]["done_count"] == 1
    assert admin_sink.rows()[good] == ("DONE", 0)


def test_the_list_shows_open_rows_in_the_reference_envelope(admin_sink: AdminSink) -> None:
    answer = httpx.get(admin_sink.url(LIST), headers=AUTH).json()
    assert set(answer) == {"success", "message", "data"}
    assert answer["success"] is True
    open_ids = {i for i, (status, _) in admin_sink.rows().items() if status != "DONE"}
    assert {e["event_id"] for e in answer["data"]["events"]} == open_ids
    assert answer["data"]["count"] == len(open_ids)


# --- the schema says what the server accepts ----------------------------------------


def test_the_openapi_document_declares_bearer_security_and_every_answer(
    admin_sink: AdminSink,
) -> None:
    doc = httpx.get(admin_sink.url("/openapi.json")).json()
    schemes = doc["components"]["securitySchemes"]
    assert list(schemes.values()) == [{**next(iter(schemes.values())), "scheme": "bearer"}]
    (scheme_name,) = schemes
    expected = {
        ("get", LIST): {"200", "401", "413", "431", "503"},
        ("post", RETRY): {"200", "400", "401", "413", "415", "422", "431", "503"},
    }
    operations = {(m, p): op for p, item in doc["paths"].items() for m, op in item.items()}
    assert set(operations) == set(expected)
    for key, operation in operations.items():
        assert operation["security"] == [{scheme_name: []}]
        assert set(operation["responses"]) == expected[key]
        for code, response in operation["responses"].items():
            ref = response["content"]["application/json"]["schema"]["$ref"]
            wanted = "ErrorResponse" if code[0] in "45" else ref.rsplit("/", 1)[1]
            assert ref == f"#/components/schemas/{wanted}"
        assert "WWW-Authenticate" in operation["responses"]["401"]["headers"]
    body = operations[("post", RETRY)]["requestBody"]
    assert body["required"] is True
    assert list(body["content"]) == ["application/json"]
    retry = doc["components"]["schemas"]["RetryResponse"]
    assert set(retry["properties"]) == {"success", "message", "data"}
    data = doc["components"]["schemas"]["RetryData"]
    assert set(data["properties"]) == {"processed_count", "done_count", "failed_count"}


def test_the_served_schema_and_the_server_agree_on_every_body(admin_sink: AdminSink) -> None:
    """What the document's RetryRequest schema accepts gets a 200, what it refuses a 422."""
    doc = httpx.get(admin_sink.url("/openapi.json")).json()
    validator = jsonschema_rs.validator_for(doc["components"]["schemas"]["RetryRequest"])
    bodies = [
        {"event_ids": [999_999_990]},
        {"event_ids": [999_999_991], "retry_all": False},
        {"event_ids": [999_999_992], "retry_all": True},
        {"event_ids": [999_999_993.0]},
        {"event_ids": [2**53 - 1]},
        {"event_ids": []},
        {"event_ids": [], "retry_all": False},
        {"retry_all": False},
        {},
        {"event_ids": ["1"]},
        {"event_ids": [True]},
        {"event_ids": [1.5]},
        {"event_ids": [0]},
        {"event_ids": [2**53]},
        {"event_ids": [1] * 1001},
        {"retry_all": "yes"},
        {"retry_all": 1},
        {"retry_all": None},
        {"retry_all": True, "other": 1},
    ]
    for body in bodies:
        status = _post(admin_sink, json.dumps(body).encode()).status_code
        assert status == (200 if validator.is_valid(body) else 422), body


# --- no token configured -------------------------------------------------------------


def test_without_a_configured_token_the_admin_api_answers_503_whatever_the_request(
    admin_db: str,
    kafka_bootstrap: str,
    admin_stub: StubServer,
    tmp_path: Path,
) -> None:
    proc, base = _start(admin_db, kafka_bootstrap, admin_stub, tmp_path, token="", name="open")
    try:
        before = AdminSink(base, admin_db, proc, [], [], []).rows()
        for headers in ({}, AUTH, {"Authorization": "Bearer"}):
            for body in HOSTILE_BODIES.values():
                response = httpx.post(
                    f"{base}{RETRY}", content=body, headers={**JSON, **headers}, timeout=60
                )
                _assert_refusal(response, 503)
            _assert_refusal(httpx.get(f"{base}{LIST}", headers=headers), 503)
        for public in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
            assert httpx.get(f"{base}{public}").status_code == 200, public
        assert AdminSink(base, admin_db, proc, [], [], []).rows() == before
    finally:
        proc.close()
    assert "Traceback" not in proc.log_path.read_text(errors="replace")
