"""The audit's cost: rows/s over a window of :data:`SIZES` events beside the relay's
streaming rate of the same events, and the audit's peak RSS.

A database of the bench's own (the audit judges every row of the outbox table). A
relay starts on a fresh slot and publishes a few warm-up events, then stops;
the window's events are committed (100-event transactions) while it is down; the
relay starts again and drains them: ``/readyz`` -> all acknowledged gives the
streaming rate. With the relay stopped, the audit runs in a process of its own
over the window that holds exactly those events (table and Kafka both read, the
group stage included): its wall time around :func:`cdc.audit.run_audit` gives
rows/s, its ``VmHWM`` the peak RSS.

Goals (issue 36, issue 49): audit rows/s / streaming events/s >= 1.0; peak RSS
<= 200 MB whatever the window - run at 1,000,000 and 10,000,000 events (the id sets
spill to disk past their budget, :mod:`cdc.audit.ids`).
``AUDIT_BENCH_EVENTS`` runs it on one other window size (e.g. 20000 to try it).

The repair (issue 49): :data:`REPAIR_EVENTS` rows committed while no relay publishes
them (none in Kafka), then ``run_audit(repair=True)`` in a process of its own: rows/s
of the whole run (read, compare, republish and every acknowledgement) and its peak
RSS. ``AUDIT_BENCH_REPAIR_EVENTS`` sets the size.

Figures are printed; only correctness is asserted (the audit finds the window
complete: every event in Kafka, none missing; the repair republishes every row).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest

from cdc.migrate import migrate
from tests.bench.conftest import create_topics, wait_drained
from tests.bench.report import fmt, metric_sum, print_table, record_goal, scrape
from tests.conftest import create_database, drop_database
from tests.harness import ROOT, Proc, RelayConfig, drop_slot, http_status, start_relay, wait_until

pytestmark = [pytest.mark.bench, pytest.mark.integration]

#: Window sizes audited (one run each).
SIZES = (
    [int(os.environ["AUDIT_BENCH_EVENTS"])]
    if os.environ.get("AUDIT_BENCH_EVENTS")
    else [1_000_000, 10_000_000]
)
REPAIR_EVENTS = int(os.environ.get("AUDIT_BENCH_REPAIR_EVENTS", "1000000"))
EVENTS_PER_TX = 100
WARMUP = 50
PARTITIONS = 6
GOAL_RATIO = 1.0
GOAL_RSS_MB = 200.0
PAYLOAD_SQL = (
    "jsonb_build_object('user_id', gen_random_uuid(), 'email', 'u' || i || '@example.org',"
    " 'display_name', 'User ' || i, 'registered_at', now())"
)

#: Runs one audit in this (fresh) process; prints its figures as one JSON line.
AUDIT_SCRIPT = """
import json, sys, time
from datetime import datetime
from cdc.audit import Window, run_audit
from cdc.settings import Settings

since, until = (datetime.fromisoformat(a) for a in sys.argv[1:3])
settings = Settings.from_env()
started = time.monotonic()
report = run_audit(settings, Window.between(since, until), repair=sys.argv[3:] == ["repair"])
seconds = time.monotonic() - started
with open("/proc/self/status") as f:
    rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
print(json.dumps({
    "seconds": seconds, "rss_mb": rss_kb / 1024, "rows": report.table.judged_rows,
    "records": report.kafka.records_read, "missing": report.missing_count,
    "in_kafka": report.comparison.total("in_kafka"), "timings": report.timings_s,
    "repaired": report.repaired,
}))
"""


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.1f} / {five:.1f} / {fifteen:.1f} (1/5/15 min)"


def _fill(dsn: str, aggregate: str, total: int, per_tx: int = EVENTS_PER_TX) -> None:
    assert aggregate.isalnum()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"""
            DO $$
            BEGIN
              FOR lo IN 0..{total - 1} BY {per_tx} LOOP
                INSERT INTO outbox (aggregatetype, aggregateid, type, payload)
                SELECT '{aggregate}', 'u' || i, 'UserRegistered', {PAYLOAD_SQL}
                FROM generate_series(lo, least(lo + {per_tx}, {total}) - 1) AS i;
                COMMIT;
              END LOOP;
            END $$
            """
        )


def _relayed(port: int, topic: str) -> float:
    return metric_sum(scrape(port), "outbox_relay_events_total", topic=topic)


def _drain(cfg: RelayConfig, tmp: Path, topic: str, events: int) -> float:
    """Start the relay on a backlog of ``events``; events/s from /readyz to all
    acknowledged (exactly-once: committed)."""
    relay, port = start_relay(cfg, tmp, name="drain", wait_ready=False)
    try:

        def ready() -> bool:
            if not relay.alive():
                raise AssertionError(f"relay exited early:\n{relay.log_tail()}")
            return http_status(f"http://127.0.0.1:{port}/readyz", timeout_s=1) == 200

        wait_until(ready, 300, "relay /readyz", interval_s=0.01)
        started = time.monotonic()
        drained = wait_drained(
            port,
            topic,
            events=events,
            transactions=math.ceil(events / EVENTS_PER_TX),
            committed=cfg.extra.get("CDC_DELIVERY") == "exactly-once",
            timeout_s=7200,
        )
        rate = events / (drained - started)
        assert relay.terminate() == 0, relay.log_tail()
    finally:
        relay.close()
    return rate


def _audit(
    cfg: RelayConfig, since: datetime, until: datetime, tmp: Path, *, repair: bool = False
) -> dict[str, object]:
    log = tmp / "audit.log"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            AUDIT_SCRIPT,
            since.isoformat(),
            until.isoformat(),
            *(["repair"] if repair else []),
        ],
        env={**cfg.env(9), "LOG_LEVEL": "WARNING"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    log.write_text(proc.stderr)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.timeout(14400)
@pytest.mark.parametrize("events", SIZES, ids=lambda n: f"{n:,}")
def test_audit_rows_per_second_beside_the_streaming_rate_and_its_peak_rss(
    pg_server: str, kafka_bootstrap: str, unique: str, tmp_path: Path, events: int
) -> None:
    dsn = create_database(pg_server, "cdc_audit_bench")
    migrate(dsn)
    cfg = RelayConfig(
        db_dsn=dsn,
        kafka=kafka_bootstrap,
        unique=unique,
        partitions=PARTITIONS,
        extra={"LOG_LEVEL": "WARNING"},
    )
    topic = cfg.topic_prefix + "bench"
    create_topics(kafka_bootstrap, [cfg.topic_prefix + "warm", topic], partitions=PARTITIONS)
    try:
        relay: Proc
        relay, port = start_relay(cfg, tmp_path, name="first")
        try:
            _fill(dsn, "warm", WARMUP)
            wait_until(lambda: _relayed(port, cfg.topic_prefix + "warm") >= WARMUP, 120, "warm")
            assert relay.terminate() == 0, relay.log_tail()
        finally:
            relay.close()
        time.sleep(0.01)
        since = datetime.now(UTC)
        filled = time.monotonic()
        _fill(dsn, "bench", events)
        fill_s = time.monotonic() - filled
        until = datetime.now(UTC)
        stream_per_s = _drain(cfg, tmp_path, topic, events)
        result = _audit(cfg, since, until, tmp_path)
    finally:
        drop_slot(dsn, cfg.slot)
        drop_database(pg_server, dsn)
    assert result["rows"] == events, result
    assert result["in_kafka"] == events and result["missing"] == 0, result
    seconds = float(result["seconds"])  # type: ignore[arg-type]
    rss_mb = float(result["rss_mb"])  # type: ignore[arg-type]
    audit_per_s = events / seconds
    ratio = audit_per_s / stream_per_s
    timings = result["timings"]
    assert isinstance(timings, dict)
    print_table(
        f"audit of a {events:,}-event window vs streaming the same events"
        f" (100-event transactions, {PARTITIONS} partitions; {_load()})",
        ["figure", "value"],
        [
            ["audit rows/s (table and Kafka read, compared)", fmt(audit_per_s)],
            ["relay streaming events/s", fmt(stream_per_s)],
            ["ratio audit / streaming (goal >= 1.0)", fmt(ratio, 2)],
            ["audit peak RSS MB (goal <= 200)", fmt(rss_mb, 1)],
            ["audit seconds", fmt(seconds, 2)],
            *[[f"  stage {k} s", fmt(float(v), 2)] for k, v in timings.items()],
            ["Kafka records read", fmt(float(result["records"]))],  # type: ignore[arg-type]
            ["(table fill s, not measured against)", fmt(fill_s, 1)],
        ],
    )
    record_goal(f"audit / streaming, {events:,}-event window", ratio, at_least=GOAL_RATIO)
    record_goal(
        f"audit peak RSS MB, {events:,}-event window", rss_mb, at_most=GOAL_RSS_MB, digits=1
    )


@pytest.mark.timeout(7200)
def test_audit_repair_of_a_window_no_relay_published_and_its_peak_rss(
    pg_server: str, kafka_bootstrap: str, unique: str, tmp_path: Path
) -> None:
    events = REPAIR_EVENTS
    dsn = create_database(pg_server, "cdc_repair_bench")
    migrate(dsn)
    cfg = RelayConfig(
        db_dsn=dsn,
        kafka=kafka_bootstrap,
        unique=unique,
        partitions=PARTITIONS,
        extra={"LOG_LEVEL": "WARNING"},
    )
    topic = cfg.topic_prefix + "bench"
    create_topics(kafka_bootstrap, [topic], partitions=PARTITIONS)
    try:
        since = datetime.now(UTC)
        _fill(dsn, "bench", events)  # no relay, no slot: none of them is in Kafka
        until = datetime.now(UTC)
        result = _audit(cfg, since, until, tmp_path, repair=True)
    finally:
        drop_database(pg_server, dsn)
    assert result["rows"] == events and result["missing"] == events, result
    assert result["repaired"] == events, result
    seconds = float(result["seconds"])  # type: ignore[arg-type]
    rss_mb = float(result["rss_mb"])  # type: ignore[arg-type]
    timings = result["timings"]
    assert isinstance(timings, dict)
    print_table(
        f"audit --repair of a {events:,}-row window none of which is in Kafka"
        f" ({PARTITIONS} partitions; {_load()})",
        ["figure", "value"],
        [
            ["rows/s (read, compare, republish, all acknowledged)", fmt(events / seconds)],
            ["peak RSS MB", fmt(rss_mb, 1)],
            ["seconds", fmt(seconds, 2)],
            *[[f"  stage {k} s", fmt(float(v), 2)] for k, v in timings.items()],
        ],
    )
    record_goal(
        f"audit --repair peak RSS MB, {events:,} rows", rss_mb, at_most=GOAL_RSS_MB, digits=1
    )
