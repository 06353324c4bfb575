"""The operator console in a real browser, on the real pipeline (PostgreSQL, Kafka, relay,
sink, the engine stub over HTTP).

Each test claims what its name says and checks it on what the services hold: the
overview's numbers against ``outbox-cdc lag --json`` and ``slot status --json`` run
beside it; a parked record counted by reason as ``outbox-cdc failed reasons --json``
counts it, found in the parking lot, retried after the stub's fault is gone and seen
applied by the stub; a selection of two retried, each applied once; an event traced by
id and every event of a key traced as ``outbox-cdc trace --key --json`` traces them; a
discard written into the parking lot; a confirmed repair run, its verdict what
``outbox-cdc audit --json`` finds over the same window; every action without its CSRF
token refused (403) and nothing done. Every view is
photographed (``shots``) and passed through axe-core (no serious or critical
violation), and the login is done with the keyboard alone.

The tests share one pipeline and run in file order (``-p no:randomly``): the first
logs in, the later ones reuse its browser context.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from cdc.outbox import OutboxEvent, write_event
from tests.console.conftest import TOKEN, Pipeline
from tests.harness import ROOT, wait_until
from tests.integration.test_audit import _delete_all_records

pytestmark = pytest.mark.integration

#: Bound of any wait on the pipeline (events through relay, Kafka and sink).
PIPELINE_WAIT_S = 90.0
#: Bound of a wait on the page (the overview refreshes every 5 s; a read takes seconds).
PAGE_WAIT_MS = 30_000
#: Violations of these impacts fail the accessibility pass.
FAILING_IMPACTS = ("serious", "critical")


def _cli_any(pipeline: Pipeline, *args: str) -> Any:
    """``outbox-cdc ARGS --json``'s answer, whatever its shape (a list for ``trace --key``)."""
    done = subprocess.run(
        [sys.executable, "-m", "cdc.cli", *args, "--json"],
        env=pipeline.cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
    )
    if not done.stdout.strip():
        raise AssertionError(f"outbox-cdc {' '.join(args)}: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def _cli(pipeline: Pipeline, *args: str) -> dict[str, Any]:
    """``outbox-cdc ARGS --json`` with the sink's environment: its JSON object."""
    answer = _cli_any(pipeline, *args)
    assert isinstance(answer, dict), answer
    return answer


def _lag(pipeline: Pipeline) -> int | None:
    """``outbox-cdc lag --json``'s total (None: no answer yet, e.g. no group yet)."""
    try:
        totals = _cli(pipeline, "lag").get("totals") or {}
    except AssertionError:
        return None
    lag = totals.get("lag")
    return lag if isinstance(lag, int) else None


def _field(page: Any, name: str) -> str:
    return str(page.locator(f'[data-field="{name}"]').first.inner_text()).strip()


def _axe(page: Any, view: str) -> None:
    """axe-core (injected into every document, :func:`context`) over the page as it is: no
    serious or critical violation."""
    assert page.evaluate("() => typeof window.axe !== 'undefined'"), "axe-core not injected"
    found = page.evaluate(
        """async () => (await axe.run(document)).violations.map(
            v => ({id: v.id, impact: v.impact, help: v.help, nodes: v.nodes.length}))"""
    )
    bad = [v for v in found if v["impact"] in FAILING_IMPACTS]
    assert not bad, f"{view}: accessibility violations {bad}"
    print(f"[axe] {view}: {len(found)} minor/moderate: {[v['id'] for v in found]}")


def _look(page: Any, shots: Path, view: str) -> None:
    """A screenshot of the view, then the accessibility pass over it."""
    page.screenshot(path=str(shots / f"console-{view}.png"), full_page=True)
    _axe(page, view)


def _write(pipeline: Pipeline, events: list[OutboxEvent]) -> None:
    with psycopg.connect(pipeline.relay_cfg.db_dsn) as conn, conn.transaction():
        for event in events:
            write_event(conn, event)


def _user_event() -> OutboxEvent:
    user = str(uuid.uuid4())
    return OutboxEvent(
        aggregate_type="user",
        aggregate_id=user,
        event_type="UserRegistered",
        payload={"user_id": user},
    )


def _parked_row(pipeline: Pipeline, event_id: uuid.UUID) -> tuple[Any, ...] | None:
    with psycopg.connect(pipeline.relay_cfg.db_dsn) as conn:
        return conn.execute(
            "SELECT event_id, status, retry_count, last_error FROM failed_sync_events"
            " WHERE outbox_event_id = %s",
            (str(event_id),),
        ).fetchone()


def _applied(pipeline: Pipeline) -> set[str]:
    return {str(i["event_id"]) for i in pipeline.stub.applied()["items"]}


@pytest.fixture(scope="module")
def context(chromium: Any, axe_js: Path) -> Iterator[Any]:
    """The browser context of the tests: axe-core injected into every document (by the
    browser's devtools protocol: the console's Content-Security-Policy, which allows its
    own script only, still holds for the page)."""
    ctx = chromium.new_context(viewport={"width": 1280, "height": 900})
    ctx.add_init_script(path=str(axe_js))
    yield ctx
    ctx.close()


@pytest.fixture(scope="module")
def page(context: Any) -> Iterator[Any]:
    tab = context.new_page()
    tab.set_default_timeout(PAGE_WAIT_MS)
    yield tab
    tab.close()


def test_a_wrong_token_gets_the_login_page_and_the_keyboard_alone_logs_in(
    pipeline: Pipeline, page: Any, shots: Path
) -> None:
    page.goto(f"{pipeline.base}/console/lag")
    assert page.url.endswith("/console/login")
    _look(page, shots, "login")
    page.fill("#token", "not-the-token")
    with page.expect_response(re.compile(r"/console/login$")) as answer:
        page.click("button[type=submit]")
    assert answer.value.status == 401
    assert page.url.endswith("/console/login")
    assert "not the admin token" in page.locator("[role=alert]").inner_text()
    # keyboard only: the skip link first, then the token field (focused), Enter submits
    page.goto(f"{pipeline.base}/console/login")
    page.keyboard.press("Tab")
    assert page.evaluate("() => document.activeElement.className") == "skip"
    page.keyboard.press("Tab")
    assert page.evaluate("() => document.activeElement.id") == "token"
    page.keyboard.type(TOKEN)
    page.keyboard.press("Enter")
    page.wait_for_url(re.compile(r"/console/$"))
    cookie = next(c for c in page.context.cookies() if c["name"] == "outbox_console")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/console"
    assert TOKEN not in cookie["value"]


def test_the_overview_shows_what_lag_and_slot_status_say_and_refreshes_itself(
    pipeline: Pipeline, page: Any, shots: Path
) -> None:
    first = _user_event()  # the topic made, the group joined and committed
    _write(pipeline, [first])
    wait_until(lambda: str(first.event_id) in _applied(pipeline), PIPELINE_WAIT_S, "applied")
    wait_until(lambda: _lag(pipeline) == 0, PIPELINE_WAIT_S, "the group committed")
    held = [_user_event() for _ in range(5)]
    pipeline.stub.add_faults({"refuse_connections_s": 120})  # the engine away: records wait
    try:
        _write(pipeline, held)

        wait_until(
            lambda: _lag(pipeline) == len(held), PIPELINE_WAIT_S, "lag --json: the held records"
        )
        cli_lag = _cli(pipeline, "lag")
        cli_slot = _cli(pipeline, "slot", "status")
        page.goto(f"{pipeline.base}/console/")
        page.evaluate("() => { window.__sameDocument = true; }")
        page.wait_for_function(
            f"""() => document.querySelector('[data-field="lag-total"]')
                  ?.textContent.trim() === '{len(held)}'""",
            timeout=PAGE_WAIT_MS,
        )
        assert _field(page, "lag-total") == str(cli_lag["totals"]["lag"])
        assert _field(page, "lag-group") == cli_lag["group"]
        assert _field(page, "slot-name") == cli_slot["slot"]
        assert _field(page, "slot-active") == ("yes" if cli_slot["active"] else "no")
        assert _field(page, "slot-wal-status") == cli_slot["wal_status"]
        assert _field(page, "relay-ready") == "yes"
        assert _field(page, "relay-mode") == "at-least-once"
        assert _field(page, "gaps-open") == "0"
        _look(page, shots, "overview")
    finally:
        pipeline.stub.end_outage()
    wait_until(
        lambda: {str(e.event_id) for e in held} <= _applied(pipeline),
        PIPELINE_WAIT_S,
        "the held records applied",
    )
    # the live part is fetched again (no full reload) until it shows the drained group
    page.wait_for_function(
        """() => document.querySelector('[data-field="lag-total"]')?.textContent.trim() === '0'
                 && window.__sameDocument === true""",
        timeout=PIPELINE_WAIT_S * 1000,
    )
    assert _cli(pipeline, "lag")["totals"]["lag"] == 0


def test_a_poison_record_is_found_in_the_parking_lot_retried_and_applied(
    pipeline: Pipeline, page: Any, shots: Path
) -> None:
    poison = _user_event()
    pipeline.stub.add_faults(
        {"event_id": str(poison.event_id), "status": 400, "times": -1, "body": {"error": "bad"}}
    )
    _write(pipeline, [poison])
    wait_until(lambda: _parked_row(pipeline, poison.event_id), PIPELINE_WAIT_S, "parked row")
    row = _parked_row(pipeline, poison.event_id)
    assert row is not None and row[1] == "FAILED"
    page.goto(f"{pipeline.base}/console/parking")
    page.fill("#f-key", poison.aggregate_id)
    page.click("form.filters button[type=submit]")
    link = page.locator(f'a[href="/console/parking/{row[0]}"]')
    assert link.count() == 1
    _look(page, shots, "parking")
    link.click()
    assert _field(page, "parked-status") == "FAILED"
    assert "400" in _field(page, "parked-error")
    _look(page, shots, "parked-row")
    assert str(poison.event_id) not in _applied(pipeline)

    # the overview counts it by reason as `outbox-cdc failed reasons` does (one read)
    cli = [(r["reason"], r["count"]) for r in _cli(pipeline, "failed", "reasons")["reasons"]]
    assert ("HTTP 400", 1) in cli, cli
    page.goto(f"{pipeline.base}/console/")
    shown = [
        (_field(page, f"reason-{i}"), int(_field(page, f"reason-{i}-count")))
        for i in range(page.locator('[data-field$="-count"][data-field^="reason-"]').count())
    ]
    assert shown == cli
    page.click('a[data-field^="reason-"] >> text="HTTP 400"')  # its open rows, exactly
    assert page.url.endswith("/console/parking?reason_class=HTTP+400")
    assert page.locator("table tbody tr").count() == 1
    assert page.locator(f'a[href="/console/parking/{row[0]}"]').count() == 1
    page.goto(f"{pipeline.base}/console/parking/{row[0]}")

    pipeline.stub.clear_faults()  # the engine fixed
    page.click("text=Retry now")
    assert "1 delivered" in page.locator("[role=status]").inner_text()
    assert _field(page, "parked-status") == "DONE"
    after = _parked_row(pipeline, poison.event_id)
    assert after is not None and after[1] == "DONE"
    assert str(poison.event_id) in _applied(pipeline)


def test_a_selection_is_discarded_with_its_reason_and_never_sent(
    pipeline: Pipeline, page: Any
) -> None:
    poisons = [_user_event() for _ in range(2)]
    for p in poisons:
        pipeline.stub.add_faults(
            {"event_id": str(p.event_id), "status": 422, "times": -1, "body": {"error": "no"}}
        )
    _write(pipeline, poisons)
    for p in poisons:
        wait_until(lambda p=p: _parked_row(pipeline, p.event_id), PIPELINE_WAIT_S, "parked")
    page.goto(f"{pipeline.base}/console/parking?status=FAILED&reason=422")
    for p in poisons:
        row = _parked_row(pipeline, p.event_id)
        assert row is not None
        page.check(f"#sel-{row[0]}")
    page.fill("#reason", "test data, not for the engine")
    page.click("text=Discard selected")
    assert "discarded 2 row(s)" in page.locator("[role=status]").inner_text()
    for p in poisons:
        row = _parked_row(pipeline, p.event_id)
        assert row is not None and row[1] == "DONE"
        assert "test data, not for the engine" in row[3]
        assert str(p.event_id) not in _applied(pipeline)
    pipeline.stub.clear_faults()


def test_a_selection_is_retried_once_the_engine_is_fixed_and_each_applied_once(
    pipeline: Pipeline, page: Any
) -> None:
    poisons = [_user_event() for _ in range(2)]
    for p in poisons:
        pipeline.stub.add_faults(
            {"event_id": str(p.event_id), "status": 409, "times": -1, "body": {"error": "dup"}}
        )
    _write(pipeline, poisons)
    for p in poisons:
        wait_until(lambda p=p: _parked_row(pipeline, p.event_id), PIPELINE_WAIT_S, "parked")
    rows = [_parked_row(pipeline, p.event_id) for p in poisons]
    assert all(r is not None and r[1] == "FAILED" for r in rows), rows
    page.goto(f"{pipeline.base}/console/parking?reason_class=HTTP+409")
    assert page.locator("table tbody tr").count() == 2  # the class: these two rows only
    for r in rows:
        assert r is not None
        page.check(f"#sel-{r[0]}")
    pipeline.stub.clear_faults()  # the engine fixed
    page.click("text=Retry selected")
    assert "2 processed, 2 delivered" in page.locator("[role=status]").inner_text()
    applied = [str(i["event_id"]) for i in pipeline.stub.applied()["items"]]
    for p in poisons:
        after = _parked_row(pipeline, p.event_id)
        assert after is not None and after[1] == "DONE"
        assert applied.count(str(p.event_id)) == 1


def test_an_event_is_traced_to_the_engines_answer(
    pipeline: Pipeline, page: Any, shots: Path
) -> None:
    event = _user_event()
    _write(pipeline, [event])
    wait_until(lambda: str(event.event_id) in _applied(pipeline), PIPELINE_WAIT_S, "applied")
    wait_until(lambda: _lag(pipeline) == 0, PIPELINE_WAIT_S, "the group committed past it")
    page.goto(f"{pipeline.base}/console/trace")
    page.fill("#t-id", str(event.event_id))
    page.click("form.filters button[type=submit]")
    cli = _cli(pipeline, "trace", str(event.event_id))
    assert _field(page, "trace-state") == cli["state"]
    record = cli["kafka_record"]
    kafka = f"{record['topic']} partition {record['partition']} offset {record['offset']}"
    assert _field(page, "trace-kafka") == kafka
    _look(page, shots, "trace")


def test_every_event_of_a_key_is_traced_as_the_cli_traces_it(pipeline: Pipeline, page: Any) -> None:
    first = _user_event()
    again = OutboxEvent(  # a second event of the same key (the aggregate id)
        aggregate_type="user",
        aggregate_id=first.aggregate_id,
        event_type="UserRegistered",
        payload={"user_id": first.aggregate_id},
    )
    _write(pipeline, [first])
    _write(pipeline, [again])
    for e in (first, again):
        wait_until(lambda e=e: str(e.event_id) in _applied(pipeline), PIPELINE_WAIT_S, "applied")
    wait_until(lambda: _lag(pipeline) == 0, PIPELINE_WAIT_S, "the group committed past them")
    page.goto(f"{pipeline.base}/console/trace")
    page.fill("#t-key", first.aggregate_id)
    page.click("form.filters button[type=submit]")
    cli = _cli_any(pipeline, "trace", "--key", first.aggregate_id)
    assert sorted(t["event_id"] for t in cli) == sorted(str(e.event_id) for e in (first, again))
    assert page.locator("article.trace").count() == len(cli)
    for t in cli:
        article = page.locator(f'article[aria-labelledby="ev-{t["event_id"]}"]')
        state = article.locator('[data-field="trace-state"]').inner_text().strip()
        assert state == t["state"]
        record = t["kafka_record"]
        kafka = f"{record['topic']} partition {record['partition']} offset {record['offset']}"
        assert article.locator('[data-field="trace-kafka"]').inner_text().strip() == kafka


def test_the_lag_and_audit_pages_read_and_a_repair_asks_first(
    pipeline: Pipeline, page: Any, shots: Path
) -> None:
    page.goto(f"{pipeline.base}/console/lag")
    page.reload()  # a second read: the sparklines have two points
    page.click("th a >> text='lag'")
    assert page.locator("th[aria-sort]").count() == 1
    _look(page, shots, "lag")
    page.goto(f"{pipeline.base}/console/audit")
    page.click("text=Run audit")
    said = page.locator("[role=status]").inner_text()
    assert said.startswith("audit ") and "failed" not in said, said
    verdict = _field(page, "audit-verdict")
    assert verdict in {"clean", "in flight", "found", "cannot judge"}, verdict
    _look(page, shots, "audit")
    page.check("#a-repair")
    page.click("text=Run audit")
    assert page.locator("h1").inner_text() == "Confirm the repair"
    _look(page, shots, "audit-confirm")


def test_a_confirmed_repair_republishes_what_kafka_lost_and_the_cli_then_finds_it_complete(
    pipeline: Pipeline, page: Any
) -> None:
    """Every record of the user topic deleted (DeleteRecords: retention at once) after the
    group processed it: the audit finds them missing; with repair confirmed the console's
    run republishes them; `outbox-cdc audit --json` over the window then finds nothing
    missing, and the engine applied the new event once (the sink reads the republished
    records again; the engine keeps one apply per idempotency key)."""
    event = _user_event()
    _write(pipeline, [event])
    wait_until(lambda: str(event.event_id) in _applied(pipeline), PIPELINE_WAIT_S, "applied")
    wait_until(lambda: _lag(pipeline) == 0, PIPELINE_WAIT_S, "the group committed past it")
    _delete_all_records(pipeline.relay_cfg.kafka, pipeline.relay_cfg.topic_prefix + "user")
    page.goto(f"{pipeline.base}/console/audit")
    page.fill("#a-since", "1h")
    page.check("#a-repair")
    page.click("text=Run audit")
    assert page.locator("h1").inner_text() == "Confirm the repair"
    page.click("text=Yes, audit and repair")
    said = page.locator("[role=status]").inner_text()
    assert said.startswith("audit ") and said.endswith(": found"), said
    assert _field(page, "audit-verdict") == "found"
    missing = int(_field(page, "audit-missing-count"))
    assert missing >= 1
    assert int(_field(page, "audit-repaired")) == missing
    after = subprocess.run(
        [sys.executable, "-m", "cdc.cli", "audit", "--since", "1h", "--json"],
        env=pipeline.cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
    )
    report = json.loads(after.stdout)
    assert report["missing_count"] == 0, report
    wait_until(lambda: _lag(pipeline) == 0, PIPELINE_WAIT_S, "the republished records read")
    applied = [str(i["event_id"]) for i in pipeline.stub.applied()["items"]]
    assert applied.count(str(event.event_id)) == 1


def test_every_action_without_its_csrf_token_is_refused_and_changes_nothing(
    pipeline: Pipeline, page: Any
) -> None:
    poison = _user_event()
    pipeline.stub.add_faults(
        {"event_id": str(poison.event_id), "status": 400, "times": -1, "body": {"error": "x"}}
    )
    _write(pipeline, [poison])
    wait_until(lambda: _parked_row(pipeline, poison.event_id), PIPELINE_WAIT_S, "parked")
    row = _parked_row(pipeline, poison.event_id)
    assert row is not None
    pipeline.stub.clear_faults()
    page.goto(f"{pipeline.base}/console/parking")
    forms = {
        "/console/parking/retry": {"id": str(row[0])},
        "/console/parking/discard": {"id": str(row[0]), "reason": "csrf test"},
        "/console/audit/run": {},
        "/console/logout": {},
    }
    for path, form in forms.items():  # a form post of another page: no token, a wrong one
        for extra in ({}, {"csrf": "0" * 64}):
            answer = page.request.post(f"{pipeline.base}{path}", form={**form, **extra})
            assert answer.status == 403, path
        status = page.evaluate(  # a fetch from the console's own page, without the header
            """async ([path, body]) => (await fetch(path, {method: 'POST',
                 headers: {'Content-Type': 'application/x-www-form-urlencoded'},
                 body: new URLSearchParams(body)})).status""",
            [path, form],
        )
        assert status == 403, path
    unchanged = _parked_row(pipeline, poison.event_id)
    assert unchanged is not None and unchanged[1:3] == row[1:3]
    # the same fetch with the session's token is taken: the row is retried
    status = page.evaluate(
        """async (id) => (await fetch('/console/parking/retry', {method: 'POST',
             headers: {'Content-Type': 'application/x-www-form-urlencoded',
                       'X-CSRF-Token': document.querySelector('meta[name=csrf-token]').content},
             body: new URLSearchParams({id: id})})).status""",
        str(row[0]),
    )
    assert status == 200
    done = _parked_row(pipeline, poison.event_id)
    assert done is not None and done[1] == "DONE"


def test_without_javascript_the_pages_read_and_forms_post(
    pipeline: Pipeline, chromium: Any
) -> None:
    ctx = chromium.new_context(java_script_enabled=False)
    try:
        tab = ctx.new_page()
        tab.goto(f"{pipeline.base}/console/login")
        tab.fill("#token", TOKEN)
        tab.click("button[type=submit]")
        assert tab.url.endswith("/console/")
        assert _field(tab, "lag-total").isdigit()
        tab.goto(f"{pipeline.base}/console/parking?status=all")
        assert tab.locator("table tbody tr").count() >= 1
        tab.click("text=Log out")
        assert tab.url.endswith("/console/login")
        tab.goto(f"{pipeline.base}/console/")
        assert tab.url.endswith("/console/login")  # the session is gone with its cookie
    finally:
        ctx.close()


def test_the_sinks_log_holds_no_token_no_session_and_no_csrf_token(
    pipeline: Pipeline, page: Any
) -> None:
    page.goto(f"{pipeline.base}/console/")
    cookie = next(c for c in page.context.cookies() if c["name"] == "outbox_console")["value"]
    csrf = page.locator("meta[name=csrf-token]").get_attribute("content")
    assert csrf
    log = pipeline.sink.log_path.read_text(errors="replace")
    assert "console login from" in log and "console action refused" in log  # it did log
    for secret in (TOKEN, cookie, csrf):
        assert secret not in log
