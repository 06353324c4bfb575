"""The Docker path stays honest: no engine runs here, so the compose file is
checked against the code's settings and CLI instead."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from cdc.cli import main as cli
from cdc.settings import ENV, Settings

COMPOSE = Path(__file__).resolve().parents[2] / "compose" / "docker-compose.yml"


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


def test_published_ports_match_the_settings_defaults() -> None:
    services = _compose()["services"]
    defaults = Settings()
    expected = {
        "relay": defaults.relay_http_port,
        "sink": defaults.sink_http_port,
        "engine-stub": defaults.engine_stub_port,
    }
    for name, port in expected.items():
        assert f"127.0.0.1:{port}:{port}" in services[name]["ports"], name


def test_sink_and_relay_reach_postgres_and_kafka_by_service_name() -> None:
    services = _compose()["services"]
    for name in ("relay", "sink"):
        env = services[name]["environment"]
        assert "@postgres:5432/" in env["CDC_PG_DSN"]
        assert env["KAFKA_BOOTSTRAP_SERVERS"] == "kafka:9092"
    assert services["sink"]["environment"]["ENGINE_BASE_URL"] == "http://engine-stub:8081"
