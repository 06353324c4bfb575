"""Exactly-once mode's pure parts: names, fencing errors, the capped tracker, the settings."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException

from cdc.errors import CdcError, ConfigError
from cdc.lineage import Origin
from cdc.relay.checkpoint import TOPIC_CONFIG, checkpoint_topic
from cdc.relay.exactly_once import (
    CheckpointTracker,
    RelayFencedError,
    is_fenced,
    transactional_id,
)
from cdc.relay.transactional import transactional_id as republish_id
from cdc.relay.txbatch import Action, TxBatch, TxLimits
from cdc.settings import Settings, build
from sinks.kafka.config import consumer_config

LIMITS = TxLimits(max_records=10, max_ms=50, abort_after_ms=1_000, commit_budget_ms=100)


def _settings(**values: object) -> Settings:
    return build(Settings, kafka_bootstrap_servers="k:9092", **values)


def test_the_transactional_id_is_the_system_and_the_slot_unless_configured() -> None:
    origin = Origin("7714869915919296735", 3, "outbox_slot")
    assert (
        transactional_id("", origin, "outbox_slot") == "outbox-cdc.7714869915919296735.outbox_slot"
    )
    assert transactional_id("mine", origin, "outbox_slot") == "mine"
    # (the timeline is not in it: a promoted standby's relay fences the old primary's)
    assert "3" not in transactional_id("", Origin("1", 3, "s"), "s").split(".")[1]


def test_republishing_runs_have_ids_of_their_own_never_the_streaming_relays() -> None:
    settings = _settings(slot="s1")
    assert republish_id(settings, "42", "recovery") == "outbox-cdc.42.s1.recovery"
    assert republish_id(settings, "42", "repair") == "outbox-cdc.42.s1.repair"


def test_the_checkpoint_topic_defaults_outside_the_sinks_subscription() -> None:
    settings = _settings()
    topic = checkpoint_topic(settings)
    assert topic == "outbox.event__checkpoints"
    assert not topic.startswith(settings.topic_prefix)
    assert checkpoint_topic(_settings(checkpoint_topic="cp")) == "cp"
    assert TOPIC_CONFIG["cleanup.policy"] == "compact"


@pytest.mark.parametrize(
    "code", [KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH]
)
def test_fenced_errors_are_recognised_bare_or_raised(code: int) -> None:
    err = KafkaError(code)
    assert is_fenced(err)
    assert is_fenced(KafkaException(err))


def test_other_errors_are_not_fencing() -> None:
    assert not is_fenced(KafkaError(KafkaError._TIMED_OUT))
    assert not is_fenced(KafkaException(KafkaError(KafkaError._TRANSPORT)))
    assert not is_fenced(ValueError("x"))


def test_fenced_is_a_cdc_error_that_ends_the_process() -> None:
    assert issubclass(RelayFencedError, CdcError)
    assert RelayFencedError.retriable is False


def test_the_tracker_never_confirms_past_the_committed_checkpoint_while_a_transaction_is_open() -> (
    None
):
    batch = TxBatch(LIMITS, 100)
    tracker = CheckpointTracker(100, batch)
    tracker.open(200)
    assert batch.wal_open
    assert batch.record(0) is Action.BEGIN
    tracker.add(200)
    tracker.ack(200)
    tracker.close(200, 210)
    assert batch.candidate == 210 and not batch.wal_open
    assert tracker.confirmable == 100  # delivered, not committed
    assert batch.due(LIMITS.max_ms) is Action.COMMIT
    batch.commit_ok()
    assert tracker.confirmable == 210
    tracker.observe_wal_end(500)  # idle: the WAL end may be confirmed
    assert tracker.confirmable == 500


def test_delivery_and_transaction_settings_are_validated() -> None:
    assert _settings().delivery == "at-least-once"
    assert _settings(delivery="exactly-once").delivery == "exactly-once"
    with pytest.raises(ConfigError, match="CDC_DELIVERY"):
        Settings.from_env({"CDC_DELIVERY": "twice"})
    with pytest.raises(ConfigError, match="CDC_TX_MAX_MS"):
        Settings.from_env({"CDC_TX_MAX_MS": "0"})


def test_the_sink_reads_committed_records_only() -> None:
    assert consumer_config(_settings())["isolation.level"] == "read_committed"
