"""docs/getting-started/writing-events.md, run as a newcomer copies it (issue 47, item 8).

The page's two Python examples run as they stand (``exec`` of the page's own text, with
``CDC_PG_DSN`` set) against the real database, a real relay, a real sink and the engine
stub over HTTP. What the page says is what happens: the ``OrderPlaced`` example is parked
by the default sink as ``UNROUTABLE`` - and ``outbox-cdc failed list`` shows it so, in 80
columns, with no next retry, and in ``--json`` under fields named for what they hold -
while the ``UserRegistered`` example reaches the engine under its event id.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest

from sinks.stub.server import StubServer
from tests.harness import ROOT, Proc, SinkConfig, free_port, start_sink, wait_until

pytestmark = pytest.mark.integration

PAGE = ROOT / "docs" / "getting-started" / "writing-events.md"


def _examples() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S)
    return [b for b in blocks if "write_event(" in b]


def _parked(dsn: str, event_id: uuid.UUID) -> tuple[int, str] | None:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT event_id, event_type FROM failed_sync_events WHERE outbox_event_id = %s",
            (event_id,),
        ).fetchone()
    return None if row is None else (int(row[0]), str(row[1]))


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cdc.cli", *args],
        env={**env, "COLUMNS": "80"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def test_the_pages_examples_run_and_do_what_the_page_says(
    relay: Proc,
    sink_cfg: SinkConfig,
    stub: StubServer,
    db_dsn: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    order_example, user_example = _examples()
    assert 'event_type="OrderPlaced"' in order_example
    assert 'event_type="UserRegistered"' in user_example
    sink, _ = start_sink(sink_cfg, tmp_path)
    try:
        monkeypatch.setenv("CDC_PG_DSN", db_dsn)
        order: dict[str, object] = {}
        exec(compile(order_example, str(PAGE), "exec"), order)
        user: dict[str, object] = {}
        exec(compile(user_example, str(PAGE), "exec"), user)
        order_id, user_id = order["event_id"], user["event_id"]
        assert isinstance(order_id, uuid.UUID) and isinstance(user_id, uuid.UUID)

        wait_until(
            lambda: str(user_id) in {i["event_id"] for i in stub.applied()["items"]},
            120,
            "the UserRegistered example applied by the engine",
        )
        parked = wait_until(lambda: _parked(db_dsn, order_id), 120, "the OrderPlaced parked")
    finally:
        sink.close()
    assert str(order_id) not in {i["event_id"] for i in stub.applied()["items"]}
    row_id, sync_type = parked
    assert sync_type == "UNROUTABLE"

    env = sink_cfg.env(free_port())
    listed = json.loads(_cli("failed", "list", "--type", "OrderPlaced", "--json", env=env).stdout)
    [mine] = [e for e in listed["events"] if e["outbox_event_id"] == str(order_id)]
    assert (mine["id"], mine["sync_type"], mine["type"]) == (row_id, "UNROUTABLE", "OrderPlaced")
    assert mine["retry_scheduled"] is False  # the scheduler leaves it until a route exists
    assert (mine["event_id"], mine["event_type"]) == (row_id, "UNROUTABLE")  # kept as before

    table = _cli("failed", "list", "--type", "OrderPlaced", env=env).stdout
    assert max(len(line) for line in table.splitlines()) <= 80
    [line] = [x for x in table.splitlines() if re.match(rf"│ +{row_id} │", x)]
    cells = [c.strip() for c in line.strip("│").split("│")]
    assert cells[:5] == [str(row_id), "UNROUTABLE", "FAILED", "0", "-"], line
    assert cells[6].startswith("no route"), line
