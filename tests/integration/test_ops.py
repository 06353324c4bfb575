"""The ops commands against the real stack: Kafka offsets, the slot, the outbox, the engine stub.

Every test works on its own topics, group and slot (the ``unique`` fixture), produces
records in the contract format itself and commits the group's offsets itself, then
runs ``python -m cdc.cli ...`` as an operator would and asserts on what Kafka,
PostgreSQL or the engine stub hold afterwards.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from cdc import pgconn
from cdc.ops import slot_status, unconfirmed_event_count
from cdc.outbox import OutboxEvent, register_user, write_event
from cdc.settings import Settings
from cdc.wal.stream import UNLIMITED, ReplicationStream
from sinks.parking.lot import ParkingLot, ParkRequest
from sinks.stub.server import StubServer
from tests.harness import (
    ROOT,
    RelayConfig,
    drop_slot,
    env_without,
    free_port,
    read_topics,
    start_relay,
    wait_until,
)

pytestmark = pytest.mark.integration

PARTITIONS = 3
#: Longest wait for one `lag --watch` frame (a loaded machine starts the CLI slowly).
WATCH_FRAME_TIMEOUT_S = 120.0
SYNC_TYPES = {"UserRegistered": "USER_SYNC", "QuizAttemptSubmitted": "QUIZ_SYNC"}
API_KEY = "ops-test-key"


@dataclass
class Ops:
    """One test's names: topics, group, slot; and how to run the CLI with them."""

    unique: str
    kafka: str
    db_dsn: str
    engine_url: str = "http://127.0.0.1:9"  # nothing listens: no test reaches it by accident

    @property
    def prefix(self) -> str:
        return f"t{self.unique}.outbox.event."

    @property
    def user_topic(self) -> str:
        return self.prefix + "user"

    @property
    def quiz_topic(self) -> str:
        return self.prefix + "quiz_attempt"

    @property
    def group(self) -> str:
        return f"g-{self.unique}"

    @property
    def slot(self) -> str:
        return f"slot_{self.unique}"

    def env(self) -> dict[str, str]:
        env = env_without(os.environ, "CDC_", "KAFKA_", "SINK_", "ENGINE_", "OUTBOX_")
        env.update(
            {
                "CDC_PG_DSN": self.db_dsn,
                "KAFKA_BOOTSTRAP_SERVERS": self.kafka,
                "CDC_TOPIC_PREFIX": self.prefix,
                "CDC_SLOT": self.slot,
                "SINK_GROUP_ID": self.group,
                "ENGINE_BASE_URL": self.engine_url,
                "INTERNAL_API_KEY": API_KEY,
                "LOG_LEVEL": "WARNING",
            }
        )
        return env

    def settings(self) -> Settings:
        return Settings.from_env(self.env())

    def cli(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "cdc.cli", *args],
            env=self.env(),
            cwd=ROOT,
            capture_output=True,
            text=True,
            input=stdin,
            timeout=180,
            check=False,
        )

    def cli_json(self, *args: str, expect_rc: int = 0) -> dict[str, object]:
        done = self.cli(*args, "--json")
        assert done.returncode == expect_rc, f"rc={done.returncode}\n{done.stdout}\n{done.stderr}"
        result: dict[str, object] = json.loads(done.stdout)
        return result


@pytest.fixture
def ops(db_dsn: str, kafka_bootstrap: str, unique: str) -> Iterator[Ops]:
    o = Ops(unique=unique, kafka=kafka_bootstrap, db_dsn=db_dsn)
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    topics = [NewTopic(t, num_partitions=PARTITIONS) for t in (o.user_topic, o.quiz_topic)]
    for fut in admin.create_topics(topics).values():
        fut.result(timeout=30)
    wait_until(
        lambda: all(
            t in admin.list_topics(timeout=10).topics for t in (o.user_topic, o.quiz_topic)
        ),
        30,
        "topics",
    )
    yield o
    admin.delete_topics([o.user_topic, o.quiz_topic])
    drop_slot(db_dsn, o.slot)


# --- producing records in the contract format and committing offsets ------------------------


@dataclass(frozen=True)
class Rec:
    """A record as the relay would write it."""

    topic: str
    partition: int
    key: str
    event_type: str
    payload: dict[str, object]
    ts_ms: int
    lsn: str = "0/0"
    event_id: str = ""


@dataclass(frozen=True)
class Produced:
    event_id: str
    topic: str
    partition: int
    offset: int
    ts_ms: int


def produce(kafka: str, records: Sequence[Rec]) -> list[Produced]:
    """Produce one record at a time, so offsets follow the list order."""
    producer = Producer({"bootstrap.servers": kafka, "enable.idempotence": True, "acks": "all"})
    out: list[Produced] = []
    for rec in records:
        event_id = rec.event_id or str(uuid.uuid4())
        reports: list[tuple[object, object]] = []
        producer.produce(
            rec.topic,
            partition=rec.partition,
            key=rec.key.encode(),
            value=json.dumps(rec.payload, separators=(",", ":")).encode(),
            timestamp=rec.ts_ms,
            headers=[
                ("id", event_id.encode()),
                ("type", rec.event_type.encode()),
                ("aggregatetype", rec.topic.rsplit(".", 1)[-1].encode()),
                ("lsn", rec.lsn.encode()),
                ("commit_ts", datetime.fromtimestamp(rec.ts_ms / 1000, UTC).isoformat().encode()),
            ],
            on_delivery=lambda err, msg, into=reports: into.append((err, msg)),
        )
        assert producer.flush(30) == 0
        ((err, msg),) = reports
        assert err is None, err
        out.append(
            Produced(
                event_id=event_id,
                topic=rec.topic,
                partition=msg.partition(),  # type: ignore[attr-defined]
                offset=msg.offset(),  # type: ignore[attr-defined]
                ts_ms=rec.ts_ms,
            )
        )
    return out


def commit(kafka: str, group: str, offsets: dict[tuple[str, int], int]) -> None:
    """Commit offsets for ``group`` as its member would (then leave)."""
    consumer = Consumer(
        {"bootstrap.servers": kafka, "group.id": group, "enable.auto.commit": False}
    )
    try:
        consumer.commit(
            offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()], asynchronous=False
        )
    finally:
        consumer.close()


def committed(kafka: str, group: str, topic: str) -> dict[int, int | None]:
    consumer = Consumer(
        {"bootstrap.servers": kafka, "group.id": group, "enable.auto.commit": False}
    )
    try:
        tps = consumer.committed([TopicPartition(topic, p) for p in range(PARTITIONS)], timeout=15)
    finally:
        consumer.close()
    return {tp.partition: (tp.offset if tp.offset >= 0 else None) for tp in tps}


def offsets_for_time(kafka: str, topic: str, ts_ms: int) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": kafka, "group.id": "unused-reader"})
    try:
        found = consumer.offsets_for_times(
            [TopicPartition(topic, p, ts_ms) for p in range(PARTITIONS)], timeout=15
        )
    finally:
        consumer.close()
    return {tp.partition: tp.offset for tp in found}


def user_event(topic: str, partition: int, user_id: str, ts_ms: int, lsn: str = "0/0") -> Rec:
    payload = {
        "user_id": user_id,
        "email": f"{user_id}@ex.org",
        "display_name": "U",
        "registered_at": datetime.fromtimestamp(ts_ms / 1000, UTC).isoformat(),
    }
    return Rec(topic, partition, user_id, "UserRegistered", payload, ts_ms, lsn)


def quiz_event(topic: str, partition: int, user_id: str, ts_ms: int, lsn: str, **kw: str) -> Rec:
    payload = {
        "attempt_id": str(uuid.uuid4()),
        "user_id": user_id,
        "quiz_id": "q1",
        "score": 7,
        "submitted_at": datetime.fromtimestamp(ts_ms / 1000, UTC).isoformat(),
    }
    return Rec(topic, partition, user_id, "QuizAttemptSubmitted", payload, ts_ms, lsn, **kw)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat()


def _spread(ops: Ops, t0: int, offsets_s: dict[int, list[int]]) -> list[Produced]:
    """Records on the user topic: partition -> seconds after t0 of each record."""
    return produce(
        ops.kafka,
        [
            user_event(ops.user_topic, p, str(uuid.uuid4()), t0 + s * 1000)
            for p, seconds in offsets_s.items()
            for s in seconds
        ],
    )


# --- replay ----------------------------------------------------------------------------------


def test_replay_to_datetime_commits_the_first_offset_at_or_after_the_time_per_partition(
    ops: Ops,
) -> None:
    t0 = now_ms() - 600_000
    _spread(ops, t0, {0: [0, 10, 20, 30, 40], 1: [5, 15, 25], 2: [1, 2]})
    ends = {(ops.user_topic, 0): 5, (ops.user_topic, 1): 3, (ops.user_topic, 2): 2}
    commit(ops.kafka, ops.group, ends)
    at = t0 + 12_000

    plan = ops.cli_json(
        "replay", "--group", ops.group, "--all-topics", "--to-datetime", iso(at), "--execute"
    )

    assert plan["executed"] is True
    expected = offsets_for_time(ops.kafka, ops.user_topic, at)
    assert expected == {0: 2, 1: 1, 2: -1}  # partition 2: nothing that recent
    assert committed(ops.kafka, ops.group, ops.user_topic) == {0: 2, 1: 1, 2: 2}
    assert plan["redeliver_count"] == 3 + 2 + 0


def test_replay_dry_run_reports_the_plan_and_changes_nothing(ops: Ops) -> None:
    _spread(ops, now_ms() - 60_000, {0: [0, 1, 2, 3], 1: [0, 1]})
    commit(ops.kafka, ops.group, {(ops.user_topic, 0): 3, (ops.user_topic, 1): 2})

    plan = ops.cli_json("replay", "--group", ops.group, "--topic", ops.user_topic, "--to-earliest")

    assert plan["executed"] is False
    rows = {p["partition"]: p for p in plan["partitions"]}  # type: ignore[attr-defined]
    assert rows[0]["current_offset"] == 3 and rows[0]["target_offset"] == 0
    assert rows[2]["current_offset"] is None and rows[2]["target_offset"] is None
    assert rows[2]["action"] == "untouched"  # never committed: --topic T leaves it alone
    assert plan["redeliver_count"] == 3 + 2
    assert committed(ops.kafka, ops.group, ops.user_topic) == {0: 3, 1: 2, 2: None}
    table = ops.cli("replay", "--group", ops.group, "--topic", ops.user_topic, "--to-earliest")
    assert table.returncode == 0
    assert "dry run, nothing changed" in table.stdout


def test_replay_is_refused_while_the_group_has_an_active_member(ops: Ops) -> None:
    _spread(ops, now_ms() - 60_000, {0: [0, 1, 2]})
    commit(ops.kafka, ops.group, {(ops.user_topic, 0): 3})
    member = Consumer(
        {"bootstrap.servers": ops.kafka, "group.id": ops.group, "enable.auto.commit": False}
    )
    member.subscribe([ops.user_topic])
    try:
        wait_until(lambda: member.poll(0.2) is not None or member.assignment(), 30, "assignment")

        done = ops.cli(
            "replay", "--group", ops.group, "--topic", ops.user_topic, "--to-earliest", "--execute"
        )
        dry = ops.cli("replay", "--group", ops.group, "--topic", ops.user_topic, "--to-earliest")

        assert done.returncode == 1, done.stderr
        assert f"consumer group {ops.group} is active" in done.stderr
        # a dry run changes nothing: exit 0, the plan, and the warning that --execute is refused
        assert dry.returncode == 0, dry.stderr
        assert "dry run, nothing changed" in dry.stdout
        assert f"consumer group {ops.group} is active" in dry.stderr
        assert "--execute would be refused" in dry.stderr
        assert committed(ops.kafka, ops.group, ops.user_topic)[0] == 3
    finally:
        member.close()


def test_replay_shift_by_is_clamped_to_each_partitions_watermarks(ops: Ops) -> None:
    _spread(ops, now_ms() - 60_000, {0: [0, 1, 2, 3, 4], 1: [0, 1, 2]})
    commit(ops.kafka, ops.group, {(ops.user_topic, 0): 2, (ops.user_topic, 1): 1})

    back = ops.cli_json(
        "replay",
        "--group",
        ops.group,
        "--topic",
        f"{ops.user_topic}:0",
        "--shift-by",
        "-10",
        "--execute",
    )
    assert committed(ops.kafka, ops.group, ops.user_topic) == {0: 0, 1: 1, 2: None}
    ahead = ops.cli_json(
        "replay",
        "--group",
        ops.group,
        "--topic",
        f"{ops.user_topic}:0,1",
        "--shift-by=+100",
        "--execute",
    )

    assert [p["target_offset"] for p in back["partitions"]] == [0]  # type: ignore[attr-defined]
    assert back["redeliver_count"] == 2
    assert committed(ops.kafka, ops.group, ops.user_topic) == {0: 5, 1: 3, 2: None}
    assert ahead["skip_count"] == 5 + 2


def test_replay_by_duration_goes_back_to_the_first_record_within_the_window(ops: Ops) -> None:
    now = now_ms()
    _spread(ops, now, {0: [-3600, -1800, -600, -60]})  # an hour ago ... a minute ago
    commit(ops.kafka, ops.group, {(ops.user_topic, 0): 4})

    plan = ops.cli_json(
        "replay",
        "--group",
        ops.group,
        "--topic",
        f"{ops.user_topic}:0",
        "--by-duration",
        "PT15M",
        "--execute",
    )

    assert committed(ops.kafka, ops.group, ops.user_topic)[0] == 2
    assert plan["redeliver_count"] == 2


def test_replay_usage_errors_exit_2(ops: Ops) -> None:
    both = ops.cli("replay", "--group", ops.group, "--all-topics", "--to-earliest", "--to-latest")
    no_topic = ops.cli("replay", "--group", ops.group, "--to-earliest")
    bad = ops.cli("replay", "--group", ops.group, "--all-topics", "--by-duration", "P1M")
    unknown = ops.cli("replay", "--group", ops.group, "--topic", "no.such.topic", "--to-latest")

    assert [r.returncode for r in (both, no_topic, bad, unknown)] == [2, 2, 2, 2]
    assert "no fixed length" in bad.stderr
    assert "does not exist" in unknown.stderr


# --- lag -------------------------------------------------------------------------------------


def test_lag_reports_the_age_of_the_oldest_unprocessed_event_per_partition(ops: Ops) -> None:
    t0 = now_ms() - 600_000
    produced = _spread(ops, t0, {0: [0, 100, 200], 1: [0, 50], 2: [300, 400]})
    commit(ops.kafka, ops.group, {(ops.user_topic, 0): 1, (ops.user_topic, 1): 2})
    before = now_ms()

    report = ops.cli_json("lag")

    after = now_ms()
    rows = {
        (r["topic"], r["partition"]): r
        for r in report["partitions"]  # type: ignore[attr-defined]
    }
    p0, p1, p2 = (rows[(ops.user_topic, p)] for p in range(3))
    first_unprocessed = next(p for p in produced if p.partition == 0 and p.offset == 1)
    assert (p0["committed_offset"], p0["end_offset"], p0["lag"]) == (1, 3, 2)
    assert p0["oldest_unprocessed_ts_ms"] == first_unprocessed.ts_ms
    assert (before - first_unprocessed.ts_ms) / 1000 <= p0["oldest_unprocessed_age_s"]
    assert p0["oldest_unprocessed_age_s"] <= (after - first_unprocessed.ts_ms) / 1000
    assert (p1["lag"], p1["oldest_unprocessed_age_s"]) == (0, 0.0)
    assert (p2["committed_offset"], p2["lag"]) == (None, 2)  # never committed
    assert p2["oldest_unprocessed_ts_ms"] == t0 + 300_000
    assert report["totals"]["lag"] == 4  # type: ignore[index]
    assert report["totals"]["oldest_unprocessed_age_s"] == p0["oldest_unprocessed_age_s"]  # type: ignore[index]
    assert set(report["parking_lot"]) == {"FAILED", "PENDING", "DONE"}  # type: ignore[arg-type]
    assert report["slot"]["exists"] is False  # type: ignore[index]


def test_lag_is_zero_with_zero_age_when_the_group_caught_up(ops: Ops) -> None:
    _spread(ops, now_ms() - 600_000, {0: [0, 1], 1: [2], 2: [3, 4, 5]})
    commit(
        ops.kafka,
        ops.group,
        {(ops.user_topic, 0): 2, (ops.user_topic, 1): 1, (ops.user_topic, 2): 3},
    )

    report = ops.cli_json("lag", "--topic", ops.user_topic)
    table = ops.cli("lag", "--topic", ops.user_topic)

    assert report["totals"] == {  # type: ignore[comparison-overlap]
        "lag": 0,
        "oldest_unprocessed_age_s": 0.0,
        "partitions": 3,
        "lagging_partitions": 0,
    }
    assert table.returncode == 0
    assert "total lag 0 in 0/3 partitions" in table.stdout


def _watch_until_frames(ops: Ops, count: int) -> tuple[int, list[str], str]:
    """Run ``lag --watch --json`` until it printed ``count`` frames (however long a loaded
    machine takes to start the CLI and read Kafka), then Ctrl-C it: (exit code, every
    line it printed, stderr)."""
    command = [sys.executable, "-m", "cdc.cli", "lag", "--topic", ops.user_topic, "--watch"]
    lines: queue.Queue[str] = queue.Queue()
    with subprocess.Popen(
        [*command, "--json"],
        env=ops.env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as watch:
        out, err = watch.stdout, watch.stderr
        assert out is not None and err is not None
        reader = threading.Thread(target=lambda: [lines.put(x) for x in out], daemon=True)
        reader.start()
        seen: list[str] = []
        try:
            while len(seen) < count:
                seen.append(lines.get(timeout=WATCH_FRAME_TIMEOUT_S))
        finally:
            watch.send_signal(signal.SIGINT)
            watch.wait(timeout=30)
            reader.join(timeout=30)
        while not lines.empty():  # frames printed before the interrupt arrived
            seen.append(lines.get_nowait())
        return watch.returncode, seen, err.read()


def test_lag_watch_refreshes_until_interrupted_and_exits_zero(ops: Ops) -> None:
    _spread(ops, now_ms() - 60_000, {0: [0, 1], 1: [2]})
    commit(ops.kafka, ops.group, {(ops.user_topic, 2): 0})  # the group exists, lags by 3

    returncode, lines, err = _watch_until_frames(ops, 2)

    assert returncode == 0, err
    frames = [json.loads(line) for line in lines if line.strip()]
    assert len(frames) >= 2, "the view refreshes"
    assert all(f["totals"]["lag"] == 3 for f in frames)


# --- redeliver -------------------------------------------------------------------------------


@dataclass(frozen=True)
class History:
    user_a: str
    user_b: str
    events_a: list[Produced]
    events_b: list[Produced]


def _two_users_history(ops: Ops) -> History:
    """User A: registered, two attempts (one duplicated in Kafka); user B interleaved."""
    a, b = str(uuid.uuid4()), str(uuid.uuid4())
    t = now_ms() - 120_000
    dup_id = str(uuid.uuid4())
    records = [
        user_event(ops.user_topic, 2, b, t, "0/50"),
        user_event(ops.user_topic, 1, a, t + 1_000, "0/100"),
        quiz_event(ops.quiz_topic, 0, a, t + 2_000, "0/200", event_id=dup_id),
        quiz_event(ops.quiz_topic, 0, b, t + 2_500, "0/250"),
        quiz_event(ops.quiz_topic, 0, a, t + 2_000, "0/200", event_id=dup_id),  # duplicate
        quiz_event(ops.quiz_topic, 0, a, t + 3_000, "0/300"),
    ]
    produced = produce(ops.kafka, records)
    return History(
        user_a=a,
        user_b=b,
        events_a=[p for p, r in zip(produced, records, strict=True) if r.key == a],
        events_b=[p for p, r in zip(produced, records, strict=True) if r.key == b],
    )


def test_redeliver_by_key_sends_exactly_that_keys_events_in_order_and_moves_no_offset(
    ops: Ops,
) -> None:
    """... and a second redelivery of the same events says ``duplicate`` (exit 0)."""
    history = _two_users_history(ops)
    group_offsets = {(ops.user_topic, 1): 1, (ops.quiz_topic, 0): 2}
    commit(ops.kafka, ops.group, group_offsets)
    admin = AdminClient({"bootstrap.servers": ops.kafka})
    groups_before = {g.group_id for g in admin.list_consumer_groups().result().valid}

    with StubServer(api_key=API_KEY) as stub:
        ops.engine_url = stub.url
        result = ops.cli_json("redeliver", "--key", history.user_a)
        applied = stub.applied()["items"]
        # again: the engine answers 200 {"status":"duplicate"}, and redeliver says so
        again = ops.cli_json("redeliver", "--key", history.user_a)

    assert [e["outcome"] for e in again["events"]] == ["duplicate"] * 3  # type: ignore[attr-defined]
    expected_ids = []
    for p in history.events_a:
        if p.event_id not in expected_ids:
            expected_ids.append(p.event_id)
    assert [i["event_id"] for i in applied] == expected_ids  # registration, attempt 1, attempt 2
    assert [i["path"] for i in applied] == [
        "/api/internal/users/sync",
        "/api/internal/quiz-attempts/sync",
        "/api/internal/quiz-attempts/sync",
    ]
    assert [e["outcome"] for e in result["events"]] == ["delivered"] * 3  # type: ignore[attr-defined]
    assert committed(ops.kafka, ops.group, ops.user_topic) == {0: None, 1: 1, 2: None}
    assert committed(ops.kafka, ops.group, ops.quiz_topic) == {0: 2, 1: None, 2: None}
    groups_after = {g.group_id for g in admin.list_consumer_groups().result().valid}
    assert not {g for g in groups_after - groups_before if g.startswith("outbox-cdc-ops-")}


def test_redeliver_by_event_id_sends_only_those_and_fails_for_ids_not_in_kafka(ops: Ops) -> None:
    history = _two_users_history(ops)
    registration_b = history.events_b[0].event_id
    last_attempt_a = history.events_a[-1].event_id
    missing = str(uuid.uuid4())

    with StubServer(api_key=API_KEY) as stub:
        ops.engine_url = stub.url
        done = ops.cli(
            "redeliver",
            "--event-id",
            last_attempt_a,
            "--event-id",
            registration_b,
            "--event-id",
            missing,
            "--json",
        )
        applied = stub.applied()["items"]

    assert done.returncode == 1
    result = json.loads(done.stdout)
    assert result["missing_event_ids"] == [missing]
    # the attempt's user was unknown to the blank engine: it was synced first, then the attempt
    assert [
        i["event_id"] for i in applied if i["event_id"] in (registration_b, last_attempt_a)
    ] == [
        registration_b,
        last_attempt_a,
    ]
    assert {e["outcome"] for e in result["events"]} == {"delivered"}


def test_redeliver_reports_engine_unavailable_and_exits_1(ops: Ops) -> None:
    history = _two_users_history(ops)

    done = ops.cli("redeliver", "--key", history.user_b, "--json")

    assert done.returncode == 1
    outcomes = [e["outcome"] for e in json.loads(done.stdout)["events"]]
    assert outcomes == ["engine_unavailable", "not_sent"]


# --- failed (parking lot) ------------------------------------------------------------------------


def _park(db_dsn: str, ops: Ops, rows: list[tuple[str, str, dict[str, object]]]) -> list[int]:
    async def run() -> list[int]:
        lot = ParkingLot(db_dsn)
        try:
            ids = []
            for n, (event_id, event_type, payload) in enumerate(rows):
                ids.append(
                    await lot.park(
                        ParkRequest(
                            outbox_event_id=event_id,
                            sync_type="USER_SYNC"
                            if event_type == "UserRegistered"
                            else "QUIZ_SYNC",
                            payload=json.dumps(payload).encode(),
                            reason="engine said 422",
                            topic=ops.user_topic,
                            partition=0,
                            offset=n,
                            key=str(payload["user_id"]).encode(),
                            headers={"id": event_id.encode(), "type": event_type.encode()},
                            retry_in_s=300,
                        )
                    )
                )
            return ids
        finally:
            await lot.close()

    return asyncio.run(run())


def test_failed_retry_counts_processed_done_and_failed_like_the_admin_api(ops: Ops) -> None:
    user_ok = [str(uuid.uuid4()), str(uuid.uuid4())]
    rejected = str(uuid.uuid4())
    rows: list[tuple[str, str, dict[str, object]]] = [
        (str(uuid.uuid4()), "UserRegistered", {"user_id": u}) for u in user_ok
    ]
    rows.append(
        (
            rejected,
            "QuizAttemptSubmitted",
            {"attempt_id": str(uuid.uuid4()), "user_id": user_ok[0], "quiz_id": "q", "score": 1},
        )
    )
    ids = _park(ops.db_dsn, ops, rows)
    listed = ops.cli_json("failed", "list", "--limit", "1000")
    assert set(ids) <= {e["event_id"] for e in listed["events"]}  # type: ignore[attr-defined]

    with StubServer(api_key=API_KEY) as stub:
        stub.add_faults({"event_id": rejected, "status": 422, "times": -1})
        ops.engine_url = stub.url
        args = [a for i in [*ids, 999_999_999] for a in ("--id", str(i))]
        done = ops.cli("failed", "retry", *args, "--json")

    assert done.returncode == 1, done.stderr
    answer = json.loads(done.stdout)
    assert answer["data"] == {"processed_count": 3, "done_count": 2, "failed_count": 1}
    assert answer["unknown_ids"] == [999_999_999]
    with psycopg.connect(ops.db_dsn) as conn:
        status = dict(
            conn.execute(
                "SELECT event_id, status || ':' || retry_count FROM failed_sync_events"
                " WHERE event_id = ANY(%s)",
                (ids,),
            ).fetchall()
        )
    assert status == {ids[0]: "DONE:0", ids[1]: "DONE:0", ids[2]: "FAILED:1"}


def _one_parked(ops: Ops) -> int:
    event_id = str(uuid.uuid4())
    return _park(ops.db_dsn, ops, [(event_id, "UserRegistered", {"user_id": str(uuid.uuid4())})])[0]


def _status_of(ops: Ops, parked_id: int) -> str:
    with psycopg.connect(ops.db_dsn) as conn:
        row = conn.execute(
            "SELECT status FROM failed_sync_events WHERE event_id = %s", (parked_id,)
        ).fetchone()
    assert row is not None
    return str(row[0])


def test_failed_accept_without_a_terminal_refuses_in_one_line_naming_yes(ops: Ops) -> None:
    parked = _one_parked(ops)

    done = ops.cli("failed", "accept", "--id", str(parked), stdin="")  # stdin: a pipe

    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "error: refusing without --yes on a non-interactive terminal (nothing changed)"
    ]
    assert "Aborted" not in done.stderr
    assert _status_of(ops, parked) == "FAILED"


def test_failed_list_of_done_rows_is_headed_done(ops: Ops) -> None:
    parked = _one_parked(ops)
    accepted = ops.cli("failed", "accept", "--id", str(parked), "--yes")
    assert accepted.returncode == 0, accepted.stderr

    done = ops.cli("failed", "list", "--status", "DONE", "--limit", "1000")

    assert done.returncode == 0, done.stderr
    assert "done sync event(s)" in done.stdout
    assert "failed or pending" not in done.stdout


def test_failed_retry_of_an_unknown_id_answers_like_the_admin_api(ops: Ops) -> None:
    """The admin API answers 200 success, processed 0, naming the id: so does the CLI (exit 0)."""
    done = ops.cli("failed", "retry", "--id", "999999999", "--json")
    table = ops.cli("failed", "retry", "--id", "999999999")

    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["success"] is True
    assert answer["data"] == {"processed_count": 0, "done_count": 0, "failed_count": 0}
    assert answer["unknown_ids"] == [999_999_999]
    assert "unknown or not open: [999999999]" in answer["message"]
    assert table.returncode == 0, table.stderr
    assert "unknown or not open: 999999999" in table.stdout


def test_lag_of_a_group_that_exists_but_never_committed_on_these_topics_says_so_and_exits_1(
    ops: Ops,
) -> None:
    _spread(ops, now_ms() - 60_000, {0: [0, 1]})
    group = f"other-{ops.unique}"
    commit(ops.kafka, group, {(ops.quiz_topic, 0): 0})

    done = ops.cli("lag", "--group", group, "--topic", ops.user_topic)
    as_json = ops.cli_json("lag", "--group", group, "--topic", ops.user_topic, expect_rc=1)

    assert done.returncode == 1
    assert f"error: consumer group {group} has never committed an offset" in done.stderr
    assert "SINK_GROUP_ID=" in done.stderr
    assert any("never committed" in p for p in as_json["problems"])  # type: ignore[attr-defined]


def test_a_mistyped_group_is_named_before_anything_is_printed_with_the_likely_intent(
    ops: Ops,
) -> None:
    _spread(ops, now_ms() - 60_000, {0: [0, 1], 1: [2]})
    commit(ops.kafka, ops.group, {(ops.user_topic, 0): 1})
    typo = ops.group[:-1] + ("x" if not ops.group.endswith("x") else "y")

    runs = {
        "lag": ops.cli("lag", "--group", typo),
        "lag --json": ops.cli("lag", "--group", typo, "--json"),
        "replay": ops.cli("replay", "--group", typo, "--all-topics", "--to-earliest"),
        "replay --execute": ops.cli(
            "replay", "--group", typo, "--all-topics", "--to-earliest", "--execute"
        ),
    }

    named = (
        f"error: consumer group {typo} does not exist (no members, no committed offsets):"
        f" did you mean {ops.group}"
    )
    for name, run in runs.items():
        assert run.returncode == 1, f"{name}: {run.stdout}{run.stderr}"
        assert run.stdout == "", f"{name} printed before its error: {run.stdout}"
        # (ours first: the closest; another test's random group on the shared broker may
        # be close enough to follow it - "or g-d9f7ef4e8b" in a clean-clone CI once)
        lines = run.stderr.splitlines()
        assert len(lines) == 1 and lines[0].endswith("?"), name
        assert lines[0] == f"{named}?" or lines[0].startswith(f"{named} or "), name
    assert committed(ops.kafka, typo, ops.user_topic) == {0: None, 1: None, 2: None}


def test_lag_without_kafka_shows_the_slot_and_the_parking_lot_and_names_the_failure(
    ops: Ops, db_dsn: str
) -> None:
    with socket.socket() as closed:  # a port nothing listens on: a stopped broker
        closed.bind(("127.0.0.1", 0))
        dead_kafka = f"127.0.0.1:{closed.getsockname()[1]}"
    env = {**ops.env(), "KAFKA_BOOTSTRAP_SERVERS": dead_kafka}

    table = subprocess.run(
        [sys.executable, "-m", "cdc.cli", "lag"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    as_json = subprocess.run(
        [sys.executable, "-m", "cdc.cli", "lag", "--json"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )

    assert table.returncode == 1, table.stderr
    assert f"consumer group {ops.group}: unknown (Kafka could not be read)" in table.stdout
    assert f"slot {ops.slot}" in table.stdout and "parking lot: FAILED" in table.stdout
    error = f"error: Kafka at {dead_kafka} unreachable: connection refused at {dead_kafka}"
    assert error in table.stderr
    assert "check KAFKA_BOOTSTRAP_SERVERS" not in table.stderr  # the setting is right
    report = json.loads(as_json.stdout)
    assert as_json.returncode == 1
    assert report["kafka"]["readable"] is False and report["partitions"] == []
    assert report["slot"]["exists"] is False and "FAILED" in report["parking_lot"]


# --- slot ------------------------------------------------------------------------------------


def _create_slot(db_dsn: str, slot: str) -> None:
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))


def _write_events(db_dsn: str, count: int) -> None:
    with psycopg.connect(db_dsn) as conn, conn.transaction():
        for _ in range(count):
            write_event(
                conn,
                OutboxEvent(
                    aggregate_type="probe",
                    aggregate_id="p",
                    event_type="Probe",
                    payload={"n": 1},
                ),
            )


def test_slot_status_reports_wal_lag_and_the_age_of_the_oldest_unconfirmed_event(
    ops: Ops,
) -> None:
    _create_slot(ops.db_dsn, ops.slot)
    _write_events(ops.db_dsn, 1)
    time.sleep(1.5)

    behind = ops.cli_json("slot", "status")
    with psycopg.connect(ops.db_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_replication_slot_advance(%s, pg_current_wal_lsn())", (ops.slot,))
    caught_up = ops.cli_json("slot", "status")

    assert behind["exists"] is True and behind["active"] is False
    assert behind["wal_lag_bytes"] > 0  # type: ignore[operator]
    assert 1.5 <= behind["lag_time_s"] < 60  # type: ignore[operator]
    assert behind["oldest_unconfirmed_commit_ts"] is not None
    assert caught_up["lag_time_s"] == 0.0
    assert ops.cli("slot", "status").returncode == 0


def test_slot_status_measures_an_active_slots_lag_through_a_temporary_copy(ops: Ops) -> None:
    _create_slot(ops.db_dsn, ops.slot)
    stream = ReplicationStream(ops.db_dsn, slot=ops.slot, publication="outbox_pub", limit=UNLIMITED)
    try:
        stream.start()  # active, and never confirms anything
        wait_until(lambda: slot_status(ops.settings())["active"], 30, "slot active")
        _write_events(ops.db_dsn, 1)
        time.sleep(1.2)

        status = ops.cli_json("slot", "status")

        assert status["active"] is True
        assert 1.2 <= status["lag_time_s"] < 60  # type: ignore[operator]
        with psycopg.connect(ops.db_dsn) as conn:
            row = conn.execute(
                "SELECT count(*) FILTER (WHERE slot_name LIKE 'outbox_ops_peek_%%'),"
                " bool_or(active) FILTER (WHERE slot_name = %s) FROM pg_replication_slots",
                (ops.slot,),
            ).fetchone()
        assert row == (0, True)  # the copy is gone, the stream still holds the slot
    finally:
        stream.close()


def test_slot_status_reads_an_active_slot_without_disturbing_the_relay(
    ops: Ops, tmp_path: Path
) -> None:
    cfg = RelayConfig(db_dsn=ops.db_dsn, kafka=ops.kafka, unique=ops.unique)
    relay, _port = start_relay(cfg, tmp_path)
    try:
        status = slot_status(ops.settings())
        assert status["active"] is True
        assert not status["lag_time_note"].startswith("lag time unavailable"), status
        with psycopg.connect(ops.db_dsn) as conn:
            user = register_user(conn, email=f"{uuid.uuid4()}@ex.org", display_name="Ops")
        msgs = read_topics(ops.kafka, [ops.user_topic], expect=1, idle_s=0.5)
        assert [dict(m.headers())["id"].decode() for m in msgs] == [str(user.event_id)]
        assert relay.alive()
    finally:
        relay.terminate()
        relay.close()


def test_slot_missing_exits_1(ops: Ops) -> None:
    done = ops.cli("slot", "status")
    assert done.returncode == 1
    assert f"slot {ops.slot} does not exist" in done.stderr


def test_prune_says_when_older_than_was_raised_to_the_recovery_horizon(ops: Ops) -> None:
    _create_slot(ops.db_dsn, ops.slot)

    done = ops.cli("prune", "--older-than", "60")

    assert done.returncode == 0, done.stderr
    assert "outbox rows older than 86400s" in done.stdout
    assert "(--older-than 60s raised to the recovery horizon, CDC_RECOVERY_HORIZON_S=86400" in (
        done.stdout
    )


def test_slot_drop_asks_then_drops_and_warns_of_the_unconfirmed_events(ops: Ops) -> None:
    _create_slot(ops.db_dsn, ops.slot)
    _write_events(ops.db_dsn, 2)

    declined = ops.cli("slot", "drop", stdin="n\n")
    assert declined.returncode == 1
    assert slot_status(ops.settings())["exists"] is True
    dropped = ops.cli("slot", "drop", "--yes")

    assert dropped.returncode == 0, dropped.stderr
    assert "2 outbox event(s)" in " ".join(dropped.stderr.split())
    assert slot_status(ops.settings())["exists"] is False


def test_slot_drop_is_refused_while_a_relay_streams_the_slot_naming_that_relay(
    ops: Ops, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal names the holder: the relay's PID and host (its replication
    connection's application_name), apart from the walsender's PID and client address."""
    _create_slot(ops.db_dsn, ops.slot)
    monkeypatch.setattr(pgconn, "PROCESS_ROLE", ["relay"])  # (this process streams, as a relay)
    stream = ReplicationStream(ops.db_dsn, slot=ops.slot, publication="outbox_pub", limit=UNLIMITED)
    try:
        stream.start()
        wait_until(lambda: slot_status(ops.settings())["active"], 30, "slot active")
        walsender = slot_status(ops.settings())["active_pid"]

        done = ops.cli("slot", "drop", "--yes")

        assert done.returncode == 1
        line = " ".join(done.stderr.split())
        assert f"slot {ops.slot} is active, held by walsender {walsender} (client 127.0.0.1:" in (
            line
        )
        assert f"relay pid {os.getpid()} on host {socket.gethostname()}" in line
        assert "stop that relay first" in line
        assert slot_status(ops.settings())["exists"] is True
    finally:
        stream.close()


def test_slot_status_against_a_closed_port_says_connection_failed_once(ops: Ops) -> None:
    """One line, ``PostgreSQL connection failed: connection to server at ...``: not
    ``connection failed: connection failed:`` (psycopg's own prefix is dropped)."""
    env = {**ops.env(), "CDC_PG_DSN": f"postgresql://postgres@127.0.0.1:{free_port()}/x"}
    done = subprocess.run(
        [sys.executable, "-m", "cdc.cli", "slot", "status"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert "PostgreSQL connection failed: connection to server at" in done.stderr, done.stderr
    assert "connection failed: connection failed" not in done.stderr


# --- resync ----------------------------------------------------------------------------------


def test_resync_users_emits_one_user_registered_event_per_user_in_batches(ops: Ops) -> None:
    with psycopg.connect(ops.db_dsn, autocommit=True) as conn:
        for n in range(25):
            conn.execute(
                "INSERT INTO users (email, display_name) VALUES (%s, %s)",
                (f"{ops.unique}-{n}@ex.org", f"user {n}"),
            )
        before = {r[0] for r in conn.execute("SELECT id FROM outbox").fetchall()}
        user_ids = {str(r[0]) for r in conn.execute("SELECT id FROM users").fetchall()}
    _create_slot(ops.db_dsn, ops.slot)

    result = ops.cli_json("resync", "users", "--batch-size", "7")

    with psycopg.connect(ops.db_dsn) as conn:
        rows = [
            r
            for r in conn.execute(
                "SELECT id, aggregateid, type, payload, xmin::text FROM outbox"
                " WHERE aggregatetype = 'user'"
            ).fetchall()
            if r[0] not in before
        ]
    assert result["emitted"] == len(user_ids)
    assert sorted(r[1] for r in rows) == sorted(user_ids)  # exactly one per user
    assert {r[2] for r in rows} == {"UserRegistered"}
    assert all(r[3]["user_id"] == r[1] for r in rows)
    assert len({r[4] for r in rows}) == math.ceil(len(user_ids) / 7)  # one transaction per batch
    assert unconfirmed_event_count(ops.settings()) == len(user_ids)  # all in the WAL for the relay
