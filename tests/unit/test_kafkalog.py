"""librdkafka errors and logs reach the process's logging and metrics (cdc.kafkalog)."""

from __future__ import annotations

import io
import json
import logging

import pytest
from confluent_kafka import KafkaError

from cdc.kafkalog import REPEAT_LOG_S, KafkaClientEvents
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
