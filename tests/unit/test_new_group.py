"""The new-group decision (pure) and its shell's waits, without Kafka."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from cdc.errors import ConfigError
from cdc.health import Liveness
from cdc.settings import Settings
from sinks.ops import new_group
from sinks.ops.errors import KafkaOpsError
from sinks.ops.new_group import GroupView, Start, decide, guard_new_group, refusal

VIEWS = [
    GroupView(own_offsets=own, consumed_by=others)
    for own, others in itertools.product((True, False), ((), ("engine-sync",)))
]


@pytest.mark.parametrize("view", VIEWS)
@pytest.mark.parametrize("choice", ["", "earliest", "latest"])
def test_only_a_group_beside_consumers_with_nothing_chosen_is_refused(
    view: GroupView, choice: str
) -> None:
    start = decide(view, choice)
    if view.own_offsets:
        assert start is Start.RESUME  # offsets win: the setting is ignored
    elif choice:
        assert start is Start(choice)
    else:
        assert start is (Start.REFUSE if view.consumed_by else Start.FIRST)


def test_the_refusal_names_the_close_group_and_the_setting() -> None:
    line = refusal("engine-synk", ("engine-sync",))
    assert "did you mean SINK_GROUP_ID=engine-sync?" in line
    assert "SINK_NEW_GROUP_START=earliest" in line and "latest" in line
    assert "\n" not in line


def test_a_far_name_is_named_as_a_consumer_not_as_a_typo() -> None:
    line = refusal("billing", ("engine-sync", "analytics"))
    assert "groups engine-sync and analytics consumed;" in line
    assert "did you mean" not in line


def _run(settings: Settings, stop_after_s: float | None = None) -> tuple[bool, Liveness]:
    liveness = Liveness()

    async def main() -> bool:
        stop = asyncio.Event()
        if stop_after_s is not None:
            asyncio.get_running_loop().call_later(stop_after_s, stop.set)
        return await guard_new_group(settings, liveness, stop)

    return asyncio.run(main()), liveness


def test_kafka_unreachable_is_tried_again_and_said_in_readiness(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []

    def check(settings: Settings) -> Start:
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise KafkaOpsError("Kafka at 127.0.0.1:1 unreachable")
        return Start.RESUME

    monkeypatch.setattr(new_group, "check_new_group", check)
    monkeypatch.setattr(new_group, "RETRY_S", 0.05)
    go_on, liveness = _run(Settings(sink_group_id="g"))
    assert go_on and len(calls) == 3
    assert liveness.state.startswith("kafka unreachable: Kafka at 127.0.0.1:1 unreachable")
    assert "checking consumer group g before joining it" in liveness.state
    assert not liveness.ready


def test_a_refusal_propagates(monkeypatch: pytest.MonkeyPatch) -> None:
    def check(settings: Settings) -> Start:
        raise ConfigError("refused")

    monkeypatch.setattr(new_group, "check_new_group", check)
    with pytest.raises(ConfigError, match="refused"):
        _run(Settings())


def test_sigterm_ends_the_wait_for_a_blocked_kafka_call(monkeypatch: pytest.MonkeyPatch) -> None:
    def check(settings: Settings) -> Start:
        time.sleep(30)  # a Kafka call that does not return (its thread is left behind)
        return Start.RESUME

    monkeypatch.setattr(new_group, "check_new_group", check)
    started = time.monotonic()
    go_on, _ = _run(Settings(), stop_after_s=0.2)
    assert not go_on
    assert time.monotonic() - started < 20  # bounded by POLL_S, far below the call's 30 s


@pytest.mark.parametrize(
    ("env", "chosen"),
    [
        ({}, ""),
        ({"SINK_NEW_GROUP_START": "latest"}, "latest"),
        ({"KAFKA_CONFIG_AUTO_OFFSET_RESET": "latest"}, "latest"),
        ({"KAFKA_CONFIG_AUTO_OFFSET_RESET": "smallest"}, "earliest"),
        ({"KAFKA_CONFIG_AUTO_OFFSET_RESET": "error"}, ""),
        (
            {"SINK_NEW_GROUP_START": "earliest", "KAFKA_CONFIG_AUTO_OFFSET_RESET": "latest"},
            "earliest",
        ),
    ],
)
def test_an_operators_reset_policy_is_a_choice_too(env: dict[str, str], chosen: str) -> None:
    from sinks.ops.new_group import chosen_start

    assert chosen_start(Settings.from_env(env)) == chosen
