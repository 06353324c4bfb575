"""The compose file, checked fast against the code's settings, CLI and shutdown bounds.

The compose lane (``tests/compose``, ``make test-compose-lane``) runs the file for real;
these checks need no Docker engine. Where the compose plugin is installed,
``docker compose config`` validates the file too (it needs no engine either)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from cdc import healthcheck
from cdc.cli import main as cli
from cdc.relay.stream.loop import SHUTDOWN_FLUSH_S
from cdc.settings import ENV, Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose" / "docker-compose.yml"
APP_SERVICES = ("migrate", "relay", "sink", "engine-stub")
#: Host ports of `make up` (stack.sh defaults) and of processes run from a checkout.
LOCAL_PORTS = {25432, 29092, 29093, 9101, 9102, 8081}
#: First port of Linux's default ephemeral range (net.ipv4.ip_local_port_range).
EPHEMERAL_FIRST_PORT = 32768
_DEFAULTED = re.compile(r"^127\.0\.0\.1:\$\{(OUTBOX_COMPOSE_\w+_PORT):-(\d+)\}:(\d+)$")


def _compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def test_compose_has_the_five_services_with_healthchecks() -> None:
    services = _compose()["services"]
    for name in ("postgres", "kafka", "relay", "sink", "engine-stub"):
        assert name in services, name
        assert "healthcheck" in services[name], name


def test_postgres_runs_with_logical_wal() -> None:
    command = _compose()["services"]["postgres"]["command"]
    assert "wal_level=logical" in command


def test_kafka_runs_kraft_without_auto_topic_creation() -> None:
    env = _compose()["services"]["kafka"]["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"


def test_app_services_use_only_variables_the_settings_know() -> None:
    known = set(ENV.values()) | {"LOG_FORMAT", "LOG_LEVEL"}
    for name in ("relay", "sink", "engine-stub", "migrate"):
        env = _compose()["services"][name].get("environment", {})
        unknown = set(env) - known
        assert not unknown, f"{name} uses unknown variables {unknown}"


def test_app_commands_exist_in_the_cli() -> None:
    for name in ("relay", "sink", "engine-stub", "migrate"):
        command = _compose()["services"][name]["command"][0]
        assert command in cli.commands, f"{name}: outbox-cdc {command} does not exist"


def _published(service: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(variable, default host port, container port) of each published port."""
    out = []
    for spec in service.get("ports", []):
        match = _DEFAULTED.match(spec)
        assert match, f"port {spec!r} is not 127.0.0.1:${{OUTBOX_COMPOSE_*_PORT:-N}}:M"
        out.append((match[1], int(match[2]), int(match[3])))
    return out


def test_published_container_ports_match_the_settings_defaults() -> None:
    services = _compose()["services"]
    defaults = Settings()
    expected = {
        "relay": defaults.relay_http_port,
        "sink": defaults.sink_http_port,
        "engine-stub": defaults.engine_stub_port,
        "postgres": 5432,
        "kafka": 29092,
    }
    for name, port in expected.items():
        assert [container for _, _, container in _published(services[name])] == [port], name


def test_host_ports_are_configurable_and_never_collide_with_the_local_stack() -> None:
    services = _compose()["services"]
    published = [p for service in services.values() for p in _published(service)]
    variables = [variable for variable, _, _ in published]
    hosts = [host for _, host, _ in published]
    assert len(set(variables)) == len(variables) == 7  # 5 app services, prometheus, grafana
    assert len(set(hosts)) == len(hosts)
    assert not set(hosts) & LOCAL_PORTS
    # below the ephemeral range, where a client socket of the host may hold the port
    assert all(1024 < host < EPHEMERAL_FIRST_PORT for host in hosts), hosts


def test_relay_and_sink_restart_unless_stopped() -> None:
    services = _compose()["services"]
    for name in ("relay", "sink"):
        assert services[name].get("restart") == "unless-stopped", name


def test_kafka_advertises_the_configured_host_port() -> None:
    kafka = _compose()["services"]["kafka"]
    ((variable, default, _),) = _published(kafka)
    advertised = kafka["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    assert f"HOST://127.0.0.1:${{{variable}:-{default}}}" in advertised


def test_every_app_service_can_build_the_one_image() -> None:
    services = _compose()["services"]
    for name in APP_SERVICES:
        service = services[name]
        assert service["image"] == "outbox-cdc:local", name
        assert service["build"] == {"context": "..", "dockerfile": "compose/Dockerfile"}, name


def test_the_image_installs_the_lock_file_with_hashes() -> None:
    dockerfile = (ROOT / "compose" / "Dockerfile").read_text()
    assert "--require-hashes -r requirements.lock" in dockerfile
    assert "--no-deps" in dockerfile
    lock = (ROOT / "compose" / "requirements.lock").read_text()
    pins = re.findall(r"^([a-z0-9][a-z0-9._-]*)==\S+ \\$", lock, flags=re.MULTILINE | re.IGNORECASE)
    assert {"psycopg", "confluent-kafka", "pydantic-settings", "uvicorn", "setuptools"} <= {
        p.lower() for p in pins
    }


def _compose_plugin() -> bool:
    try:
        proc = subprocess.run(
            ["docker", "compose", "version"], capture_output=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def test_docker_compose_config_accepts_the_file() -> None:
    if not _compose_plugin():
        pytest.skip("the docker compose plugin is not installed (the YAML checks above still run)")
    env = {**os.environ, "ADMIN_API_TOKEN": "validate-only"}
    proc = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_sink_and_relay_reach_postgres_and_kafka_by_service_name() -> None:
    services = _compose()["services"]
    for name in ("relay", "sink"):
        env = services[name]["environment"]
        assert "@postgres:5432/" in env["CDC_PG_DSN"]
        assert env["KAFKA_BOOTSTRAP_SERVERS"] == "kafka:9092"
    assert services["sink"]["environment"]["ENGINE_BASE_URL"] == "http://engine-stub:8081"


# --- observability (Prometheus + Grafana) -----------------------------------------------------

PROMETHEUS_DIR = COMPOSE.parent / "prometheus"
GRAFANA_DIR = COMPOSE.parent / "grafana"


def test_prometheus_and_grafana_services_have_healthchecks() -> None:
    services = _compose()["services"]
    for name in ("prometheus", "grafana"):
        assert name in services, name
        assert "healthcheck" in services[name], name


def test_prometheus_mounts_the_repository_config_and_rules() -> None:
    service = _compose()["services"]["prometheus"]
    assert "./prometheus:/etc/prometheus:ro" in service["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in service["command"]
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    assert config["rule_files"] == ["rules/*.rules.yml"]
    assert list(PROMETHEUS_DIR.glob("rules/*.rules.yml")), "no rule file to mount"


def test_prometheus_scrapes_relay_and_sink_on_their_compose_ports() -> None:
    services = _compose()["services"]
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    targets = {
        job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
        for job in config["scrape_configs"]
    }
    relay_port = services["relay"]["environment"]["CDC_RELAY_HTTP_PORT"]
    sink_port = services["sink"]["environment"]["SINK_HTTP_PORT"]
    assert targets["outbox-relay"] == [f"relay:{relay_port}"]
    assert targets["outbox-sink"] == [f"sink:{sink_port}"]
    sink_job = next(j for j in config["scrape_configs"] if j["job_name"] == "outbox-sink")
    group = services["sink"]["environment"]["SINK_GROUP_ID"]
    assert sink_job["static_configs"][0]["labels"]["group"] == group


def test_grafana_provisions_the_prometheus_datasource_and_the_dashboard() -> None:
    service = _compose()["services"]["grafana"]
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in service["volumes"]
    assert "./grafana/dashboards:/var/lib/grafana/dashboards:ro" in service["volumes"]
    datasources = yaml.safe_load(
        (GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )["datasources"]
    assert datasources[0]["url"] == "http://prometheus:9090"
    providers = yaml.safe_load(
        (GRAFANA_DIR / "provisioning" / "dashboards" / "outbox.yml").read_text()
    )["providers"]
    assert providers[0]["options"]["path"] == "/var/lib/grafana/dashboards"
    dashboards = list((GRAFANA_DIR / "dashboards").glob("*.json"))
    assert [d.name for d in dashboards] == ["outbox-cdc.json"]
    uid = datasources[0]["uid"]
    panels = json.loads(dashboards[0].read_text())["panels"]
    for panel in panels:
        assert panel["datasource"]["uid"] == uid, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == uid, panel["title"]


# --- the image and the stand-ins (issue 50) ----------------------------------------------------

DOCKERFILE = ROOT / "compose" / "Dockerfile"
STANDINS = ROOT / "compose" / "standins"
_GRACE = re.compile(r"^(\d+)s$")


def _grace_s(service: dict[str, Any]) -> int:
    match = _GRACE.match(str(service["stop_grace_period"]))
    assert match, service["stop_grace_period"]
    return int(match[1])


def test_grafana_starts_only_with_its_profile() -> None:
    services = _compose()["services"]
    assert services["grafana"]["profiles"] == ["grafana"]
    assert [name for name, s in services.items() if "profiles" in s] == ["grafana"]


def test_relay_and_sink_get_twice_their_shutdown_bound_before_a_sigkill() -> None:
    services = _compose()["services"]
    # the relay flushes Kafka and confirms, the sink waits for deliveries then commits
    assert _grace_s(services["relay"]) >= 2 * SHUTDOWN_FLUSH_S
    sink_env = services["sink"]["environment"]
    sink_bound_s = float(sink_env.get("SINK_SHUTDOWN_S", Settings().sink_shutdown_s))
    assert _grace_s(services["sink"]) >= 2 * sink_bound_s
    assert "STOPSIGNAL SIGTERM" in DOCKERFILE.read_text().splitlines()


def test_the_image_runs_as_a_user_with_one_healthcheck_for_every_role() -> None:
    lines = DOCKERFILE.read_text().splitlines()
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users == ["outbox"]
    (healthcheck,) = [line for line in lines if line.startswith("HEALTHCHECK ")]
    assert lines[lines.index(healthcheck) + 1].strip() == 'CMD ["python", "-m", "cdc.healthcheck"]'
    services = _compose()["services"]
    for name in ("relay", "sink", "engine-stub"):
        assert services[name]["healthcheck"]["test"] == ["CMD", "python", "-m", "cdc.healthcheck"]


def _seconds(text: str) -> float:
    assert re.fullmatch(r"\d+s", text), text
    return float(text[:-1])


def test_docker_ends_a_probe_only_well_after_the_probe_bounds_itself() -> None:
    """The probe's own bound plus the interpreter's start on a busy host (a CI run on a
    loaded host saw Docker end a probe at 3 s, exit -1, while the relay answered): Docker's
    timeout is at least twice the probe's, in the image and in every app service."""
    (line,) = [ln for ln in DOCKERFILE.read_text().splitlines() if ln.startswith("HEALTHCHECK ")]
    (image_timeout,) = re.findall(r"--timeout=(\S+)", line)
    assert _seconds(image_timeout) >= 2 * healthcheck.PROBE_TIMEOUT_S
    services = _compose()["services"]
    for name in ("relay", "sink", "engine-stub"):
        timeout_s = _seconds(services[name]["healthcheck"]["timeout"])
        assert timeout_s >= 2 * healthcheck.PROBE_TIMEOUT_S, name


def test_the_build_context_is_an_allow_list_that_leaves_out_dev_and_venv() -> None:
    rules = [
        line
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert rules[0] == "*"
    allowed = {line[1:] for line in rules if line.startswith("!")}
    copied = {
        part
        for line in DOCKERFILE.read_text().splitlines()
        if line.startswith("COPY ")
        for part in line.split()[1:-1]
    }
    assert copied == allowed
    assert not {".dev", ".venv", "tests"} & allowed


def _pulled_images() -> set[str]:
    services = _compose()["services"]
    images = {s["image"] for s in services.values() if "build" not in s and "profiles" not in s}
    bases = re.findall(r"^FROM\s+(\S+)", DOCKERFILE.read_text(), flags=re.MULTILINE)
    return images | set(bases)


def test_every_image_the_stack_pulls_has_a_stand_in_under_its_exact_name() -> None:
    script = (STANDINS / "build.sh").read_text()
    known = set(re.search(r'^ALL="([^"]+)"', script, flags=re.MULTILINE)[1].split())  # type: ignore[index]
    assert _pulled_images() == known
    for image in known:
        case = rf"^\s+{re.escape(image)}\) echo (\w+) ;;"
        assert re.search(case, script, flags=re.MULTILINE), image
    readme = (STANDINS / "README.md").read_text()
    assert "only for machines without an image registry" in readme
    for image in known:
        assert f"`{image}`" in readme, image


# --- the docs show what the compose lane runs ---------------------------------------------------

RUN_IT_YOURSELF = ROOT / "docs" / "getting-started" / "run-it-yourself.md"
LANE_TESTS = ROOT / "tests" / "compose" / "test_compose_stack.py"
DOCKER_SH = ROOT / "compose" / "docker.sh"
_SHOWN = re.compile(r"docker compose -f compose/docker-compose\.yml((?: [\w*'-]+)+)")
_SCRIPTED = re.compile(r"^\s*(?:\S+=\S+ )*compose((?: (?!\")[^\s|\"]+)+)", re.MULTILINE)
ANY = "*"


def _shown_compose_commands() -> set[tuple[str, ...]]:
    return {tuple(m[1].split()) for m in _SHOWN.finditer(RUN_IT_YOURSELF.read_text())}


def _lane_compose_commands() -> list[tuple[str, ...]]:
    """``compose.run(...)`` of the lane's tests (a variable: any word) and the
    ``compose ...`` lines of compose/docker.sh."""
    import ast

    commands = []
    for node in ast.walk(ast.parse(LANE_TESTS.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "run"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "compose"
        ):
            commands.append(
                tuple(
                    a.value if isinstance(a, ast.Constant) and isinstance(a.value, str) else ANY
                    for a in node.args
                )
            )
    commands += [tuple(m[1].split()) for m in _SCRIPTED.finditer(DOCKER_SH.read_text())]
    return commands


def _runs(shown: tuple[str, ...], ran: tuple[str, ...]) -> bool:
    """The lane ran ``shown``: a command that starts with its words (any word for a
    variable of the lane; more options after them are the lane's bounds)."""
    return len(ran) >= len(shown) and all(r in (s, ANY) for s, r in zip(shown, ran, strict=False))


def test_every_compose_command_the_docs_show_is_one_the_lane_runs() -> None:
    shown = _shown_compose_commands()
    lane = _lane_compose_commands()
    assert {("up", "-d", "--build", "--wait"), ("down", "-v"), ("restart", "kafka")} <= shown
    not_run = [" ".join(c) for c in shown if not any(_runs(c, ran) for ran in lane)]
    assert not not_run, f"shown in {RUN_IT_YOURSELF.name}, never run by the lane: {not_run}"


@pytest.mark.parametrize(("args", "names"), [(["up"], "ADMIN_API_TOKEN"), (["nonsense"], "usage")])
def test_a_mistake_with_docker_sh_is_one_line_and_exit_2(args: list[str], names: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ADMIN_API_TOKEN"}
    proc = subprocess.run(
        ["bash", str(DOCKER_SH), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and names in lines[0], proc.stderr
