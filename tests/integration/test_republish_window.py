"""Republishing in the window's order: the audit's large repairs read the window through
its ``created_at`` index, each row kept when its id is the run's (cdc.repair.rows).

Real PostgreSQL, real Kafka, both delivery modes. Shape: the window's order is taken
at 50,000 ids and half the window (:data:`cdc.repair.rows.WINDOW_MIN_IDS`,
``WINDOW_SHARE``); here made small (at one id) so a test runs it on a few rows:

* every id of the run once (an id no longer in the table passed by), none of the
  window's other rows, each key's rows in commit order, rows of one transaction (one
  ``created_at``) by id - the order the places' sort gives;
* a run whose ids are a small share of the window's rows (the planner's count) sorts
  their places instead (the window would be read whole for a few of them); the
  planner's count of a few rows is rough, so these tests set the share, and
  ``test_the_window_share_is_judged_on_the_planners_count`` judges it on 20,000 rows;
* the window's own bounds hold: rows created before or after them are not read, even
  when their ids are the run's (the caller's bounds say where its rows are; the audit
  passes its table read's).
"""

from __future__ import annotations

import logging
import random
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from cdc.migrate import migrate
from cdc.outbox import write_event
from cdc.repair import republish, rows
from tests.harness import RelayConfig, read_topics
from tests.integration.test_gap_evidence import (
    _event,
    _headers,
    _settings,
    _topic,
    gap_config,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def cfg(db_dsn: str, kafka_bootstrap: str, unique: str) -> Iterator[RelayConfig]:
    yield from gap_config(db_dsn, kafka_bootstrap, unique)


WINDOW = "read in the window's order"
PLACES = "their places sorted by the server first"


def _write(dsn: str, count: int, per_tx: int = 1, key: str | None = None) -> list[str]:
    """``count`` rows, ``per_tx`` to a transaction (one ``created_at`` each; ``key``: all
    of one aggregate); their ids in the order written."""
    ids: list[str] = []
    with psycopg.connect(dsn) as conn:
        for start in range(0, count, per_tx):
            with conn.transaction():
                for i in range(start, min(start + per_tx, count)):
                    event = _event(i)
                    if key is not None:
                        event = replace(event, aggregate_id=key)
                    ids.append(str(write_event(conn, event)))
    return ids


def _bounds(dsn: str, ids: list[str]) -> tuple[datetime, datetime]:
    """The rows' ``created_at`` span, as ``[since, until)``."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT min(created_at), max(created_at) FROM outbox WHERE id = ANY(%s::uuid[])",
            (ids,),
        ).fetchone()
        conn.execute("ANALYZE outbox")  # (the window's share is judged on the planner's count)
    assert row is not None
    return row[0], row[1] + timedelta(microseconds=1)


def _run(
    cfg: RelayConfig,
    ids: list[str],
    created: tuple[datetime, datetime],
    delivery: str,
    caplog: pytest.LogCaptureFixture,
) -> tuple[int, str]:
    shuffled = [*ids, str(uuid.uuid4())]  # (one no longer in the table)
    random.Random(5).shuffle(shuffled)
    blob = b"".join(uuid.UUID(i).bytes for i in shuffled)
    settings = _settings(cfg, delivery=delivery, republish_tx_max_records=9)
    with caplog.at_level(logging.INFO, logger="cdc.relay"):
        sent = republish.republish(
            settings, memoryview(blob), origin="test/x", mark="audit-w", created=created
        )
    return sent, caplog.text


def _published(cfg: RelayConfig, expect: int, delivery: str) -> list[Any]:
    return read_topics(
        cfg.kafka,
        [_topic(cfg)],
        expect=expect,
        idle_s=1,
        committed_only=delivery == "exactly-once",
    )


@pytest.mark.parametrize("delivery", ["at-least-once", "exactly-once"])
def test_a_large_share_of_the_window_is_read_in_its_order_each_id_once_in_commit_order(
    cfg: RelayConfig,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    delivery: str,
) -> None:
    monkeypatch.setattr(rows, "WINDOW_MIN_IDS", 1)
    monkeypatch.setattr(rows, "WINDOW_SHARE", 0.0)  # (the planner's count of a few rows: rough)
    migrate(cfg.db_dsn)
    before = _write(cfg.db_dsn, 3)  # (created before the window: the run's, not read)
    singles = _write(cfg.db_dsn, 30)
    grouped = _write(cfg.db_dsn, 12, per_tx=4, key="g")  # (one created_at per four rows)
    others = _write(cfg.db_dsn, 4)  # (the window's, not the run's)
    created = _bounds(cfg.db_dsn, singles + grouped + others)
    after = _write(cfg.db_dsn, 2)  # (created after it: the run's, not read)
    ids = singles + grouped
    sent, log = _run(cfg, ids + before + after, created, delivery, caplog)
    assert WINDOW in log
    assert sent == len(ids)
    msgs = _published(cfg, len(ids), delivery)
    got = [_headers(m)["id"].decode() for m in msgs]
    assert sorted(got) == sorted(ids), "every id of the window once, nothing else"
    # Each key's rows in commit order; one transaction's rows (one created_at, key "g")
    # by id, as the places' sort orders them.
    by_tx = [i for at in range(0, 12, 4) for i in sorted(grouped[at : at + 4], key=uuid.UUID)]
    order = {event_id: n for n, event_id in enumerate(singles + by_tx)}
    for key in {m.key() for m in msgs}:
        mine = [_headers(m)["id"].decode() for m in msgs if m.key() == key]
        assert mine == sorted(mine, key=order.__getitem__), key
    assert [_headers(m)["id"].decode() for m in msgs if m.key() == b"g"] == by_tx


def test_a_small_share_of_the_window_sorts_the_places_instead(
    cfg: RelayConfig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(rows, "WINDOW_MIN_IDS", 1)
    monkeypatch.setattr(rows, "WINDOW_SHARE", 2.0)  # (more ids than rows: never the window)
    migrate(cfg.db_dsn)
    written = _write(cfg.db_dsn, 40)
    created = _bounds(cfg.db_dsn, written)
    few = written[::10]
    sent, log = _run(cfg, few, created, "at-least-once", caplog)
    assert PLACES in log and WINDOW not in log
    assert sent == len(few)
    got = [_headers(m)["id"].decode() for m in _published(cfg, len(few), "at-least-once")]
    assert sorted(got) == sorted(few)


def test_the_window_share_is_judged_on_the_planners_count(
    cfg: RelayConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """20,000 rows in the window (200 transactions; the planner's count, after ANALYZE):
    15,000 ids of them are read in the window's order, 2,000 have their places sorted
    (the default share, a half; the minimum made one id)."""
    monkeypatch.setattr(rows, "WINDOW_MIN_IDS", 1)
    migrate(cfg.db_dsn)
    written: list[bytes] = []
    with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
        for _ in range(200):
            written += [
                row[0].bytes
                for row in conn.execute(
                    "INSERT INTO outbox (aggregatetype, aggregateid, type, payload)"
                    " SELECT 'share', 'k' || g % 7, 'T', '{}' FROM generate_series(1, 100) AS g"
                    " RETURNING id"
                )
            ]
    created = _bounds(cfg.db_dsn, [str(uuid.UUID(bytes=i)) for i in written])
    table = sql.Identifier("outbox")
    for share, taken in ((written[:15_000], True), (written[:2_000], False)):
        with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
            rows.session_settings(conn)
            rows.fill_ids(conn, b"".join(share), indexed=True)
            query = rows.window_query(conn, table, created, len(share))
        assert (query is not None) is taken, len(share)
