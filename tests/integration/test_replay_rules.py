"""Replay and lag never skip what the group has not processed (issue 14), on the real broker.

The scene of the issue, built for real: one topic whose partition 0 holds 200
records, partition 1 holds 100 of which the first 30 were deleted (``DeleteRecords``,
so its low watermark is 30) and partition 2 is empty. Each test commits the group's
offsets itself, runs ``python -m cdc.cli`` as an operator would, and then measures
the group's **real** resume point: a consumer built from the sink's own
configuration (:func:`sinks.kafka.config.consumer_config`, ``auto.offset.reset``
included) joins the group and reports the first offset it is handed in each
partition. The end-to-end test runs the sink itself against the engine stub and
asserts on the event ids the engine applied.

Kafka's own ``kafka-consumer-groups`` (``ConsumerGroupCommand`` from the 4.1.1 jars
that ``make up`` installs under ``.dev/kafka/libs``) runs side by side in the last
tests: where our rules are Kafka's the targets agree exactly, and where they differ
the difference is the documented one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from sinks.kafka.config import consumer_config
from sinks.stub.server import StubServer
from tests.harness import ROOT, RelayConfig, SinkConfig, start_sink, wait_until
from tests.integration.test_ops import Ops, commit, committed, user_event

pytestmark = pytest.mark.integration

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
#: The issue's partitions: records written, records deleted from the head.
P0_RECORDS, P1_RECORDS, P1_DELETED = 200, 100, 30
PARTITIONS = 3
#: Seconds between two records' timestamps (commit times), from T0 an hour ago.
STEP_S = 1
KAFKA_TOOL = "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand"


@dataclass(frozen=True)
class Scene:
    """The issue's topic: ids by partition and offset, and the first record's time."""

    ops: Ops
    topic: str
    t0_ms: int
    ids: dict[int, dict[int, str]]  # partition -> offset -> event id (deleted ones included)

    @property
    def group(self) -> str:
        return self.ops.group

    def ts_ms(self, offset: int) -> int:
        return self.t0_ms + offset * STEP_S * 1000

    def iso(self, offset: int, *, tz: timezone = UTC, timespec: str = "seconds") -> str:
        """The commit time of the record at ``offset`` (any partition: same spacing)."""
        moment = datetime.fromtimestamp(self.ts_ms(offset) / 1000, tz)
        return moment.isoformat(timespec=timespec)

    def replay(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.ops.cli("replay", "--group", self.group, *args)

    def replay_json(self, *args: str, expect_rc: int = 0) -> dict[str, object]:
        return self.ops.cli_json("replay", "--group", self.group, *args, expect_rc=expect_rc)

    def committed(self) -> dict[int, int | None]:
        return committed(self.ops.kafka, self.group, self.topic)

    def commit(self, offsets: dict[int, int]) -> None:
        commit(self.ops.kafka, self.group, {(self.topic, p): o for p, o in offsets.items()})


def _produce_scene(kafka: str, topic: str, t0_ms: int) -> dict[int, dict[int, str]]:
    producer = Producer({"bootstrap.servers": kafka, "enable.idempotence": True, "acks": "all"})
    ids: dict[int, dict[int, str]] = {0: {}, 1: {}, 2: {}}
    errors: list[object] = []

    def report(err: object, msg: object, event_id: str) -> None:
        if err is not None:
            errors.append(err)
        else:
            ids[msg.partition()][msg.offset()] = event_id  # type: ignore[attr-defined]

    for partition, count in ((0, P0_RECORDS), (1, P1_RECORDS)):
        for n in range(count):
            rec = user_event(topic, partition, str(uuid.uuid4()), t0_ms + n * STEP_S * 1000)
            event_id = str(uuid.uuid4())
            producer.produce(
                topic,
                partition=partition,
                key=rec.key.encode(),
                value=json.dumps(rec.payload, separators=(",", ":")).encode(),
                timestamp=rec.ts_ms,
                headers=[("id", event_id.encode()), ("type", b"UserRegistered")],
                on_delivery=lambda err, msg, eid=event_id: report(err, msg, eid),
            )
        producer.poll(0)
    assert producer.flush(60) == 0
    assert not errors, errors
    return ids


@pytest.fixture
def scene(
    db_dsn: str, kafka_bootstrap: str, unique: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Scene]:
    monkeypatch.setenv("COLUMNS", "250")  # rich tables unwrapped, so cells read as one line
    ops = Ops(unique=unique, kafka=kafka_bootstrap, db_dsn=db_dsn)
    topic = ops.user_topic
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=PARTITIONS)])[topic].result(timeout=30)
    wait_until(lambda: topic in admin.list_topics(timeout=10).topics, 30, "topic")
    t0_ms = time.time_ns() // 1_000_000 - 3_600_000
    ids = _produce_scene(kafka_bootstrap, topic, t0_ms)
    assert [len(ids[p]) for p in range(PARTITIONS)] == [P0_RECORDS, P1_RECORDS, 0]
    for fut in admin.delete_records([TopicPartition(topic, 1, P1_DELETED)]).values():
        fut.result(timeout=30)
    yield Scene(ops=ops, topic=topic, t0_ms=t0_ms, ids=ids)
    admin.delete_topics([topic])


def real_resume_points(scene: Scene, *, timeout_s: float = 90.0) -> dict[int, int]:
    """Where the group really resumes: the first offset a consumer configured exactly as
    the sink (its ``consumer_config``, ``auto.offset.reset`` included) is handed in each
    partition - a record's offset, or the end when the partition has nothing for it. It
    joins the group, never commits, and leaves."""
    config = consumer_config(scene.ops.settings())
    assert config["group.id"] == scene.group
    config.update({"enable.partition.eof": True, "logger": logging.getLogger("test.resume")})
    consumer = Consumer(config)
    first: dict[int, int] = {}
    try:
        consumer.subscribe([scene.topic])
        deadline = time.monotonic() + timeout_s
        while len(first) < PARTITIONS and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            error = msg.error()
            if error is not None and error.code() != KafkaError._PARTITION_EOF:
                raise AssertionError(f"consumer error: {error}")
            first.setdefault(msg.partition(), msg.offset())
    finally:
        consumer.close()
    _wait_group_empty(scene)
    assert len(first) == PARTITIONS, f"resume points seen: {first}"
    return first


def _wait_group_empty(scene: Scene) -> None:
    admin = AdminClient({"bootstrap.servers": scene.ops.kafka})

    def empty() -> bool:
        desc = admin.describe_consumer_groups([scene.group])[scene.group].result(timeout=15)
        return not desc.members

    wait_until(empty, 30, "group empty", interval_s=0.3)


def rows(plan: dict[str, object]) -> dict[int, dict[str, object]]:
    return {p["partition"]: p for p in plan["partitions"]}  # type: ignore[attr-defined,index]


# --- 1. a shift without a committed offset ------------------------------------------------


def test_shift_of_a_named_partition_without_a_committed_offset_is_refused_and_skips_nothing(
    scene: Scene,
) -> None:
    scene.commit({0: 100})
    before = real_resume_points(scene)

    done = scene.replay("--topic", f"{scene.topic}:1", "--shift-by", "+50", "--execute")
    as_json = scene.replay_json("--topic", f"{scene.topic}:1", "--shift-by=+50", expect_rc=1)

    assert done.returncode == 1, done.stderr
    assert f"cannot shift {scene.topic}[1]" in done.stderr
    assert "--from-earliest-if-uncommitted" in done.stderr
    assert "not committed — shift refused" in done.stdout  # the refused plan is shown
    assert "refused, nothing changed" in done.stdout
    assert as_json["refused"] is True and as_json["executed"] is False
    assert rows(as_json)[1]["action"] == "refused"
    assert rows(as_json)[1]["target_offset"] is None
    assert scene.committed() == {0: 100, 1: None, 2: None}
    after = real_resume_points(scene)
    assert before == after == {0: 100, 1: P1_DELETED, 2: 0}  # records 30..79 not skipped


def test_shift_of_a_whole_topic_leaves_partitions_without_a_commit_untouched(
    scene: Scene,
) -> None:
    scene.commit({0: 100})

    plan = scene.replay_json("--topic", scene.topic, "--shift-by", "+50", "--execute")

    assert plan["executed"] is True
    assert [rows(plan)[p]["action"] for p in range(PARTITIONS)] == [
        "move",
        "untouched",
        "untouched",
    ]
    assert rows(plan)[1]["note"] == "not committed — untouched"
    assert scene.committed() == {0: 150, 1: None, 2: None}
    assert real_resume_points(scene) == {0: 150, 1: P1_DELETED, 2: 0}


def test_shift_from_earliest_if_uncommitted_is_explicit_shown_in_the_dry_run_and_applied(
    scene: Scene,
) -> None:
    args = ("--topic", f"{scene.topic}:1", "--shift-by", "+50", "--from-earliest-if-uncommitted")

    dry = scene.replay(*args)
    plan = scene.replay_json(*args, "--execute")

    assert dry.returncode == 0, dry.stderr
    assert "--shift-by +50 --from-earliest-if-uncommitted" in dry.stdout
    assert "not committed — shifted from the low watermark 30" in dry.stdout
    assert (rows(plan)[1]["target_offset"], rows(plan)[1]["skip_count"]) == (80, 50)
    assert scene.committed()[1] == 80
    assert real_resume_points(scene)[1] == 80


# --- 2. --all-topics / --topic T and partitions never committed ---------------------------


def test_all_topics_to_datetime_leaves_never_committed_partitions_alone(scene: Scene) -> None:
    scene.commit({0: 100})
    before = real_resume_points(scene)
    at = scene.iso(60)

    table = scene.replay("--all-topics", "--to-datetime", at)
    plan = scene.replay_json("--all-topics", "--to-datetime", at, "--execute")

    assert table.returncode == 0, table.stderr
    assert "not committed — untouched" in table.stdout
    assert "2 partition(s) not committed — untouched" in table.stdout
    assert rows(plan)[0]["target_offset"] == 60
    assert rows(plan)[1]["action"] == rows(plan)[2]["action"] == "untouched"
    assert plan["redeliver_count"] == 40 and plan["skip_count"] == 0
    assert scene.committed() == {0: 60, 1: None, 2: None}
    after = real_resume_points(scene)
    assert after == {0: 60, 1: before[1], 2: before[2]}  # p1 still resumes at 30, not 60
    assert after[1] == P1_DELETED


def test_include_uncommitted_moves_never_committed_partitions_too(scene: Scene) -> None:
    scene.commit({0: 100})

    plan = scene.replay_json(
        "--topic", scene.topic, "--to-datetime", scene.iso(60), "--include-uncommitted", "--execute"
    )

    assert plan["include_uncommitted"] is True
    assert [rows(plan)[p]["target_offset"] for p in range(PARTITIONS)] == [60, 60, 0]
    assert rows(plan)[1]["skip_count"] == 30  # said in the plan: 30..59 skipped on request
    assert scene.committed() == {0: 60, 1: 60, 2: 0}
    assert real_resume_points(scene) == {0: 60, 1: 60, 2: 0}


def test_replay_leaves_an_untouched_partitions_records_to_the_sink_end_to_end(
    scene: Scene, tmp_path: Path
) -> None:
    relay = RelayConfig(db_dsn=scene.ops.db_dsn, kafka=scene.ops.kafka, unique=scene.ops.unique)
    with StubServer(api_key="replay-key") as stub:
        cfg = SinkConfig(relay=relay, engine_url=stub.url, api_key="replay-key")
        commit(scene.ops.kafka, cfg.group, {(scene.topic, 0): 100})
        done = scene.ops.cli(
            "replay",
            "--group",
            cfg.group,
            "--all-topics",
            "--to-datetime",
            scene.iso(60),
            "--execute",
        )
        assert done.returncode == 0, done.stderr
        expected = {scene.ids[0][o] for o in range(60, P0_RECORDS)} | {
            scene.ids[1][o] for o in range(P1_DELETED, P1_RECORDS)
        }
        sink, _port = start_sink(cfg, tmp_path)
        try:
            wait_until(
                lambda: expected <= {i["event_id"] for i in stub.applied()["items"]},
                180,
                f"{len(expected)} events applied",
                interval_s=0.5,
            )
        finally:
            sink.terminate()
            sink.close()
        applied = {i["event_id"] for i in stub.applied()["items"]}
    below_target = {scene.ids[0][o] for o in range(60)}
    assert applied == expected  # p1's 70 records all delivered (resume 30, untouched)
    assert not applied & below_target


# --- 3. committed offsets outside the log's range -----------------------------------------


def test_dry_run_reports_where_an_out_of_range_group_really_resumes_and_warns(
    scene: Scene,
) -> None:
    scene.commit({0: 700, 1: 10})
    real = real_resume_points(scene)

    dry = scene.replay("--topic", f"{scene.topic}:0,1", "--shift-by", "-50")
    plan = scene.replay_json("--topic", f"{scene.topic}:0,1", "--shift-by", "-50")

    assert real == {0: 0, 1: P1_DELETED, 2: 0}  # librdkafka, auto.offset.reset=earliest
    assert {p: rows(plan)[p]["resume_offset"] for p in (0, 1)} == {0: real[0], 1: real[1]}
    assert {p: rows(plan)[p]["commit_range"] for p in (0, 1)} == {0: "past_end", 1: "below_low"}
    assert dry.returncode == 0
    text = " ".join(dry.stderr.split())
    assert f"warning: {scene.topic}[0]: committed offset 700 is past the end 200" in text
    assert "recreated" in text
    assert f"warning: {scene.topic}[1]: committed offset 10 is below the low watermark 30" in text
    assert "retention, DeleteRecords" in text
    assert len(plan["warnings"]) == 2  # type: ignore[arg-type]


@pytest.mark.parametrize(("shift", "targets"), [("-50", {0: 200, 1: 30}), ("+50", {0: 200, 1: 60})])
def test_shift_of_an_out_of_range_commit_is_committed_plus_n_then_clamped_as_kafka(
    scene: Scene, shift: str, targets: dict[int, int]
) -> None:
    scene.commit({0: 700, 1: 10})
    before = real_resume_points(scene)

    plan = scene.replay_json("--topic", f"{scene.topic}:0,1", f"--shift-by={shift}", "--execute")

    assert {p: rows(plan)[p]["target_offset"] for p in (0, 1)} == targets
    after = real_resume_points(scene)
    assert {p: after[p] for p in (0, 1)} == targets
    for p in (0, 1):  # the plan's counts are exactly what moved at the real resume point
        moved = after[p] - before[p]
        assert rows(plan)[p]["skip_count"] == max(0, moved)
        assert rows(plan)[p]["redeliver_count"] == max(0, -moved)


def test_lag_of_a_group_whose_commits_are_out_of_range_reports_the_real_resume_point(
    scene: Scene,
) -> None:
    scene.commit({0: 700, 1: 10})
    real = real_resume_points(scene)

    done = scene.ops.cli("lag", "--topic", scene.topic, "--json")
    table = scene.ops.cli("lag", "--topic", scene.topic)

    report = json.loads(done.stdout)
    parts = {r["partition"]: r for r in report["partitions"]}
    assert {p: parts[p]["resume_offset"] for p in range(PARTITIONS)} == real
    assert (parts[0]["committed_offset"], parts[0]["lag"]) == (700, P0_RECORDS)  # not 0
    assert (parts[1]["committed_offset"], parts[1]["lag"]) == (10, P1_RECORDS - P1_DELETED)
    assert parts[0]["oldest_unprocessed_ts_ms"] == scene.ts_ms(0)
    assert parts[1]["oldest_unprocessed_ts_ms"] == scene.ts_ms(P1_DELETED)
    assert report["totals"]["lag"] == P0_RECORDS + P1_RECORDS - P1_DELETED
    assert len(report["warnings"]) == 2
    assert "committed offset 700 is past the end 200" in " ".join(done.stderr.split())
    assert "0 !" in table.stdout  # the resume column marks the out-of-range commit
    assert "committed offset 10 is below the low watermark 30" in " ".join(table.stderr.split())


# --- what to keep -------------------------------------------------------------------------


def test_datetimes_without_milliseconds_and_with_an_offset_are_accepted(scene: Scene) -> None:
    scene.commit({0: 150, 1: 90})
    plus_two = timezone(timedelta(hours=2))

    plan = scene.replay_json(
        "--topic", f"{scene.topic}:0,1", "--to-datetime", scene.iso(60, tz=plus_two), "--execute"
    )

    assert "+02:00" in scene.iso(60, tz=plus_two) and "." not in scene.iso(60, tz=plus_two)
    assert {p: rows(plan)[p]["target_offset"] for p in (0, 1)} == {0: 60, 1: 60}
    assert scene.committed() == {0: 60, 1: 60, 2: None}


@pytest.mark.parametrize(
    ("duration", "target"),
    [("P1W", 0), ("PT1.5H", 0), ("PT0.5H", P0_RECORDS)],  # records are about an hour old
)
def test_durations_in_weeks_and_fractional_hours_are_accepted(
    scene: Scene, duration: str, target: int
) -> None:
    scene.commit({0: 150})

    plan = scene.replay_json("--topic", f"{scene.topic}:0", "--by-duration", duration)

    assert rows(plan)[0]["target_offset"] == target


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--by-duration", "-PT10M"), "not an ISO-8601 duration"),
        (("--to-offset", "-5"), "offsets are not negative"),
        (("--to-datetime", "yesterday"), "not an ISO-8601 date-time"),
        (("--to-earliest", "--from-earliest-if-uncommitted"), "with --shift-by only"),
    ],
)
def test_bad_input_is_a_usage_error_exit_2_and_changes_nothing(
    scene: Scene, args: tuple[str, ...], message: str
) -> None:
    scene.commit({0: 150})

    done = scene.replay("--topic", scene.topic, *args, "--execute")

    assert done.returncode == 2, done.stderr
    assert message in " ".join(done.stderr.split())
    assert scene.committed() == {0: 150, 1: None, 2: None}


def test_an_active_group_is_refused_with_exit_1_and_the_refused_plan_shown(scene: Scene) -> None:
    scene.commit({0: 150})
    member = Consumer(
        {
            "bootstrap.servers": scene.ops.kafka,
            "group.id": scene.group,
            "enable.auto.commit": False,
            "logger": logging.getLogger("test.member"),
        }
    )
    member.subscribe([scene.topic])
    try:
        wait_until(lambda: member.poll(0.2) is not None or member.assignment(), 30, "assignment")

        done = scene.replay("--topic", f"{scene.topic}:0", "--to-earliest", "--execute")

        assert done.returncode == 1
        assert f"consumer group {scene.group} is active" in done.stderr
        assert f"replay of group {scene.group}: --to-earliest" in done.stdout
        assert "refused, nothing changed" in done.stdout
        assert scene.committed()[0] == 150
    finally:
        member.close()


# --- side by side with Kafka's kafka-consumer-groups ----------------------------------------


def _kafka_tool_classpath() -> str:
    libs = ROOT / ".dev" / "kafka" / "libs"
    if shutil.which("java") is None or not list(libs.glob("kafka-tools-*.jar")):
        reason = f"java or Kafka's tools jar missing under {libs} (run `make up`)"
        if IN_CI:
            pytest.fail(f"required tool unavailable in CI: {reason}", pytrace=False)
        pytest.skip(reason)
    return f"{libs}/*"


@dataclass(frozen=True)
class KafkaAnswer:
    returncode: int
    targets: dict[tuple[str, int], int]  # (group, partition) -> NEW-OFFSET
    output: str


def kafka_reset(scene: Scene, groups: list[str], *args: str) -> KafkaAnswer:
    """``kafka-consumer-groups --reset-offsets --dry-run`` for ``groups``, parsed."""
    command = [
        "java",
        "-XX:TieredStopAtLevel=1",
        "-XX:+UseSerialGC",
        "-Xmx256m",
        "-cp",
        _kafka_tool_classpath(),
        KAFKA_TOOL,
        "--bootstrap-server",
        scene.ops.kafka,
        "--reset-offsets",
        "--dry-run",
        *[a for g in groups for a in ("--group", g)],
        *args,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)
    targets = {}
    for line in done.stdout.splitlines():
        cells = line.split()
        if len(cells) == 4 and cells[1] == scene.topic and cells[3].isdigit():
            targets[(cells[0], int(cells[2]))] = int(cells[3])
    return KafkaAnswer(done.returncode, targets, done.stdout + done.stderr)


def ours(scene: Scene, group: str, *args: str) -> dict[int, int]:
    """Our dry run's targets for the partitions it would move."""
    plan = scene.ops.cli_json("replay", "--group", group, *args)
    return {p: r["target_offset"] for p, r in rows(plan).items() if r["action"] == "move"}  # type: ignore[misc]


def test_shift_targets_agree_with_kafka_in_range_and_out_of_range(scene: Scene) -> None:
    in_range, out_of_range = f"{scene.group}-in", f"{scene.group}-out"
    commit(scene.ops.kafka, in_range, {(scene.topic, 0): 100, (scene.topic, 1): 50})
    commit(scene.ops.kafka, out_of_range, {(scene.topic, 0): 700, (scene.topic, 1): 10})
    spec = f"{scene.topic}:0,1"

    for shift in ("-50", "+50", "-100000"):
        kafka = kafka_reset(scene, [in_range, out_of_range], "--topic", spec, f"--shift-by={shift}")
        assert kafka.returncode == 0, kafka.output
        for group in (in_range, out_of_range):
            expected = {p: kafka.targets[(group, p)] for p in (0, 1)}
            assert ours(scene, group, "--topic", spec, f"--shift-by={shift}") == expected, shift


def test_time_offset_and_edge_targets_agree_with_kafka_for_committed_partitions(
    scene: Scene,
) -> None:
    scene.commit({0: 100, 1: 50, 2: 0})
    spec = f"{scene.topic}:0,1,2"
    cases = [
        ("--to-datetime", scene.iso(60, timespec="milliseconds")),  # Kafka needs the .sss
        ("--to-offset", "40"),
        ("--to-earliest",),
        ("--to-latest",),
    ]
    for args in cases:
        kafka = kafka_reset(scene, [scene.group], "--topic", spec, *args)
        assert kafka.returncode == 0, kafka.output
        expected = {p: kafka.targets[(scene.group, p)] for p in range(PARTITIONS)}
        assert ours(scene, scene.group, "--topic", spec, *args) == expected, args


def test_where_we_differ_from_kafka_we_never_skip_an_unprocessed_record(scene: Scene) -> None:
    scene.commit({0: 100})
    at = scene.iso(60, timespec="milliseconds")

    # a shift without a committed offset: both refuse (Kafka: exit 1 and its usage text)
    kafka = kafka_reset(scene, [scene.group], "--topic", f"{scene.topic}:1", "--shift-by", "50")
    refused = scene.replay("--topic", f"{scene.topic}:1", "--shift-by", "+50")
    assert kafka.returncode != 0 and "no current committed offset" in kafka.output
    assert refused.returncode == 1
    # --all-topics: Kafka takes the partitions the group committed; we leave the rest alone
    kafka = kafka_reset(scene, [scene.group], "--all-topics", "--to-datetime", at)
    assert kafka.targets == {(scene.group, 0): 60}
    assert ours(scene, scene.group, "--all-topics", "--to-datetime", at) == {0: 60}
    # --topic T: Kafka also moves p1 (never committed) to 60, skipping 30..59; we do not
    kafka = kafka_reset(scene, [scene.group], "--topic", scene.topic, "--to-datetime", at)
    assert kafka.targets == {(scene.group, 0): 60, (scene.group, 1): 60, (scene.group, 2): 0}
    assert ours(scene, scene.group, "--topic", scene.topic, "--to-datetime", at) == {0: 60}
    assert ours(
        scene, scene.group, "--topic", scene.topic, "--to-datetime", at, "--include-uncommitted"
    ) == {0: 60, 1: 60, 2: 0}
    assert scene.committed() == {0: 100, 1: None, 2: None}  # every run above was a dry run
