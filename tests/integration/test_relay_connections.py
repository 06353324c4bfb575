"""The relay's connections against real PostgreSQL and Kafka (issue 34, items 5, 6 and 8).

* A large transaction of another table, decoded at its commit for longer than
  ``CDC_REPLICATION_SILENCE_S`` with ``wal_sender_timeout`` raised (its
  walsender says nothing meanwhile): the relay looks, leaves the walsender
  alone (and says so), and every event around the transaction arrives once.
* A hot standby waits cheaply and quietly: over a minute beside an active relay
  it runs no gap check (no tail read of the topics), logs a few lines at most,
  its /readyz says ``standby`` at every poll, and it takes over when the active
  one dies (issue 39, item 5).
* A recovery whose lock connection dies half-way (killed, or an
  ``idle_session_timeout`` shorter than the recovery) still finishes: the lock
  is taken again and re-checked, the gap is marked recovered once and the
  window is published once, not for ever. The lock itself: another process
  sees it held (the standby's cheap look) and cannot take it; lost with its
  connection, it is taken again; a recovery whose slot was replaced, or whose
  gap another process closed, is not marked.
"""

from __future__ import annotations

import os
import re
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from cdc import gaps
from cdc.errors import SlotInUseError
from cdc.outbox import OutboxEvent, write_event
from cdc.relay.gaps import recovery
from cdc.repair.lock import RecoveryLock, lock_name, recovery_in_progress
from cdc.settings import Settings
from tests.harness import (
    Proc,
    RelayConfig,
    drop_slot,
    headers_of,
    read_topics,
    start_relay,
    wait_for_ready,
    wait_until,
)
from tests.integration.test_relay_errors import metric

pytestmark = pytest.mark.integration


@pytest.fixture
def cfg(db_dsn: str, kafka_bootstrap: str, unique: str) -> Iterator[RelayConfig]:
    config = RelayConfig(db_dsn=db_dsn, kafka=kafka_bootstrap, unique=unique, partitions=2)
    yield config
    drop_slot(db_dsn, config.slot)


def _write(dsn: str, aggregate: str, count: int) -> list[str]:
    ids = []
    with psycopg.connect(dsn) as conn:
        for i in range(count):
            with conn.transaction():
                event = OutboxEvent(
                    aggregate_type=aggregate,
                    aggregate_id=f"k{i % 7}",
                    event_type="T",
                    payload={"i": i},
                )
                ids.append(str(write_event(conn, event)))
    return ids


def _ids_in_kafka(cfg: RelayConfig, aggregate: str, expect: int) -> Counter[str]:
    msgs = read_topics(cfg.kafka, [cfg.topic_prefix + aggregate], expect=expect, idle_s=2.0)
    return Counter(headers_of(m)["id"].decode() for m in msgs)


def _walsender_pid(dsn: str, slot: str) -> int | None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
    return None if row is None else row[0]


# --- item 6: a walsender busy decoding is left alone ------------------------------------

#: Rows of the large transaction: its decoding (spilled to disk past
#: logical_decoding_work_mem, replayed at its commit) outlasts CDC_REPLICATION_SILENCE_S
#: (1 s) by far on any machine (~10 s of silence on a loaded 2-core one).
BIG_ROWS = 3_000_000


def test_a_walsender_decoding_a_large_transaction_is_left_alone_and_nothing_is_lost(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    raised = make_conninfo(cfg.db_dsn, options="-c wal_sender_timeout=600s")
    cfg.extra = {"CDC_PG_DSN": raised, "CDC_REPLICATION_SILENCE_S": "1"}
    relay, port = start_relay(cfg, tmp_path)
    table = f"big_{cfg.unique}"
    try:
        before = _write(cfg.db_dsn, "busy", 20)
        wait_until(
            lambda: (
                metric(port, "outbox_relay_events_total", f'topic="{cfg.topic_prefix}busy"') >= 20
            ),
            60,
            "the first events",
        )
        pid = _walsender_pid(cfg.db_dsn, cfg.slot)
        with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
            conn.execute(f"CREATE TABLE {table} (n int)")  # (not in the publication)
            conn.execute(f"INSERT INTO {table} SELECT g FROM generate_series(1, {BIG_ROWS}) g")
        after = _write(cfg.db_dsn, "busy", 20)
        wait_until(
            lambda: (
                metric(port, "outbox_relay_events_total", f'topic="{cfg.topic_prefix}busy"') >= 40
            ),
            300,
            "the events after the large transaction",
        )
        log = relay.log_path.read_text()
        assert _walsender_pid(cfg.db_dsn, cfg.slot) == pid, "the same walsender streams"
        assert metric(port, "outbox_relay_replication_silences_total") == 0
        assert metric(port, "outbox_relay_walsender_looks_total", 'verdict="end"') == 0
        assert metric(port, "outbox_relay_walsender_looks_total", 'verdict="leave"') >= 1
        assert "leaving it alone" in log
        found = _ids_in_kafka(cfg, "busy", 40)
        assert set(before + after) <= set(found), "every event arrived"
        assert all(found[i] == 1 for i in before + after), "each once: no session restarted"
        assert relay.alive(), relay.log_tail()
    finally:
        relay.close()
        with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}")


# --- item 8: the standby waits cheaply ---------------------------------------------------


def _kafka_sockets(pid: int, kafka_port: int) -> set[int]:
    """Local ports of the TCP connections process ``pid`` holds to ``kafka_port`` now."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, remote, inode = fields[1], fields[2], fields[9]
            if inode in inodes and int(remote.rsplit(":", 1)[1], 16) == kafka_port:
                ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


def _readyz(port: int) -> tuple[int | None, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return None, str(exc)


#: How long the standby is watched: long enough for ~30 gap checks of the old behaviour.
STANDBY_WATCH_S = 65.0


def test_a_standby_reads_no_topic_tail_for_a_minute_and_takes_over(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    active, _ = start_relay(cfg, tmp_path, name="active")
    standby: Proc | None = None
    try:
        standby, standby_port = start_relay(cfg, tmp_path, name="standby", wait_ready=False)
        wait_until(
            lambda: "waiting as hot standby" in standby.log_path.read_text(),
            60,
            "the second relay to wait as a standby",
        )
        kafka_port = int(cfg.kafka.rsplit(":", 1)[1])
        known = _kafka_sockets(standby.pid, kafka_port)  # (its admin client's, if any)
        opened: set[int] = set()
        mark = standby.log_path.stat().st_size
        readyz: list[tuple[int | None, str]] = []
        next_poll = 0.0
        deadline = time.monotonic() + STANDBY_WATCH_S
        while time.monotonic() < deadline:  # (sampled often: a tail read lasts ~100 ms)
            opened |= _kafka_sockets(standby.pid, kafka_port) - known
            if time.monotonic() >= next_poll:  # /readyz once a second: standby every time
                readyz.append(_readyz(standby_port))
                next_poll = time.monotonic() + 1.0
            time.sleep(0.05)
        with standby.log_path.open("rb") as f:
            f.seek(mark)
            watched = f.read().decode(errors="replace").splitlines()
        # quiet: the minute's log is a few lines at most (it was 3 INFO lines every ~3 s)
        assert len(watched) <= 3, "\n".join(watched)
        assert standby.log_path.read_text().count("waiting as hot standby") == 1
        flips = [r for r in readyz if r[0] != 503 or not r[1].startswith("standby: ")]
        assert not flips, f"/readyz left standby {len(flips)} of {len(readyz)} times: {flips[:3]}"
        # A tail read is a new consumer: two connections (bootstrap, then the broker) per
        # gap check, ~60 in this minute before. The relay's admin client may open its
        # broker connection late (librdkafka connects sparsely): at most that one.
        assert len(opened) <= 1, f"the standby opened {len(opened)} Kafka connections"
        assert metric(standby_port, "outbox_relay_gap_checks_total") == 0
        assert (
            metric(standby_port, ["outbox_relay_state", 'state="standby"}'][0], 'state="standby"')
            == 1
        )
        ids = _write(cfg.db_dsn, "takeover", 20)
        active.kill()
        wait_for_ready(standby, standby_port, timeout_s=60)
        assert "relay standby -> streaming" in standby.log_path.read_text()  # its takeover
        assert metric(standby_port, "outbox_relay_gap_checks_total") >= 1, "once it was free"
        found = _ids_in_kafka(cfg, "takeover", len(ids))
        assert set(ids) <= set(found), "every event arrived through the new active relay"
    finally:
        active.close()
        if standby is not None:
            standby.close()


# --- item 5: a recovery whose lock connection dies still finishes, once ------------------

#: Rows in the recovered window: the recovery lasts seconds, its lock connection idles
#: through them (idle_session_timeout 1 s).
WINDOW_ROWS = 20_000


def _bulk(dsn: str, aggregate: str, count: int) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "INSERT INTO outbox (aggregatetype, aggregateid, type, payload)"
            " SELECT %s, 'k' || (g %% 50), 'T', jsonb_build_object('n', g)"
            " FROM generate_series(1, %s) g RETURNING id::text",
            (aggregate, count),
        ).fetchall()
    return [str(r[0]) for r in rows]


def _history(cfg: RelayConfig) -> list[tuple[object, ...]]:
    with psycopg.connect(cfg.db_dsn) as conn:
        return conn.execute(
            "SELECT event, cause, state, rows_recovered FROM outbox_cdc_slot_history"
            " WHERE slot = %s ORDER BY id",
            (cfg.slot,),
        ).fetchall()


def _a_gap_after(cfg: RelayConfig, tmp_path: Path, aggregate: str) -> list[str]:
    """A first start that published, the relay stopped, its slot dropped, a window of
    WINDOW_ROWS rows written: the next start finds a gap to recover. The window's ids."""
    relay, _ = start_relay(cfg, tmp_path, name="first")
    try:
        _write(cfg.db_dsn, aggregate, 3)
        _ids_in_kafka(cfg, aggregate, 3)
        assert relay.terminate() == 0
    finally:
        relay.close()
    drop_slot(cfg.db_dsn, cfg.slot)
    return _bulk(cfg.db_dsn, aggregate, WINDOW_ROWS)


def _recovered_once(
    cfg: RelayConfig, relay: Proc, port: int, aggregate: str, window: list[str]
) -> None:
    wait_for_ready(relay, port, timeout_s=300)
    log = relay.log_path.read_text()
    assert len(re.findall(r"gap \d+ recovered: ", log)) == 1, "recovered once"
    assert [h[:3] for h in _history(cfg)][-1] == ("gap", "slot_missing", "recovered")
    after = _write(cfg.db_dsn, aggregate, 5)  # streaming from the new slot
    found = _ids_in_kafka(cfg, aggregate, 3 + WINDOW_ROWS + 5)
    assert set(window + after) <= set(found), "every event arrived"
    twice = [i for i in window if found[i] != 1]
    assert not twice, f"{len(twice)} rows of the window were published more than once"


#: the idle_session_timeout the relay's connections get in the test below
IDLE_TIMEOUT_S = 1.0


def test_a_recovery_outlasting_idle_session_timeout_finishes_once(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    cfg.extra = {"CDC_GAP_MARGIN_S": "2"}
    window = _a_gap_after(cfg, tmp_path, "idlegap")
    # The DSN's word wins over the relay's idle-timeout exemption of its lock connection:
    # the server ends every connection of the relay idle for a second.
    cfg.extra["CDC_PG_DSN"] = make_conninfo(cfg.db_dsn, options="-c idle_session_timeout=1000")
    # A transaction with an xid, open while the recovery makes its slot: the slot's snapshot
    # waits for it, so the recovery outlasts the timeout whatever the machine's speed.
    blocker = psycopg.connect(cfg.db_dsn)
    blocker.execute("SELECT txid_current()")
    relay, port = start_relay(cfg, tmp_path, name="second", wait_ready=False)
    try:
        wait_until(
            lambda: _recovery_lock_holder(cfg.db_dsn, cfg.slot),
            120,
            "the recovery to take its lock",
            0.01,
        )
        time.sleep(3 * IDLE_TIMEOUT_S)  # the lock's connection idle past the timeout
        blocker.commit()
        _recovered_once(cfg, relay, port, "idlegap", window)
        log = relay.log_path.read_text()
        assert "lost with its connection" in log and "taken again" in log, "lock re-taken"
        assert relay.alive(), relay.log_tail()
    finally:
        blocker.close()
        relay.close()


def test_a_recovery_whose_lock_connection_is_killed_finishes_once(
    cfg: RelayConfig, tmp_path: Path
) -> None:
    cfg.extra = {"CDC_GAP_MARGIN_S": "2"}
    window = _a_gap_after(cfg, tmp_path, "killgap")
    # The recovery is held inside its slot's snapshot (which waits for this transaction
    # with an xid) until the lock's connection is killed: it cannot have finished first.
    # (CI once killed the holder after the recovery's last check on a fast machine.)
    blocker = psycopg.connect(cfg.db_dsn)
    blocker.execute("SELECT txid_current()")
    relay, port = start_relay(cfg, tmp_path, name="second", wait_ready=False)
    try:
        holder = wait_until(
            lambda: _recovery_lock_holder(cfg.db_dsn, cfg.slot),
            120,
            "the recovery to take its lock",
            0.01,
        )
        with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(%s)", (holder,))
        blocker.commit()
        _recovered_once(cfg, relay, port, "killgap", window)
        log = relay.log_path.read_text()
        assert "lost with its connection" in log and "taken again" in log, "lock re-taken"
    finally:
        blocker.close()
        relay.close()


def _recovery_lock_holder(dsn: str, slot: str) -> int | None:
    """The pid holding the relay's recovery lock of ``slot`` (that advisory key only: the
    start-up check's audit lock and the migration lock are advisory locks too)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT l.pid FROM pg_locks l, (SELECT hashtext(%s)::bigint AS key) k"
            " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
            " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            " AND l.classid = ((k.key >> 32) & 4294967295)::oid"
            " AND l.objid = (k.key & 4294967295)::oid",
            (lock_name(slot),),
        ).fetchone()
    return None if row is None else int(row[0])


# --- the recovery lock and its re-check, against the real server ------------------------


def test_a_lost_recovery_lock_is_taken_again_and_seen_by_other_processes(
    cfg: RelayConfig,
) -> None:
    settings = Settings(pg_dsn=cfg.db_dsn, slot=cfg.slot)
    with psycopg.connect(cfg.db_dsn, autocommit=True) as other:
        assert not recovery_in_progress(other, cfg.slot)
        with RecoveryLock(settings) as lock:
            assert recovery_in_progress(other, cfg.slot), "another process sees it"
            with pytest.raises(SlotInUseError, match="another process is recovering"):
                RecoveryLock(settings).take()
            first = lock.conn.info.backend_pid
            other.execute("SELECT pg_terminate_backend(%s)", (first,))
            lock.ensure()
            assert lock.retaken and lock.conn.info.backend_pid != first
            assert recovery_in_progress(other, cfg.slot)
        assert not recovery_in_progress(other, cfg.slot), "released with its connection"


def test_a_recovery_is_not_marked_when_its_slot_or_gap_changed_meanwhile(
    cfg: RelayConfig,
) -> None:
    settings = Settings(pg_dsn=cfg.db_dsn, slot=cfg.slot)
    with psycopg.connect(cfg.db_dsn, autocommit=True) as conn:
        written = gaps.record_gap(
            conn,
            gaps.NewGap(cfg.slot, "slot_missing", "test", None, None, None, False),
            seen_latest=None,
        )
        gap = gaps.latest(conn, cfg.slot)
        assert gap is not None and gap.id == written.id
        row = conn.execute(
            "SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput')",
            (cfg.slot,),
        ).fetchone()
        assert row is not None
        ours = gaps.Recovered(None, datetime.now(UTC), "o", str(row[0]), 0, 0.0)
        recovery._check_still_ours(conn, settings, gap, ours)  # the slot it made: fine
        replaced = gaps.Recovered(None, datetime.now(UTC), "o", "0/1", 0, 0.0)
        with pytest.raises(SlotInUseError, match="no longer the one this recovery made"):
            recovery._check_still_ours(conn, settings, gap, replaced)
        gaps.mark_recovered(conn, gap.id, ours)  # (another process closed it)
        with pytest.raises(SlotInUseError, match="closed by another process"):
            recovery._check_still_ours(conn, settings, gap, ours)
