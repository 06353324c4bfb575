"""librdkafka errors and logs reach the process's logging and metrics (cdc.kafka.log)."""

from __future__ import annotations

import io
import json
import logging

import pytest
from confluent_kafka import KafkaError, KafkaException

from cdc.kafka.log import REPEAT_LOG_S, KafkaClientEvents, KafkaReach, fatal_error
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
    with caplog.at_level(logging.WARNING, logger="cdc.kafka.log"):
        for _ in range(5):
            events.on_error(err)
        clock.now += REPEAT_LOG_S + 1
        events.on_error(err)
    assert counted == ["_TRANSPORT"] * 6
    lines = [r for r in caplog.records if r.name == "cdc.kafka.log"]
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
    with caplog.at_level(logging.ERROR, logger="cdc.kafka.log"):
        assert events.raised(raised)
        assert events.raised(KafkaException(KafkaError(KafkaError._FATAL)))
    assert counted == ["_GAPLESS_GUARANTEE", "_FATAL"]
    assert events.fatal == "gap"
    assert fatals == ["gap"]
    lines = [r for r in caplog.records if r.name == "cdc.kafka.log"]
    assert len(lines) == 2  # a different code each
    assert lines[0].fatal is True  # type: ignore[attr-defined]
    assert lines[0].kafka_error == "_GAPLESS_GUARANTEE"  # type: ignore[attr-defined]


def test_a_dead_client_repeating_its_fatal_error_is_logged_once_per_period(
    caplog: pytest.LogCaptureFixture,
) -> None:
    events = KafkaClientEvents("producer")
    dead = KafkaException(KafkaError(KafkaError._FATAL))
    with caplog.at_level(logging.ERROR, logger="cdc.kafka.log"):
        for _ in range(100):
            events.raised(dead)
    assert len([r for r in caplog.records if r.name == "cdc.kafka.log"]) == 1


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


def test_librdkafka_log_lines_are_rate_limited_per_kind_with_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A broker outage: every broker thread says "Connect ... failed" every second, with
    changing timings; one line per kind per period, the next one says how many were held."""
    clock = _Clock()
    events = KafkaClientEvents("sink", clock=clock)
    log_lines = events.config()["logger"]
    with caplog.at_level(logging.DEBUG, logger="kafka.sink"):
        for i in range(1000):
            log_lines.log(
                logging.ERROR,
                "%s [%s] %s",
                "FAIL",
                "rdkafka#consumer-1",
                f"127.0.0.1:{29000 + i % 3}/1: Connect to ipv4#127.0.0.1:29092 failed: "
                f"Connection refused (after {i}ms in state CONNECT, {i} identical error(s) "
                "suppressed)",
            )
            log_lines.log(logging.INFO, "%s [%s] %s", "CLOSE", "c", "broker went down")
            clock.now += 0.5  # 500 s in all
    lines = [r.getMessage() for r in caplog.records if r.name == "kafka.sink"]
    fails = [line for line in lines if line.startswith("FAIL")]
    closes = [line for line in lines if line.startswith("CLOSE")]
    assert 8 <= len(fails) <= 10  # once, then once per REPEAT_LOG_S of 500 s
    assert len(closes) == len(fails)
    assert "more since last logged" in fails[1]
    assert int(fails[1].rsplit("(", 1)[1].split()[0]) == REPEAT_LOG_S / 0.5 - 1


def test_a_held_first_contact_writes_nothing_but_still_counts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    counted: list[str] = []
    events = KafkaClientEvents("ops", count=counted.append)
    with caplog.at_level(logging.DEBUG), events.held():
        events.on_error(KafkaError(KafkaError._TRANSPORT, "refused"))
        events.config()["logger"].log(logging.ERROR, "%s [%s] %s", "FAIL", "c", "refused")
    assert counted == ["_TRANSPORT"]
    assert [r for r in caplog.records if r.name in ("kafka.ops", "cdc.kafka.log")] == []


def _stats(*states: str) -> str:
    brokers = {f"b{i}": {"state": s, "nodeid": i} for i, s in enumerate(states)}
    return json.dumps({"brokers": brokers})


def test_reach_is_level_from_statistics_and_errors_and_overruled_by_later_progress() -> None:
    """No broker up and an error since one was: unreachable, from the first such statistics
    on (the bootstrap broker librdkafka falls back to reads INIT between its attempts);
    the next statistics with one up clear it (no stale flag); an idle client (INIT, no
    error) is not unreachable; progress after the statistics overrules them."""
    now = [100.0]
    reach = KafkaReach(clock=lambda: now[0])
    assert reach.unreachable_s() is None  # no statistics yet: not unreachable
    reach.on_stats(_stats("INIT", "INIT"))
    assert reach.unreachable_s() is None  # nothing tried, nothing failed
    reach.on_stats(_stats("UP"))
    now[0] = 101.0
    reach.on_stats(_stats("DOWN"))
    assert reach.unreachable_s() is None  # no error reported yet
    reach.failed()
    reach.on_stats(_stats("INIT"))  # the learned broker forgotten, the bootstrap retried
    now[0] = 104.0
    reach.on_stats(_stats("CONNECT"))
    assert reach.unreachable_s() == 3.0
    assert reach.unreachable_s(progress_at=104.5) is None  # an ack after the statistics
    assert reach.unreachable_s(progress_at=103.0) == 3.0
    reach.on_stats("not json")
    assert reach.unreachable_s() == 3.0  # a bad document changes nothing
    now[0] = 105.0
    reach.on_stats(_stats("DOWN", "UP"))
    assert reach.unreachable_s() is None
    now[0] = 106.0
    reach.on_stats(_stats("INIT"))
    assert reach.unreachable_s() is None  # the error was before the broker was up again


def test_a_reach_client_asks_for_statistics_and_names_why() -> None:
    events = KafkaClientEvents("t", reach=True)
    config = events.config()
    assert config["statistics.interval.ms"] > 0 and callable(config["stats_cb"])
    assert "stats_cb" not in KafkaClientEvents("plain").config()
    assert events.why_unreachable() == "no broker connection is up"
    events._report("_ALL_BROKERS_DOWN", "1/1 brokers are down", is_fatal=False)
    assert events.why_unreachable() == "1/1 brokers are down"
    events._report("_TRANSPORT", "Connect to ipv4#127.0.0.1:1 failed: refused", is_fatal=False)
    events._report("_ALL_BROKERS_DOWN", "1/1 brokers are down", is_fatal=False)
    assert events.why_unreachable() == "Connect to ipv4#127.0.0.1:1 failed: refused"
