"""The relay's memory at a session start after a large gap recovery (issue 49, item 4).

A database of the bench's own and :data:`PARTITIONS` partitions. A relay makes its slot
and publishes a few warm-up events, then stops; :data:`EVENTS` events are committed
(100-event transactions) and the slot is dropped: the next start recovers the gap from
the table, republishing every event marked ``recovered``. Each partition's tail then
holds ~EVENTS / PARTITIONS recovered records above the relay's newest streamed one, so
the gap check at the next session start reads deep - up to ``CDC_GAP_TAIL_MAX_RECORDS``
per partition (2,400,000 records here). The relay is restarted and its resident memory
sampled (``VmRSS``, every 0.1 s) from its start until it streams and 5 s after: the
peak is printed beside a relay's on the same slot before the recovery (a shallow tail).

Before issue 49 the tail read kept ~380 bytes per record of its own it read: ~0.9 GB at
this shape. Goal: the peak after the recovery within 100 MB of the shallow one.
``BENCH_RECOVERY_EVENTS`` sets the size. Figures are printed; only correctness is
asserted (every event recovered).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from cdc.migrate import migrate
from tests.bench.conftest import create_topics
from tests.bench.report import fmt, metric_sum, print_table, record_goal, scrape
from tests.bench.test_audit_bench import _fill, _load
from tests.conftest import create_database, drop_database
from tests.harness import Proc, RelayConfig, drop_slot, http_status, start_relay, wait_until
from tests.rss import RssSampler

pytestmark = [pytest.mark.bench, pytest.mark.integration]

EVENTS = int(os.environ.get("BENCH_RECOVERY_EVENTS", "2400000"))
PARTITIONS = 24
WARMUP = 50
#: The restarted relay is sampled this long after it streams.
AFTER_READY_S = 5.0
GOAL_EXTRA_MB = 100.0


def _streaming_peak_mb(cfg: RelayConfig, tmp: Path, name: str) -> tuple[float, float]:
    """Start the relay, sample its RSS until it streams and AFTER_READY_S more; stop it.
    (peak MB, seconds from its start to streaming)."""
    relay, port = start_relay(cfg, tmp, name=name, wait_ready=False)
    try:
        started = time.monotonic()
        with RssSampler(relay.pid, interval_s=0.1) as rss:

            def ready() -> bool:
                if not relay.alive():
                    raise AssertionError(f"relay exited early:\n{relay.log_tail()}")
                return http_status(f"http://127.0.0.1:{port}/readyz", timeout_s=1) == 200

            wait_until(ready, 1800, "relay streaming", interval_s=0.1)
            ready_s = time.monotonic() - started
            time.sleep(AFTER_READY_S)
            peak = max(b for _, b in rss.samples) / 2**20
        assert relay.terminate() == 0, relay.log_tail()
    finally:
        relay.close()
    return peak, ready_s


@pytest.mark.timeout(7200)
def test_relay_rss_at_a_session_start_after_a_large_recovery(
    pg_server: str, kafka_bootstrap: str, unique: str, tmp_path: Path
) -> None:
    dsn = create_database(pg_server, "cdc_memory_bench")
    migrate(dsn)
    cfg = RelayConfig(
        db_dsn=dsn,
        kafka=kafka_bootstrap,
        unique=unique,
        partitions=PARTITIONS,
        extra={"LOG_LEVEL": "WARNING", "CDC_AUDIT_INTERVAL_S": "0"},
    )
    topic = cfg.topic_prefix + "bench"
    create_topics(kafka_bootstrap, [topic], partitions=PARTITIONS)
    try:
        relay: Proc
        relay, port = start_relay(cfg, tmp_path, name="first")
        try:
            _fill(dsn, "bench", WARMUP)
            wait_until(
                lambda: (
                    metric_sum(scrape(port), "outbox_relay_events_total", topic=topic) >= WARMUP
                ),
                120,
                "warm-up events",
            )
            assert relay.terminate() == 0, relay.log_tail()
        finally:
            relay.close()
        shallow_mb, shallow_s = _streaming_peak_mb(cfg, tmp_path, "shallow")
        _fill(dsn, "bench", EVENTS)
        drop_slot(dsn, cfg.slot)  # the slot is lost: the next start recovers from the table
        relay, port = start_relay(cfg, tmp_path, name="recovery", wait_ready=False)
        try:
            recovering = time.monotonic()

            def recovered() -> bool:
                if not relay.alive():
                    raise AssertionError(f"relay exited early:\n{relay.log_tail()}")
                try:
                    done = metric_sum(scrape(port), "outbox_relay_recovered_events_total")
                except OSError:  # (its HTTP server not up yet)
                    return False
                return done >= EVENTS + WARMUP

            wait_until(recovered, 7000, "the gap recovered", interval_s=1.0)
            recovery_s = time.monotonic() - recovering
            assert relay.terminate() == 0, relay.log_tail()
        finally:
            relay.close()
        deep_mb, deep_s = _streaming_peak_mb(cfg, tmp_path, "after-recovery")
    finally:
        drop_slot(dsn, cfg.slot)
        drop_database(pg_server, dsn)
    print_table(
        f"relay RSS at a session start after recovering {EVENTS:,} events into"
        f" {PARTITIONS} partitions ({_load()}; shared machine)",
        ["figure", "value"],
        [
            ["peak RSS MB, session start after the recovery (deep tails)", fmt(deep_mb, 1)],
            ["peak RSS MB, session start before it (shallow tails)", fmt(shallow_mb, 1)],
            ["  seconds to streaming, after / before", f"{deep_s:.1f} / {shallow_s:.1f}"],
            ["recovery seconds (not measured against)", fmt(recovery_s, 1)],
            ["recovered events/s", fmt((EVENTS + WARMUP) / recovery_s)],
        ],
    )
    record_goal(
        "relay RSS MB after a large recovery, above the shallow start",
        deep_mb - shallow_mb,
        at_most=GOAL_EXTRA_MB,
        digits=1,
    )
