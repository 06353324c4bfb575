"""The operator's first hour (issue 23, D1): the demo cannot crash or orphan its children,
a Kafka outage does not flood any log, an ops command fails fast with one line.

One broker outage is shared by the module (:func:`outage`): relay + sink + an ops
command run while Kafka is stopped for :data:`OUTAGE_S`, then Kafka is started again
and the demo's start path runs on the just-restarted broker.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from sinks.stub.server import StubServer
from tests.conftest import IN_CI, Services
from tests.harness import (
    ROOT,
    RelayConfig,
    SinkConfig,
    drop_slot,
    free_port,
    stack,
    start_relay,
    start_sink,
    topics_with_prefix,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.fault]

#: How long Kafka stays stopped under relay + sink + an ops command.
OUTAGE_S = 60.0
#: "A few dozen lines per process" for a minute without Kafka (it was 1,396 and 2,379).
MAX_LINES_PER_PROCESS = 60
#: Rounds of the demo's start path on the just-restarted broker.
START_ROUNDS = 2
API_KEY = "first-hour-key"


@dataclass
class Outage:
    relay_lines: list[str]
    sink_lines: list[str]
    ops: subprocess.CompletedProcess[str]
    ops_wall_s: float
    #: relay /readyz (status, body) with Kafka stopped and nothing waiting
    relay_idle: tuple[int | None, str]
    #: relay and sink /readyz once events wait: (status, body)
    relay_waiting: tuple[int | None, str]
    sink_waiting: tuple[int | None, str]
    #: relay /readyz once an event of a new type waits for its topic to be created
    relay_new_topic: tuple[int | None, str]
    #: relay /backlog?group=<the sink's group> meanwhile: (status, JSON document)
    backlog: tuple[int, dict[str, object]]
    #: both /readyz 200 again after Kafka came back
    recovered: bool


def _get(url: str) -> tuple[int | None, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return None, str(exc)


def _until_unreachable(url: str, words: str = "kafka unreachable") -> tuple[int | None, str]:
    """Poll ``url`` until it says ``words`` (bounded); its last answer."""
    last: list[tuple[int | None, str]] = []

    def said() -> bool:
        last[:] = [_get(url)]
        return words in last[0][1]

    with contextlib.suppress(AssertionError):
        wait_until(said, 40, f"{url} to say {words}", interval_s=0.5)
    return last[0]


def _write_events(dsn: str, count: int, aggregate: str = "user") -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (aggregatetype, aggregateid, type, payload)"
            " SELECT %s, 'k' || g, 'UserCreated', jsonb_build_object('n', g)"
            " FROM generate_series(1, %s) g",
            (aggregate, count),
        )


def _lines_since(path: Path, offset: int) -> list[str]:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace").splitlines()


@pytest.fixture(scope="module")
def local_stack(services: Services) -> None:
    if services.origin != "local-stack":
        msg = "these tests stop and start Kafka: they need the local stack"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="module")
def outage(
    local_stack: None, db_dsn: str, kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Outage]:
    """Relay and sink running; Kafka stopped for OUTAGE_S (an ops command meanwhile); started."""
    tmp = tmp_path_factory.mktemp("outage")
    # (the stall thresholds far away: /readyz must say why at once, not after them)
    relay_cfg = RelayConfig(
        db_dsn=db_dsn,
        kafka=kafka_bootstrap,
        unique=uuid.uuid4().hex[:10],
        extra={"CDC_RELAY_STALL_AFTER_S": "600"},
    )
    with StubServer(api_key=API_KEY) as stub:
        sink_cfg = SinkConfig(
            relay=relay_cfg,
            engine_url=stub.url,
            api_key=API_KEY,
            extra={"SINK_STALL_AFTER_S": "600"},
        )
        relay, relay_port = start_relay(relay_cfg, tmp)
        sink, sink_port = start_sink(sink_cfg, tmp)
        relay_url, sink_url = (f"http://127.0.0.1:{p}" for p in (relay_port, sink_port))
        _write_events(db_dsn, 1)  # (its topic made before the outage)
        wait_until(
            lambda: bool(topics_with_prefix(kafka_bootstrap, relay_cfg.topic_prefix + "user")),
            60,
            "the user topic",
        )
        try:
            relay_mark, sink_mark = (p.log_path.stat().st_size for p in (relay, sink))
            stack("down", "kafka")
            stopped = time.monotonic()
            try:
                started = time.monotonic()
                ops = subprocess.run(
                    [sys.executable, "-m", "cdc.cli", "lag"],
                    env=sink_cfg.env(free_port()),
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                    timeout=120,
                    check=False,
                )
                ops_wall_s = time.monotonic() - started
                relay_idle = _get(f"{relay_url}/readyz")  # nothing waits: no outage yet
                _write_events(db_dsn, 5)
                relay_waiting = _until_unreachable(f"{relay_url}/readyz")
                sink_waiting = _until_unreachable(f"{sink_url}/readyz")
                _write_events(db_dsn, 1, aggregate="quiz")  # a new type: its topic waits
                relay_new_topic = _until_unreachable(f"{relay_url}/readyz", "(creating topic")
                status, body = _get(f"{relay_url}/backlog?group={sink_cfg.group}")
                backlog = (status or 0, json.loads(body) if status else {})
                time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - stopped)))
                assert relay.alive() and sink.alive()
            finally:
                stack("up", "kafka")
            lines = (
                _lines_since(relay.log_path, relay_mark),
                _lines_since(sink.log_path, sink_mark),
            )
            recovered = True
            try:
                for url in (relay_url, sink_url):
                    wait_until(lambda u=url: _get(f"{u}/readyz")[0] == 200, 120, f"{url} ready")
            except AssertionError:
                recovered = False
            yield Outage(
                relay_lines=lines[0],
                sink_lines=lines[1],
                ops=ops,
                ops_wall_s=ops_wall_s,
                relay_idle=relay_idle,
                relay_waiting=relay_waiting,
                sink_waiting=sink_waiting,
                relay_new_topic=relay_new_topic,
                backlog=backlog,
                recovered=recovered,
            )
        finally:
            for proc in (sink, relay):
                proc.close()
            drop_slot(db_dsn, relay_cfg.slot)


def test_a_minute_without_kafka_writes_a_few_dozen_lines_per_process(outage: Outage) -> None:
    for name, lines in (("relay", outage.relay_lines), ("sink", outage.sink_lines)):
        assert len(lines) <= MAX_LINES_PER_PROCESS, (
            f"{name} wrote {len(lines)} lines in {OUTAGE_S:.0f}s without Kafka:\n"
            + "\n".join(lines[:80])
        )
    print(f"lines: relay {len(outage.relay_lines)}, sink {len(outage.sink_lines)}")


def test_lag_without_kafka_shows_what_it_can_read_and_names_the_failure_in_one_line(
    outage: Outage,
) -> None:
    run = outage.ops
    assert run.returncode == 1, run.stdout + run.stderr
    assert "unknown (Kafka could not be read)" in run.stdout
    assert "parking lot: " in run.stdout  # PostgreSQL is up: its lines are shown
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("error: Kafka at 127.0.0.1:")
    assert "unreachable: connection refused at 127.0.0.1:" in lines[0]
    assert "check KAFKA_BOOTSTRAP_SERVERS" not in lines[0]  # the setting is right: Kafka is down
    print(f"ops command failed after {outage.ops_wall_s:.1f}s, load {os.getloadavg()}")


def test_readyz_and_backlog_name_a_kafka_outage_while_work_waits_not_before(
    outage: Outage,
) -> None:
    """Nothing waiting, a stopped broker is no outage (200); events waiting, both /readyz
    say ``kafka unreachable: <why>`` at once (the stall thresholds are 600 s away), the
    relay's /backlog answers 503 ``unknown`` naming the failure; all ready again after."""
    assert outage.relay_idle[0] == 200, outage.relay_idle
    assert outage.relay_waiting[1].startswith("stalled: kafka unreachable: "), outage.relay_waiting
    status, body = outage.relay_new_topic
    assert status == 503 and "kafka unreachable: " in body, outage.relay_new_topic
    assert "(creating topic " in body and "outbox.event.quiz)" in body, body
    for name, (status, body) in (("relay", outage.relay_waiting), ("sink", outage.sink_waiting)):
        assert status == 503, (name, status, body)
        assert "kafka unreachable: " in body, (name, body)
        assert "Connection refused" in body or "refused" in body, (name, body)
    status, doc = outage.backlog
    assert status == 503, outage.backlog
    assert doc["state"] == "unknown", doc
    problems = " ".join(str(p) for p in doc["problems"])  # type: ignore[attr-defined]
    assert "unreachable: connection refused" in problems, doc
    assert outage.recovered, "relay and sink /readyz 200 again once Kafka is back"
    print(f"relay: {outage.relay_waiting}\nsink: {outage.sink_waiting}\nbacklog: {doc}")
    print(f"relay, a new topic waiting: {outage.relay_new_topic}")


def _demo_env(db_dsn: str, kafka: str) -> tuple[RelayConfig, dict[str, str]]:
    relay = RelayConfig(db_dsn=db_dsn, kafka=kafka, unique=uuid.uuid4().hex[:10])
    stub_port = free_port()
    env = SinkConfig(relay=relay, engine_url="", api_key=API_KEY).env(free_port())
    env.update(
        {"ENGINE_STUB_PORT": str(stub_port), "ENGINE_BASE_URL": f"http://127.0.0.1:{stub_port}"}
    )
    return relay, env


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie left for its parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_demo_start_path_on_a_just_restarted_broker_never_crashes(
    outage: Outage, db_dsn: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    """The crash: AdminClient.list_consumer_group_offsets on a broker that had just started."""
    relay, env = _demo_env(db_dsn, kafka_bootstrap)
    try:
        run = subprocess.run(
            [
                *(sys.executable, "-X", "faulthandler", "-m", "tests.integration.demo_start_path"),
                *(str(START_ROUNDS), str(tmp_path)),
            ],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
        rounds = [line.split() for line in run.stdout.splitlines() if line.startswith("round ")]
        assert len(rounds) == START_ROUNDS, run.stdout
        assert all(r[2] in ("ok", "unknown") for r in rounds), run.stdout
        pids = [int(p) for r in rounds for p in r[3:]]
        assert len(pids) == 3 * START_ROUNDS
        assert not [p for p in pids if _alive(p)], "a child outlived the demo's stop"
    finally:
        drop_slot(db_dsn, relay.slot)


#: Starts the demo with Python's Ctrl-C handling even when the test runner ignores SIGINT.
_DEMO_WITH_CTRL_C = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv = ['outbox-cdc', *sys.argv[1:]]; runpy.run_module('cdc.cli', run_name='__main__')"
)


def _children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == pid:
                out.append(int(entry.name))
    return out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "crash"])
def test_the_children_die_with_the_demo(
    sig: signal.Signals, db_dsn: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    relay, env = _demo_env(db_dsn, kafka_bootstrap)
    out = (tmp_path / "demo.out").open("w+")
    demo = subprocess.Popen(
        [
            *(sys.executable, "-c", _DEMO_WITH_CTRL_C, "demo", "--users", "100000"),
            *("--log-dir", str(tmp_path)),
        ],
        env=env,
        cwd=ROOT,
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
    )
    children: list[int] = []
    try:

        def up() -> bool:
            assert demo.poll() is None, (tmp_path / "demo.out").read_text()
            return "relay, sink and engine stub are up" in (tmp_path / "demo.out").read_text()

        wait_until(up, 180, "the demo's children up")
        children = _children_of(demo.pid)
        assert len(children) == 3, children
        demo.send_signal(sig)
        demo.wait(120)
        wait_until(lambda: not [p for p in children if _alive(p)], 90, "no child left")
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        for pid in children:  # never leave one behind a failed test
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        out.close()
        drop_slot(db_dsn, relay.slot)


@pytest.mark.parametrize("variable", ["CDC_RELAY_HTTP_PORT", "SINK_HTTP_PORT", "ENGINE_STUB_PORT"])
def test_a_taken_port_is_refused_with_one_line_naming_its_setting(
    variable: str, db_dsn: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    _, env = _demo_env(db_dsn, kafka_bootstrap)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env[variable] = str(port)
        run = subprocess.run(
            [sys.executable, "-m", "cdc.cli", "demo", "--log-dir", str(tmp_path)],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stdout == ""
    assert run.stderr.splitlines() == [
        f"error: {variable}={port}: port 127.0.0.1:{port} already in use (Address already in"
        f" use): stop what listens there or set {variable} to a free port"
    ]
    assert not list(tmp_path.glob("demo-*.log")), "a child was started"
