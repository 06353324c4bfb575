"""Every configuration mistake of the operator's first hour: one line naming the fix, exit 2.

Each bad value goes through the real command line (``python -m cdc.cli``, as
the console script runs it) of the process it would break: the relay, the sink,
the engine stub, ``migrate`` and an ops command. Each answer is exactly one
``error:`` line on stderr, naming the variable, exit 2, no traceback, and never
the value of a secret (a typo in a ``KAFKA_CONFIG_SASL_*`` must not print the
password). Nothing here needs PostgreSQL or Kafka: the settings are refused
before anything connects.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.harness import free_port

ROOT = Path(__file__).resolve().parents[2]
SECRET = "hunter2-s3cret"
#: Settings every command needs present (nothing listens there: nothing connects).
BASE = {
    "CDC_PG_DSN": "host=127.0.0.1 port=1 dbname=nowhere",
    "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1",
}


@dataclass(frozen=True)
class Case:
    """A command, the environment that breaks it, and what its one line must say."""

    name: str
    command: tuple[str, ...]
    env: dict[str, str]
    names: str  # the variable the line must name
    hidden: tuple[str, ...] = ()  # values that must appear nowhere in the output
    expect: tuple[str, ...] = field(default=())  # more text the line must hold


CASES = [
    Case("log level", ("relay",), {"LOG_LEVEL": "LOUD"}, "LOG_LEVEL", expect=("'INFO'",)),
    Case("log format", ("sink",), {"LOG_FORMAT": "xml"}, "LOG_FORMAT", expect=("'json'",)),
    Case("port out of range", ("relay",), {"CDC_RELAY_HTTP_PORT": "99999"}, "CDC_RELAY_HTTP_PORT"),
    Case(
        "negative count",
        ("sink",),
        {"SINK_INLINE_ATTEMPTS": "-1"},
        "SINK_INLINE_ATTEMPTS",
        expect=(">= 0",),
    ),
    Case(
        "engine URL without scheme",
        ("sink",),
        {"ENGINE_BASE_URL": "localhost:8081"},
        "ENGINE_BASE_URL",
        expect=("http",),
    ),
    Case(
        "librdkafka refuses a value",
        ("relay",),
        {"KAFKA_CONFIG_SECURITY_PROTOCOL": "SASL_SSLX"},
        "KAFKA_CONFIG_SECURITY_PROTOCOL",
        hidden=("SASL_SSLX",),
    ),
    Case(
        "a typo in a SASL password variable",
        ("sink",),
        {"KAFKA_CONFIG_SASL_PASSWORDD": SECRET},
        "KAFKA_CONFIG_SASL_PASSWORDD",
        hidden=(SECRET,),
        expect=("no such setting",),
    ),
    Case(
        "a bad value beside a password",
        ("lag",),
        {
            "KAFKA_CONFIG_SASL_PASSWORD": SECRET,
            "KAFKA_CONFIG_SASL_MECHANISMS": "PLAIN",
            "KAFKA_CONFIG_SECURITY_PROTOCOL": f"SASL_{SECRET}",
        },
        "KAFKA_CONFIG_SECURITY_PROTOCOL",
        hidden=(SECRET,),
    ),
    Case(
        "proxy URL with a password and no scheme",
        ("failed", "list"),
        {"HTTPS_PROXY": f"user:{SECRET}@proxy:3128"},
        "HTTPS_PROXY",
        hidden=(SECRET,),
    ),
    Case(
        "unparseable DSN holding a password",
        ("migrate",),
        {"CDC_PG_DSN": f"host=h password='{SECRET}"},
        "CDC_PG_DSN",
        hidden=(SECRET,),
    ),
    Case(
        "partitions not a number",
        ("lag",),
        {"CDC_TOPIC_PARTITIONS": "six"},
        "CDC_TOPIC_PARTITIONS",
    ),
    Case("stub port", ("engine-stub",), {"ENGINE_STUB_PORT": "0"}, "ENGINE_STUB_PORT"),
    # A misspelt name under the project's prefixes: the closest setting named, in every
    # command that reads settings (the check's answer is its own test below).
    *(
        Case(
            f"misspelt {variable} ({' '.join(command)})",
            command,
            {variable: "8"},
            variable,
            expect=(f"did you mean {closest}?",),
        )
        for command, variable, closest in (
            (("sink",), "SINK_MAX_INFLIGHT", "SINK_MAX_IN_FLIGHT"),
            (("relay",), "CDC_SLOTT", "CDC_SLOT"),
            (("lag",), "SINK_GROUPID", "SINK_GROUP_ID"),
            (("failed", "list"), "OUTBOX_RETRY_MAX_ATTEMPT", "OUTBOX_RETRY_MAX_ATTEMPTS"),
            (("migrate",), "CDC_OUTBOX_TABEL", "CDC_OUTBOX_TABLE"),
        )
    ),
    Case(
        "subscription not a regex",
        ("sink",),
        {"SINK_TOPICS_PATTERN": "^("},
        "SINK_TOPICS_PATTERN",
        expect=("not a regular expression",),
    ),
    Case(
        "misspelt name in the stub",
        ("engine-stub",),
        {"ENGINE_STUB_PROT": "8081"},
        "ENGINE_STUB_PROT",
        expect=("did you mean ENGINE_STUB_PORT?",),
    ),
]


def _env(extra: dict[str, str]) -> dict[str, str]:
    prefixes = ("CDC_", "KAFKA_", "SINK_", "ENGINE_", "OUTBOX_", "LOG_", "ADMIN_", "INTERNAL_")
    keep = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    keep = {k: v for k, v in keep.items() if k.upper() not in {"HTTPS_PROXY", "HTTP_PROXY"}}
    return {**keep, **BASE, **extra}


def _cli(command: tuple[str, ...], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cdc.cli", *command],
        env=_env(env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
        check=False,
    )


def _assert_one_line(done: subprocess.CompletedProcess[str], case: Case) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, f"{case.name}: rc={done.returncode}\n{done.stderr}"
    assert len(lines) == 1, f"{case.name}: {done.stderr}"
    line = lines[0]
    assert line.startswith("error: "), line
    assert case.names in line, line
    assert "Traceback" not in done.stderr
    for value in case.hidden:
        assert value not in done.stderr + done.stdout, line
    for text in case.expect:
        assert text in line, line
    return line


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_bad_setting_is_one_line_naming_the_variable_exit_2(case: Case) -> None:
    _assert_one_line(_cli(case.command, case.env), case)


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port something else listens on."""
    port = free_port()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        yield port


@pytest.mark.parametrize(
    ("command", "variable"),
    [
        (("relay",), "CDC_RELAY_HTTP_PORT"),
        (("sink",), "SINK_HTTP_PORT"),
        (("engine-stub",), "ENGINE_STUB_PORT"),
    ],
)
def test_a_port_in_use_is_one_line_naming_its_setting_exit_2(
    taken_port: int, command: tuple[str, ...], variable: str
) -> None:
    case = Case(f"{variable} in use", command, {variable: str(taken_port)}, variable)
    line = _assert_one_line(_cli(command, case.env), case)
    assert f"{variable}={taken_port}: port 127.0.0.1:{taken_port} already in use" in line


def test_check_lists_a_misspelt_name_as_its_settings_finding() -> None:
    """``check`` reports every finding at once: a misspelt name fails its settings item (as a
    bad value does: exit 1, the table and one ``error: settings:`` line), never "valid"."""
    done = _cli(("check", "--json"), {"CDC_SLOTT": "foo"})
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    [finding] = [f for f in json.loads(done.stdout)["findings"] if f["item"] == "settings"]
    assert finding["status"] == "fail"
    assert finding["detail"].startswith("unknown setting CDC_SLOTT (did you mean CDC_SLOT?")
    assert done.stderr.strip().splitlines() == [f"error: settings: {finding['detail']}"]
