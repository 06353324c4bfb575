"""`outbox-cdc audit` against real PostgreSQL, real Kafka and the engine stub over HTTP.

Each test has a database of its own (the audit judges every row of the outbox
table: the session's shared database holds the other tests' rows) and its own
slot, topics and group. Faults are made with the plain calls an operator or a
tool would use: ``ALTER PUBLICATION``, ``AdminClient.delete_records``. (A slot
advanced by hand is no longer one of them: the relay's gap check sees it at its
next start - tests/integration/test_gap_evidence.py. The audit is for what no
check inside the lineage can see: the stand-in here is the outbox table taken
out of the relay's publication for a moment while the relay streams.)

* N events committed while the outbox was out of the publication: the relay
  streamed on past them, the audit lists exactly those N (exit 1; events still
  in the slot are in flight, not missing),
  ``--repair`` republishes them (header ``recovered=audit-<run>``), the engine
  applies them, a second audit exits 0;
* records deleted before the group read them: the audit lists them and the
  partitions the group lost, the sink logs one ERROR per partition naming the
  range and counts it, the repair brings the events to the engine;
* the relay's periodic audit repairs such a silent loss with no command, and never
  republishes the rows a `slot init --from now` left out (nor does `audit` report
  them, unless asked with --before-first-start);
* no false alarms: writers going, the relay killed and the sink restarted, audits
  during and after the load (and the relay's own) are clean; dead-lettered and
  parked events are accounted, not missing; other relays' records (shards) are
  not phantoms, a record of this relay with no row is;
* exit codes (0, 1, 2) and the ``--json`` document.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient
from psycopg import sql
from psycopg.conninfo import make_conninfo

from cdc.audit.run import run_audit, verify_since
from cdc.audit.window import Window
from cdc.migrate import migrate
from cdc.outbox import OutboxEvent, register_user, write_event
from cdc.repair.lock import AuditBusyError, SlotLock, audit_lock
from cdc.settings import Settings
from sinks.stub.server import StubServer
from tests.harness import (
    ROOT,
    Proc,
    RelayConfig,
    SinkConfig,
    drop_slot,
    free_port,
    headers_of,
    produce,
    read_topics,
    start_relay,
    start_sink,
    wait_until,
)
from tests.integration.conftest import API_KEY

pytestmark = pytest.mark.integration

#: The keys the issue asks of `audit --json` (more are allowed).
JSON_KEYS = {
    "window",
    "table_rows",
    "in_kafka",
    "dead_lettered",
    "missing",
    "missing_count",
    "phantoms",
    "duplicates",
    "expired_unprocessed",
    "parked",
    "repaired",
}
#: Bound of every wait on the pipeline (generous: the machine is shared and loaded).
WAIT_S = 180


@pytest.fixture
def audit_db(empty_db_dsn: str) -> str:
    migrate(empty_db_dsn, demo=True)
    return empty_db_dsn


@pytest.fixture
def cfg(audit_db: str, kafka_bootstrap: str, unique: str) -> Iterator[RelayConfig]:
    config = RelayConfig(
        db_dsn=audit_db,
        kafka=kafka_bootstrap,
        unique=unique,
        extra={"CDC_AUDIT_SETTLE_S": "0", "CDC_GAP_MARGIN_S": "5"},
    )
    yield config
    drop_slot(audit_db, config.slot)


@pytest.fixture
def stub() -> Iterator[StubServer]:
    with StubServer(api_key=API_KEY) as server:
        yield server


@pytest.fixture
def sink_cfg(cfg: RelayConfig, stub: StubServer) -> SinkConfig:
    return SinkConfig(relay=cfg, engine_url=stub.url, api_key=API_KEY)


# -- helpers ------------------------------------------------------------------------------------


def _users(dsn: str, count: int) -> list[str]:
    """Register ``count`` users (one transaction each); their event ids."""
    with psycopg.connect(dsn) as conn:
        return [
            str(register_user(conn, email=f"{uuid.uuid4()}@ex.org", display_name="U").event_id)
            for _ in range(count)
        ]


def _audit(env: dict[str, str], *args: str) -> tuple[int, dict[str, Any], str]:
    """``outbox-cdc audit --json ARGS``: exit code, the document, stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "cdc.cli", "audit", "--json", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode in (0, 1, 3, 4), proc.stderr
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cdc.cli", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@contextlib.contextmanager
def _outbox_out_of_publication(dsn: str) -> Iterator[None]:
    """What a hand or a migration tool does: the outbox table out of the relay's publication
    for a moment. The relay streams on; what is committed meanwhile is never decoded, and
    the slot confirms past it (no gap the relay's own evidence can show)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ALTER PUBLICATION outbox_pub DROP TABLE outbox")
        try:
            yield
        finally:
            conn.execute("ALTER PUBLICATION outbox_pub ADD TABLE outbox")


def _applied(stub: StubServer) -> set[str]:
    return {str(item["event_id"]) for item in stub.applied()["items"]}


def _wait_applied(stub: StubServer, ids: set[str], proc: Proc) -> None:
    def done() -> bool:
        if not proc.alive():
            raise AssertionError(f"{proc.args} exited:\n{proc.log_tail()}")
        return ids <= _applied(stub)

    try:
        wait_until(done, WAIT_S, f"{len(ids)} events applied", interval_s=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{proc.log_tail()}") from None


def _metrics(port: int) -> dict[str, float]:
    """A process's /metrics as ``{name{labels}: value}``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _window_start() -> str:
    """An ISO time a moment from now (what a later --since starts at)."""
    time.sleep(1.1)
    start = datetime.now(UTC).isoformat()
    time.sleep(1.1)
    return start


# -- a slot advanced by hand --------------------------------------------------------------------


def test_events_the_relay_never_saw_are_listed_exactly_repaired_and_then_clean(
    cfg: RelayConfig, sink_cfg: SinkConfig, stub: StubServer, tmp_path: Path
) -> None:
    relay, _ = start_relay(cfg, tmp_path)
    sink, _ = start_sink(sink_cfg, tmp_path)
    env = sink_cfg.env(free_port())
    try:
        before = set(_users(cfg.db_dsn, 10))
        _wait_applied(stub, before, sink)
        with _outbox_out_of_publication(cfg.db_dsn):
            skipped = set(_users(cfg.db_dsn, 7))
        _wait_applied(stub, set(_users(cfg.db_dsn, 1)), sink)  # the relay streamed past them
        assert relay.terminate() == 0
        relay.close()
        in_slot = set(_users(cfg.db_dsn, 3))  # committed while the relay is down: in the slot

        code, doc, _ = _audit(env, "--since", "10m")
        assert code == 1
        assert set(doc) >= JSON_KEYS
        assert {m["id"] for m in doc["missing"]} == skipped
        assert doc["missing_count"] == 7
        assert doc["in_flight"] == 3
        assert doc["table_rows"] == 21 and doc["in_kafka"] == 11
        assert all(m["aggregatetype"] == "user" and m["aggregateid"] for m in doc["missing"])
        assert doc["repaired"] == 0

        code, repaired, _ = _audit(env, "--since", "10m", "--repair")
        assert code == 1  # the run found a loss, even though it repaired it
        assert repaired["repaired"] == 7
        mark = repaired["repair_mark"]
        assert mark == f"audit-{repaired['run_id']}"
        _wait_applied(stub, skipped, sink)

        relay, _ = start_relay(cfg, tmp_path, name="relay-2")  # streams what the slot held
        _wait_applied(stub, in_slot, sink)
        code, clean, _ = _audit(env, "--since", "10m")
        assert code == 0, clean
        assert clean["missing_count"] == 0 and clean["in_kafka"] == 21
        records = read_topics(cfg.kafka, [cfg.topic_prefix + "user"], expect=21)
        marks = {headers_of(m)["id"].decode(): headers_of(m).get("recovered") for m in records}
        assert {i for i, r in marks.items() if r == mark.encode()} == skipped
    finally:
        relay.close()
        sink.close()


# -- records deleted from Kafka -----------------------------------------------------------------


def _delete_all_records(kafka: str, topic: str) -> None:
    """DeleteRecords up to the end of every partition (what retention does, at once)."""
    admin = AdminClient({"bootstrap.servers": kafka})
    meta = admin.list_topics(topic, timeout=15).topics[topic]
    from confluent_kafka import Consumer

    probe = Consumer({"bootstrap.servers": kafka, "group.id": f"probe-{uuid.uuid4().hex}"})
    try:
        ends = [
            TopicPartition(topic, p, probe.get_watermark_offsets(TopicPartition(topic, p), 10)[1])
            for p in meta.partitions
        ]
    finally:
        probe.close()
    for future in admin.delete_records(ends).values():
        future.result(timeout=30)


def test_records_deleted_before_the_group_read_them_are_an_error_listed_and_repaired(
    cfg: RelayConfig, sink_cfg: SinkConfig, stub: StubServer, tmp_path: Path
) -> None:
    relay, _ = start_relay(cfg, tmp_path)
    sink, sink_port = start_sink(sink_cfg, tmp_path)
    env = sink_cfg.env(free_port())
    topic = cfg.topic_prefix + "user"
    try:
        read = set(_users(cfg.db_dsn, 30))  # (every partition gets a commit)
        _wait_applied(stub, read, sink)
        assert sink.terminate() == 0  # commits what it processed
        sink.close()
        since = _window_start()
        unread = set(_users(cfg.db_dsn, 9))
        read_topics(cfg.kafka, [topic], expect=39)  # the relay published them
        _delete_all_records(cfg.kafka, topic)

        code, doc, _ = _audit(env, "--since", since)
        assert code == 1
        assert {m["id"] for m in doc["missing"]} == unread
        assert doc["uncommitted_removed"] == []
        assert sum(e["count"] for e in doc["expired_unprocessed"]) == 9
        for lost in doc["expired_unprocessed"]:
            assert lost["topic"] == topic
            assert lost["committed_offset"] + lost["count"] == lost["log_start_offset"]

        sink, sink_port = start_sink(sink_cfg, tmp_path, name="sink-2")
        wait_until(
            lambda: _metrics(sink_port).get("outbox_sink_offsets_expired_total") == 9,
            WAIT_S,
            "the sink to count the 9 offsets removed unread",
        )
        errors = [
            line
            for line in sink.log_path.read_text().splitlines()
            if "ERROR" in line and "were removed" in line
        ]
        assert errors, sink.log_tail()
        assert all(topic in line and re.search(r"offsets \d+\.\.\d+", line) for line in errors)
        assert len(errors) == len(doc["expired_unprocessed"])  # one line per partition
        wait_until(  # the group's commit says what the sink dealt with
            lambda: not _audit(env, "--since", since)[1]["expired_unprocessed"],
            WAIT_S,
            "the sink to commit the position it skipped to",
        )
        assert sink.terminate() == 0
        sink.close()
        sink, sink_port = start_sink(sink_cfg, tmp_path, name="sink-3")  # reported once only

        code, repaired, _ = _audit(env, "--since", since, "--repair")
        assert repaired["repaired"] == 9
        _wait_applied(stub, unread, sink)
        code, clean, _ = _audit(env, "--since", since)
        assert code == 0, clean
        assert _metrics(sink_port)["outbox_sink_offsets_expired_total"] == 0  # (sink-3)
        assert "were removed" not in sink.log_path.read_text()
    finally:
        relay.close()
        sink.close()


# -- the relay by itself ------------------------------------------------------------------------


def test_the_relays_periodic_audit_repairs_a_silent_loss_with_no_command(
    cfg: RelayConfig, sink_cfg: SinkConfig, stub: StubServer, tmp_path: Path
) -> None:
    cfg.extra.update(
        {"CDC_AUDIT_INTERVAL_S": "2", "CDC_AUDIT_SETTLE_S": "1", "CDC_AUDIT_WINDOW_S": "600"}
    )
    relay, port = start_relay(cfg, tmp_path, name="relay-audit")
    sink, _ = start_sink(sink_cfg, tmp_path)
    try:
        _wait_applied(stub, set(_users(cfg.db_dsn, 5)), sink)
        with _outbox_out_of_publication(cfg.db_dsn):
            skipped = set(_users(cfg.db_dsn, 6))
        _wait_applied(stub, skipped, sink)
        warnings = [
            line
            for line in relay.log_path.read_text().splitlines()
            if "WARNING" in line and "events missing from Kafka" in line
        ]
        # (a run may land between two of the six commits: the runs' counts add up)
        found = [int(m.group(1)) for w in warnings if (m := re.search(r"(\d+) events missing", w))]
        assert sum(found) == 6, relay.log_tail()
        assert all("republished" in w for w in warnings)
        metrics = _metrics(port)
        assert metrics["outbox_audit_repaired_total"] == 6
        assert metrics['outbox_audit_runs_total{result="found"}'] >= 1
        clean = metrics['outbox_audit_runs_total{result="clean"}']  # (runs before the loss too)
        wait_until(
            lambda: _metrics(port)['outbox_audit_runs_total{result="clean"}'] > clean,
            WAIT_S,
            "a clean audit after the repair",
        )
        assert _metrics(port)["outbox_audit_missing"] == 0
    finally:
        relay.close()
        sink.close()


def test_rows_slot_init_from_now_left_out_are_never_republished_and_audit_clean(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    """Edge: `slot init --from now` over an outbox that holds rows, then the relay with a
    short CDC_AUDIT_INTERVAL_S and a window reaching back before that first start: the
    periodic audit never judges nor republishes the rows left out (its window starts at
    the first start, as the start-up check's does) and runs clean; `outbox-cdc audit`
    (default window and an explicit --since before the first start) reports clean, says
    the window was moved, and only --before-first-start lists them (not repaired)."""
    old = set(_users(cfg.db_dsn, 6))  # in the table before the relay's first start
    cfg.extra.update(
        {"CDC_AUDIT_INTERVAL_S": "2", "CDC_AUDIT_SETTLE_S": "1", "CDC_AUDIT_WINDOW_S": "600"}
    )
    env = cfg.env(free_port())
    init = _cli(env, "slot", "init", "--from", "now")
    assert init.returncode == 0, init.stderr
    relay, port = start_relay(cfg, tmp_path, name="relay-init-now")
    try:
        new = set(_users(cfg.db_dsn, 4))
        topic = cfg.topic_prefix + "user"
        read_topics(cfg.kafka, [topic], expect=4)
        clean = _metrics(port)['outbox_audit_runs_total{result="clean"}']
        wait_until(  # three whole runs after the new rows were in Kafka
            lambda: _metrics(port)['outbox_audit_runs_total{result="clean"}'] >= clean + 3,
            WAIT_S,
            "three clean periodic audits",
        )
        metrics = _metrics(port)
        assert metrics['outbox_audit_runs_total{result="found"}'] == 0, relay.log_tail()
        assert metrics['outbox_audit_runs_total{result="failed"}'] == 0, relay.log_tail()
        assert metrics["outbox_audit_repaired_total"] == 0
        assert metrics["outbox_audit_missing"] == 0
        ids = {headers_of(m)["id"].decode() for m in read_topics(cfg.kafka, [topic], expect=4)}
        assert ids == new  # none of the six old rows, by the audit nor anything else
        assert "events missing from Kafka" not in relay.log_path.read_text()

        for args in ((), ("--since", "1h")):  # the default window, an explicit one
            code, doc, stderr = _audit(env, *args)
            assert code == 0, doc
            assert doc["missing_count"] == 0 and doc["table_rows"] == 4 and doc["in_kafka"] == 4
            assert doc["first_start"] is not None and doc["requested_since"] is not None
            assert doc["window"]["since"] == doc["first_start"]
            assert any("not judged nor repaired" in n for n in doc["notes"]), doc["notes"]
            assert "first start" in stderr

        code, asked, _ = _audit(env, "--since", "1h", "--before-first-start")
        assert code == 1
        assert {m["id"] for m in asked["missing"]} == old and asked["repaired"] == 0
        assert asked["requested_since"] is None
        assert any("counted missing" in n for n in asked["notes"]), asked["notes"]

        ahead = _cli(env, "audit", "--since", "2h", "--until", "1h")  # all before the start
        assert ahead.returncode == 2, ahead.stderr
        assert "--before-first-start" in ahead.stderr and "Traceback" not in ahead.stderr
    finally:
        relay.close()


# -- no false alarms ----------------------------------------------------------------------------


class _Writers(threading.Thread):
    """Registers users until stopped; their event ids."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.ids: list[str] = []
        self.halt = threading.Event()

    def run(self) -> None:
        with psycopg.connect(self.dsn) as conn:
            while not self.halt.is_set():
                written = register_user(conn, email=f"{uuid.uuid4()}@ex.org", display_name="W")
                self.ids.append(str(written.event_id))
                self.halt.wait(0.005)


def test_a_clean_run_under_load_with_restarts_audits_clean(
    cfg: RelayConfig, sink_cfg: SinkConfig, stub: StubServer, tmp_path: Path
) -> None:
    cfg.extra.update({"CDC_AUDIT_INTERVAL_S": "3", "CDC_AUDIT_SETTLE_S": "1"})
    relay, relay_port = start_relay(cfg, tmp_path)
    sink, _ = start_sink(sink_cfg, tmp_path)
    env = sink_cfg.env(free_port())
    writers = _Writers(cfg.db_dsn)
    writers.start()
    try:
        wait_until(lambda: len(writers.ids) > 200, WAIT_S, "writers going")
        code, during, _ = _audit(env, "--since", "10m", "--until", "0s")  # the relay streams
        assert code in (0, 4), during  # (4: rows still in the slot, in flight - not clean)
        assert during["verdict"] == ("in flight" if during["in_flight"] else "clean")
        assert during["missing_count"] == 0
        assert during["slot"]["in_flight_known"]  # the active relay's slot was read
        relay.kill()  # kill -9: unacknowledged records are sent again (duplicates, no loss)
        relay.close()
        relay, relay_port = start_relay(cfg, tmp_path, name="relay-2")
        assert sink.terminate() == 0
        sink.close()
        sink, _ = start_sink(sink_cfg, tmp_path, name="sink-2")
        wait_until(lambda: len(writers.ids) > 600, WAIT_S, "more writes after the restarts")
        wait_until(
            lambda: _metrics(relay_port).get('outbox_audit_runs_total{result="clean"}', 0) >= 2,
            WAIT_S,
            "two periodic audits of the restarted relay",
        )
        writers.halt.set()
        writers.join(30)
        _wait_applied(stub, set(writers.ids), sink)
        code, after, _ = _audit(env, "--since", "10m", "--until", "0s")  # (settle is 1 s here)
        assert code == 0, after
        assert after["table_rows"] == len(writers.ids)
        assert after["missing_count"] == 0 and after["phantoms"]["count"] == 0
        metrics = _metrics(relay_port)
        assert metrics.get('outbox_audit_runs_total{result="found"}', 0) == 0
        assert metrics["outbox_audit_repaired_total"] == 0
    finally:
        writers.halt.set()
        relay.close()
        sink.close()


def test_dead_lettered_and_parked_events_are_accounted_not_missing(
    cfg: RelayConfig, sink_cfg: SinkConfig, stub: StubServer, tmp_path: Path
) -> None:
    relay, _ = start_relay(cfg, tmp_path)
    sink, _ = start_sink(sink_cfg, tmp_path)
    env = sink_cfg.env(free_port())
    try:
        delivered = set(_users(cfg.db_dsn, 3))
        with psycopg.connect(cfg.db_dsn) as conn, conn.transaction():
            conn.execute(  # a payload that is not a JSON object: the relay dead-letters it
                "INSERT INTO outbox (aggregatetype, aggregateid, type, payload)"
                " VALUES ('user', 'k', 'UserRegistered', '[1, 2]')"
            )
            parked = write_event(  # a type the sink has no route for: parked
                conn,
                OutboxEvent(
                    aggregate_type="user",
                    aggregate_id="k",
                    event_type="NobodyRoutesThis",
                    payload={"x": 1},
                ),
            )
        _wait_applied(stub, delivered, sink)

        def parked_row() -> bool:
            with psycopg.connect(cfg.db_dsn) as conn:
                row = conn.execute(
                    "SELECT count(*) FROM failed_sync_events WHERE outbox_event_id = %s",
                    (parked,),
                ).fetchone()
            return bool(row and row[0])

        wait_until(parked_row, WAIT_S, "the unroutable event parked")
        code, doc, _ = _audit(env, "--since", "10m")
        assert code == 0, doc
        assert doc["table_rows"] == 5
        assert doc["dead_lettered"] == 1
        assert doc["in_kafka"] == 4
        assert doc["missing_count"] == 0
        assert sum(doc["parked"].values()) == 1
    finally:
        relay.close()
        sink.close()


# -- shards: other relays' records ----------------------------------------------------------------


@pytest.fixture
def shards(audit_db: str, kafka_bootstrap: str, unique: str) -> Iterator[list[RelayConfig]]:
    """Two relays, each streaming one half of the outbox (row filters) to the same topics."""
    configs = []
    with psycopg.connect(audit_db, autocommit=True) as conn:
        for shard in range(2):
            pub, slot = f"pub_{unique}_s{shard}", f"slot_{unique}_s{shard}"
            conn.execute(
                sql.SQL(
                    "CREATE PUBLICATION {} FOR TABLE outbox"
                    " WHERE ((hashtext(aggregateid) & 1) = {}) WITH (publish = 'insert')"
                ).format(sql.Identifier(pub), sql.Literal(shard))
            )
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
            configs.append(
                RelayConfig(
                    db_dsn=audit_db,
                    kafka=kafka_bootstrap,
                    unique=unique,
                    extra={
                        "CDC_PUBLICATION": pub,
                        "CDC_SLOT": slot,
                        "CDC_PUBLICATION_FILTERED": "true",
                        "CDC_AUDIT_SETTLE_S": "0",
                    },
                )
            )
    yield configs
    for config in configs:
        drop_slot(audit_db, config.extra["CDC_SLOT"])


def test_other_relays_records_are_not_phantoms_and_a_record_of_ours_without_a_row_is(
    shards: list[RelayConfig], tmp_path: Path
) -> None:
    procs = [start_relay(c, tmp_path, name=f"relay-{i}")[0] for i, c in enumerate(shards)]
    try:
        with psycopg.connect(shards[0].db_dsn) as conn:
            for i in range(40):
                with conn.transaction():
                    write_event(
                        conn,
                        OutboxEvent(
                            aggregate_type="account",
                            aggregate_id=f"cust-{i}",
                            event_type="T",
                            payload={"i": i},
                        ),
                    )
        topic = shards[0].topic_prefix + "account"
        records = read_topics(shards[0].kafka, [topic], expect=40)
        origins = {headers_of(m)["origin"] for m in records}
        assert len(origins) == 2  # both relays published to the topic
        ours = next(o for o in origins if o.endswith(shards[0].extra["CDC_SLOT"].encode()))
        theirs = next(o for o in origins if o != ours)
        phantom, foreign = str(uuid.uuid4()), str(uuid.uuid4())
        produce(
            shards[0].kafka,
            topic,
            [
                (b"k", b"{}", {"id": phantom.encode(), "origin": ours}),
                (b"k", b"{}", {"id": foreign.encode(), "origin": theirs}),
            ],
        )
        docs = []
        for config in shards:
            code, doc, _ = _audit(config.env(free_port()), "--since", "10m")
            assert code == 0, doc  # phantoms are reported, they are not a loss
            assert doc["missing_count"] == 0
            docs.append(doc)
        assert docs[0]["table_rows"] + docs[1]["table_rows"] == 40
        assert docs[0]["phantoms"] == {"judged": True, "count": 1, "ids": [phantom]}
        assert docs[1]["phantoms"] == {"judged": True, "count": 1, "ids": [foreign]}
    finally:
        for proc in procs:
            proc.close()


# -- one lock: the start-up check and the audit ------------------------------------------------


def test_the_start_check_and_a_repairing_audit_never_hold_the_slot_at_once(
    cfg: RelayConfig,
) -> None:
    """Edge: the relay's start-up check (verify_since) and an audit that repairs (the
    periodic one, `audit --repair`) take the slot's one audit lock (a PostgreSQL advisory
    lock): while one holds it, the other is refused before it reads anything; another
    slot's lock is another lock."""
    settings = Settings(
        pg_dsn=cfg.db_dsn,
        kafka_bootstrap_servers=cfg.kafka,
        slot=cfg.slot,
        topic_prefix=cfg.topic_prefix,
        dlq_topic=cfg.dlq_topic,
    )
    now = datetime.now(UTC)
    window = Window.between(now - timedelta(minutes=1), now)
    with audit_lock(settings):
        with pytest.raises(AuditBusyError):
            verify_since(settings, window.since, until=window.until)
        with pytest.raises(AuditBusyError):
            run_audit(settings, window, repair=True)
        with audit_lock(settings.model_copy(update={"slot": cfg.slot + "_other"})):
            pass
    with audit_lock(settings):  # (released with its session)
        pass


# -- never "complete" without evidence (issue 49, item 3) -------------------------------------


def _audit_any(env: dict[str, str], *args: str) -> tuple[int, dict[str, Any], str]:
    """``outbox-cdc audit --json ARGS`` whatever its exit code (a JSON document always)."""
    proc = _cli(env, "audit", "--json", *args)
    assert proc.stdout.strip(), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout), proc.stderr


@pytest.fixture
def auditor(cfg: RelayConfig, unique: str) -> Iterator[str]:
    """A role that may read everything but has no REPLICATION attribute: its DSN."""
    role, password = f"auditor_{unique}", "pw-" + unique
    with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN NOREPLICATION PASSWORD {}").format(
                sql.Identifier(role), sql.Literal(password)
            )
        )
        conn.execute(sql.SQL("GRANT pg_read_all_data TO {}").format(sql.Identifier(role)))
    yield make_conninfo(cfg.db_dsn, user=role, password=password)
    with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_an_audit_that_cannot_identify_the_server_cannot_judge_and_refuses_to_repair(
    cfg: RelayConfig, auditor: str, tmp_path: Path
) -> None:
    """Edge: evidence the audit does not own. A row is lost (the outbox out of the
    publication for a moment) and a record of *another* cluster's relay carries its id.
    As a role without REPLICATION the audit cannot run IDENTIFY_SYSTEM, so it cannot
    tell that record from the relay's own: exit 3, ``cannot_judge`` says why, never
    clean, and ``--repair`` republishes nothing. The relay's own role finds the row
    missing (exit 1): the foreign record never vouched for it."""
    relay, _ = start_relay(cfg, tmp_path)
    try:
        ids = _users(cfg.db_dsn, 3)
        records = read_topics(cfg.kafka, [cfg.topic_prefix + "user"], expect=len(ids))
        ours = headers_of(records[0])["origin"]
        with _outbox_out_of_publication(cfg.db_dsn):
            (lost,) = _users(cfg.db_dsn, 1)
        time.sleep(2)  # (the relay confirms past it: never decoded)
    finally:
        relay.close()
    system_id, rest = ours.split(b"/", 1)
    foreign = str(int(system_id) + 1).encode() + b"/" + rest  # another cluster, same slot
    produce(
        cfg.kafka,
        cfg.topic_prefix + "user",
        [(b"k", b"{}", {"id": lost.encode(), "origin": foreign})],
    )

    env = {**cfg.env(free_port()), "CDC_PG_DSN": auditor}
    code, doc, stderr = _audit_any(env, "--since", "10m")
    assert code == 3, (doc, stderr)
    assert doc["verdict"] == "cannot judge" and doc["clean"] is False
    assert doc["cannot_judge"].startswith("cannot judge: the server cannot be identified")
    assert "REPLICATION" in doc["cannot_judge"]
    code, doc, _ = _audit_any(env, "--since", "10m", "--repair")
    assert code == 3 and doc["repaired"] == 0, doc
    human = _cli(env, "audit", "--since", "10m")
    assert human.returncode == 3 and "cannot judge" in human.stdout
    assert "complete" not in human.stdout

    code, doc, _ = _audit_any(cfg.env(free_port()), "--since", "10m")
    assert code == 1, doc
    assert [row["id"] for row in doc["missing"]] == [lost]
    assert doc["cannot_judge"] is None


def test_rows_the_slot_still_holds_are_in_flight_not_clean(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    """Edge: a relay stopped (or stuck) with rows committed after it: they are in the slot,
    not in Kafka. The audit says so - in flight, exit 4, not clean - and once the relay
    published them, clean (exit 0)."""
    relay, _ = start_relay(cfg, tmp_path)
    try:
        first = _users(cfg.db_dsn, 2)
        read_topics(cfg.kafka, [cfg.topic_prefix + "user"], expect=len(first))
    finally:
        relay.close()
    held = _users(cfg.db_dsn, 3)  # committed while the relay is down: in the slot
    code, doc, _ = _audit_any(cfg.env(free_port()), "--since", "10m")
    assert code == 4, doc
    assert doc["verdict"] == "in flight" and doc["clean"] is False
    assert doc["in_flight"] == len(held) and doc["missing_count"] == 0
    relay, _ = start_relay(cfg, tmp_path, name="relay-again")
    try:
        read_topics(cfg.kafka, [cfg.topic_prefix + "user"], expect=len(first) + len(held))
        wait_until(
            lambda: _audit_any(cfg.env(free_port()), "--since", "10m")[0] == 0,
            WAIT_S,
            "a clean audit once the relay published them",
            interval_s=1.0,
        )
    finally:
        relay.close()


def test_the_audit_lock_is_the_recovery_locks_type_exempt_from_idle_timeouts_and_retaken(
    cfg: RelayConfig,
) -> None:
    """Edge: the audit lock's connection killed mid-run (an idle_session_timeout, a NAT, a
    terminated backend): the audit lock is a SlotLock like the recovery lock - its
    connection exempt from the server's idle timeouts, checked before the repair, taken
    again when lost (and the lost-lock run compares again); held, it refuses a second
    audit that may repair."""
    settings = Settings(pg_dsn=cfg.db_dsn, kafka_bootstrap_servers=cfg.kafka, slot=cfg.slot)
    with audit_lock(settings) as lock:
        assert isinstance(lock, SlotLock)
        row = lock.conn.execute("SHOW idle_session_timeout").fetchone()
        assert row is not None and row[0] == "0"
        pid = lock.conn.info.backend_pid
        with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        wait_until(lambda: not _backend_alive(cfg.db_dsn, pid), 30, "the lock's backend gone")
        lock.ensure()
        assert lock.retaken and lock.conn.info.backend_pid != pid
        with pytest.raises(AuditBusyError):
            run_audit(
                settings,
                Window.between(datetime.now(UTC) - timedelta(minutes=1), datetime.now(UTC)),
                repair=True,
            )


def _backend_alive(dsn: str, pid: int) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
    return bool(row and row[0])


# -- exit codes ---------------------------------------------------------------------------------


def test_exit_codes_are_0_clean_and_2_for_usage_or_configuration(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    env = cfg.env(free_port())
    code, doc, stderr = _audit(env, "--since", "5m")  # no slot, no topic, no row: clean
    assert code == 0
    assert doc["table_rows"] == 0 and doc["missing_count"] == 0 and doc["clean"] is True
    assert "slot" in stderr and "does not exist" in stderr  # the note says what it could not tell

    for args in (["--since", "yesterday"], ["--since", "1h", "--until", "2h"], ["--limit", "-1"]):
        proc = _cli(env, "audit", *args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert "Traceback" not in proc.stderr
    without_dsn = {k: v for k, v in env.items() if k != "CDC_PG_DSN"}
    proc = _cli(without_dsn, "audit")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: missing setting: CDC_PG_DSN"

    proc = _cli(env, "audit", "--since", "5m")  # the human answer
    assert proc.returncode == 0, proc.stderr
    assert "complete" in proc.stdout
