"""A setting's value beyond its type: checked for what the processes need, never shown if secret.

The settings class (:mod:`cdc.settings`: its fields, its sources, ``build``) calls
these; nothing here reads the environment or a file, or touches the network.

Guarantees:

* :func:`check_number`: numbers are never negative (:data:`NEGATIVE_ALLOWED`
  excepted) and some never 0 (:data:`POSITIVE`); ports are 1..65535;
* :func:`check_url`: URL settings (:data:`URL_SCHEMES`) have a scheme they take
  and a host;
* :func:`check_kafka_config` has librdkafka validate the ``KAFKA_CONFIG_*``
  settings (a throwaway producer and consumer that never connect) and names the
  variable it refuses, never its value (a SASL password): the message is rebuilt
  from the property's name, and every configured value is cut from a message
  that names none;
* :func:`redact_dsn` hides the password (and the client key's passphrase,
  :data:`DSN_SECRET_KEYS`) of a DSN in any form libpq accepts (URL,
  ``?password=``, key=value with spaces or quotes) by parsing it with psycopg's
  own conninfo parser (:func:`parse_dsn`); a DSN libpq cannot parse is not echoed;
* :func:`redact_url` hides the secret of a URL's userinfo (a proxy's password, or
  an API key given as the user).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

#: The variables whose settings pass through to librdkafka (read by :mod:`cdc.settings`).
KAFKA_CONFIG_PREFIX = "KAFKA_CONFIG_"
#: conninfo keywords whose value is a secret (libpq's ``password`` and the
#: passphrase of an encrypted client key).
DSN_SECRET_KEYS = frozenset({"password", "sslpassword"})
REDACTED = "***"
_PROPERTY_RE = re.compile(r'property:? "?([A-Za-z0-9._-]+)"?')

#: Numeric settings that may be negative, and what a negative value means.
NEGATIVE_ALLOWED = frozenset({"topic_replication_factor"})  # -1: the broker's default
#: Numeric settings that must be above 0 (0 would stall or divide: no partitions, no
#: request in flight, a zero timeout, a scheduler spinning).
POSITIVE = frozenset(
    {
        "topic_partitions",
        "relay_max_in_flight",
        "sink_max_in_flight",
        "retry_batch_size",
        "admin_api_max_body_bytes",
        "engine_connect_timeout_s",
        "engine_read_timeout_s",
        "scheduler_interval_s",
        "gap_tail_records",
        "gap_tail_max_records",
        "audit_window_s",
        "tx_max_records",
        "republish_tx_max_records",
        "tx_max_ms",
        "tx_timeout_ms",
    }
)
#: Highest TCP port number.
MAX_PORT = 65535
#: URL settings: attribute -> the schemes it takes.
URL_SCHEMES = {
    "engine_base_url": ("http", "https"),
    "https_proxy": ("http",),
    "http_proxy": ("http",),
    "console_relay_url": ("http", "https"),
}
#: The example a refused URL setting's message gives, where the default one would mislead.
URL_EXAMPLES = {"console_relay_url": "http://relay-host:9101"}


def check_number(name: str, value: Any) -> None:
    """Raise ``ValueError`` when the number of setting ``name`` is out of its range:
    counts, sizes and durations are never negative (some > 0); a port is 1..65535."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    if name.endswith("_port") and not 1 <= value <= MAX_PORT:
        raise ValueError(f"expected a TCP port, 1..{MAX_PORT}")
    if value <= 0 and name in POSITIVE:
        raise ValueError("expected a number > 0")
    if value < 0 and name not in NEGATIVE_ALLOWED:
        raise ValueError("expected a number >= 0")


def check_url(name: str, text: str) -> None:
    """Raise ``ValueError`` unless ``text`` (empty: unset) is a URL of a scheme setting
    ``name`` takes, with a host: ``localhost:8081`` is refused (the scheme says plain
    HTTP or TLS)."""
    if not text:
        return
    schemes = URL_SCHEMES[name]
    try:
        parts = urlsplit(text)
        ok = parts.scheme in schemes and bool(parts.hostname)
        parts.port  # noqa: B018 - raises ValueError on a port out of range
    except ValueError:
        ok = False
    if not ok:
        example = URL_EXAMPLES.get(name) or (
            "http://host:port" if schemes == ("http",) else "https://engine.example"
        )
        raise ValueError(f"expected an {' or '.join(schemes)} URL with a host, e.g. {example}")


class _Silent(logging.Logger):
    """A logger that drops everything: librdkafka's start-up notes while checking a config."""

    def __init__(self) -> None:
        super().__init__("kafka.config-check", logging.CRITICAL + 1)


def check_kafka_config(config: Mapping[str, str]) -> None:
    """Raise ``ValueError`` naming the ``KAFKA_CONFIG_*`` variable librdkafka refuses.

    Builds a throwaway producer (with the relay's own defaults under the
    settings, as the relay will) and consumer; neither connects (no bootstrap
    servers), so librdkafka validates names and values as it will at start.
    Its message quotes the value, which may be a password: the message is
    rebuilt from the property's name only.
    """
    from confluent_kafka import Consumer, KafkaException, Producer  # noqa: PLC0415 - heavy

    from cdc.kafka.producer import producer_config  # noqa: PLC0415 - heavy (confluent_kafka)

    as_relay: dict[str, Any] = producer_config("", config)  # the relay's defaults under it
    as_consumer: dict[str, Any] = {**config, "group.id": "outbox-cdc-config-check"}
    for client, conf in ((Producer, as_relay), (Consumer, as_consumer)):
        try:
            client({**conf, "logger": _Silent()})
        except (KafkaException, ValueError, TypeError) as exc:
            raise ValueError(_kafka_config_problem(str(exc), config)) from None


def _kafka_config_problem(message: str, config: Mapping[str, str]) -> str:
    """librdkafka's refusal as ``KAFKA_CONFIG_NAME: what`` without any configured value."""
    match = _PROPERTY_RE.search(message)
    if match is None:  # e.g. "No provider for SASL mechanism GSSAPI": no property named
        detail = message.split('str="', 1)[-1].rstrip('"})')
        for value in sorted(config.values(), key=len, reverse=True):
            if value:
                detail = detail.replace(value, REDACTED)
        return f"{KAFKA_CONFIG_PREFIX}*: librdkafka refuses the configuration: {detail}"
    prop = match.group(1)
    variable = KAFKA_CONFIG_PREFIX + prop.upper().replace(".", "_")
    if prop not in config or "no such configuration property" in message.lower():
        return f"{variable}: librdkafka has no such setting (see its CONFIGURATION.md)"
    return f"{variable}: librdkafka refuses this value (value not shown; see its CONFIGURATION.md)"


def redact_dsn(dsn: str) -> str:
    """The DSN as ``key=value`` pairs with any password replaced by ``***``.

    Parsed by libpq (psycopg's ``conninfo_to_dict``), so every form libpq
    accepts is covered: ``postgresql://u:pw@h/db``, ``...?password=pw``,
    ``password = pw``, ``password='p w'``. A DSN libpq cannot parse is not
    echoed at all (its text may hold the password).
    """
    if not dsn:
        return ""
    params = parse_dsn(dsn)
    if params is None:
        return "<unparseable DSN>"
    for key in DSN_SECRET_KEYS & params.keys():
        params[key] = REDACTED
    from psycopg.conninfo import make_conninfo  # noqa: PLC0415 - see parse_dsn

    return make_conninfo("", **params)


def parse_dsn(dsn: str) -> dict[str, Any] | None:
    """libpq's reading of ``dsn`` (``None`` when it cannot parse it).

    psycopg is imported here, not at the top: it costs a CLI start-up a
    noticeable part of a second that commands without a database need not pay.
    """
    import psycopg  # noqa: PLC0415 - deferred, see the docstring

    try:
        return psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.Error:
        return None


def redact_url(url: str) -> str:
    """``url`` with the secret of its userinfo replaced by ``***`` (proxy URLs).

    ``user:password@`` keeps the user and hides the password; a userinfo with no
    password (``KEY@proxy``: some proxy services take an API key as the user) is
    hidden whole.
    """
    if not url:
        return ""
    try:
        parts = urlsplit(url)
        username, password = parts.username, parts.password
    except ValueError:
        return "<unparseable URL>"
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rpartition("@")[2]
    if password is not None:
        userinfo = f"{username or ''}:{REDACTED}"
    elif username:
        userinfo = REDACTED
    else:
        return url
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{host}"))
