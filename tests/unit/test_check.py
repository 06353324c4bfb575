"""The preflight's pure parts: findings of topics, a probe that raises, the plugin's probes."""

from __future__ import annotations

from collections.abc import Iterator

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

    assert [name for name, _ in PLUGIN.checks] == ["engine", "parking lot"]
