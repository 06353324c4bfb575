"""Exactly-once republishing: an aborted transaction is redone from its rows as the run read them.

A republishing run (the audit's repair, the start-up check, gap recovery) keeps only
the event ids of its open Kafka transaction for a redo; a redo makes the records again
from their rows, read in the run's own snapshot (cdc.repair.republish.rows_again).
Real PostgreSQL, real Kafka:

* the audit's path (:func:`cdc.repair.republish.republish`): a row whose record the
  broker refuses (over its topic's ``max.message.bytes``) makes its transaction abort;
  the redo - after every row of the window was deleted from the table, between the
  run's read and the redo - still finds the rows in the run's snapshot: every id once
  for a read_committed consumer, the refused one as a dead letter, each key's rows in
  order (shape: 40 rows in transactions of 7, ids handed over shuffled);
* gap recovery's path (:func:`cdc.relay.gaps.recovery.recover`, the slot's exported
  snapshot): the same refused row in a gap's window, redone from that snapshot.
"""

from __future__ import annotations

import base64
import logging
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from cdc.outbox import OutboxEvent, write_event
from cdc.relay.gaps import recovery
from cdc.repair import publisher, republish
from tests.harness import RelayConfig, drop_slot, read_topics
from tests.integration.test_exactly_once import _create_topic
from tests.integration.test_gap_evidence import (
    _event,
    _first_run,
    _headers,
    _ids,
    _settings,
    _topic,
    _write,
    gap_config,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def cfg(db_dsn: str, kafka_bootstrap: str, unique: str) -> Iterator[RelayConfig]:
    yield from gap_config(db_dsn, kafka_bootstrap, unique)


#: The topic's max.message.bytes, and a payload over it (its record is refused) that no
#: compression brings under it.
TOPIC_MAX_BYTES = 4096
#: One record per produce request: the broker refuses a whole batch over the topic's
#: max.message.bytes, the records beside the big one too (librdkafka does not split it).
ALONE = {"batch.num.messages": "1"}
BIG_PAYLOAD = {"blob": base64.b64encode(random.Random(1).randbytes(3 * TOPIC_MAX_BYTES)).decode()}


def _write_big(dsn: str) -> str:
    """One row whose record is over the topic's ``max.message.bytes``; its id."""
    with psycopg.connect(dsn) as conn, conn.transaction():
        big = OutboxEvent(
            aggregate_type=_event(0).aggregate_type,
            aggregate_id="k9",
            event_type="T",
            payload=BIG_PAYLOAD,
        )
        return str(write_event(conn, big))


def _committed(cfg: RelayConfig, expect: int) -> list[Any]:
    return read_topics(
        cfg.kafka, [_topic(cfg), cfg.dlq_topic], expect=expect, idle_s=1, committed_only=True
    )


def _assert_once_with_a_dead_letter(
    cfg: RelayConfig, msgs: list[Any], ids: list[str], big: str
) -> None:
    """Every id once; the refused one as its dead letter (with the reason); each key's
    rows in the order written."""
    per_id: dict[str, int] = {}
    for m in msgs:
        event_id = _headers(m)["id"].decode()
        per_id[event_id] = per_id.get(event_id, 0) + 1
    assert per_id == dict.fromkeys(ids, 1), "every id once, none twice"
    letters = [m for m in msgs if m.topic() == cfg.dlq_topic]
    assert [_headers(m)["id"].decode() for m in letters] == [big]
    assert b"refused" in _headers(letters[0])["dlq.reason"]
    order = {event_id: n for n, event_id in enumerate(ids)}
    for key in {m.key() for m in msgs if m.topic() == _topic(cfg)}:
        mine = [
            _headers(m)["id"].decode() for m in msgs if m.key() == key and m.topic() == _topic(cfg)
        ]
        assert mine == sorted(mine, key=order.__getitem__), key


def test_a_refused_record_redoes_its_transaction_from_the_rows_as_the_run_read_them(
    cfg: RelayConfig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _create_topic(cfg.kafka, _topic(cfg), {"max.message.bytes": str(TOPIC_MAX_BYTES)})
    from cdc.migrate import migrate

    migrate(cfg.db_dsn)
    ids = _write(cfg.db_dsn, 20)
    big = _write_big(cfg.db_dsn)
    ids += [big, *_write(cfg.db_dsn, 19)]
    shuffled = list(ids)
    random.Random(3).shuffle(shuffled)
    send = publisher.Publisher.send
    deleted: list[int] = []

    def send_then_delete(self: publisher.Publisher, record: Any) -> None:
        send(self, record)
        if not deleted:  # (the run has read; the table loses every row of the window)
            with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
                gone = conn.execute("DELETE FROM outbox WHERE id = ANY(%s::uuid[])", (ids,))
                deleted.append(gone.rowcount)

    monkeypatch.setattr(publisher.Publisher, "send", send_then_delete)
    settings = _settings(
        cfg, delivery="exactly-once", republish_tx_max_records=7, kafka_config=ALONE
    )
    blob = b"".join(uuid.UUID(i).bytes for i in shuffled)
    with caplog.at_level(logging.WARNING, logger="cdc.relay"):
        sent = republish.republish(settings, memoryview(blob), origin="test/x", mark="audit-r")
    assert deleted == [len(ids)]
    assert sent == len(ids)
    assert "redoing it" in caplog.text
    _assert_once_with_a_dead_letter(cfg, _committed(cfg, len(ids)), ids, big)


def test_gap_recovery_redoes_a_refused_records_transaction_from_the_slots_snapshot(
    cfg: RelayConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _create_topic(cfg.kafka, _topic(cfg), {"max.message.bytes": str(TOPIC_MAX_BYTES)})
    cfg.extra["CDC_DELIVERY"] = "exactly-once"
    first = _first_run(cfg, tmp_path)
    drop_slot(cfg.db_dsn, cfg.slot)  # (the gap: the slot is gone, rows written after it)
    stranded = _write(cfg.db_dsn, 9)
    big = _write_big(cfg.db_dsn)
    stranded += [big, *_write(cfg.db_dsn, 9)]
    settings = _settings(
        cfg, delivery="exactly-once", republish_tx_max_records=4, kafka_config=ALONE
    )
    found = recovery.inspect(settings)
    gap = recovery.open_gap(settings, found)
    with caplog.at_level(logging.WARNING, logger="cdc.relay"):
        recovery.recover(settings, gap)
    assert "redoing it" in caplog.text
    msgs = _committed(cfg, len(first) + len(stranded))
    assert set(first) <= _ids(msgs)
    mine = [m for m in msgs if _headers(m)["id"].decode() in set(stranded)]
    _assert_once_with_a_dead_letter(cfg, mine, stranded, big)
