"""The overview's "parked rows by reason" on a real parking lot (issue 53): the reason
classes the sink's own reasons fall into, their counts, the rows each class's link lists,
and ``outbox-cdc failed reasons --json`` printing the same counts (one source:
:meth:`sinks.parking.lot.ParkingLot.counts_by_reason`).

No browser: PostgreSQL only (a database of its own, migrated, so the counts are exact).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from cdc.migrate import migrate
from sinks.core.machine import UNREADABLE_RECORD
from sinks.core.statuses import classify
from sinks.parking.lot import ParkingLot, ParkRequest
from sinks.parking.retrier import NO_EVENT_ID
from tests.conftest import create_database, drop_database
from tests.harness import ROOT

pytestmark = pytest.mark.integration

BAD_JSON = "payload is not valid JSON"
#: Reasons as the sink writes them (the engine's answers classified by the sink's own
#: code), and the class each is counted under.
REASONS: list[tuple[str, str]] = [
    (classify(400, b'{"error": "bad email"}', {}).reason, "HTTP 400"),
    (classify(400, b'{"error": "bad name"}', {}).reason, "HTTP 400"),
    (classify(400, b"", {}).reason + " (after 3 attempts)", "HTTP 400"),
    (classify(404, b'{"error": "user_not_found"}', {}).reason, "HTTP 404 user_not_found"),
    ("engine unavailable: " + classify(503, b"busy", {}).reason, "engine unavailable: HTTP 503"),
    (f"{UNREADABLE_RECORD}: ValueError: bad: thing", UNREADABLE_RECORD),
    ("UserRegistered: payload is not valid JSON (Expecting value: line 1)", BAD_JSON),
    ("QuizAttemptSubmitted: payload is not valid JSON (not UTF-8: 0xff)", BAD_JSON),
    (NO_EVENT_ID, "no event id"),
]


@pytest.fixture
def lot_dsn(pg_server: str) -> Iterator[str]:
    dsn = create_database(pg_server, "cdc_reasons")
    migrate(dsn)
    yield dsn
    drop_database(pg_server, dsn)


def _request(reason: str) -> ParkRequest:
    event_id = str(uuid.uuid4())
    return ParkRequest(
        outbox_event_id=event_id,
        sync_type="USER_SYNC",
        payload=b'{"user_id": "u"}',
        reason=reason,
        topic="outbox.event.user",
        partition=0,
        offset=1,
        key=b"u",
        headers={"id": event_id.encode(), "type": b"UserRegistered"},
        retry_in_s=0.0,
    )


def test_open_rows_are_counted_per_reason_class_listed_by_it_and_the_cli_prints_the_same(
    lot_dsn: str,
) -> None:
    expected: dict[str, int] = {}
    for _, cls in REASONS:
        expected[cls] = expected.get(cls, 0) + 1
    ranked = sorted(expected.items(), key=lambda kv: (-kv[1], kv[0]))

    async def run() -> None:
        lot = ParkingLot(lot_dsn)
        try:
            ids = await lot.park_many([_request(r) for r, _ in REASONS])
            done = await lot.park_many([_request("HTTP 400: gone")])
            assert await lot.accept(ids=done, event_type=None) == done  # DONE: not counted
            counted = await lot.counts_by_reason(limit=100)
            assert [(c.reason, c.count) for c in counted] == ranked
            top = await lot.counts_by_reason(limit=2)
            assert [(c.reason, c.count) for c in top] == ranked[:2]
            by_id = dict(zip(ids, (cls for _, cls in REASONS), strict=True))
            for cls, n in expected.items():  # each class's link lists exactly its open rows
                rows = await lot.list_rows(reason_class=cls)
                assert sorted(r.event_id for r in rows) == sorted(
                    i for i, c in by_id.items() if c == cls
                ), cls
                assert len(rows) == n
        finally:
            await lot.close()

    asyncio.run(run())
    cli = subprocess.run(
        [sys.executable, "-m", "cdc.cli", "failed", "reasons", "--limit", "100", "--json"],
        env={**os.environ, "CDC_PG_DSN": lot_dsn},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )
    assert cli.returncode == 0, cli.stderr
    printed = [(r["reason"], r["count"]) for r in json.loads(cli.stdout)["reasons"]]
    assert printed == ranked
    with psycopg.connect(lot_dsn) as conn:  # the rows were only read
        assert conn.execute(
            "SELECT count(*) FROM failed_sync_events WHERE status <> 'DONE'"
        ).fetchone() == (len(REASONS),)
