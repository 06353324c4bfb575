"""Day two after the demo (issue 39, items 1 and 2): the stack remembers its ports, and
the pipeline runs in the background (``make run`` / ``make stop``, ``demo write``,
``demo --keep-running``) through the real CLI, on the real stack.

* ``compose/stack.sh`` in a shell without the port variables reports this stack's own
  ports (recorded in its ``ports`` file by ``up``), and refuses other ports in one line
  while the stack runs;
* ``outbox-cdc demo --keep-running`` leaves engine stub, relay and sink running (PIDs
  under ``<OUTBOX_DEV_DIR>/run``), ``demo write`` commits a burst that the running
  pipeline applies, ``demo stop`` ends every one of them; ``demo start`` (make run)
  starts them again, refuses a second start, and ``demo stop`` ends them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import IN_CI, Services
from tests.harness import (
    ROOT,
    RelayConfig,
    SinkConfig,
    drop_slot,
    free_port,
    http_status,
    wait_until,
)

pytestmark = pytest.mark.integration

#: The port variables of the stack (compose/stack.sh's PORT_DEFAULTS).
PORT_VARIABLES = (
    "OUTBOX_PG_PORT",
    "OUTBOX_KAFKA_PORT",
    "OUTBOX_KAFKA_CONTROLLER_PORT",
    "OUTBOX_ENGINE_STUB_PORT",
    "OUTBOX_RELAY_HTTP_PORT",
    "OUTBOX_SINK_HTTP_PORT",
)


@pytest.fixture(scope="module")
def local_stack(services: Services) -> None:
    if services.origin != "local-stack":
        msg = "these tests drive compose/stack.sh: they need the local stack"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)


def _stack(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "compose" / "stack.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_stack_remembers_its_ports_and_refuses_others_in_one_line(
    local_stack: None, kafka_bootstrap: str
) -> None:
    kafka_port = kafka_bootstrap.rsplit(":", 1)[1]
    bare = {k: v for k, v in os.environ.items() if k not in PORT_VARIABLES}
    status = _stack("status", env=bare)
    assert status.returncode == 0, status.stderr
    assert f"kafka       up    127.0.0.1:{kafka_port}" in status.stdout, status.stdout
    other = str(int(kafka_port) + 7)
    refused = _stack("status", env={**bare, "OUTBOX_KAFKA_PORT": other})
    assert refused.returncode == 1
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    assert f"OUTBOX_KAFKA_PORT={other} (it runs on {kafka_port})" in lines[0]
    assert "up" not in refused.stdout  # nothing reported as this stack's


def test_other_http_ports_are_no_reason_to_stop_the_stack(
    local_stack: None, kafka_bootstrap: str
) -> None:
    """The HTTP ports of `make run` are not the stack's: a verb given others goes on (the
    next `up` records them) - a busy HTTP port never needs `make down` of PostgreSQL and
    Kafka. The shell's own process settings win over `.dev/env` for those ports (so
    `CDC_RELAY_HTTP_PORT=33195 make demo` listens there), and the engine URL follows the
    stub's port."""
    bare = {k: v for k, v in os.environ.items() if k not in PORT_VARIABLES}
    given = {var: str(free_port()) for var in PORT_VARIABLES[3:]}
    status = _stack("status", env={**bare, **given})
    assert status.returncode == 0, status.stderr
    assert f"127.0.0.1:{kafka_bootstrap.rsplit(':', 1)[1]}" in status.stdout

    env_file = Path(os.environ.get("OUTBOX_DEV_DIR") or ROOT / ".dev") / "env"
    shown = "$CDC_RELAY_HTTP_PORT $SINK_HTTP_PORT $ENGINE_STUB_PORT $ENGINE_BASE_URL"
    ports = [str(free_port()) for _ in range(3)]
    sourced = subprocess.run(
        ["bash", "-c", f'. "{env_file}" && echo {shown}'],
        env={
            "PATH": os.environ["PATH"],
            "CDC_RELAY_HTTP_PORT": ports[0],
            "SINK_HTTP_PORT": ports[1],
            "ENGINE_STUB_PORT": ports[2],
            "ENGINE_BASE_URL": "http://elsewhere:1",
        },
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert sourced.stdout.split() == [*ports, f"http://127.0.0.1:{ports[2]}"]


def _cli(
    *args: str, env: dict[str, str], timeout_s: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cdc.cli", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _pids(run_dir: Path) -> dict[str, int]:
    return {p.stem: int(p.read_text().split()[0]) for p in run_dir.glob("*.pid") if p.read_text()}


def test_keep_running_then_write_then_stop_then_run_again(
    local_stack: None, db_dsn: str, kafka_bootstrap: str, unique: str, tmp_path: Path
) -> None:
    relay = RelayConfig(db_dsn=db_dsn, kafka=kafka_bootstrap, unique=unique)
    stub_port, relay_port, sink_port = free_port(), free_port(), free_port()
    env = SinkConfig(relay=relay, engine_url="", api_key="day-two-key").env(sink_port)
    env.update(
        {
            "ENGINE_STUB_PORT": str(stub_port),  # (ENGINE_BASE_URL follows it)
            "CDC_RELAY_HTTP_PORT": str(relay_port),
            "OUTBOX_DEV_DIR": str(tmp_path),
        }
    )
    del env["ENGINE_BASE_URL"]
    run_dir = tmp_path / "run"
    try:
        demo = _cli(
            *("demo", "--keep-running", "--users", "10", "--attempts-per-user", "1"),
            *("--log-dir", str(tmp_path)),
            env=env,
        )
        assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
        assert "Left running (--keep-running)" in demo.stdout
        assert "make stop" in demo.stdout
        pids = _pids(run_dir)
        assert set(pids) == {"engine-stub", "relay", "sink"}
        assert all(_alive(p) for p in pids.values()), "the demo left them running"
        assert http_status(f"http://127.0.0.1:{relay_port}/readyz") == 200

        write = _cli("demo", "write", "--users", "5", "--attempts-per-user", "1", env=env)
        assert write.returncode == 0, write.stdout + write.stderr
        assert "10 events committed, 10 applied by the engine stub" in write.stdout

        stop = _cli("demo", "stop", env=env)
        assert stop.returncode == 0, stop.stderr
        assert stop.stdout.count(" stopped") == 3, stop.stdout
        assert not [p for p in pids.values() if _alive(p)], "make stop ended every one"
        assert not list(run_dir.glob("*.pid"))

        start = _cli("demo", "start", env=env)
        assert start.returncode == 0, start.stdout + start.stderr
        assert start.stdout.count("running, pid") == 3, start.stdout
        again = _cli("demo", "start", env=env)
        assert again.returncode == 1
        assert "already running" in again.stderr and "make stop first" in again.stderr
        pids = _pids(run_dir)
        wait_until(lambda: http_status(f"http://127.0.0.1:{sink_port}/readyz") == 200, 60, "sink")

        # One of the three dead: `make run` starts that one again, leaves the others be.
        os.killpg(pids["relay"], signal.SIGKILL)
        wait_until(lambda: not _alive(pids["relay"]), 30, "the relay gone")
        restart = _cli("demo", "start", env=env)
        assert restart.returncode == 0, restart.stdout + restart.stderr
        assert f"relay (pid {pids['relay']}) had exited" in restart.stdout, restart.stdout
        assert "relay running, pid" in restart.stdout
        for name in ("engine-stub", "sink"):
            assert f"{name} still running, pid {pids[name]}" in restart.stdout, restart.stdout
        assert "make down" in restart.stdout
        restarted = _pids(run_dir)
        assert restarted["relay"] != pids["relay"] and _alive(restarted["relay"])
        assert {n: restarted[n] for n in ("engine-stub", "sink")} == {
            n: pids[n] for n in ("engine-stub", "sink")
        }
        assert http_status(f"http://127.0.0.1:{relay_port}/readyz") == 200

        # `make stop` names one that had died.
        pids = restarted
        os.killpg(pids["engine-stub"], signal.SIGKILL)
        wait_until(lambda: not _alive(pids["engine-stub"]), 30, "the stub gone")
        stop = _cli("demo", "stop", env=env)
        assert stop.returncode == 0, stop.stderr
        assert f"engine-stub (pid {pids['engine-stub']}) was not running" in stop.stdout
        assert stop.stdout.count(" stopped") == 2, stop.stdout
    finally:
        _cli("demo", "stop", env=env)
        drop_slot(db_dsn, relay.slot)
    assert not [p for p in pids.values() if _alive(p)]
