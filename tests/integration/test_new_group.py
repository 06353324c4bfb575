"""A new consumer group never starts from the log start unless someone chose it (issue 47, 8).

The scene: one topic of the test's own prefix holding :data:`BEFORE` records that the
sink's group (``sink-<unique>``) delivered and committed. Then, with the real sink
process (``python -m cdc.cli sink``), the real broker and the engine stub over HTTP:

* a misspelt ``SINK_GROUP_ID`` is refused before it joins: exit 2, one line naming the
  group that consumed the topic (did you mean) and ``SINK_NEW_GROUP_START``; the engine
  got no request and the misspelt group holds no offset; ``outbox-cdc check`` fails its
  ``sink group`` item for it (and passes it for the real group);
* ``SINK_NEW_GROUP_START=latest``: the new group's offsets are set at the ends before it
  joins - the records written afterwards are delivered, none of the earlier ones;
* ``SINK_NEW_GROUP_START=earliest``: the new group delivers every record again (the
  engine counts them as duplicates of their idempotency keys).

The first start on topics no group consumed (no setting) is the scene's own set-up.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sinks.stub.server import StubServer
from tests.harness import (
    ROOT,
    RelayConfig,
    SinkConfig,
    create_topics,
    free_port,
    group_caught_up,
    produce,
    start_sink,
    wait_until,
)
from tests.integration.conftest import API_KEY

pytestmark = pytest.mark.integration

#: Records in the topic before any new group starts; more written in the latest test.
BEFORE, AFTER = 40, 10
PARTITIONS = 3


def _records(n: int) -> tuple[list[tuple[bytes, bytes, dict[str, bytes]]], set[str]]:
    records, ids = [], set()
    for _ in range(n):
        user, event_id = str(uuid.uuid4()), str(uuid.uuid4())
        headers = {"id": event_id.encode(), "type": b"UserRegistered"}
        records.append((user.encode(), json.dumps({"user_id": user}).encode(), headers))
        ids.add(event_id)
    return records, ids


@dataclass
class Scene:
    topics: RelayConfig
    topic: str
    first: SinkConfig
    ids: set[str]


@pytest.fixture
def scene(
    db_dsn: str, kafka_bootstrap: str, unique: str, stub: StubServer, tmp_path: Path
) -> Iterator[Scene]:
    """The topic with BEFORE records, delivered and committed by the first group, which
    started without any setting: the first group on its topics starts from the earliest."""
    topics = RelayConfig(db_dsn=db_dsn, kafka=kafka_bootstrap, unique=unique)
    topic = topics.topic_prefix + "user"
    create_topics(kafka_bootstrap, [topic], partitions=PARTITIONS)
    records, ids = _records(BEFORE)
    produce(kafka_bootstrap, topic, records)
    first = SinkConfig(relay=topics, engine_url=stub.url, api_key=API_KEY)
    sink, _ = start_sink(first, tmp_path, name="first")
    try:
        wait_until(lambda: stub.stats()["applied"] == BEFORE, 120, "the first group's delivery")
        wait_until(lambda: group_caught_up(kafka_bootstrap, first.group, [topic]), 60, "commits")
    finally:
        sink.close()
    yield Scene(topics=topics, topic=topic, first=first, ids=ids)


def _config(scene: Scene, stub: StubServer, group: str, **extra: str) -> SinkConfig:
    config = SinkConfig(relay=scene.topics, engine_url=stub.url, api_key=API_KEY, extra=extra)
    config.extra["SINK_GROUP_ID"] = group
    return config


def test_a_misspelt_group_is_refused_before_it_joins_naming_the_group_that_consumed(
    scene: Scene, stub: StubServer, kafka_bootstrap: str
) -> None:
    typo = scene.first.group.replace("sink-", "sinc-")
    requests_before = stub.stats()["requests"]
    done = subprocess.run(
        [sys.executable, "-m", "cdc.cli", "sink"],
        env=_config(scene, stub, typo).env(free_port()),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert len(errors) == 1, done.stderr
    assert f"consumer group {typo} has committed no offset" in errors[0]
    assert f"did you mean SINK_GROUP_ID={scene.first.group}?" in errors[0]
    assert "SINK_NEW_GROUP_START=earliest" in errors[0] and "latest" in errors[0]
    assert stub.stats()["requests"] == requests_before  # not one engine request
    assert not _has_offsets(kafka_bootstrap, typo, scene.topic)  # it never joined

    # `check` says it first, for the misspelt group and the real one; it changes nothing
    said = {}
    for group in (typo, scene.first.group):
        checked = subprocess.run(
            [sys.executable, "-m", "cdc.cli", "check", "--json"],
            env=_config(scene, stub, group).env(free_port()),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        findings = json.loads(checked.stdout)["findings"]
        [said[group]] = [f for f in findings if f["item"] == "sink group"]
    assert said[typo]["status"] == "fail", said
    assert f"did you mean SINK_GROUP_ID={scene.first.group}?" in said[typo]["detail"]
    assert said[scene.first.group]["status"] == "ok", said
    assert said[scene.first.group]["detail"].endswith("resumes from its committed offsets")
    assert not _has_offsets(kafka_bootstrap, typo, scene.topic)


def test_a_new_group_chosen_to_start_latest_delivers_only_what_arrives_afterwards(
    scene: Scene, stub: StubServer, kafka_bootstrap: str, tmp_path: Path
) -> None:
    group = f"{scene.first.group}-b"
    config = _config(scene, stub, group, SINK_NEW_GROUP_START="latest")
    sink, _ = start_sink(config, tmp_path, name="latest")
    try:
        assert _has_offsets(kafka_bootstrap, group, scene.topic)  # the ends, before it joined
        records, later = _records(AFTER)
        produce(kafka_bootstrap, scene.topic, records)
        wait_until(lambda: stub.stats()["applied"] == BEFORE + AFTER, 120, "the later records")
        wait_until(lambda: group_caught_up(kafka_bootstrap, group, [scene.topic]), 60, "commits")
    finally:
        sink.close()
    applied = [item["event_id"] for item in stub.applied()["items"]]
    assert set(applied) == scene.ids | later
    assert stub.stats()["duplicates"] == 0  # not one earlier record delivered again


def test_a_new_group_chosen_to_start_earliest_delivers_every_record_again(
    scene: Scene, stub: StubServer, kafka_bootstrap: str, tmp_path: Path
) -> None:
    group = f"{scene.first.group}-c"
    config = _config(scene, stub, group, SINK_NEW_GROUP_START="earliest")
    sink, _ = start_sink(config, tmp_path, name="earliest")
    try:
        wait_until(lambda: stub.stats()["duplicates"] == BEFORE, 120, "every record again")
        wait_until(lambda: group_caught_up(kafka_bootstrap, group, [scene.topic]), 60, "commits")
    finally:
        sink.close()
    assert stub.stats()["applied"] == BEFORE


def _has_offsets(kafka: str, group: str, topic: str) -> bool:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": kafka, "group.id": group})
    try:
        parts = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        return any(tp.offset >= 0 for tp in consumer.committed(parts, timeout=15))
    finally:
        consumer.close()
