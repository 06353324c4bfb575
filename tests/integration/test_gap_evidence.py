"""Gap detection that cannot be fooled (issue 34), against real PostgreSQL and real Kafka.

Each test is one thing done to the world while the relay is down (or at its first
start), then the relay started, and what Kafka, the slot and the slot history hold
afterwards. Every one failed on the code before issue 34:

* a record with a non-UTF-8 header name at the tail of the relay's topic: the
  relay starts (it crashed with ``SystemError`` at every start), passes it by
  and counts it;
* another cluster's records (same slot name) and records without ``origin``,
  newer than the relay's own: not its memory, no gap, the healthy slot kept
  (before: a false ``system_changed`` gap, the slot dropped, the events lost);
* the slot dropped and re-created under the same name while the relay is down:
  ``slot_replaced``, every event recovered (before: trusted, events lost);
* table rows and logical messages over a dropped slot: the gap stays open
  (``/readyz`` 503, one ERROR line naming logical messages) until ``accept-gap``
  (before: ``recovered``, the messages lost);
* a first start on a non-empty outbox refuses; ``slot init --from now|table``
  (before: the slot made silently, the rows never published);
* the start-up check re-publishes rows missing from Kafka (a database migrated
  before 007 whose slot was re-created: adopted, the window checked);
* the start-up check leaves alone the rows a `--from now` first start chose not
  to publish;
* a recovery that died half-way resumes from its recorded progress; two
  writers cannot both open a gap; migration 007 merges duplicate open gaps.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Producer

from cdc import gaps
from cdc.migrate import migrate
from cdc.outbox import OutboxEvent, emit_event, write_event
from cdc.records import read_headers
from cdc.relay.gaps import recovery
from cdc.repair import publisher, republish, rows
from cdc.settings import Settings
from tests.harness import (
    ROOT,
    Proc,
    RelayConfig,
    drop_slot,
    free_port,
    read_topics,
    start_relay,
    wait_until,
)
from tests.records import RawProducer, RawRecord

pytestmark = pytest.mark.integration

AGG = "evidence"
#: Records of another cluster, and records without origin, per partition (more than the
#: 20 of a tail read's first round).
FOREIGN_PER_KIND = 15
#: The gap margin of these tests (the session's database is shared: keep windows short).
MARGIN_S = 2


def gap_config(db_dsn: str, kafka: str, unique: str) -> Iterator[RelayConfig]:
    """A gap test's relay configuration (a short gap margin); its slot dropped after."""
    config = RelayConfig(
        db_dsn=db_dsn, kafka=kafka, unique=unique, extra={"CDC_GAP_MARGIN_S": str(MARGIN_S)}
    )
    yield config
    drop_slot(db_dsn, config.slot)


@pytest.fixture
def cfg(db_dsn: str, kafka_bootstrap: str, unique: str) -> Iterator[RelayConfig]:
    yield from gap_config(db_dsn, kafka_bootstrap, unique)


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


def _metric(port: int, name: str, labels: str = "") -> float:
    body = _get(port, "/metrics")[1]
    pattern = rf"^{re.escape(name)}{re.escape('{' + labels + '}') if labels else ''} (\S+)$"
    found = re.search(pattern, body, re.M)
    return float(found.group(1)) if found else 0.0


def _history(dsn: str, slot: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT event, cause, state, rows_recovered, accepted_by, resume_from"
            " FROM outbox_cdc_slot_history WHERE slot = %s ORDER BY id",
            (slot,),
        ).fetchall()


def _slot_exists(dsn: str, slot: str) -> bool:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
    return bool(row and row[0])


def _event(i: int) -> OutboxEvent:
    return OutboxEvent(
        aggregate_type=AGG, aggregate_id=f"k{i % 5}", event_type="T", payload={"i": i}
    )


def _write(dsn: str, count: int) -> list[str]:
    """``count`` outbox rows, one transaction each; their ids."""
    ids = []
    with psycopg.connect(dsn) as conn:
        for i in range(count):
            with conn.transaction():
                ids.append(str(write_event(conn, _event(i))))
    return ids


def _emit(dsn: str, count: int) -> list[str]:
    """``count`` logical-message events, one transaction each; their ids."""
    ids = []
    with psycopg.connect(dsn) as conn:
        for i in range(count):
            with conn.transaction():
                ids.append(str(emit_event(conn, _event(i))))
    return ids


def _headers(msg: Any) -> dict[str, bytes]:
    """A record's headers, read as the relay reads them (a hostile one gives none)."""
    return {k: v or b"" for k, v in read_headers(msg).headers}


def _ids(msgs: list[Any], *, recovered: bytes | None = None) -> set[str]:
    """Ids of the records (``recovered``: only those whose header has that value)."""
    out = set()
    for msg in msgs:
        headers = _headers(msg)
        if "id" in headers and (recovered is None or headers.get("recovered") == recovered):
            out.add(headers["id"].decode())
    return out


def _recovered_ids(msgs: list[Any]) -> set[str]:
    return {_headers(m)["id"].decode() for m in msgs if "recovered" in _headers(m)}


def _topic(cfg: RelayConfig) -> str:
    return cfg.topic_prefix + AGG


def _settings(cfg: RelayConfig, **overrides: Any) -> Settings:
    """The settings of an in-process run against ``cfg``'s database, Kafka and slot."""
    return Settings(
        pg_dsn=cfg.db_dsn,
        kafka_bootstrap_servers=cfg.kafka,
        slot=cfg.slot,
        topic_prefix=cfg.topic_prefix,
        dlq_topic=cfg.dlq_topic,
        topic_partitions=cfg.partitions,
        **overrides,
    )


def _first_run(cfg: RelayConfig, tmp: Path, count: int = 3) -> list[str]:
    """A relay's first start, ``count`` events published, the relay stopped."""
    relay, _ = start_relay(cfg, tmp, name="first")
    try:
        ids = _write(cfg.db_dsn, count)
        read_topics(cfg.kafka, [_topic(cfg)], expect=count, idle_s=0.5)
        assert relay.terminate() == 0
    finally:
        relay.close()
    return ids


def test_a_non_utf8_header_name_at_the_tail_is_passed_by_and_counted(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    """Edge: issue 34 item 1 - any producer on a shared topic writes a header name that is
    not UTF-8; the tail read called ``headers()`` plainly and the relay crashed at every
    start (it could not publish the records that would push the hostile one out)."""
    published = _first_run(cfg, tmp_path)
    raw = RawProducer(cfg.kafka)
    for partition in range(cfg.partitions):  # the newest record of every partition
        raw.send(
            _topic(cfg),
            partition,
            [RawRecord(b"k", b"{}", ((b"\xff\xfeorigin", b"x"), (b"id\xc3\x28", b"y")))],
        )
    while_down = _write(cfg.db_dsn, 5)
    relay, port = start_relay(cfg, tmp_path, name="second")
    try:
        later = _write(cfg.db_dsn, 2)
        msgs = read_topics(cfg.kafka, [_topic(cfg)], expect=10 + cfg.partitions)
        assert set(published + while_down + later) <= _ids(msgs)
        skipped = _metric(
            port, "outbox_relay_tail_records_skipped_total", 'reason="unreadable_headers"'
        )
        assert skipped == cfg.partitions
        assert relay.alive()
    finally:
        relay.close()
    assert "unreadable_headers=3" in relay.log_path.read_text()
    dry = json.loads(_cli(cfg, "slot", "recover", "--json").stdout)  # the CLI reads tails too
    assert dry == {"gap": False, "verdict": "stream"}
    assert [(h[0], h[2]) for h in _history(cfg.db_dsn, cfg.slot)] == [("created", "created")]


def test_records_of_another_cluster_and_without_origin_are_not_the_relays_memory(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    """Edge: issue 34 item 2 - another cluster's relay (same default slot name, same
    prefix) and an origin-less producer write records newer than the relay's own; before,
    the first made a false ``system_changed`` gap: the healthy slot dropped, recovery from
    the foreign commit time, the events written meanwhile lost."""
    published = _first_run(cfg, tmp_path)
    future = datetime.now(UTC) + timedelta(hours=1)
    producer = Producer({"bootstrap.servers": cfg.kafka})
    foreign = [f"6999999999999999999/1/{cfg.slot}".encode(), None] * FOREIGN_PER_KIND
    for partition in range(cfg.partitions):
        for origin in foreign:
            headers = [
                ("id", str(uuid.uuid4()).encode()),
                ("commit_ts", future.isoformat().encode()),
                ("lsn", b"FF/0"),
            ]
            if origin is not None:
                headers.append(("origin", origin))
            producer.produce(
                _topic(cfg),
                b"{}",
                b"k",
                partition=partition,
                headers=headers,
                timestamp=int(future.timestamp() * 1000),
            )
    assert producer.flush(30) == 0
    shallow = {**cfg.extra, "CDC_GAP_TAIL_MAX_RECORDS": str(2 * FOREIGN_PER_KIND - 5)}
    buried = _cli(replace(cfg, extra=shallow), "slot", "recover", check=False)
    assert buried.returncode == 1, buried  # (the relay's records lie deeper: it says so)
    assert len(buried.stderr.strip().splitlines()) == 1, buried.stderr
    assert "CDC_GAP_TAIL_MAX_RECORDS" in buried.stderr
    while_down = _write(cfg.db_dsn, 5)
    relay, port = start_relay(cfg, tmp_path, name="second")
    try:
        msgs = read_topics(cfg.kafka, [_topic(cfg)], expect=8 + len(foreign) * cfg.partitions)
        assert set(published + while_down) <= _ids(msgs)
        assert not _recovered_ids(msgs), "no gap: nothing re-published"
        labels = ('reason="foreign_origin"', 'reason="no_origin"')
        name = "outbox_relay_tail_records_skipped_total"
        # (the tails grew past the 20 records of the first round to find the relay's own)
        assert [_metric(port, name, label) for label in labels] == [
            FOREIGN_PER_KIND * cfg.partitions
        ] * 2
    finally:
        relay.close()
    log = relay.log_path.read_text()
    assert "slot gap" not in log
    assert [(h[0], h[2]) for h in _history(cfg.db_dsn, cfg.slot)] == [("created", "created")]


def test_a_slot_dropped_and_recreated_under_its_name_is_a_gap_and_every_event_recovered(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    """Edge: issue 34 item 3 - a DBA, a provisioning job or an older relay drops and
    re-creates the slot while the relay is down: system, timeline and name all match;
    before, the relay streamed the new slot and the events committed in between were lost."""
    published = _first_run(cfg, tmp_path)
    between = _write(cfg.db_dsn, 5)
    drop_slot(cfg.db_dsn, cfg.slot)
    with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (cfg.slot,))
    after = _write(cfg.db_dsn, 3)
    relay, port = start_relay(cfg, tmp_path, name="second")
    try:
        msgs = read_topics(cfg.kafka, [_topic(cfg)], expect=11)
        assert set(published + between + after) <= _ids(msgs)
        assert set(between) <= _recovered_ids(msgs), "recovered from the table, marked"
        assert _metric(port, "outbox_relay_gaps_total", 'cause="slot_replaced"') == 1
    finally:
        relay.close()
    log = relay.log_path.read_text()
    assert "slot gap" in log and "slot_replaced" in log and "confirmed_flush_lsn" in log
    history = _history(cfg.db_dsn, cfg.slot)
    assert [h[:3] for h in history][-1] == ("gap", "slot_replaced", "recovered")


def test_with_messages_off_logical_messages_are_not_decoded_and_a_lost_slot_recovers(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    """Edge: issue 49 item 5 - ``CDC_MESSAGES=off`` (the default): the relay does not decode
    logical messages at all (nothing published, nothing dead-lettered), so whether an
    application uses them is never guessed from history: a slot lost while the relay was
    down is recovered from the table on its own."""
    assert "CDC_MESSAGES" not in cfg.env(0), "the default is tested"
    relay, _ = start_relay(cfg, tmp_path, name="first")
    try:
        rows = _write(cfg.db_dsn, 2)
        ignored = _emit(cfg.db_dsn, 2)
        after = _write(cfg.db_dsn, 1)
        msgs = read_topics(cfg.kafka, [_topic(cfg)], expect=3, idle_s=1.0)
        assert _ids(msgs) == set(rows + after) and not set(ignored) & _ids(msgs)
        assert relay.terminate() == 0
    finally:
        relay.close()
    assert "dead-letter" not in relay.log_path.read_text().lower()
    drop_slot(cfg.db_dsn, cfg.slot)
    down = _write(cfg.db_dsn, 2)
    _emit(cfg.db_dsn, 1)  # (not decoded with off: it holds no gap open either)
    relay, _ = start_relay(cfg, tmp_path, name="second")
    try:
        msgs = read_topics(cfg.kafka, [_topic(cfg)], expect=5, idle_s=1.0)
        assert set(down) <= _ids(msgs), "the lost slot's rows recovered from the table"
    finally:
        relay.close()
    log = relay.log_path.read_text()
    assert "slot_missing" in log and "accept-gap" not in log


def test_rows_and_logical_messages_over_a_dropped_slot_keep_the_gap_open_until_accepted(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    """Edge: issue 34 item 4 and issue 49 item 5 - mixed forms. With ``CDC_MESSAGES=on``
    any slot loss holds the gap open: the relay had published rows only, and the
    application wrote its first logical messages while the relay was down and the slot
    gone (no evidence of them anywhere: issue 49 measured them lost with /readyz 200).
    Before issue 34 such a gap was recoverable when any of the newest ids was still in
    the table: the rows came back, the messages were lost and the gap marked
    ``recovered``."""
    cfg.extra["CDC_MESSAGES"] = "on"
    relay, _ = start_relay(cfg, tmp_path, name="first")
    try:
        published = _write(cfg.db_dsn, 2)  # rows only: this slot never published a message
        first_msgs = read_topics(cfg.kafka, [_topic(cfg)], expect=2, idle_s=0.5)
        assert relay.terminate() == 0
    finally:
        relay.close()
    forms = {_headers(m)["id"].decode(): _headers(m).get("form") for m in first_msgs}
    assert list(forms.values()) == [None, None]
    drop_slot(cfg.db_dsn, cfg.slot)
    down_rows = _write(cfg.db_dsn, 2)
    down_messages = _emit(cfg.db_dsn, 2)  # lost: no slot held them, the table never did
    port = free_port()
    relay2 = Proc(["relay"], cfg.env(port), tmp_path / "second.log").start()
    try:
        wait_until(lambda: "gap: slot_missing" in _get(port, "/readyz")[1], 60, "readyz gap")
        status, body = _get(port, "/readyz")
        assert status == 503 and "logical messages" in body, body
        refused = _cli(cfg, "slot", "recover", "--execute", check=False)
        assert refused.returncode == 1 and "accept-gap" in refused.stderr
        time.sleep(6)  # (a recheck of the gap: still one ERROR line)
        assert not _slot_exists(cfg.db_dsn, cfg.slot), "nothing published until accepted"
        accepted = json.loads(
            _cli(cfg, "slot", "accept-gap", "--by", "bob", "--yes", "--json").stdout
        )
        assert accepted["accepted_by"] == "bob"
        wait_until(lambda: _get(port, "/readyz")[0] == 200, 60, "relay streaming again")
        later = _write(cfg.db_dsn, 1) + _emit(cfg.db_dsn, 1)
        msgs = read_topics(cfg.kafka, [_topic(cfg)], expect=6)
        # The rows the table still held come back through the start-up check; the
        # messages of the window are the accepted loss.
        assert _ids(msgs) == set(published + later + down_rows)
        assert _ids(msgs, recovered=b"verify") == set(down_rows)
        assert not set(down_messages) & _ids(msgs)
    finally:
        relay2.close()
    errors = [line for line in relay2.log_path.read_text().splitlines() if " ERROR " in line]
    assert len(errors) == 1, errors
    assert "logical messages" in errors[0] and "CDC_MESSAGES=on" in errors[0]
    assert "slot accept-gap" in errors[0]
    event, cause, state, _rows, by, _ = _history(cfg.db_dsn, cfg.slot)[-1]
    assert (event, cause, state, by) == ("gap", "slot_missing", "accepted", "bob")


@pytest.fixture
def private_db(empty_db_dsn: str) -> str:
    """A migrated database of this test's own (a first start needs its own outbox)."""
    migrate(empty_db_dsn)
    return empty_db_dsn


@pytest.mark.parametrize("how", ["now", "table"])
def test_a_first_start_on_a_non_empty_outbox_refuses_until_slot_init(
    private_db: str, kafka_bootstrap: str, unique: str, tmp_path: Path, how: str
) -> None:
    """Edge: issue 34 item 3 - a first start is silent only on an empty outbox: rows already
    in the table were never published (topics recreated or expired, a history lost), so the
    relay refuses with one line until the operator chooses (before: the slot made silently,
    those rows never published)."""
    cfg = RelayConfig(
        db_dsn=private_db,
        kafka=kafka_bootstrap,
        unique=unique,
        extra={"CDC_SLOT_INIT": "refuse", "CDC_GAP_MARGIN_S": str(MARGIN_S)},
    )
    existing = _write(private_db, 3)
    port = free_port()
    relay = Proc(["relay"], cfg.env(port), tmp_path / "refused.log").start()
    try:
        wait_until(lambda: "slot init" in _get(port, "/readyz")[1], 60, "readyz refusal")
        assert _get(port, "/readyz")[0] == 503
        time.sleep(6)  # (a recheck: still one line)
        assert not _slot_exists(private_db, cfg.slot)
    finally:
        relay.close()
    errors = [line for line in relay.log_path.read_text().splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "slot init --from now" in errors[0], errors
    done = json.loads(_cli(cfg, "slot", "init", "--from", how, "--json").stdout)
    assert done["from"] == how
    if how == "table":
        assert done["rows"] == 3
    relay2, _ = start_relay(cfg, tmp_path, name="after")
    try:
        later = _write(private_db, 2)
        msgs = read_topics(kafka_bootstrap, [_topic(cfg)], expect=5 if how == "table" else 2)
    finally:
        relay2.close()
    if how == "table":
        assert _ids(msgs) == set(existing + later)
        assert _recovered_ids(msgs) == set(existing)
    else:
        assert _ids(msgs) == set(later), "the rows already there are not published"
    again = _cli(cfg, "slot", "init", "--from", how, check=False)
    assert again.returncode == 1 and "not at its first start" in again.stderr
    history = _history(private_db, cfg.slot)
    expected = ("created", "init_now", "created") if how == "now" else ("gap", "first_start")
    assert history[0][: len(expected)] == expected


def test_the_start_check_republishes_rows_missing_from_kafka(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    """Edge: issue 34, defence in depth - a database migrated before 007 (no slot identity
    recorded) whose slot was re-created while the relay was down: the slot is adopted, so
    the gap check cannot see it; the start-up check compares the window since the relay's
    last record with the table and re-publishes what Kafka lacks."""
    published = _first_run(cfg, tmp_path)
    with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:  # as migrated before 007
        conn.execute(
            "UPDATE outbox_cdc_slot_history SET confirm_limit_lsn = NULL, slot_catalog_xmin"
            " = NULL WHERE slot = %s",
            (cfg.slot,),
        )
    lost = _write(cfg.db_dsn, 4)
    drop_slot(cfg.db_dsn, cfg.slot)
    with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (cfg.slot,))
    after = _write(cfg.db_dsn, 2)
    time.sleep(MARGIN_S + 1)  # (the check's window ends at the start minus the margin)
    relay, port = start_relay(cfg, tmp_path, name="second")
    try:
        wait_until(
            lambda: _metric(port, "outbox_relay_start_check_republished_total") >= 4,
            120,
            "the start-up check to re-publish",
        )
        msgs = read_topics(cfg.kafka, [_topic(cfg)], expect=9)
    finally:
        relay.close()
    assert set(published + lost + after) <= _ids(msgs)
    assert set(lost) <= _ids(msgs, recovered=b"verify")
    assert not set(published + after) & _ids(msgs, recovered=b"verify")
    log = relay.log_path.read_text()
    assert "no recorded identity" in log and "start-up check" in log
    assert [h[:2] for h in _history(cfg.db_dsn, cfg.slot)][-1] == ("adopted", "upgrade")


@pytest.mark.parametrize("delivery", ["at-least-once", "exactly-once"])
def test_republishing_ids_over_many_fills_and_read_chunks_keeps_every_keys_order(
    cfg: RelayConfig, monkeypatch: pytest.MonkeyPatch, delivery: str
) -> None:
    """The republish path (the audit's repair, the start-up check) at the shape of a large
    window, made small: the ids go to the server in fills of 7 and the rows stream back
    in chunks of 5 (10,000,000 rows are 100 fills of 100,000 and 5,000 chunks). Ids
    handed over shuffled, an id no longer in the table among them: every row present
    is published once, each key's rows in commit order, marked."""
    monkeypatch.setattr(rows, "IDS_PER_FILL", 7)
    monkeypatch.setattr(rows, "FETCH_ROWS", 5)
    migrate(cfg.db_dsn)
    written = _write(cfg.db_dsn, 60)  # keys k0..k4, one transaction each
    gone = str(uuid.uuid4())
    shuffled = [*written, gone]
    random.Random(7).shuffle(shuffled)
    # (exactly-once: several transactions, cut inside the run)
    settings = _settings(cfg, delivery=delivery, republish_tx_max_records=11)
    blob = b"".join(uuid.UUID(i).bytes for i in shuffled)
    sent = republish.republish(settings, memoryview(blob), origin="test/x", mark="audit-t")
    assert sent == len(written)
    msgs = read_topics(
        cfg.kafka,
        [_topic(cfg)],
        expect=len(written),
        idle_s=1,
        committed_only=delivery == "exactly-once",
    )
    assert sorted(_ids(msgs, recovered=b"audit-t")) == sorted(written)
    assert len(msgs) == len(written)
    order = {event_id: n for n, event_id in enumerate(written)}
    for key in {m.key() for m in msgs}:
        mine = [_headers(m)["id"].decode() for m in msgs if m.key() == key]
        assert mine == sorted(mine, key=order.__getitem__), key


def test_a_recovery_that_died_half_way_resumes_from_its_recorded_progress(
    cfg: RelayConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Edge: issue 34 item 5 - a recovery that fails (Kafka, a connection) after part of
    its window was acknowledged: the next attempt starts at the recorded progress instead of
    re-publishing the whole window."""
    _first_run(cfg, tmp_path)
    drop_slot(cfg.db_dsn, cfg.slot)
    stranded = _write(cfg.db_dsn, 12)
    # (an attempt resumes no later than its predecessor's start minus the margin: rows
    # committed after that snapshot may carry a created_at up to the margin earlier)
    time.sleep(MARGIN_S + 1)
    settings = _settings(cfg, gap_margin_s=MARGIN_S)
    found = recovery.inspect(settings)
    gap = recovery.open_gap(settings, found)
    monkeypatch.setattr(recovery, "PROGRESS_EVERY_ROWS", 3)
    send = publisher.Publisher.send
    mine = set(stranded)

    def failing_send(self: publisher.Publisher, record: Any) -> None:
        if record.event_id == stranded[8]:
            raise recovery.KafkaUnavailableError("Kafka went away (test)")
        send(self, record)

    monkeypatch.setattr(publisher.Publisher, "send", failing_send)
    with pytest.raises(recovery.KafkaUnavailableError):
        recovery.recover(settings, gap)
    monkeypatch.undo()
    first_attempt = {
        i for i in _ids(read_topics(cfg.kafka, [_topic(cfg)], expect=3, idle_s=1)) if i in mine
    }
    with psycopg.connect(cfg.db_dsn) as conn:
        progress = gaps.open_gaps(conn, cfg.slot)
    assert len(progress) == 1 and progress[0].resume_from is not None
    assert progress[0].rows_recovered and progress[0].rows_recovered >= 6
    relay, _ = start_relay(cfg, tmp_path, name="second")
    try:
        # (the first attempt's records, and the rest once: read until idle)
        msgs = read_topics(cfg.kafka, [_topic(cfg)], expect=3 + len(first_attempt) + 6)
    finally:
        relay.close()
    assert mine <= _ids(msgs), "every stranded event is in Kafka"
    per_id: dict[str, int] = {}
    for m in msgs:
        event_id = _headers(m)["id"].decode()
        per_id[event_id] = per_id.get(event_id, 0) + 1
    again = [i for i in stranded[:6] if per_id[i] > 1]
    assert not again, f"re-published although acknowledged before the progress: {again}"
    assert _history(cfg.db_dsn, cfg.slot)[-1][:3] == ("gap", "slot_missing", "recovered")


def test_two_writers_cannot_both_open_a_gap(db_dsn: str, unique: str) -> None:
    """Edge: issue 34 item 8 - two relays (or a relay and the CLI) found the same gap at
    once and both wrote an open row; migration 007's unique index keeps one."""
    slot = f"slot_{unique}"
    barrier = threading.Barrier(2)
    rows: list[gaps.HistoryRow] = []

    def write() -> None:
        with psycopg.connect(db_dsn, autocommit=True) as conn:
            barrier.wait(30)
            rows.append(
                gaps.record_gap(
                    conn,
                    gaps.NewGap(slot, "slot_missing", "test", None, None, None, False),
                    seen_latest=None,
                )
            )

    threads = [threading.Thread(target=write) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(rows) == 2 and rows[0].id == rows[1].id
    assert [h[:3] for h in _history(db_dsn, slot)] == [("gap", "slot_missing", "open")]


def test_migration_007_keeps_one_open_gap_per_slot_with_the_earliest_window(
    empty_db_dsn: str, tmp_path: Path
) -> None:
    """Edge: upgrading a database where two relays had both opened a gap (before 007):
    the unique index needs one open row per slot; the oldest is kept, with the earliest
    window of them all (nothing of either window is left out), the other superseded."""
    before_007 = tmp_path / "sql"
    before_007.mkdir()
    for path in sorted((ROOT / "sql").glob("00[1-6]_*.sql")):
        (before_007 / path.name).write_text(path.read_text())
    migrate(empty_db_dsn, directory=before_007)
    with psycopg.connect(empty_db_dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox_cdc_slot_history (slot, event, cause, state, window_start)"
            " VALUES ('a', 'gap', 'slot_lost', 'open', now() - interval '1 hour'),"
            " ('a', 'gap', 'slot_missing', 'open', now() - interval '2 hours'),"
            " ('b', 'gap', 'slot_lost', 'open', NULL), ('b', 'gap', 'slot_lost', 'open', now())"
        )
    assert migrate(empty_db_dsn)[0] == "007"  # (and the later ones)
    with psycopg.connect(empty_db_dsn) as conn:
        rows = conn.execute(
            "SELECT slot, state, window_start IS NULL,"
            " window_start < now() - interval '90 minutes'"
            " FROM outbox_cdc_slot_history ORDER BY id"
        ).fetchall()
        assert rows == [
            ("a", "open", False, True),
            ("a", "superseded", False, True),
            ("b", "open", True, None),
            ("b", "superseded", False, False),
        ]
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute(
                "INSERT INTO outbox_cdc_slot_history (slot, event, cause, state)"
                " VALUES ('a', 'gap', 'slot_lost', 'open')"
            )


def test_the_start_check_leaves_alone_the_rows_a_first_start_chose_not_to_publish(
    private_db: str, kafka_bootstrap: str, unique: str, tmp_path: Path
) -> None:
    """Edge: `slot init --from now` said the rows already in the table are not published;
    a later start's check of the window since the last record (minus the margin) must not
    reach back before that first start and publish them after all."""
    margin_s = 8
    cfg = RelayConfig(
        db_dsn=private_db,
        kafka=kafka_bootstrap,
        unique=unique,
        extra={"CDC_SLOT_INIT": "refuse", "CDC_GAP_MARGIN_S": str(margin_s)},
    )
    existing = _write(private_db, 3)
    _cli(cfg, "slot", "init", "--from", "now")
    relay, _ = start_relay(cfg, tmp_path, name="first")
    try:
        later = _write(private_db, 2)  # (within the margin of the rows before the init)
        read_topics(kafka_bootstrap, [_topic(cfg)], expect=2, idle_s=0.5)
        assert relay.terminate() == 0
    finally:
        relay.close()
    time.sleep(margin_s + 1)  # (the check's window ends at the start minus the margin)
    relay2, _ = start_relay(cfg, tmp_path, name="second")
    try:
        wait_until(
            lambda: "start-up check of slot" in relay2.log_path.read_text(), 120, "the check"
        )
        msgs = read_topics(kafka_bootstrap, [_topic(cfg)], expect=2)
    finally:
        relay2.close()
    assert _ids(msgs) == set(later), "the rows the first start left are still not published"
    assert not set(existing) & _ids(msgs)
    assert "are in Kafka" in relay2.log_path.read_text()
