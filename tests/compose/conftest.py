"""The compose lane's fixtures: the stack of ``compose/docker-compose.yml``, driven by compose.

``compose`` (session) brings the stack up the way ``make compose-up`` does
(``compose/docker.sh up``: a no-op in seconds when it already runs healthy, as in the
lane, which runs it first and times it) and hands the tests a :class:`Compose`: the
``docker compose`` commands of the file, the containers' state, the host ports, the DSN
of the composed PostgreSQL. Secrets come from the environment the stack was started
with (the lane's ``COMPOSE_LANE_ENV``), with the compose file's defaults otherwise.

Without a Docker engine the tests fail in CI and are skipped elsewhere. The tests of
this folder run in file order (a later one takes the stack down), whatever order
pytest-randomly chose.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import IN_CI, ROOT

COMPOSE_FILE = ROOT / "compose" / "docker-compose.yml"
DOCKER_SH = ROOT / "compose" / "docker.sh"
#: The compose file's project name (its `name:`).
PROJECT = "outbox-cdc"
#: Bound of `compose/docker.sh up` from nothing (engine, plugin, stand-ins, image, --wait).
UP_TIMEOUT_S = 1800.0
#: Bound of one docker / docker compose command (a stop waits for the grace period).
COMMAND_TIMEOUT_S = 180.0
#: Secrets and their compose-file defaults (the lane sets its own).
SECRET_DEFAULTS = {
    "ADMIN_API_TOKEN": "change-me",
    "INTERNAL_API_KEY": "change-me",
    "POSTGRES_PASSWORD": "outbox",
}
_PORT = re.compile(r"^127\.0\.0\.1:\$\{(OUTBOX_COMPOSE_\w+_PORT):-(\d+)\}:\d+$")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """This folder's tests in file order: each file's tests by line (the stack is shared
    and the last test takes it down); other items keep their places."""
    ours = [i for i in items if Path(str(i.fspath)).parent == Path(__file__).parent]
    if not ours:
        return
    slots = [n for n, i in enumerate(items) if i in ours]
    ordered = sorted(ours, key=lambda i: (Path(str(i.fspath)).name, i.location[1]))
    for slot, item in zip(slots, ordered, strict=True):
        items[slot] = item


@dataclass
class Compose:
    """The composed stack, seen from the host."""

    env: dict[str, str]
    ports: dict[str, int] = field(default_factory=dict)

    def run(
        self, *args: str, timeout_s: float = COMMAND_TIMEOUT_S, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """``docker compose -f compose/docker-compose.yml ARGS`` (the docs' commands)."""
        proc = subprocess.run(
            ["docker", "compose", "-f", str(COMPOSE_FILE), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"docker compose {' '.join(args)}: {proc.returncode}\n{proc.stderr}"
            )
        return proc

    def container_id(self, service: str) -> str:
        out = self.run("ps", "-a", "-q", service).stdout.split()
        assert len(out) == 1, f"{service}: containers {out}"
        return out[0]

    def inspect(self, service: str) -> dict[str, Any]:
        out = docker("inspect", self.container_id(service))
        data = json.loads(out)
        assert isinstance(data, list)
        return dict(data[0])

    def health(self, service: str) -> str:
        state = self.inspect(service)["State"]
        return str(state.get("Health", {}).get("Status", state["Status"]))

    def wait_healthy(self, service: str, timeout_s: float) -> float:
        """Seconds until the service's healthcheck passed (fails after ``timeout_s``)."""
        start = time.monotonic()
        while (status := self.health(service)) != "healthy":
            elapsed = time.monotonic() - start
            if elapsed > timeout_s:
                logs = self.run("logs", "--tail", "40", service, check=False).stdout
                raise AssertionError(f"{service} {status} after {elapsed:.0f}s\n{logs}")
            time.sleep(1.0)
        return time.monotonic() - start

    def logs(self, service: str, tail: int = 40) -> str:
        return self.run("logs", "--timestamps", "--tail", str(tail), service, check=False).stdout

    @property
    def pg_dsn(self) -> str:
        return (
            f"postgresql://outbox:{self.env['POSTGRES_PASSWORD']}@127.0.0.1:"
            f"{self.ports['OUTBOX_COMPOSE_PG_PORT']}/outbox"
        )

    def url(self, variable: str, path: str) -> str:
        return f"http://127.0.0.1:{self.ports[variable]}{path}"

    def cli_env(self) -> dict[str, str]:
        """The environment of `outbox-cdc` run on the host against the stack (docs)."""
        return {
            **self.env,
            "CDC_PG_DSN": self.pg_dsn,
            "KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{self.ports['OUTBOX_COMPOSE_KAFKA_PORT']}",
            "ENGINE_STUB_PORT": str(self.ports["OUTBOX_COMPOSE_ENGINE_PORT"]),
            "CDC_RELAY_HTTP_PORT": str(self.ports["OUTBOX_COMPOSE_RELAY_PORT"]),
            "SINK_HTTP_PORT": str(self.ports["OUTBOX_COMPOSE_SINK_PORT"]),
            "SINK_GROUP_ID": "engine-sync",
        }


def docker(*args: str, timeout_s: float = COMMAND_TIMEOUT_S) -> str:
    proc = subprocess.run(
        ["docker", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if proc.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)}: {proc.returncode}\n{proc.stderr}")
    return proc.stdout


def compose_ports(env: dict[str, str]) -> dict[str, int]:
    """Every published host port: OUTBOX_COMPOSE_*_PORT, else the compose file's default."""
    ports = {}
    for line in COMPOSE_FILE.read_text().splitlines():
        for spec in re.findall(r'"(127\.0\.0\.1:[^"]+)"', line):
            match = _PORT.match(spec)
            assert match, spec
            ports[match[1]] = int(env.get(match[1]) or match[2])
    return ports


def _engine_answers() -> bool:
    try:
        proc = subprocess.run(
            ["docker", "version", "--format", "{{.Server.Version}}"],
            capture_output=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def _docker_sh(verb: str, env: dict[str, str]) -> None:
    """``compose/docker.sh VERB`` (``images``, ``up``): fails in CI, skips elsewhere."""
    if not _engine_answers() and not IN_CI and os.geteuid() != 0:
        pytest.skip("no Docker engine answers (make compose-up starts one, as root)")
    start = time.monotonic()
    proc = subprocess.run(
        ["bash", str(DOCKER_SH), verb],
        env=env,
        capture_output=True,
        text=True,
        timeout=UP_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        message = f"compose/docker.sh {verb} failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
        if IN_CI:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    print(f"[compose] compose/docker.sh {verb} ({time.monotonic() - start:.0f}s)")


@pytest.fixture(scope="session")
def engine() -> None:
    """A Docker engine answering and the compose file's images present (no stack):
    ``compose/docker.sh images``, a no-op in a second when they are."""
    _docker_sh("images", {**os.environ})


@pytest.fixture(scope="session")
def compose() -> Iterator[Compose]:
    """The stack up and healthy (``compose/docker.sh up``, as ``make compose-up``)."""
    env = {**os.environ}
    for name, default in SECRET_DEFAULTS.items():
        env.setdefault(name, default)
    _docker_sh("up", env)
    yield Compose(env=env, ports=compose_ports(env))
