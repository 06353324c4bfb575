"""The preflight's pure parts: findings of topics, a probe that raises, the plugin's probes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cdc.check import Finding, Status, _topics, run_probes
from cdc.settings import Settings


def test_topic_partitions_other_than_the_setting_are_a_warning_naming_it() -> None:
    settings = Settings(topic_prefix="p.", topic_partitions=6, dlq_topic="p.dlq")
    found = {f.item: f for f in _topics(settings, {"p.user": 6, "p.quiz": 3, "other": 1})}
    assert found["topic p.user"].status is Status.OK
    assert found["topic p.quiz"].status is Status.WARN
    assert "CDC_TOPIC_PARTITIONS=6" in found["topic p.quiz"].detail
    assert "topic other" not in found


def test_no_topic_yet_is_fine() -> None:
    found = list(_topics(Settings(topic_prefix="p."), {}))
    assert all(f.status is Status.OK for f in found)


def test_a_probe_that_raises_is_one_failing_finding_and_the_others_still_run() -> None:
    def broken(_: Settings) -> Iterator[Finding]:
        raise RuntimeError("boom")
        yield  # pragma: no cover

    def fine(_: Settings) -> Iterator[Finding]:
        yield Finding("fine", Status.OK, "yes")

    findings = run_probes(Settings(), [("broken", broken), ("fine", fine)])
    assert [(f.item, f.status) for f in findings] == [
        ("broken", Status.FAIL),
        ("fine", Status.OK),
    ]
    assert "RuntimeError: boom" in findings[0].detail


def test_the_sink_registers_its_probes_through_the_plugin() -> None:
    from sinks.cli import PLUGIN

    assert [name for name, _ in PLUGIN.checks] == ["engine", "parking lot", "sink group"]


def test_the_sink_group_item_fails_for_a_named_group_and_warns_for_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A start the sink would refuse: `fail` when SINK_GROUP_ID names the group, `warn`
    for the default group (a relay's shell, an operator's, may run no sink)."""
    from sinks.cli.check import sink_group
    from sinks.ops import new_group
    from sinks.ops.new_group import Start

    monkeypatch.setattr(new_group, "preview", lambda s: (Start.REFUSE, "refused: did you mean"))
    named = list(
        sink_group(
            Settings.from_env({"KAFKA_BOOTSTRAP_SERVERS": "k:9092", "SINK_GROUP_ID": "engine-synk"})
        )
    )
    default = list(sink_group(Settings.from_env({"KAFKA_BOOTSTRAP_SERVERS": "k:9092"})))
    assert [(f.status, f.detail) for f in named] == [(Status.FAIL, "refused: did you mean")]
    assert [f.status for f in default] == [Status.WARN]
    assert "SINK_GROUP_ID is not set" in default[0].detail
    monkeypatch.setattr(new_group, "preview", lambda s: (Start.RESUME, "resumes"))
    assert [f.status for f in sink_group(Settings.from_env({"KAFKA_BOOTSTRAP_SERVERS": "k"}))] == [
        Status.OK
    ]
