"""librdkafka errors and logs reach the process's logging and metrics (cdc.kafkalog)."""

from __future__ import annotations

import io
import json
import logging

import pytest
from confluent_kafka import KafkaError, KafkaException

from cdc.kafkalog import REPEAT_LOG_S, KafkaClientEvents, fatal_error
from cdc.logs import JsonFormatter


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_every_error_is_counted_by_code_and_repeats_are_logged_once_per_period(
    caplog: pytest.LogCaptureFixture,
) -> None:
    counted: list[str] = []
    clock = _Clock()
    events = KafkaClientEvents("producer", count=counted.append, clock=clock)
    err = KafkaError(KafkaError._TRANSPORT, "broker down")
    with caplog.at_level(logging.WARNING, logger="cdc.kafkalog"):
        for _ in range(5):
            events.on_error(err)
        clock.now += REPEAT_LOG_S + 1
        events.on_error(err)
    assert counted == ["_TRANSPORT"] * 6
    lines = [r for r in caplog.records if r.name == "cdc.kafkalog"]
    assert len(lines) == 2
    assert "4 more since last logged" in lines[1].getMessage()
    assert lines[0].kafka_error == "_TRANSPORT"  # type: ignore[attr-defined]
    assert events.last_error == ("_TRANSPORT", "broker down")
    assert events.fatal is None


def test_a_fatal_error_is_kept_reported_once_and_cleared_by_the_owner() -> None:
    fatals: list[str] = []
    events = KafkaClientEvents("producer", on_fatal=fatals.append)
    err = KafkaError(KafkaError._FATAL, "producer fenced", fatal=True)
    events.on_error(err)
    events.on_error(err)
    assert events.fatal == "producer fenced"
    assert fatals == ["producer fenced"]
    events.clear_fatal()
    assert events.fatal is None


def test_a_fatal_error_raised_by_a_client_call_is_routed_like_an_error_cb_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """confluent-kafka raises a fatal error from poll()/flush() instead of
    calling error_cb; produce() raises _FATAL (not flagged fatal) afterwards."""
    counted: list[str] = []
    fatals: list[str] = []
    events = KafkaClientEvents("producer", count=counted.append, on_fatal=fatals.append)
    raised = KafkaException(KafkaError(KafkaError._GAPLESS_GUARANTEE, "gap", fatal=True))
    with caplog.at_level(logging.ERROR, logger="cdc.kafkalog"):
        assert events.raised(raised)
        assert events.raised(KafkaException(KafkaError(KafkaError._FATAL)))
    assert counted == ["_GAPLESS_GUARANTEE", "_FATAL"]
    assert events.fatal == "gap"
    assert fatals == ["gap"]
    lines = [r for r in caplog.records if r.name == "cdc.kafkalog"]
    assert len(lines) == 2  # a different code each
    assert lines[0].fatal is True  # type: ignore[attr-defined]
    assert lines[0].kafka_error == "_GAPLESS_GUARANTEE"  # type: ignore[attr-defined]


def test_a_dead_client_repeating_its_fatal_error_is_logged_once_per_period(
    caplog: pytest.LogCaptureFixture,
) -> None:
    events = KafkaClientEvents("producer")
    dead = KafkaException(KafkaError(KafkaError._FATAL))
    with caplog.at_level(logging.ERROR, logger="cdc.kafkalog"):
        for _ in range(100):
            events.raised(dead)
    assert len([r for r in caplog.records if r.name == "cdc.kafkalog"]) == 1


def test_exceptions_without_a_fatal_error_are_left_alone() -> None:
    events = KafkaClientEvents("producer")
    assert not events.raised(KafkaException(KafkaError(KafkaError._TRANSPORT)))
    assert not events.raised(BufferError("Local: Queue full"))
    assert not events.raised(KafkaException("no KafkaError inside"))
    assert fatal_error(RuntimeError()) is None
    assert events.fatal is None


def test_config_routes_errors_and_logs() -> None:
    events = KafkaClientEvents("consumer")
    config = events.config()
    assert config["error_cb"] == events.on_error
    assert config["logger"].name == "kafka.consumer"


def test_json_log_lines_carry_the_structured_fields() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("test.json.fields")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning(
            "event %s parked", "e1", extra={"event_id": "e1", "topic": "t", "partition": 2}
        )
    finally:
        logger.removeHandler(handler)
    line = json.loads(stream.getvalue())
    assert line["msg"] == "event e1 parked"
    assert (line["event_id"], line["topic"], line["partition"]) == ("e1", "t", 2)
    assert {"ts", "level", "logger"} <= set(line)
    assert "args" not in line and "levelno" not in line
