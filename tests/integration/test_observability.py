"""Observability against the running pipeline: trace, trace context, metrics the rules use.

One pipeline for the module: the real relay and sink (subprocesses) on real
PostgreSQL and Kafka, delivering to the engine stub over HTTP. It commits

* a delivered event (with a W3C traceparent in ``tracingspancontext``),
* an event the engine rejects with 400 (parked),
* an event it rejects three times, then accepts on a retry of its parked row,
* an event Kafka cannot take (an invalid topic name: dead-lettered),

then stops the engine (connections refused) for two minutes, commits more
events and scrapes both processes' ``/metrics`` while the circuit is open; the
sink's alert gauges are recorded every 15 s (Prometheus' scrape interval)
through the whole outage, and promtool evaluates the shipped alert rules on
that recorded series.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from prometheus_client.parser import text_string_to_metric_families

from cdc.outbox import OutboxEvent, write_event
from cdc.settings import Settings
from sinks.engine.client import EngineClient
from sinks.ops.lag import group_lag
from sinks.parking.lot import ParkingLot
from sinks.parking.retrier import Retrier
from sinks.stub.server import StubServer
from sinks.trace.model import (
    EventState,
    EventTrace,
    GroupPosition,
    TraceNotFound,
    crc32_partition,
    murmur2_partition,
)
from sinks.trace.search import trace_event, trace_key
from tests.harness import (
    ROOT,
    Proc,
    RelayConfig,
    SinkConfig,
    drop_slot,
    free_port,
    read_topics,
    start_relay,
    start_sink,
    wait_until,
)
from tests.observability import promtool, referenced_metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

API_KEY = "obs-key"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
#: Gauges the engine outage must drive above zero: the sink's alerts read them.
MOVES_IN_OUTAGE = ("outbox_sink_circuit_open", "outbox_sink_oldest_unprocessed_age_seconds")
#: The engine outage the alerts must see: two minutes, sampled like Prometheus
#: scrapes (compose/prometheus/prometheus.yml: every 15 s).
OUTAGE_S = 120
SCRAPE_INTERVAL_S = 15
#: The sink's alerts, as promtool's ALERTS series shows them while they fire.
ALERTS_FIRING = (
    'ALERTS{alertstate="firing",alertname=~"OutboxSinkCircuitOpen|OutboxOldestEventTooOld"}'
)


@dataclass(repr=False)  # its configs hold the test database's DSN (a password)
class Pipeline:
    relay_cfg: RelayConfig
    sink_cfg: SinkConfig
    settings: Settings
    cli_env: dict[str, str]
    stub: StubServer
    user: str
    delivered: str
    parked: str
    retried: str
    dead: str
    outage: list[str]
    outage_trace: EventTrace | None = None
    scrapes: dict[str, str] = field(default_factory=dict)
    #: gauge name -> its value at each 15 s tick of the outage (the first at its start)
    recorded: dict[str, list[float]] = field(default_factory=dict)


def _user_event(user: str, *, traceparent: str | None = None) -> OutboxEvent:
    return OutboxEvent(
        aggregate_type="user",
        aggregate_id=user,
        event_type="UserRegistered",
        payload={"user_id": user, "email": f"{user}@ex.org", "display_name": "U"},
        traceparent=traceparent,
    )


def _commit(dsn: str, *events: OutboxEvent) -> list[str]:
    with psycopg.connect(dsn) as conn, conn.transaction():
        for event in events:
            write_event(conn, event)
    return [str(e.event_id) for e in events]


def _parked_row_id(dsn: str, event_id: str) -> int | None:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT event_id FROM failed_sync_events WHERE outbox_event_id = %s", (event_id,)
        ).fetchone()
    return None if row is None else int(row[0])


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def _family_name(family: Any) -> str:
    """The name the rules use (the parser drops a counter's ``_total``)."""
    return f"{family.name}_total" if family.type == "counter" else str(family.name)


def _samples(text: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    """family name -> its samples (name, labels, value)."""
    return {
        _family_name(family): [(s.name, s.labels, s.value) for s in family.samples]
        for family in text_string_to_metric_families(text)
    }


def _gauge(port: int, name: str) -> float:
    for sample_name, _labels, value in _samples(_scrape(port)).get(name, []):
        if sample_name == name:
            return value
    return 0.0


def _retry(p: Pipeline, row_id: int) -> None:
    async def go() -> None:
        lot = ParkingLot(p.settings.pg_dsn.get_secret_value())
        async with EngineClient(base_url=p.stub.url, api_key=API_KEY) as engine:
            summary = await Retrier(lot=lot, engine=engine, settings=p.settings).retry(
                [row_id], retry_all=False
            )
        await lot.close()
        assert summary.done_count == 1, summary

    asyncio.run(go())


def _settled(p: Pipeline) -> bool:
    rows = group_lag(p.settings, group=p.sink_cfg.group)
    return bool(rows) and all(r.lag == 0 for r in rows)


@pytest.fixture(scope="module")
def pipeline(
    db_dsn: str, kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pipeline]:
    tmp = tmp_path_factory.mktemp("observability")
    unique = uuid.uuid4().hex[:10]
    relay_cfg = RelayConfig(db_dsn=db_dsn, kafka=kafka_bootstrap, unique=unique, partitions=3)
    procs: list[Proc] = []
    with StubServer(api_key=API_KEY) as stub:
        sink_cfg = SinkConfig(relay=relay_cfg, engine_url=stub.url, api_key=API_KEY)
        cli_env = sink_cfg.env(free_port())  # (a valid port; trace binds none)
        settings = Settings(
            pg_dsn=db_dsn,
            kafka_bootstrap_servers=kafka_bootstrap,
            topic_prefix=relay_cfg.topic_prefix,
            dlq_topic=relay_cfg.dlq_topic,
            sink_group_id=sink_cfg.group,
        )
        try:
            relay, relay_port = start_relay(relay_cfg, tmp)
            procs.append(relay)
            sink, sink_port = start_sink(sink_cfg, tmp)
            procs.append(sink)
            p = _steady_state(relay_cfg, sink_cfg, settings, cli_env, stub)
            _outage(p, relay_port=relay_port, sink_port=sink_port)
            yield p
        finally:
            for proc in procs:
                proc.close()
            drop_slot(db_dsn, relay_cfg.slot)


def _steady_state(
    relay_cfg: RelayConfig,
    sink_cfg: SinkConfig,
    settings: Settings,
    cli_env: dict[str, str],
    stub: StubServer,
) -> Pipeline:
    dsn = relay_cfg.db_dsn
    user = str(uuid.uuid4())
    parked_event = _user_event(str(uuid.uuid4()))
    retried_event = _user_event(str(uuid.uuid4()), traceparent=TRACEPARENT)
    stub.add_faults({"event_id": str(parked_event.event_id), "status": 400, "times": -1})
    stub.add_faults({"event_id": str(retried_event.event_id), "status": 422, "times": 3})
    (delivered,) = _commit(dsn, _user_event(user, traceparent=TRACEPARENT))
    parked, retried = _commit(dsn, parked_event, retried_event)
    bad = OutboxEvent(
        aggregate_type="not a topic!",
        aggregate_id=user,
        event_type="UserRegistered",
        payload={"user_id": user},
    )
    (dead,) = _commit(dsn, bad)
    p = Pipeline(
        relay_cfg, sink_cfg, settings, cli_env, stub, user, delivered, parked, retried, dead, []
    )
    wait_until(lambda: stub.applied(event_id=delivered)["items"], 60, "delivered event applied")
    wait_until(lambda: _parked_row_id(dsn, parked), 60, "parked row")
    retried_row = wait_until(lambda: _parked_row_id(dsn, retried), 60, "second parked row")
    read_topics(relay_cfg.kafka, [relay_cfg.dlq_topic], expect=1, idle_s=0.5)
    _retry(p, retried_row)
    wait_until(lambda: _settled(p), 60, "the sink's group committed everything")
    return p


def _record(sink_port: int, into: dict[str, list[float]], ticks: int) -> None:
    """The sink's alert gauges every SCRAPE_INTERVAL_S, ``ticks`` times, from now."""
    started = time.monotonic()
    for tick in range(ticks):
        time.sleep(max(0.0, started + tick * SCRAPE_INTERVAL_S - time.monotonic()))
        samples = _samples(_scrape(sink_port))
        for name in MOVES_IN_OUTAGE:
            values = [v for n, _, v in samples.get(name, []) if n == name]
            into.setdefault(name, []).append(values[0] if values else 0.0)


def _outage(p: Pipeline, *, relay_port: int, sink_port: int) -> None:
    """Engine refuses connections for two minutes; events pile up; both processes are
    scraped meanwhile, and the sink's alert gauges recorded through the whole outage."""
    p.stub.add_faults({"refuse_connections_s": OUTAGE_S + 2 * SCRAPE_INTERVAL_S})
    recorder = threading.Thread(
        target=_record,
        args=(sink_port, p.recorded, OUTAGE_S // SCRAPE_INTERVAL_S + 1),
        daemon=True,
    )
    recorder.start()
    try:
        p.outage = _commit(p.relay_cfg.db_dsn, _user_event(str(uuid.uuid4())))
        wait_until(lambda: _gauge(sink_port, "outbox_sink_circuit_open") == 1, 60, "circuit open")
        wait_until(
            lambda: _gauge(sink_port, "outbox_sink_oldest_unprocessed_age_seconds") > 0,
            60,
            "oldest unprocessed age above zero",
        )
        wait_until(  # refreshed from the broker every few seconds, off the event loop
            lambda: _gauge(sink_port, "outbox_sink_consumer_lag") > 0,
            60,
            "consumer lag above zero",
        )
        p.scrapes = {"relay": _scrape(relay_port), "sink": _scrape(sink_port)}
        p.outage_trace = trace_event(p.settings, p.outage[0])
        recorder.join(OUTAGE_S + 4 * SCRAPE_INTERVAL_S)
    finally:
        p.stub.end_outage()


def _cli(p: Pipeline, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cdc.cli", "trace", *args],
        env=p.cli_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


# --- trace -------------------------------------------------------------------------------------


def test_trace_shows_a_delivered_event_from_outbox_row_to_the_sinks_group(p: Pipeline) -> None:
    t = trace_event(p.settings, p.delivered)
    assert t.state is EventState.DELIVERED
    assert t.outbox is not None and t.outbox.aggregate_id == p.user
    assert t.outbox.traceparent == TRACEPARENT
    assert t.record is not None
    assert t.record.topic == p.relay_cfg.topic_prefix + "user"
    assert t.record.headers["id"] == p.delivered
    assert t.record.headers["traceparent"] == TRACEPARENT
    assert t.commit_lsn and t.commit_lsn == t.record.headers["lsn"]
    assert t.commit_ts == t.record.headers["commit_ts"]
    sink = next(g for g in t.groups if g.group == p.sink_cfg.group)
    assert sink.position is GroupPosition.CONSUMED and sink.committed is not None
    assert sink.committed > t.record.offset
    assert t.parked is None and t.dead_letter is None
    assert t.bounds.since_source == "outbox row"


def test_trace_shows_a_parked_event_with_its_parking_row(p: Pipeline) -> None:
    t = trace_event(p.settings, p.parked)
    assert t.state is EventState.PARKED
    assert t.parked is not None and t.parked.status == "FAILED"
    assert t.parked.last_error is not None and "400" in t.parked.last_error
    assert t.record is not None
    assert (t.parked.kafka_topic, t.parked.kafka_offset) == (t.record.topic, t.record.offset)
    assert "parked as failed_sync_events" in t.summary


def test_trace_shows_an_event_delivered_by_a_retry_of_its_parked_row(p: Pipeline) -> None:
    t = trace_event(p.settings, p.retried)
    assert t.state is EventState.DELIVERED_ON_RETRY
    assert t.parked is not None and t.parked.status == "DONE"


def test_trace_shows_a_dead_lettered_event_with_the_reason(p: Pipeline) -> None:
    t = trace_event(p.settings, p.dead)
    assert t.state is EventState.DEAD_LETTERED
    assert t.record is None
    assert t.dead_letter is not None and t.dead_letter.topic == p.relay_cfg.dlq_topic
    assert "invalid topic name" in t.dead_letter.headers["dlq.reason"]
    assert t.outbox is not None and t.outbox.aggregate_type == "not a topic!"


def test_trace_shows_an_event_the_group_has_not_processed_as_pending(p: Pipeline) -> None:
    assert p.outage_trace is not None  # traced while the engine refused connections
    assert p.outage_trace.state is EventState.PENDING
    assert p.outage_trace.record is not None


def test_trace_key_lists_every_event_of_the_key_in_commit_order(p: Pipeline) -> None:
    traces = trace_key(p.settings, p.user, since_ms=int((time.time() - 600) * 1000))
    states = {t.event_id: t.state for t in traces}
    assert states == {p.delivered: EventState.DELIVERED, p.dead: EventState.DEAD_LETTERED}
    assert [t.event_id for t in traces] == [p.delivered, p.dead]


def test_trace_of_an_unknown_event_names_the_bound_to_widen(p: Pipeline) -> None:
    since = int((time.time() - 60) * 1000)
    with pytest.raises(TraceNotFound, match="widen --since"):
        trace_event(p.settings, str(uuid.uuid4()), since_ms=since)


def test_trace_stopped_by_max_records_says_to_widen_it(p: Pipeline) -> None:
    since = int((time.time() - 600) * 1000)
    with pytest.raises(TraceNotFound, match="--max-records"):
        trace_event(p.settings, str(uuid.uuid4()), since_ms=since, max_records=1)


def test_trace_cli_prints_the_verdict_and_json(p: Pipeline) -> None:
    table = _cli(p, p.parked)
    assert table.returncode == 0, table.stderr
    assert "PARKED" in table.stdout and p.parked in table.stdout
    as_json = _cli(p, p.delivered, "--json")
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert doc["state"] == "delivered"
    assert doc["kafka_record"]["headers"]["traceparent"] == TRACEPARENT
    keyed = _cli(p, "--key", p.user, "--json")
    assert keyed.returncode == 0, keyed.stderr
    assert {d["event_id"] for d in json.loads(keyed.stdout)} == {p.delivered, p.dead}


def test_trace_cli_exits_1_with_a_clear_message_when_not_found(p: Pipeline) -> None:
    missing = str(uuid.uuid4())
    proc = _cli(p, missing, "--since", "2026-01-01T00:00:00Z", "--max-records", "5")
    assert proc.returncode == 1
    assert f"event {missing} not found" in proc.stderr
    assert "widen" in proc.stderr
    usage = _cli(p)
    assert usage.returncode == 2 and "EVENT_ID or --key" in usage.stderr


# --- trace context to the engine ---------------------------------------------------------------


def test_the_engine_receives_the_outbox_rows_traceparent(p: Pipeline) -> None:
    (item,) = p.stub.applied(event_id=p.delivered)["items"]
    assert item["trace"] == {"traceparent": TRACEPARENT}


def test_a_retry_of_a_parked_event_forwards_its_traceparent(p: Pipeline) -> None:
    (item,) = p.stub.applied(event_id=p.retried)["items"]
    assert item["trace"] == {"traceparent": TRACEPARENT}


def test_an_event_without_trace_context_sends_no_trace_headers(p: Pipeline) -> None:
    wait_until(lambda: p.stub.applied(event_id=p.outage[0])["items"], 60, "outage event applied")
    (item,) = p.stub.applied(event_id=p.outage[0])["items"]
    assert item["trace"] == {}


def test_relay_with_otel_on_exports_a_produce_span_in_the_applications_trace(
    db_dsn: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    otel = {"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    cfg = RelayConfig(
        db_dsn=db_dsn, kafka=kafka_bootstrap, unique=uuid.uuid4().hex[:10], extra=otel
    )
    relay, _ = start_relay(cfg, tmp_path)
    try:
        (event_id,) = _commit(db_dsn, _user_event(str(uuid.uuid4()), traceparent=TRACEPARENT))
        wait_until(lambda: event_id in relay.log_path.read_text(), 60, "the span in the output")
    finally:
        relay.terminate()
        relay.close()
        drop_slot(db_dsn, cfg.slot)
    output = relay.log_path.read_text()
    # ConsoleSpanExporter prints each span as indented JSON, starting with its name
    start = output.rfind('{\n    "name"', 0, output.index(event_id))
    doc = json.JSONDecoder().raw_decode(output[start:])[0]
    assert doc["name"] == f"{cfg.topic_prefix}user publish"
    assert doc["kind"] == "SpanKind.PRODUCER"
    assert doc["context"]["trace_id"] == "0x" + TRACEPARENT.split("-")[1]
    assert doc["parent_id"] == "0x" + TRACEPARENT.split("-")[2]
    assert doc["attributes"]["messaging.message.id"] == event_id
    assert doc["attributes"]["messaging.kafka.offset"] >= 0


# --- no dangling names -------------------------------------------------------------------------


def _families(p: Pipeline) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    return {**_samples(p.scrapes["relay"]), **_samples(p.scrapes["sink"])}


#: Counters of a fault this pipeline does not stage: the named test drives the real
#: process through that fault and asserts the counter moved.
COUNTED_ELSEWHERE = {
    "outbox_relay_replication_silences_total": "test_relay_network_faults.py",
    "outbox_sink_offsets_expired_total": "test_audit.py",
    "outbox_sink_park_skipped_total": "test_sink_reading.py",
}


def test_every_metric_the_rules_and_dashboard_name_is_exported_and_set(p: Pipeline) -> None:
    for name, test_file in COUNTED_ELSEWHERE.items():
        assert name in (Path(__file__).parent / test_file).read_text(encoding="utf-8")
    families = _families(p)
    types = {
        _family_name(f): f.type
        for text in p.scrapes.values()
        for f in text_string_to_metric_families(text)
    }
    problems = []
    for name, users in sorted(referenced_metrics().items()):
        samples = families.get(name)
        if samples is None:
            problems.append(f"{name} is not exported (used by {users})")
            continue
        if types[name] in {"counter", "histogram"}:
            total = sum(v for n, _, v in samples if n.endswith(("_total", "_count")))
            if total <= 0 and name not in COUNTED_ELSEWHERE:
                problems.append(f"{name} was never incremented (used by {users})")
        elif any(labels for _, labels, _ in samples) and not any(v for _, _, v in samples):
            problems.append(f"{name} has no child set (used by {users})")
        if name in MOVES_IN_OUTAGE and not any(v > 0 for _, _, v in samples):
            problems.append(f"{name} did not move while the engine was down (used by {users})")
    assert not problems, "\n".join(problems)


def test_the_outage_drove_what_the_sink_alerts_read(p: Pipeline) -> None:
    families = _families(p)
    for name in MOVES_IN_OUTAGE:
        (_, _, value), *_ = families[name]
        assert value > 0, name
    retried = {labels.get("kind"): v for _, labels, v in families["outbox_sink_retried_total"]}
    assert retried.get("engine", 0) >= 1


def test_promtool_fires_the_sink_alerts_on_the_recorded_two_minute_outage(
    p: Pipeline, tmp_path: Path
) -> None:
    """The shipped rules, evaluated by promtool on the series the real sink exported
    every 15 s while the engine was down for two minutes: the circuit and the
    oldest-age alerts both fire by the end of the outage (a gauge that dipped to 0
    at a probe, or an age that restarted, would keep them pending)."""
    ticks = OUTAGE_S // SCRAPE_INTERVAL_S + 1
    assert {name: len(values) for name, values in p.recorded.items()} == {
        name: ticks for name in MOVES_IN_OUTAGE
    }, "the recorder sampled the whole outage"
    labels = f'job="outbox-sink",instance="sink:9102",group="{p.sink_cfg.group}"'
    firing = {
        name: {
            "labels": (
                f'ALERTS{{alertname="{name}",alertstate="firing",'
                f'group="{p.sink_cfg.group}",severity="critical"}}'
            ),
            "value": 1,
        }
        for name in ("OutboxOldestEventTooOld", "OutboxSinkCircuitOpen")
    }
    spec = {
        "rule_files": [str(ROOT / "compose" / "prometheus" / "rules" / "outbox.rules.yml")],
        "evaluation_interval": f"{SCRAPE_INTERVAL_S}s",
        "tests": [
            {
                "name": "recorded engine outage",
                "interval": f"{SCRAPE_INTERVAL_S}s",
                "input_series": [
                    {
                        "series": f"{name}{{{labels}}}",
                        "values": " ".join(f"{v:g}" for v in p.recorded[name]),
                    }
                    for name in MOVES_IN_OUTAGE
                ]
                + [{"series": f"up{{{labels}}}", "values": f"1x{ticks - 1}"}],
                "promql_expr_test": [
                    {
                        "expr": ALERTS_FIRING,
                        "eval_time": f"{OUTAGE_S}s",
                        "exp_samples": [
                            firing["OutboxOldestEventTooOld"],
                            firing["OutboxSinkCircuitOpen"],
                        ],
                    }
                ],
            }
        ],
    }
    path = tmp_path / "recorded.test.yml"
    path.write_text(json.dumps(spec, indent=2))  # JSON is YAML
    proc = subprocess.run(
        [promtool(), "test", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"{p.recorded}\n{proc.stdout}{proc.stderr}"


def test_consumer_lag_gauge_moves_while_the_engine_is_down(p: Pipeline) -> None:
    families = _families(p)
    assert any(v > 0 for _, _, v in families["outbox_sink_consumer_lag"])


# --- partitions trace prefers ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("partitioner", "predict"),
    [("murmur2", murmur2_partition), ("consistent", crc32_partition)],
)
def test_predicted_partition_is_where_librdkafka_puts_the_key(
    kafka_bootstrap: str, partitioner: str, predict: Any
) -> None:
    topic = f"t{uuid.uuid4().hex[:10]}.partitioner"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=6, replication_factor=1)])[topic].result(30)
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "partitioner": partitioner})
    keys = [f"user-{n}-{uuid.uuid4()}".encode() for n in range(40)]
    landed: dict[bytes, int] = {}

    def report(err: Any, msg: Any) -> None:
        assert err is None, err
        landed[msg.key()] = msg.partition()

    for key in keys:
        producer.produce(topic, b"{}", key, on_delivery=report)
    assert producer.flush(30) == 0
    assert landed == {key: predict(key, 6) for key in keys}
    admin.delete_topics([topic])


@pytest.fixture
def p(pipeline: Pipeline) -> Pipeline:
    return pipeline
