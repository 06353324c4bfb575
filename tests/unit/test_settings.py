"""Settings: environment contract, coercion, secrets kept out of logs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from cdc.errors import ConfigError
from cdc.settings import ENV, SECRET_FIELDS, Settings, env
from cdc.settings import doc as settings_doc
from cdc.settings.doc import SettingsDocError, render
from cdc.settings.values import redact_dsn

#: What docs/configuration/index.md holds where the generated reference goes.
MARKER = "<!-- settings-reference -->"


def test_defaults_match_the_design_contract() -> None:
    s = Settings.from_env({})
    assert (s.slot, s.publication, s.topic_prefix) == ("outbox_slot", "outbox_pub", "outbox.event.")
    assert s.sink_group_id == "engine-sync"
    assert s.engine_base_url == "http://localhost:8081"
    assert s.internal_api_key.get_secret_value() == ""
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
        {
            "KAFKA_CONFIG_SECURITY_PROTOCOL": "SASL_SSL",
            # librdkafka checks the whole configuration at start: PLAIN needs both
            "KAFKA_CONFIG_SASL_MECHANISMS": "PLAIN",
            "KAFKA_CONFIG_SASL_USERNAME": "u",
            "KAFKA_CONFIG_SASL_PASSWORD": "p",
            "KAFKA_CONFIG_LINGER_MS": "10",
        }
    )
    assert s.kafka_config == {
        "security.protocol": "SASL_SSL",
        "sasl.mechanisms": "PLAIN",
        "sasl.username": "u",
        "sasl.password": "p",
        "linger.ms": "10",
    }


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


DSN_FORMS = [
    "postgresql://u:s3cret@h:5432/db",
    "postgresql://u@h/db?password=s3cret",
    "postgresql://u@h/db?sslmode=disable&password=s3cret&application_name=x",
    "postgres://u:s3cret@h1:5432,h2:5433/db?target_session_attrs=any",
    "host=h password=s3cret dbname=db",
    "host=h password = s3cret dbname=db",
    "host=h password= s3cret dbname=db",
    "host=h password='s3cret' dbname=db",
    "host=h password='s3 cret\\'s' dbname=db",
    "host=h sslpassword=s3cret dbname=db",
]


@pytest.mark.parametrize("dsn", DSN_FORMS)
def test_redact_dsn_hides_the_password_in_every_form_libpq_accepts(dsn: str) -> None:
    redacted = redact_dsn(dsn)
    assert "s3" not in redacted
    assert "cret" not in redacted
    assert "password=***" in redacted
    assert "host=h" in redacted


def test_redact_dsn_keeps_the_rest_of_the_dsn() -> None:
    assert redact_dsn("postgresql://u:s3cret@h:5432/db") == (
        "user=u password=*** dbname=db host=h port=5432"
    )
    assert redact_dsn("postgresql://u@h/db") == "user=u dbname=db host=h"
    assert redact_dsn("") == ""


def test_redact_dsn_never_echoes_a_dsn_it_cannot_parse() -> None:
    assert redact_dsn("host=h password='s3cret") == "<unparseable DSN>"


@pytest.mark.parametrize("dsn", ["host=h password s3cret", "host=h password='s3cret"])
def test_an_unparseable_dsn_is_a_config_error_that_does_not_quote_it(dsn: str) -> None:
    with pytest.raises(ConfigError, match="CDC_PG_DSN") as info:
        Settings.from_env({"CDC_PG_DSN": dsn})
    assert "s3cret" not in str(info.value)


def test_secrets_never_appear_in_repr_str_or_summary() -> None:
    s = Settings.from_env(
        {
            "CDC_PG_DSN": "host=h password = 'pg pass' dbname=db",
            "INTERNAL_API_KEY": "apikey",
            "ADMIN_API_TOKEN": "admintok",
            "HTTPS_PROXY": "http://proxyuser:proxypass@proxy:3128",
            "KAFKA_CONFIG_SASL_PASSWORD": "kafkapass",
        }
    )
    text = repr(s) + str(s) + repr(s.safe_summary())
    for secret in ("pg pass", "apikey", "admintok", "proxypass", "kafkapass"):
        assert secret not in text
    assert s.safe_summary()["https_proxy"] == "http://proxyuser:***@proxy:3128"
    assert s.pg_dsn.get_secret_value() == "host=h password = 'pg pass' dbname=db"
    assert s.internal_api_key.get_secret_value() == "apikey"


def test_secret_fields_are_secret_strings() -> None:
    assert {"pg_dsn", "internal_api_key", "admin_api_token"} <= SECRET_FIELDS


def test_a_malformed_secret_names_the_variable_but_not_the_value(tmp_path: Path) -> None:
    f = tmp_path / "cdc.toml"
    f.write_text("internal_api_key = 123456789\n")
    with pytest.raises(ConfigError, match="INTERNAL_API_KEY") as info:
        Settings.from_env({"CDC_CONFIG_FILE": str(f)})
    assert "123456789" not in str(info.value)


def test_toml_file_takes_field_or_variable_names_and_a_kafka_table(tmp_path: Path) -> None:
    f = tmp_path / "cdc.toml"
    f.write_text('slot = "s"\nCDC_PUBLICATION = "p"\n[kafka_config]\n"linger.ms" = "7"\n')
    s = Settings.from_env({}, config_file=str(f))
    assert (s.slot, s.publication, s.kafka_config) == ("s", "p", {"linger.ms": "7"})


def test_missing_config_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="CDC_CONFIG_FILE"):
        Settings.from_env({"CDC_CONFIG_FILE": str(tmp_path / "absent.toml")})


def test_proxy_variables_are_read_in_either_case() -> None:
    s = Settings.from_env({"https_proxy": "http://p:3128", "no_proxy": "engine.internal"})
    assert s.https_proxy.get_secret_value() == "http://p:3128"
    assert s.no_proxy == "engine.internal"
    upper = Settings.from_env({"HTTPS_PROXY": "http://upper:1", "https_proxy": "http://lower:2"})
    assert upper.https_proxy.get_secret_value() == "http://upper:1"


def test_engine_tls_settings_default_to_verified_system_trust() -> None:
    s = Settings.from_env({})
    assert s.engine_tls_verify is True
    assert (s.engine_ca_file, s.engine_client_cert, s.engine_client_key) == ("", "", "")
    assert Settings.from_env({"ENGINE_TLS_VERIFY": "false"}).engine_tls_verify is False


def test_settings_are_immutable() -> None:
    s = Settings()
    with pytest.raises(ValidationError):
        s.slot = "other"  # type: ignore[misc]


def test_settings_built_directly_ignore_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CDC_SLOT", "from_env")
    assert Settings().slot == "outbox_slot"
    assert Settings(slot="given").slot == "given"


def test_every_field_but_kafka_config_has_an_environment_variable() -> None:
    names = set(Settings.model_fields) - {"kafka_config"}
    assert names == set(ENV)
    assert ENV["pg_dsn"] == "CDC_PG_DSN"
    assert ENV["engine_ca_file"] == "ENGINE_CA_FILE"


# --- validated at start: one message naming the variable, never a secret's value -------------

BAD_VALUES = [
    ({"LOG_LEVEL": "LOUD"}, "LOG_LEVEL"),
    ({"LOG_FORMAT": "xml"}, "LOG_FORMAT"),
    ({"CDC_RELAY_HTTP_PORT": "99999"}, "CDC_RELAY_HTTP_PORT"),
    ({"SINK_HTTP_PORT": "0"}, "SINK_HTTP_PORT"),
    ({"SINK_INLINE_ATTEMPTS": "-1"}, "SINK_INLINE_ATTEMPTS"),
    ({"OUTBOX_RETRY_MAX_ATTEMPTS": "-3"}, "OUTBOX_RETRY_MAX_ATTEMPTS"),
    ({"ENGINE_READ_TIMEOUT_S": "-1"}, "ENGINE_READ_TIMEOUT_S"),
    ({"ENGINE_READ_TIMEOUT_S": "0"}, "ENGINE_READ_TIMEOUT_S"),
    ({"CDC_TOPIC_PARTITIONS": "0"}, "CDC_TOPIC_PARTITIONS"),
    ({"SINK_MAX_IN_FLIGHT": "0"}, "SINK_MAX_IN_FLIGHT"),
    ({"ENGINE_BASE_URL": "localhost:8081"}, "ENGINE_BASE_URL"),
    ({"ENGINE_BASE_URL": "ftp://engine"}, "ENGINE_BASE_URL"),
    ({"KAFKA_CONFIG_SECURITY_PROTOCOL": "SASL_SSLX"}, "KAFKA_CONFIG_SECURITY_PROTOCOL"),
    ({"KAFKA_CONFIG_NO_SUCH_THING": "s3cret"}, "KAFKA_CONFIG_NO_SUCH_THING"),
    ({"HTTPS_PROXY": "user:s3cret@proxy:3128"}, "HTTPS_PROXY"),
]


@pytest.mark.parametrize(("env", "variable"), BAD_VALUES, ids=[v for _, v in BAD_VALUES])
def test_a_bad_value_names_its_variable(env: dict[str, str], variable: str) -> None:
    with pytest.raises(ConfigError, match=variable) as info:
        Settings.from_env(env)
    assert "s3cret" not in str(info.value)
    assert "SASL_SSLX" not in str(info.value)


def test_good_values_pass_and_case_does_not_matter() -> None:
    s = Settings.from_env(
        {
            "LOG_LEVEL": "debug",
            "LOG_FORMAT": "JSON",
            "CDC_TOPIC_REPLICATION_FACTOR": "-1",  # the broker's default
            "ENGINE_BASE_URL": "https://engine.example:8443/base",
            "HTTPS_PROXY": "http://u:p@proxy:3128",
            "KAFKA_CONFIG_LINGER_MS": "5",
        }
    )
    assert (s.log_level.value, s.log_format.value) == ("DEBUG", "json")
    assert s.topic_replication_factor == -1


# --- the configuration page, generated from the settings class (cdc.settings.doc) ------------

ROOT = Path(__file__).resolve().parents[2]


def test_every_setting_is_on_the_generated_page_once_with_its_default() -> None:
    page = render()
    documented = re.findall(r"^\| `([^`]+)`", page, re.MULTILINE)
    assert len(documented) == len(set(documented)), "a variable is listed twice"
    assert set(ENV.values()) <= set(documented)
    assert "| `CDC_SLOT` | `outbox_slot` | text |" in page
    assert "| `CDC_TOPIC_REPLICATION_FACTOR` | `-1` | count |" in page
    assert "| `OUTBOX_SCHEDULER_ENABLED` | `true` | `true` / `false` |" in page
    assert "| `CDC_GAP_MARGIN_S` | `300` | seconds |" in page
    assert "| `INTERNAL_API_KEY` | empty | secret |" in page
    assert "| `CDC_GAP_RECOVERY` | `auto` | `auto` / `manual` |" in page


def test_every_field_has_a_description_of_its_own() -> None:
    entries = {e.field: e for e in settings_doc.entries()}
    assert set(entries) == set(ENV)
    for name, entry in entries.items():
        assert len(entry.description) >= 15, f"{ENV[name]}: describe it for an operator"
        assert "``" not in entry.description, name  # reST turned into markdown
    descriptions = [e.description for e in entries.values()]
    assert len(set(descriptions)) == len(descriptions), "two settings share one description"


def test_a_field_without_a_description_stops_the_page() -> None:
    class Undocumented(Settings):
        #: Documented.
        documented_extra: str = env("CDC_DOCUMENTED_EXTRA", "")
        bare_extra: int = env("CDC_BARE_EXTRA", 1)

    with pytest.raises(SettingsDocError, match=r"CDC_BARE_EXTRA \(Undocumented\.bare_extra\)"):
        settings_doc.entries(Undocumented)
    with pytest.raises(SettingsDocError):
        render([Undocumented])


def test_a_new_setting_is_documented_the_moment_it_exists() -> None:
    class Grown(Settings):
        #: Something a later change adds, in a group nobody planned: `|` stays in its cell.
        frobnicate_s: float = env("CDC_FROBNICATE_S", 2.5)

    page = render([Grown])
    assert "### Other settings" in page  # no group claims CDC_FROBNICATE_: listed all the same
    assert "CDC_SLOT" in page  # the inherited fields, with their own descriptions
    row = next(line for line in page.splitlines() if "CDC_FROBNICATE_S" in line)
    assert row.startswith("| `CDC_FROBNICATE_S` | `2.5` | seconds | Something a later change")
    assert "`\\|` stays" in row


def test_every_variable_lands_in_the_group_of_its_longest_prefix() -> None:
    assert settings_doc.group_of("ENGINE_STUB_PORT").title == "Engine stub"
    assert settings_doc.group_of("ENGINE_CA_FILE").title == "Engine client"
    assert settings_doc.group_of("CDC_STANDBY_SAFE_POLL_S").title == "Relay: standby-safe mode"
    assert settings_doc.group_of("CDC_AUDIT_WINDOW_S").title == "Audit"
    assert settings_doc.group_of("SOMETHING_NEW").title == "Other settings"
    grouped = {g.title for g, _ in settings_doc.grouped(settings_doc.entries())}
    assert "Other settings" not in grouped, "give today's settings a section in GROUPS"


def test_variables_read_elsewhere_are_read_where_the_page_says() -> None:
    for x in settings_doc.ELSEWHERE:
        assert x.variable not in ENV.values(), f"{x.variable} is a settings field: drop it here"
        source = (ROOT / x.read_in).read_text(encoding="utf-8")
        assert x.variable.rstrip("*") in source, f"{x.variable} is not read in {x.read_in}"
        assert x.description


def test_the_docs_page_carries_the_marker_the_hook_fills() -> None:
    page = (ROOT / "docs" / "configuration" / "index.md").read_text(encoding="utf-8")
    hook = (ROOT / "docs" / "_hooks" / "settings.py").read_text(encoding="utf-8")
    assert page.count(MARKER) == 1
    assert f'MARKER = "{MARKER}"' in hook


def test_python_dash_m_prints_the_page(capsys: pytest.CaptureFixture[str]) -> None:
    assert settings_doc.main() == 0
    assert capsys.readouterr().out == render()


def test_engine_base_url_follows_the_stub_port_unless_given() -> None:
    """``check`` and the sink find the stub of ``make run`` / the demo by ENGINE_STUB_PORT
    alone (issue 39: it probed localhost:8081); an ENGINE_BASE_URL given wins."""
    assert Settings.from_env({}).engine_base_url == "http://localhost:8081"
    stub = Settings.from_env({"ENGINE_STUB_PORT": "30181"})
    assert stub.engine_base_url == "http://127.0.0.1:30181"
    given = {"ENGINE_STUB_PORT": "30181", "ENGINE_BASE_URL": "https://engine.example"}
    assert Settings.from_env(given).engine_base_url == "https://engine.example"


@pytest.mark.parametrize(
    ("variable", "closest"),
    [
        ("SINK_MAX_INFLIGHT", "SINK_MAX_IN_FLIGHT"),
        ("CDC_SLOTT", "CDC_SLOT"),
        ("ENGINE_BASE_URI", "ENGINE_BASE_URL"),
        ("ADMIN_API_TOKN", "ADMIN_API_TOKEN"),
        ("OUTBOX_SCHEDULER_ENABLE", "OUTBOX_SCHEDULER_ENABLED"),
        ("OUTBOX_RETRY_MAX_ATTEMPT", "OUTBOX_RETRY_MAX_ATTEMPTS"),
        ("SINK_HTTP_PROT", "SINK_HTTP_PORT"),
        ("ENGINE_PORT", "ENGINE_STUB_PORT"),  # no tcp:// value: not a service link
    ],
)
def test_a_misspelt_setting_name_is_refused_naming_the_closest(variable: str, closest: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Settings.from_env({variable: "8"})
    message = str(caught.value)
    assert message.startswith(f"unknown setting {variable} (did you mean {closest}?")
    assert "\n" not in message


def test_every_name_under_a_prefix_is_refused_even_far_from_any_setting() -> None:
    with pytest.raises(ConfigError, match=r"unknown setting CDC_ENVIRONMENT \(did you mean CDC_"):
        Settings.from_env({"CDC_ENVIRONMENT": "prod"})


def test_names_that_are_not_settings_pass() -> None:
    """The librdkafka pass-through, the stack's and the tests' OUTBOX_* variables, Kafka's
    image's KAFKA_*, LOG_*, what is read elsewhere, and the variables of a Kubernetes or
    Docker service link named after a prefix (a Service `sink`, `engine`, `cdc`)."""
    env = {
        "KAFKA_CONFIG_LINGER_MS": "10",
        "KAFKA_NODE_ID": "1",
        "KAFKA_HEAP_OPTS": "-Xmx1g",
        "OUTBOX_PG_PORT": "27200",
        "OUTBOX_DEV_DIR": "/tmp/x",
        "OUTBOX_RELAY_HTTP_PORT": "9101",
        "OUTBOX_CDC_PURE_PYTHON": "1",
        "OUTBOX_EOS_KILLS": "3",
        "LOG_DIR": "/tmp",
        "CDC_SQL_DIR": "/nonexistent",
        "SINK_SERVICE_HOST": "10.0.0.7",
        "SINK_SERVICE_PORT": "9102",
        "SINK_SERVICE_PORT_HTTP": "9102",
        "SINK_PORT": "tcp://10.0.0.7:9102",
        "SINK_PORT_9102_TCP": "tcp://10.0.0.7:9102",
        "SINK_PORT_9102_TCP_PROTO": "tcp",
        "SINK_PORT_9102_TCP_PORT": "9102",
        "SINK_PORT_9102_TCP_ADDR": "10.0.0.7",
        "ENGINE_SERVICE_HOST": "10.0.0.8",
        "ENGINE_PORT": "tcp://10.0.0.8:8081",
        "CDC_NAME": "/web/cdc",
        "CDC_ENV_PGDATA": "/var/lib/postgresql",
    }
    assert Settings.from_env(env).kafka_config == {"linger.ms": "10"}


def test_names_read_elsewhere_are_the_documented_ones_under_the_prefixes() -> None:
    from cdc.settings.sources import READ_ELSEWHERE, SETTING_PREFIXES

    documented = {
        x.variable for x in settings_doc.ELSEWHERE if x.variable.startswith(SETTING_PREFIXES)
    }
    assert documented == set(READ_ELSEWHERE)


def test_an_unknown_toml_key_names_the_closest(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('slott = "x"\n')
    with pytest.raises(ConfigError, match=r"unknown setting 'slott' \(did you mean slot\?\)"):
        Settings.from_env({}, config_file=str(path))
