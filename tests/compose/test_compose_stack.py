"""The stack users run (``compose/docker-compose.yml``), up for real, written to the
documented way and faulted through compose itself (issue 50; the compose lane).

In file order, on one stack (``compose`` fixture, ``make compose-up``'s script):

1. the image: non-root, one healthcheck answering for each role, ``STOPSIGNAL``, no
   secret in any layer (``docker history``, ``docker save``), its size;
2. Prometheus scrapes the relay and the sink (targets up) and loaded the alert rules;
3. 1,000 events (250 registrations, 750 quiz attempts) written with the docs'
   ``outbox-cdc migrate --demo`` / ``outbox-cdc demo write`` reach the composed engine
   stub, each once, in per-key order;
4. with a writer committing throughout: the relay's process killed (the restart policy
   brings it back), ``docker compose kill -s SIGKILL relay`` (a manual stop for Docker:
   ``docker compose start relay``), ``docker compose restart kafka``, the sink stopped
   (exit 0 within its grace period) and started, the engine stub stopped for 30 s: 0 lost,
   0 phantom, per-key order kept, nothing parked;
5. ``docker compose down -v`` leaves no container, network or volume.

The outbox table of the composed PostgreSQL is the truth of what was committed; the
stub's ``/_stub/applied`` is what the engine received (the stub forgets on a restart:
what it applied is read just before it stops, while it answers 503).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from cdc.outbox import register_user, submit_quiz_attempt
from sinks.shared.routes import QUIZ_ATTEMPTS_SYNC_PATH, USERS_SYNC_PATH
from tests.compose.conftest import PROJECT, ROOT, SECRET_DEFAULTS, Compose, docker
from tests.harness import wait_until, without_derived_user_syncs

IMAGE = "outbox-cdc:local"
#: The documented burst: 250 users, 3 quiz attempts each - 1,000 events.
DEMO_USERS = 250
DEMO_ATTEMPTS = 3
#: The engine stub's outage (issue 50: 30 s).
STUB_OUTAGE_S = 30.0
#: The writer's pace during the faults (one commit per interval).
WRITE_INTERVAL_S = 0.1
#: Users the writer registers before it also writes attempts (then one in five is new).
WRITER_FIRST_USERS = 20
#: Bounds: a restarted service healthy again; every committed event applied.
HEALTHY_TIMEOUT_S = 240.0
DRAIN_TIMEOUT_S = 420.0
#: What a healthy role's healthcheck printed last (cdc.healthcheck: "<url>: 200").
ROLE_PROBES = {
    "relay": ":9101/readyz: 200",
    "sink": ":9102/readyz: 200",
    "engine-stub": ":8081/_stub/stats: 200",
}
PROMETHEUS_DIR = ROOT / "compose" / "prometheus"

# Bounds of each test (the first brings the stack up when the lane did not: a cold build)
pytestmark = pytest.mark.timeout(2400)


def _get(url: str, timeout_s: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as answer:
        return json.loads(answer.read())


def _post(url: str, body: object) -> None:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.status == 200


@contextmanager
def _phase(name: str) -> Iterator[None]:
    start = time.monotonic()
    print(f"[compose] {time.strftime('%H:%M:%S', time.gmtime())} {name} ...")
    yield
    print(f"[compose] {name}: {time.monotonic() - start:.1f}s")


# --- what was committed, what was applied --------------------------------------------------------


def _outbox(dsn: str) -> list[tuple[str, str, str]]:
    """(event id, aggregate id, type) of every outbox row, in commit order (each writer
    commits one event per transaction, one after the other: created_at orders them)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT id::text, aggregateid, type FROM outbox ORDER BY created_at, id"
        ).fetchall()
    return [(r[0], r[1], r[2]) for r in rows]


def _applied(compose: Compose) -> list[dict[str, Any]]:
    answer = _get(compose.url("OUTBOX_COMPOSE_ENGINE_PORT", "/_stub/applied?limit=1000000"))
    items: list[dict[str, Any]] = answer["items"]
    return items


def _parked(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM failed_sync_events").fetchone()
    assert row is not None
    return int(row[0])


def _check_delivery(
    committed: list[tuple[str, str, str]], applied: list[dict[str, Any]], outbox_ids: set[str]
) -> dict[str, int]:
    """Lost, phantom, order: ``committed`` (id, key, type) in commit order, ``applied`` the
    engine calls in the order the engine took them (across stub lifetimes)."""
    ids = {c[0] for c in committed}
    # the user syncs the sink derived from any event (the stub forgot its users on a restart)
    calls = without_derived_user_syncs(applied, outbox_ids)  # type: ignore[arg-type]
    applied_ids = [str(c["event_id"]) for c in calls]
    lost = ids - set(applied_ids)
    # phantom: an engine call of an event no one committed (the outbox is the truth)
    phantom = set(applied_ids) - outbox_ids
    assert not lost, f"{len(lost)} committed events never applied, e.g. {sorted(lost)[:5]}"
    assert not phantom, f"{len(phantom)} applied events never committed: {sorted(phantom)[:5]}"
    # per key (the user) and route: the order of first application is the commit order
    path_of = {"UserRegistered": USERS_SYNC_PATH, "QuizAttemptSubmitted": QUIZ_ATTEMPTS_SYNC_PATH}
    expected: dict[tuple[str, str], list[str]] = defaultdict(list)
    for event_id, key, event_type in committed:
        expected[(key, path_of[event_type])].append(event_id)
    seen: set[str] = set()
    got: dict[tuple[str, str], list[str]] = defaultdict(list)
    for call in calls:
        event_id = str(call["event_id"])
        if event_id in ids and event_id not in seen:
            seen.add(event_id)
            got[(str(call["user_id"]), str(call["path"]))].append(event_id)
    out_of_order = [k for k, v in expected.items() if got[k] != v]
    assert not out_of_order, f"{len(out_of_order)} keys out of order, e.g. {out_of_order[:3]}"
    ours = [i for i in applied_ids if i in ids]
    return {
        "committed": len(ids),
        "engine calls": len(ours),
        "duplicates": len(ours) - len(set(ours)),
        "keys": len(expected),
    }


# --- 1. the image --------------------------------------------------------------------------------


def _secrets(compose: Compose) -> list[str]:
    """The secret values the stack runs with (but the compose file's public development
    defaults) and the local stack's (.dev/): none may be in the image."""
    values = [compose.env[name] for name in SECRET_DEFAULTS]
    for name in ("admin.token", "engine.key", "pg.password"):
        path = ROOT / ".dev" / name
        if path.exists():
            values.append(path.read_text().strip())
    return [v for v in values if len(v) >= 6 and v not in SECRET_DEFAULTS.values()]


def test_the_image_is_non_root_healthchecked_per_role_and_holds_no_secret(
    compose: Compose,
) -> None:
    config = json.loads(docker("image", "inspect", IMAGE))[0]["Config"]
    assert config["User"] == "outbox"
    assert config["StopSignal"] == "SIGTERM"
    assert config["Healthcheck"]["Test"] == ["CMD", "python", "-m", "cdc.healthcheck"]
    assert not {e.split("=")[0] for e in config["Env"]} & set(SECRET_DEFAULTS)
    for service, probe in ROLE_PROBES.items():
        assert compose.run("exec", "-T", service, "id", "-u").stdout.strip() == "10001"
        compose.wait_healthy(service, HEALTHY_TIMEOUT_S)
        # healthy means the probe answered (Docker's retries ride out a slow one on a busy
        # host): the latest answered probe names the role's own endpoint
        log = compose.inspect(service)["State"]["Health"]["Log"]
        answered = [entry for entry in log if entry["ExitCode"] == 0]
        assert answered and probe in answered[-1]["Output"], (service, log)
    migrate = compose.inspect("migrate")["State"]
    assert (migrate["Status"], migrate["ExitCode"]) == ("exited", 0)
    # no secret in any layer: neither in the build steps nor in the files
    history = docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", IMAGE)
    secrets = _secrets(compose)
    for word in ("ADMIN_API_TOKEN=", "INTERNAL_API_KEY=", "PASSWORD=", "SECRET"):
        assert word not in history, word
    for value in secrets:
        assert value not in history
    with subprocess.Popen(["docker", "save", IMAGE], stdout=subprocess.PIPE) as save:
        assert save.stdout is not None
        tail, size = b"", 0
        needles = [v.encode() for v in secrets]
        while chunk := save.stdout.read(1 << 20):
            window = tail + chunk
            assert not [n for n in needles if n in window], "a secret value is in a layer"
            tail, size = window[-256:], size + len(chunk)
    assert save.returncode == 0
    sizes = {
        image: json.loads(docker("image", "inspect", image))[0]["Size"]
        for image in (IMAGE, "python:3.11-slim", "postgres:16", "apache/kafka:4.1.1")
    }
    print(
        f"[compose] image sizes: {', '.join(f'{i} {s / 1e6:.0f} MB' for i, s in sizes.items())};"
        f" {IMAGE} saved: {size / 1e6:.0f} MB, {len(secrets)} secret values searched"
    )


# --- 2. Prometheus -------------------------------------------------------------------------------


def _rule_names() -> set[str]:
    names = set()
    for path in PROMETHEUS_DIR.glob("rules/*.rules.yml"):
        for group in yaml.safe_load(path.read_text())["groups"]:
            names |= {r.get("alert") or r["record"] for r in group["rules"]}
    return names


def test_prometheus_scrapes_relay_and_sink_and_loaded_every_alert_rule(compose: Compose) -> None:
    compose.wait_healthy("prometheus", HEALTHY_TIMEOUT_S)

    def targets_up() -> bool:
        answer = _get(compose.url("OUTBOX_COMPOSE_PROMETHEUS_PORT", "/api/v1/targets"))
        health = {t["labels"]["job"]: t["health"] for t in answer["data"]["activeTargets"]}
        return health == {"outbox-relay": "up", "outbox-sink": "up"}

    wait_until(targets_up, 120, "relay and sink scraped (targets up)", interval_s=2)
    groups = _get(compose.url("OUTBOX_COMPOSE_PROMETHEUS_PORT", "/api/v1/rules"))["data"]["groups"]
    loaded = {rule["name"] for group in groups for rule in group["rules"]}
    assert loaded == _rule_names()
    print(f"[compose] prometheus: targets up, {len(loaded)} rules loaded")


# --- 3. the documented burst ---------------------------------------------------------------------


def _outbox_cdc(compose: Compose, *args: str) -> str:
    """`outbox-cdc ARGS` on the host against the stack (docs: the compose lane)."""
    program = Path(sys.executable).parent / "outbox-cdc"
    proc = subprocess.run(
        [str(program), *args],
        env=compose.cli_env(),
        capture_output=True,
        text=True,
        timeout=DRAIN_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, f"outbox-cdc {' '.join(args)}: {proc.returncode}\n{proc.stderr}"
    return proc.stdout + proc.stderr


def test_a_thousand_events_written_the_documented_way_reach_the_stub_in_per_key_order(
    compose: Compose,
) -> None:
    _outbox_cdc(compose, "migrate", "--demo")
    before = {row[0] for row in _outbox(compose.pg_dsn)}
    with _phase("1,000 events written and applied (outbox-cdc demo write)"):
        out = _outbox_cdc(
            compose, "demo", "write", "--users", str(DEMO_USERS),
            "--attempts-per-user", str(DEMO_ATTEMPTS),
        )  # fmt: skip
    total = DEMO_USERS * (1 + DEMO_ATTEMPTS)
    assert f"{total} events committed, {total} applied by the engine stub" in out, out
    outbox = _outbox(compose.pg_dsn)
    ours = [row for row in outbox if row[0] not in before]
    assert len(ours) == total
    figures = _check_delivery(ours, _applied(compose), {row[0] for row in outbox})
    assert figures["duplicates"] == 0
    assert _parked(compose.pg_dsn) == 0
    print(f"[compose] documented burst: {figures}")


# --- 4. faults through compose, with writes going on ---------------------------------------------


class Writer(threading.Thread):
    """Registrations and quiz attempts, one transaction each, every WRITE_INTERVAL_S."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True, name="compose-writer")
        self.dsn = dsn
        self.committed: list[str] = []
        self.errors: list[str] = []
        self._halt = threading.Event()

    def run(self) -> None:
        rng = random.Random(50)
        users: list[uuid.UUID] = []
        run = uuid.uuid4().hex[:8]
        with psycopg.connect(self.dsn) as conn:
            while not self._halt.wait(WRITE_INTERVAL_S):
                try:
                    if len(users) < WRITER_FIRST_USERS or rng.random() < 0.2:
                        written = register_user(
                            conn, email=f"faults-{run}-{len(users)}@example.org", display_name="F"
                        )
                        users.append(written.entity_id)
                    else:
                        written = submit_quiz_attempt(
                            conn, user_id=rng.choice(users), quiz_id="faults", score=1
                        )
                    self.committed.append(str(written.event_id))
                except psycopg.Error as exc:  # the composed PostgreSQL is never faulted
                    self.errors.append(repr(exc))
                    return

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)
        assert not self.is_alive()


def _crash(compose: Compose, service: str) -> None:
    """SIGKILL of the service's process (the child of Docker's init), as an OOM kill or a
    crash: Docker sees the container end on its own, and the restart policy applies."""
    before = compose.inspect(service)
    init = before["State"]["Pid"]
    children = subprocess.run(
        ["pgrep", "-P", str(init)], capture_output=True, text=True, check=False
    ).stdout.split()
    assert len(children) == 1, f"{service}: init {init} has children {children}"
    os.kill(int(children[0]), signal.SIGKILL)

    def restarted() -> bool:
        return bool(compose.inspect(service)["RestartCount"] > before["RestartCount"])

    wait_until(restarted, 60, f"{service} restarted by its restart policy", interval_s=0.5)


def test_kills_and_restarts_through_compose_lose_nothing_and_keep_per_key_order(
    compose: Compose,
) -> None:
    dsn = compose.pg_dsn
    stub_faults = compose.url("OUTBOX_COMPOSE_ENGINE_PORT", "/_stub/faults")
    writer = Writer(dsn)
    applied_before_stub_stop: list[dict[str, Any]] = []
    writer.start()
    try:
        time.sleep(5)
        with _phase("the relay's process SIGKILLed, back by restart: unless-stopped"):
            _crash(compose, "relay")
            compose.wait_healthy("relay", HEALTHY_TIMEOUT_S)
        with _phase("docker compose kill -s SIGKILL relay, then docker compose start relay"):
            restarts = compose.inspect("relay")["RestartCount"]
            compose.run("kill", "-s", "SIGKILL", "relay")
            time.sleep(5)
            state = compose.inspect("relay")
            # Docker: a kill through its API is a manual stop; the policy does not apply
            assert (state["State"]["Status"], state["RestartCount"]) == ("exited", restarts)
            compose.run("start", "relay")
            compose.wait_healthy("relay", HEALTHY_TIMEOUT_S)
        with _phase("docker compose restart kafka"):
            compose.run("restart", "kafka")
            for service in ("kafka", "relay", "sink"):
                compose.wait_healthy(service, HEALTHY_TIMEOUT_S)
        with _phase("docker compose stop relay (exit 0 within its grace), start relay"):
            compose.run("stop", "relay")  # SIGTERM: flush Kafka, confirm the slot, exit 0
            state = compose.inspect("relay")["State"]
            assert state["ExitCode"] == 0, (state, compose.logs("relay", tail=80))
            compose.run("start", "relay")
            compose.wait_healthy("relay", HEALTHY_TIMEOUT_S)
        with _phase("docker compose stop sink (exit 0 within its grace), start sink"):
            compose.run("stop", "sink")
            state = compose.inspect("sink")["State"]
            assert state["ExitCode"] == 0, (state, compose.logs("sink", tail=80))
            compose.run("start", "sink")
            compose.wait_healthy("sink", HEALTHY_TIMEOUT_S)
        with _phase(f"engine stub stopped for {STUB_OUTAGE_S:.0f}s"):
            # what the stub applied, read while it answers 503 (it forgets on a restart)
            _post(stub_faults, {"status": 503, "times": -1})
            time.sleep(1)
            applied_before_stub_stop = _applied(compose)
            compose.run("stop", "engine-stub")
            time.sleep(STUB_OUTAGE_S)
            compose.run("start", "engine-stub")
            compose.wait_healthy("engine-stub", HEALTHY_TIMEOUT_S)
        time.sleep(5)
    finally:
        writer.stop()
    assert not writer.errors, writer.errors
    committed = set(writer.committed)
    outbox = _outbox(dsn)
    ours = [row for row in outbox if row[0] in committed]
    assert len(ours) == len(committed)

    def drained() -> bool:
        calls = applied_before_stub_stop + _applied(compose)
        return committed <= {str(c["event_id"]) for c in calls}

    with _phase("every committed event applied"):
        wait_until(drained, DRAIN_TIMEOUT_S, f"{len(committed)} events applied", interval_s=2)
    figures = _check_delivery(
        ours, applied_before_stub_stop + _applied(compose), {row[0] for row in outbox}
    )
    assert _parked(dsn) == 0, "nothing is parked by an outage"
    print(f"[compose] faults: {figures}, parked 0")


# --- 5. down -------------------------------------------------------------------------------------


def _project(kind: str) -> list[str]:
    label = f"label=com.docker.compose.project={PROJECT}"
    args = ["ps", "-a"] if kind == "container" else [kind, "ls"]
    return docker(*args, "-q", "--filter", label).split()


def _volumes_of(containers: Iterable[str]) -> set[str]:
    volumes = set()
    for container in containers:
        for mount in json.loads(docker("inspect", container))[0]["Mounts"]:
            if mount["Type"] == "volume":
                volumes.add(mount["Name"])
    return volumes


def test_down_v_leaves_no_container_network_or_volume(compose: Compose) -> None:
    containers = _project("container")
    volumes = _volumes_of(containers) | set(_project("volume"))
    assert containers and _project("network")
    with _phase("docker compose down -v"):
        compose.run("down", "-v")
    assert _project("container") == []
    assert _project("network") == []
    assert _project("volume") == []
    left = set(docker("volume", "ls", "-q").split()) & volumes
    assert not left, f"volumes left: {left}"
    print(f"[compose] down -v removed {len(containers)} containers and {len(volumes)} volumes")
