"""Settings: environment contract, coercion, secrets kept out of logs."""

from __future__ import annotations

from pathlib import Path

import pytest

from cdc.errors import ConfigError
from cdc.settings import ENV, Settings, redact_dsn


def test_defaults_match_the_design_contract() -> None:
    s = Settings.from_env({})
    assert (s.slot, s.publication, s.topic_prefix) == ("outbox_slot", "outbox_pub", "outbox.event.")
    assert s.sink_group_id == "engine-sync"
    assert s.engine_base_url == "http://localhost:8081"
    assert s.internal_api_key == ""
    assert s.scheduler_enabled is True
    assert s.retry_max_attempts == 5
    assert (s.engine_connect_timeout_s, s.engine_read_timeout_s) == (2.0, 3.0)


def test_environment_variables_are_coerced_to_field_types() -> None:
    s = Settings.from_env(
        {
            "OUTBOX_SCHEDULER_ENABLED": "false",
            "OUTBOX_RETRY_MAX_ATTEMPTS": "7",
            "CDC_HEARTBEAT_INTERVAL_S": "2.5",
        }
    )
    assert s.scheduler_enabled is False
    assert s.retry_max_attempts == 7
    assert s.heartbeat_interval_s == 2.5


def test_malformed_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="OUTBOX_RETRY_MAX_ATTEMPTS"):
        Settings.from_env({"OUTBOX_RETRY_MAX_ATTEMPTS": "many"})


def test_kafka_config_prefix_passes_librdkafka_settings_through() -> None:
    s = Settings.from_env(
        {"KAFKA_CONFIG_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_CONFIG_LINGER_MS": "10"}
    )
    assert s.kafka_config == {"security.protocol": "SASL_SSL", "linger.ms": "10"}


def test_missing_required_setting_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="CDC_PG_DSN"):
        Settings.from_env({}).require("pg_dsn")


def test_toml_file_is_overridden_by_environment(tmp_path: Path) -> None:
    f = tmp_path / "cdc.toml"
    f.write_text('slot = "from_file"\npublication = "pub_file"\n')
    s = Settings.from_env({"CDC_CONFIG_FILE": str(f), "CDC_SLOT": "from_env"})
    assert (s.slot, s.publication) == ("from_env", "pub_file")


def test_unknown_toml_key_is_an_error(tmp_path: Path) -> None:
    f = tmp_path / "cdc.toml"
    f.write_text("no_such_knob = 1\n")
    with pytest.raises(ConfigError, match="no_such_knob"):
        Settings.from_env({"CDC_CONFIG_FILE": str(f)})


@pytest.mark.parametrize(
    ("dsn", "expected"),
    [
        ("postgresql://u:s3cret@h:5432/db", "postgresql://u:***@h:5432/db"),
        ("host=h password=s3cret dbname=db", "host=h password=*** dbname=db"),
        ("postgresql://u@h/db", "postgresql://u@h/db"),
    ],
)
def test_redact_dsn_hides_the_password(dsn: str, expected: str) -> None:
    assert redact_dsn(dsn) == expected


def test_secrets_never_appear_in_repr_or_summary() -> None:
    s = Settings.from_env(
        {
            "CDC_PG_DSN": "postgresql://u:pgpass@h/db",
            "INTERNAL_API_KEY": "apikey",
            "ADMIN_API_TOKEN": "admintok",
        }
    )
    text = repr(s) + repr(s.safe_summary())
    for secret in ("pgpass", "apikey", "admintok"):
        assert secret not in text


def test_every_field_but_kafka_config_has_an_environment_variable() -> None:
    from dataclasses import fields

    names = {f.name for f in fields(Settings)} - {"kafka_config"}
    assert names == set(ENV)
