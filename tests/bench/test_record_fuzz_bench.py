"""Record-fuzz throughput: the sink on a clean topic beside the same good events among
hostile records (issue 22: every record is data).

Two runs in one test, each on fresh topics and a fresh group, against the stub in
its own process: GOOD registrations alone, then the same number of good ones
with HOSTILE random records interleaved (:func:`tests.records.random_record`:
non-UTF-8 header names, duplicates, null values, tombstones, huge header sets,
missing or malformed ids), written raw. The figure is records settled per
second (delivered + parked) from the sink's ``/readyz`` to every partition
committed to its end, the good events' rate over the same span, and the good
events' steady rate (the stub's first to last ``applied_at``, without the group
join); the fuzz/clean ratios are printed beside the load average. Only
correctness is asserted (every good event applied once, every partition
committed to its end, the sink alive).
"""

from __future__ import annotations

import os
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.bench.conftest import StubProc, create_topics, start_stub
from tests.bench.report import CpuMeter, fmt, print_table
from tests.harness import (
    RelayConfig,
    SinkConfig,
    group_caught_up,
    start_sink,
    wait_until,
    without_derived_user_syncs,
)
from tests.integration.test_record_fuzz import hostile, sink_events, write_mixed
from tests.records import RawProducer

pytestmark = [pytest.mark.bench, pytest.mark.integration]

PARTITIONS = 3
GOOD_USERS = 2_000  # x (1 registration + 3 attempts) = 8,000 good events
HOSTILE = 8_000
SEED = 2022


@dataclass(frozen=True)
class Run:
    name: str
    records: int
    good: int
    elapsed_s: float
    sink_cpu_pct: float
    #: good events / s between the stub's first and last applied_at (steady state)
    steady_good_rate: float

    @property
    def rate(self) -> float:
        return self.records / self.elapsed_s

    @property
    def good_rate(self) -> float:
        return self.good / self.elapsed_s


def _run(name: str, db_dsn: str, kafka: str, stub: StubProc, tmp: Path, *, hostile_n: int) -> Run:
    rng = random.Random(SEED)
    relay = RelayConfig(
        db_dsn=db_dsn,
        kafka=kafka,
        unique=uuid.uuid4().hex[:10],
        partitions=PARTITIONS,
        extra={"LOG_LEVEL": "WARNING"},
    )
    topics = [relay.topic_prefix + "user", relay.topic_prefix + "quiz_attempt"]
    create_topics(kafka, topics, partitions=PARTITIONS)
    events = sink_events([str(uuid.uuid4()) for _ in range(GOOD_USERS)])
    good = {relay.topic_prefix + t: records for t, records in events.items()}
    written = write_mixed(RawProducer(kafka), good, hostile(rng, hostile_n, []), rng)
    cfg = SinkConfig(relay=relay, engine_url=stub.url, api_key="bench-key")
    before = len(stub.applied_items())
    sink, _ = start_sink(cfg, tmp, name=f"sink-{name}")
    try:
        started = time.monotonic()
        cpu = CpuMeter({"sink": sink.pid}).start()
        wait_until(
            lambda: sink.alive() and group_caught_up(kafka, cfg.group, topics),
            600,
            f"{name}: every partition committed to its end",
            interval_s=0.25,
        )
        elapsed_s = time.monotonic() - started
        cpu_pct = cpu.stop()["sink"]
        assert sink.alive(), sink.log_tail()
    finally:
        sink.close()
    # (a quiz attempt read before its user's registration syncs the user under a key of
    # its own: an engine call of that event, not an extra event)
    items = without_derived_user_syncs(stub.applied_items()[before:], written.good_ids)
    applied = Counter(i["event_id"] for i in items)
    assert set(applied) == written.good_ids and max(applied.values()) == 1
    span_s = items[-1]["applied_at"] - items[0]["applied_at"]
    return Run(
        name,
        sum(written.ends.values()),
        len(written.good_ids),
        elapsed_s,
        cpu_pct,
        (len(items) - 1) / span_s,
    )


@pytest.mark.timeout(900)
def test_sink_throughput_among_hostile_records_beside_a_clean_run(
    db_dsn: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    stub = start_stub(tmp_path, name="stub-fuzz")
    try:
        clean = _run("clean", db_dsn, kafka_bootstrap, stub, tmp_path, hostile_n=0)
        fuzz = _run("fuzz", db_dsn, kafka_bootstrap, stub, tmp_path, hostile_n=HOSTILE)
    finally:
        stub.proc.close()
    rows = [
        [
            r.name,
            fmt(r.records),
            fmt(r.good),
            fmt(r.elapsed_s, 1),
            fmt(r.rate),
            fmt(r.good_rate),
            fmt(r.steady_good_rate),
            fmt(r.sink_cpu_pct),
        ]
        for r in (clean, fuzz)
    ]
    rows.append(
        [
            "fuzz / clean",
            "",
            "",
            "",
            f"{fuzz.rate / clean.rate:.2f}",
            f"{fuzz.good_rate / clean.good_rate:.2f}",
            f"{fuzz.steady_good_rate / clean.steady_good_rate:.2f}",
            f"load avg {os.getloadavg()[0]:.2f}",
        ]
    )
    print_table(
        f"sink: {GOOD_USERS * 4:,} good events alone, then among {HOSTILE:,} hostile records",
        [
            "run",
            "records",
            "good",
            "ready->committed s",
            "records/s",
            "good/s",
            "good/s first->last applied",
            "sink CPU %",
        ],
        rows,
    )
