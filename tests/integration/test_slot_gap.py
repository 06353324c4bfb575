"""Slot gaps against real PostgreSQL and Kafka: a dropped slot is recovered from the outbox
table, never papered over by a slot created silently.

* first start on empty topics creates the slot (recorded as such);
* a slot dropped while the relay is down, writers going on: the restarted relay
  reports the gap, re-publishes the window from the table (header ``recovered``)
  and every committed event is in Kafka;
* manual mode: the relay stays in ``gap`` (``/readyz`` 503, ``/backlog`` over)
  until ``slot recover --execute``; the dry run changes nothing;
* delete-after-insert: ``gap`` and nothing published until ``slot accept-gap``,
  which records who accepted which window;
* ``prune`` keeps rows the slot has not confirmed and rows inside the horizon.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from cdc.outbox import OutboxEvent, write_event
from tests.harness import (
    ROOT,
    Proc,
    RelayConfig,
    drop_slot,
    free_port,
    headers_of,
    read_topics,
    start_relay,
    wait_until,
)

pytestmark = pytest.mark.integration

AGG = "gapdemo"


@pytest.fixture
def cfg(db_dsn: str, kafka_bootstrap: str, unique: str) -> Iterator[RelayConfig]:
    # A small margin: the session's database is shared, the window stays short.
    config = RelayConfig(
        db_dsn=db_dsn, kafka=kafka_bootstrap, unique=unique, extra={"CDC_GAP_MARGIN_S": "2"}
    )
    yield config
    drop_slot(db_dsn, config.slot)


def _cli(cfg: RelayConfig, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cdc.cli", *args],
        env=cfg.env(free_port()),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=check,
    )


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=20) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()
    except (urllib.error.URLError, OSError):
        return 0, ""  # not listening yet


def _history(cfg: RelayConfig) -> list[tuple[Any, ...]]:
    with psycopg.connect(cfg.db_dsn) as conn:
        return conn.execute(
            "SELECT event, cause, state, rows_recovered, accepted_by, window_start"
            " FROM outbox_cdc_slot_history WHERE slot = %s ORDER BY id",
            (cfg.slot,),
        ).fetchall()


def _slot_exists(cfg: RelayConfig) -> bool:
    with psycopg.connect(cfg.db_dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", (cfg.slot,)
        ).fetchone()
    return bool(row and row[0])


def _write(dsn: str, count: int, *, delete_after: bool = False) -> list[str]:
    ids = []
    with psycopg.connect(dsn) as conn:
        for i in range(count):
            with conn.transaction():
                event = OutboxEvent(
                    aggregate_type=AGG, aggregate_id=f"k{i % 5}", event_type="T", payload={"i": i}
                )
                ids.append(str(write_event(conn, event, delete_after=delete_after)))
    return ids


class _Writer(threading.Thread):
    """Commits one event per transaction until stopped; ``ids`` in commit order."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.ids: list[str] = []
        self.halt = threading.Event()

    def run(self) -> None:
        with psycopg.connect(self.dsn) as conn:
            while not self.halt.is_set():
                with conn.transaction():
                    event = OutboxEvent(
                        aggregate_type=AGG, aggregate_id="w", event_type="T", payload={"n": 1}
                    )
                    self.ids.append(str(write_event(conn, event)))
                self.halt.wait(0.01)

    def more(self, count: int) -> list[str]:
        """Wait until ``count`` more events are committed; the ids so far."""
        target = len(self.ids) + count
        wait_until(lambda: len(self.ids) >= target, 60, f"{count} more events")
        return list(self.ids)


def _ids(msgs: list[Any], *, recovered: bool | None = None) -> set[str]:
    out = set()
    for msg in msgs:
        headers = headers_of(msg)
        if recovered is None or ("recovered" in headers) == recovered:
            out.add(headers["id"].decode())
    return out


def _slot_past(cfg: RelayConfig, event_id: str) -> bool:
    """The slot's catalog_xmin is newer than the row's transaction (nudged by a checkpoint,
    which logs the running transactions, and an event the relay confirms after it)."""
    with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT age(o.xmin) > age(s.catalog_xmin) FROM outbox o, pg_replication_slots s"
            " WHERE o.id::text = %s AND s.slot_name = %s",
            (event_id, cfg.slot),
        ).fetchone()
        if row and row[0]:
            return True
        conn.execute("CHECKPOINT")
    _write(cfg.db_dsn, 1)
    return False


def _run_relay(cfg: RelayConfig, tmp: Path, name: str) -> tuple[Proc, int]:
    return start_relay(cfg, tmp, name=name)


def test_first_start_then_a_dropped_slot_is_recovered_with_writers_going_on(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    writer = _Writer(cfg.db_dsn)
    relay, _ = _run_relay(cfg, tmp_path, "first")
    try:
        first_log = relay.log_path.read_text()
        assert "first start" in first_log and f"slot {cfg.slot} created at" in first_log
        writer.start()
        writer.more(20)
        assert relay.terminate() == 0
        before_drop = writer.more(20)
        dropped = json.loads(_cli(cfg, "slot", "drop", "--yes", "--json").stdout)
        assert dropped["dropped"] is True and dropped["slot"] == cfg.slot
        writer.more(20)
        relay2, port = _run_relay(cfg, tmp_path, "second")
        try:
            writer.more(20)
            writer.halt.set()
            writer.join(30)
            msgs = read_topics(cfg.kafka, [cfg.topic_prefix + AGG], expect=len(writer.ids))
            assert set(writer.ids) <= _ids(msgs), "every committed event is in Kafka"
            stranded = set(before_drop[-20:])  # committed while down, before the drop
            assert stranded <= _ids(msgs, recovered=True), "recovered from the table, marked"
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                metrics = r.read().decode()
            assert 'outbox_relay_gaps_total{cause="slot_missing"} 1.0' in metrics
            log2 = relay2.log_path.read_text()
        finally:
            relay2.close()
    finally:
        writer.halt.set()
        relay.close()
    assert "slot gap" in log2 and "recovering the window" in log2
    assert "first start" not in log2, "no slot created silently after the first start"
    history = _history(cfg)
    assert [h[:3] for h in history][1:] == [("gap", "slot_missing", "recovered")]
    assert history[0][0] == "created" and history[0][1] in ("first_start", "init_now")
    assert history[1][3] >= len(stranded)


def test_manual_mode_waits_in_gap_until_recover_execute(cfg: RelayConfig, tmp_path: Path) -> None:
    cfg.extra["CDC_GAP_RECOVERY"] = "manual"
    relay, _ = _run_relay(cfg, tmp_path, "first")
    first = _write(cfg.db_dsn, 5)
    read_topics(cfg.kafka, [cfg.topic_prefix + AGG], expect=5, idle_s=0.5)
    relay.terminate()
    relay.close()
    drop_slot(cfg.db_dsn, cfg.slot)
    stranded = _write(cfg.db_dsn, 7)
    port = free_port()
    relay2 = Proc(["relay"], cfg.env(port), tmp_path / "second.log").start()
    try:
        wait_until(lambda: "gap: slot_missing" in _get(port, "/readyz")[1], 60, "readyz gap")
        assert _get(port, "/readyz")[0] == 503
        status, body = _get(port, "/backlog")
        assert status == 429 and json.loads(body)["state"] == "over", body
        dry = json.loads(_cli(cfg, "slot", "recover", "--json").stdout)
        assert dry["executed"] is False and dry["cause"] == "slot_missing"
        assert dry["rows"] >= len(stranded) and dry["unrecoverable"] is None
        assert not _slot_exists(cfg), "the dry run changes nothing"
        assert _history(cfg)[-1][2] == "open"
        done = json.loads(_cli(cfg, "slot", "recover", "--execute", "--json").stdout)
        assert done["executed"] is True and done["rows"] >= len(stranded)
        wait_until(lambda: _get(port, "/readyz")[0] == 200, 60, "relay streaming again")
        after = _write(cfg.db_dsn, 3)
        msgs = read_topics(cfg.kafka, [cfg.topic_prefix + AGG], expect=15)
        assert set(first + stranded + after) <= _ids(msgs)
        assert set(stranded) <= _ids(msgs, recovered=True)
        status_doc = json.loads(_cli(cfg, "slot", "status", "--json").stdout)
        assert status_doc["gap"]["state"] == "recovered" and status_doc["wal_status"]
        # no gap now: the dry run says why (it printed "no gap: stream: " before)
        again = _cli(cfg, "slot", "recover").stdout
        assert f"no gap: stream: slot {cfg.slot} is the one this relay made" in again, again
        assert "nothing to recover" in again
        # the relay's stream start names the slot's confirmed position, not 0/0
        log = (tmp_path / "second.log").read_text()
        assert re.search(r"streaming from [0-9A-F]+/[0-9A-F]+ \(its confirmed position\)", log)
        assert "streaming from 0/0" not in log
    finally:
        relay2.close()


def test_delete_after_insert_stays_in_gap_until_the_loss_is_accepted(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    relay, _ = _run_relay(cfg, tmp_path, "first")
    published = _write(cfg.db_dsn, 4, delete_after=True)
    read_topics(cfg.kafka, [cfg.topic_prefix + AGG], expect=4, idle_s=0.5)
    relay.terminate()
    relay.close()
    drop_slot(cfg.db_dsn, cfg.slot)
    _write(cfg.db_dsn, 3, delete_after=True)  # lost: neither in the WAL of a slot nor in the table
    port = free_port()
    relay2 = Proc(["relay"], cfg.env(port), tmp_path / "second.log").start()
    try:
        wait_until(lambda: "gap: slot_missing" in _get(port, "/readyz")[1], 60, "readyz gap")
        refused = _cli(cfg, "slot", "recover", "--execute", check=False)
        assert refused.returncode == 1 and "accept-gap" in refused.stderr
        assert not _slot_exists(cfg), "nothing published, no slot, until the loss is accepted"
        accepted = json.loads(
            _cli(cfg, "slot", "accept-gap", "--by", "alice", "--yes", "--json").stdout
        )
        assert accepted["accepted_by"] == "alice" and accepted["window_start"]
        wait_until(lambda: _get(port, "/readyz")[0] == 200, 60, "relay streaming again")
        later = _write(cfg.db_dsn, 2, delete_after=True)
        msgs = read_topics(cfg.kafka, [cfg.topic_prefix + AGG], expect=6)
        assert _ids(msgs) == set(published + later)
        assert not _ids(msgs, recovered=True)
        log = relay2.log_path.read_text()
        assert "accept-gap" in log and log.count("slot gap") == 1, "logged once"
    finally:
        relay2.close()
    event, cause, state, _rows, by, window_start = _history(cfg)[-1]
    assert (event, cause, state, by) == ("gap", "slot_missing", "accepted", "alice")
    assert window_start is not None


def test_prune_keeps_unconfirmed_rows_and_rows_inside_the_horizon(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    cfg.extra["CDC_RECOVERY_HORIZON_S"] = "3600"
    relay, _ = _run_relay(cfg, tmp_path, "relay")
    with psycopg.connect(cfg.db_dsn) as conn:
        rows = conn.execute(
            "INSERT INTO outbox (aggregatetype, aggregateid, type, payload, created_at)"
            " SELECT %s, 'p', 'T', '{}', now() - make_interval(secs => s)"
            " FROM unnest(ARRAY[7200, 7300, 1800]) AS s RETURNING id::text, created_at",
            (AGG + "prune",),
        ).fetchall()
        conn.commit()
    old = [r[0] for r in rows[:2]]
    young = rows[2][0]
    read_topics(cfg.kafka, [cfg.topic_prefix + AGG + "prune"], expect=3, idle_s=0.5)
    wait_until(lambda: _slot_past(cfg, old[0]), 90, "the slot's catalog_xmin past the rows")
    relay.terminate()
    relay.close()
    with psycopg.connect(cfg.db_dsn) as conn:  # committed now, "created" 3 h ago: unpublished
        unpublished = conn.execute(
            "INSERT INTO outbox (aggregatetype, aggregateid, type, payload, created_at)"
            " VALUES (%s, 'p', 'T', '{}', now() - interval '3 hours') RETURNING id::text",
            (AGG + "prune",),
        ).fetchone()
        conn.commit()
    assert unpublished is not None
    out = json.loads(_cli(cfg, "prune", "--older-than", "60", "--json").stdout)
    assert out["horizon_s"] == 3600 and out["kept_unconfirmed_of_slot"] == cfg.slot
    with psycopg.connect(cfg.db_dsn) as conn:
        left = {
            r[0]
            for r in conn.execute(
                "SELECT id::text FROM outbox WHERE id::text = ANY(%s)",
                ([*old, young, unpublished[0]],),
            ).fetchall()
        }
    assert young in left, "inside the horizon"
    assert unpublished[0] in left, "not confirmed by the slot (not in Kafka yet)"
    assert not set(old) & left, "published and older than the horizon: pruned"


def test_a_recovery_that_died_half_way_is_done_again_at_the_next_start(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    relay, _ = _run_relay(cfg, tmp_path, "first")
    published = _write(cfg.db_dsn, 3)
    read_topics(cfg.kafka, [cfg.topic_prefix + AGG], expect=3, idle_s=0.5)
    relay.terminate()
    relay.close()
    drop_slot(cfg.db_dsn, cfg.slot)
    stranded = _write(cfg.db_dsn, 5)
    with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
        # Two rows that cannot become records: dead-lettered by the recovery, never dropped.
        poison = [
            str(row[0])
            for row in conn.execute(
                "INSERT INTO outbox (aggregatetype, aggregateid, type, payload) VALUES"
                " (%s, 'big', 'T', jsonb_build_object('blob', repeat('x', 1100000))),"
                " (%s, '', 'T', '{}') RETURNING id",
                (AGG, AGG),
            ).fetchall()
        ]
        # What a relay killed during its recovery leaves: the gap open, the new slot made
        # (after the stranded rows, so it does not hold them), nothing re-published.
        conn.execute(
            "INSERT INTO outbox_cdc_slot_history (slot, event, cause, detail, state, window_start)"
            " VALUES (%s, 'gap', 'slot_missing', 'killed during recovery', 'open',"
            " now() - interval '1 minute')",
            (cfg.slot,),
        )
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (cfg.slot,))
    relay2, _ = _run_relay(cfg, tmp_path, "second")
    try:
        msgs = read_topics(cfg.kafka, [cfg.topic_prefix + AGG], expect=8)
        assert set(published + stranded) <= _ids(msgs)
        assert set(stranded) <= _ids(msgs, recovered=True)
        assert "killed during recovery" in relay2.log_path.read_text()
        dead = read_topics(cfg.kafka, [cfg.dlq_topic], expect=2)
        assert set(poison) <= _ids(dead, recovered=True)
        reasons = {headers_of(m)["dlq.reason"].decode() for m in dead}
        assert any("lacks aggregateid" in r for r in reasons), reasons
        assert any("Kafka refused" in r for r in reasons), reasons
    finally:
        relay2.close()
    assert _history(cfg)[-1][:3] == ("gap", "slot_missing", "recovered")
