"""The CLI's shared helpers: the one port check, the start line of the settings."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from cdc.cli.app import require_free_port, settings_line
from cdc.errors import ConfigError
from cdc.settings import Settings


@pytest.fixture
def taken() -> Iterator[int]:
    """A port something listens on, on 127.0.0.1."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def test_a_taken_port_is_one_line_naming_its_variable_and_host(taken: int) -> None:
    settings = Settings.from_env({"CDC_RELAY_HTTP_PORT": str(taken)})
    with pytest.raises(ConfigError) as raised:
        require_free_port(settings, "relay_http_port")
    assert str(raised.value) == (
        f"CDC_RELAY_HTTP_PORT={taken}: port 127.0.0.1:{taken} already in use (Address already"
        " in use): stop what listens there or set CDC_RELAY_HTTP_PORT to a free port"
    )


def test_a_free_port_passes_and_the_check_leaves_it_free(taken: int) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    settings = Settings.from_env({"SINK_HTTP_PORT": str(free)})
    require_free_port(settings, "sink_http_port")
    require_free_port(settings, "sink_http_port")  # (its own probe socket is closed)


def test_the_host_given_wins_over_cdc_http_host(taken: int) -> None:
    """The demo's engine stub binds 127.0.0.1 whatever CDC_HTTP_HOST says."""
    settings = Settings.from_env({"ENGINE_STUB_PORT": str(taken), "CDC_HTTP_HOST": "127.0.0.2"})
    require_free_port(settings, "engine_stub_port")  # free on 127.0.0.2
    with pytest.raises(ConfigError, match=f"ENGINE_STUB_PORT={taken}: port 127.0.0.1:{taken} "):
        require_free_port(settings, "engine_stub_port", host="127.0.0.1")


def test_a_host_that_cannot_be_bound_is_one_line_too() -> None:
    settings = Settings.from_env({"CDC_HTTP_HOST": "192.0.2.1"})  # TEST-NET-1: not ours
    with pytest.raises(ConfigError) as raised:
        require_free_port(settings, "relay_http_port")
    assert str(raised.value).startswith(
        "CDC_RELAY_HTTP_PORT=9101: cannot listen on 192.0.2.1:9101 ("
    )


def test_the_start_line_shows_only_what_differs_from_the_defaults_secrets_redacted() -> None:
    settings = Settings.from_env(
        {
            "CDC_PG_DSN": "postgresql://relay:pg%20pass@db.example:5432/app",
            "KAFKA_BOOTSTRAP_SERVERS": "k1:9092,k2:9092",
            "CDC_SLOT": "outbox_slot",  # the default, set explicitly: not shown
            "CDC_PUBLICATION_FILTERED": "true",
            "SINK_ROUTES": "A=USER_SYNC, B=QUIZ_SYNC",
            "INTERNAL_API_KEY": "apikey",
            "HTTPS_PROXY": "http://proxyuser:proxypass@proxy:3128",
            "KAFKA_CONFIG_SASL_PASSWORD": "kafkapass",
            "KAFKA_CONFIG_CLIENT_ID": "relay-1",
            "LOG_LEVEL": "debug",
        }
    )
    line = settings_line(settings)
    assert line == (
        'CDC_PG_DSN="user=relay password=*** dbname=app host=db.example port=5432"'
        " CDC_PUBLICATION_FILTERED=true KAFKA_BOOTSTRAP_SERVERS=k1:9092,k2:9092"
        " KAFKA_CONFIG_*=client.id,sasl.password"
        ' SINK_ROUTES="A=USER_SYNC, B=QUIZ_SYNC" INTERNAL_API_KEY=***'
        " HTTPS_PROXY=http://proxyuser:***@proxy:3128 LOG_LEVEL=DEBUG"
    )
    for secret in ("pg pass", "pg%20pass", "apikey", "proxypass", "kafkapass", "relay-1"):
        assert secret not in line
    assert "\n" not in line


def test_the_start_line_of_the_defaults_says_so() -> None:
    assert settings_line(Settings.from_env({})) == "every setting at its default"
    assert len(str(Settings.from_env({}).safe_summary())) > 1_000  # what it replaces


def _dev_env_settings() -> Settings:
    """What a shell that sourced .dev/env (plus one relay and one sink setting) holds."""
    return Settings.from_env(
        {
            "CDC_PG_DSN": "postgresql://postgres:pw@127.0.0.1:27200/outbox",
            "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:31200",
            "ENGINE_STUB_PORT": "17200",
            "ENGINE_BASE_URL": "http://127.0.0.1:17200",
            "CDC_RELAY_HTTP_PORT": "17201",
            "SINK_HTTP_PORT": "17202",
            "ADMIN_API_TOKEN": "admintoken",
            "INTERNAL_API_KEY": "enginekey",
            "CDC_SLOT": "other_slot",
            "SINK_GROUP_ID": "billing",
            "LOG_LEVEL": "debug",
        }
    )


def test_the_sink_start_line_shows_only_the_sink_settings_that_differ() -> None:
    from sinks.cli.run import sink_reads

    line = settings_line(_dev_env_settings(), reads=sink_reads)
    assert line == (
        'CDC_PG_DSN="user=postgres password=*** dbname=outbox host=127.0.0.1 port=27200"'
        " KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:31200 SINK_GROUP_ID=billing SINK_HTTP_PORT=17202"
        " ENGINE_BASE_URL=http://127.0.0.1:17200 INTERNAL_API_KEY=*** ADMIN_API_TOKEN=***"
        " LOG_LEVEL=DEBUG"
    )  # not CDC_SLOT, CDC_RELAY_HTTP_PORT (the relay's), ENGINE_STUB_PORT (the stub's)
    for text in ("pw", "admintoken", "enginekey", "LogLevel", "{", "SecretStr"):
        assert text not in line.replace("password=***", "")


def test_the_relay_start_line_leaves_the_sink_settings_out() -> None:
    from cdc.cli.relay import relay_reads

    line = settings_line(_dev_env_settings(), reads=relay_reads)
    assert line == (
        'CDC_PG_DSN="user=postgres password=*** dbname=outbox host=127.0.0.1 port=27200"'
        " CDC_SLOT=other_slot CDC_RELAY_HTTP_PORT=17201 KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:31200"
        " LOG_LEVEL=DEBUG"
    )
