"""Typed settings for every process, read from the environment (12-factor).

The variable names in :data:`ENV` are the contract documented in the README;
an optional TOML file (``CDC_CONFIG_FILE``) supplies the same keys in lower
case, and the environment wins over the file. librdkafka settings pass through
from variables prefixed ``KAFKA_CONFIG_`` (``KAFKA_CONFIG_SECURITY_PROTOCOL``
becomes ``security.protocol``). Secrets are kept out of ``repr``.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from cdc.errors import ConfigError

KAFKA_CONFIG_PREFIX = "KAFKA_CONFIG_"

#: setting attribute -> environment variable
ENV: dict[str, str] = {
    "pg_dsn": "CDC_PG_DSN",
    "slot": "CDC_SLOT",
    "publication": "CDC_PUBLICATION",
    "outbox_table": "CDC_OUTBOX_TABLE",
    "topic_prefix": "CDC_TOPIC_PREFIX",
    "topic_partitions": "CDC_TOPIC_PARTITIONS",
    "topic_replication_factor": "CDC_TOPIC_REPLICATION_FACTOR",
    "dlq_topic": "CDC_DLQ_TOPIC",
    "heartbeat_interval_s": "CDC_HEARTBEAT_INTERVAL_S",
    "relay_http_port": "CDC_RELAY_HTTP_PORT",
    "relay_max_in_flight": "CDC_MAX_IN_FLIGHT",
    "http_host": "CDC_HTTP_HOST",
    "kafka_bootstrap_servers": "KAFKA_BOOTSTRAP_SERVERS",
    "sink_group_id": "SINK_GROUP_ID",
    "sink_topics_pattern": "SINK_TOPICS_PATTERN",
    "sink_max_in_flight": "SINK_MAX_IN_FLIGHT",
    "sink_http_port": "SINK_HTTP_PORT",
    "sink_backoff_max_s": "SINK_BACKOFF_MAX_S",
    "engine_base_url": "ENGINE_BASE_URL",
    "internal_api_key": "INTERNAL_API_KEY",
    "engine_connect_timeout_s": "ENGINE_CONNECT_TIMEOUT_S",
    "engine_read_timeout_s": "ENGINE_READ_TIMEOUT_S",
    "admin_api_token": "ADMIN_API_TOKEN",
    "scheduler_enabled": "OUTBOX_SCHEDULER_ENABLED",
    "scheduler_interval_s": "OUTBOX_SCHEDULER_INTERVAL_S",
    "retry_max_attempts": "OUTBOX_RETRY_MAX_ATTEMPTS",
    "retry_batch_size": "OUTBOX_RETRY_BATCH_SIZE",
    "retry_backoff_base_s": "OUTBOX_RETRY_BACKOFF_BASE_S",
    "engine_stub_port": "ENGINE_STUB_PORT",
    "backlog_max_relay_age_s": "CDC_BACKLOG_MAX_RELAY_AGE_S",
    "backlog_max_slot_lag_bytes": "CDC_BACKLOG_MAX_SLOT_LAG_BYTES",
    "backlog_group": "CDC_BACKLOG_GROUP",
    "backlog_max_group_age_s": "CDC_BACKLOG_MAX_GROUP_AGE_S",
    "backlog_cache_ttl_s": "CDC_BACKLOG_CACHE_TTL_S",
    "backlog_retry_after_s": "CDC_BACKLOG_RETRY_AFTER_S",
}

SECRET_FIELDS = frozenset({"pg_dsn", "internal_api_key", "admin_api_token"})


def redact_dsn(dsn: str) -> str:
    """The DSN with any password replaced by ``***`` (URL or key=value form)."""
    if "://" in dsn:
        parts = urlsplit(dsn)
        if parts.password is None:
            return dsn
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return " ".join(
        "password=***" if item.startswith("password=") else item for item in dsn.split()
    )


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Every knob of relay, sink, engine stub and ops CLI; see the README table."""

    pg_dsn: str = field(default="", repr=False)
    slot: str = "outbox_slot"
    publication: str = "outbox_pub"
    outbox_table: str = "outbox"
    topic_prefix: str = "outbox.event."
    topic_partitions: int = 6
    #: -1 takes the broker's default.replication.factor.
    topic_replication_factor: int = -1
    dlq_topic: str = "outbox.dlq"
    #: 0 disables; else a pg_logical_emit_message heartbeat this often.
    heartbeat_interval_s: float = 0.0
    relay_http_port: int = 9101
    #: Records handed to Kafka but not yet acknowledged before the relay stops
    #: reading WAL (back-pressure); bounds memory while Kafka is slow or away.
    relay_max_in_flight: int = 50_000
    #: Address the /metrics, /healthz, /readyz (and admin) servers bind.
    http_host: str = "127.0.0.1"
    kafka_bootstrap_servers: str = ""
    kafka_config: Mapping[str, str] = field(default_factory=dict, repr=False)
    sink_group_id: str = "engine-sync"
    sink_topics_pattern: str = ""
    sink_max_in_flight: int = 64
    sink_http_port: int = 9102
    #: Longest wait between probes of an engine that is down (jittered, growing).
    sink_backoff_max_s: float = 15.0
    engine_base_url: str = "http://localhost:8081"
    internal_api_key: str = field(default="", repr=False)
    engine_connect_timeout_s: float = 2.0
    engine_read_timeout_s: float = 3.0
    admin_api_token: str = field(default="", repr=False)
    scheduler_enabled: bool = True
    scheduler_interval_s: float = 300.0
    retry_max_attempts: int = 5
    retry_batch_size: int = 100
    retry_backoff_base_s: float = 60.0
    engine_stub_port: int = 8081
    # Backlog guard (cdc.backlog): a limit <= 0 switches that check off.
    #: Oldest committed event not yet confirmed in Kafka older than this: over.
    backlog_max_relay_age_s: float = 60.0
    #: WAL the slot holds unconfirmed above this: over (1 GiB).
    backlog_max_slot_lag_bytes: int = 1 << 30
    #: Consumer group whose oldest unprocessed record is checked too (empty: none).
    backlog_group: str = ""
    #: That group's oldest unprocessed record older than this: over.
    backlog_max_group_age_s: float = 300.0
    #: A measurement is reused this long, so a check per request stays cheap.
    backlog_cache_ttl_s: float = 1.0
    #: Seconds an over-limit answer tells the client to wait (Retry-After).
    backlog_retry_after_s: int = 5

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, *, config_file: str | None = None
    ) -> Settings:
        """Settings from a TOML file (optional) overlaid by the environment."""
        env = os.environ if env is None else env
        raw: dict[str, Any] = {}
        path = config_file or env.get("CDC_CONFIG_FILE")
        if path:
            try:
                raw.update(tomllib.loads(Path(path).read_text(encoding="utf-8")))
            except (OSError, tomllib.TOMLDecodeError) as exc:
                raise ConfigError(f"CDC_CONFIG_FILE {path}: {exc}") from exc
        for attr, var in ENV.items():
            if var in env:
                raw[attr] = env[var]
        kafka_config = {
            k[len(KAFKA_CONFIG_PREFIX) :].lower().replace("_", "."): v
            for k, v in env.items()
            if k.startswith(KAFKA_CONFIG_PREFIX)
        }
        kafka_config.update(raw.pop("kafka_config", {}) or {})
        return cls(kafka_config=kafka_config, **_coerce(raw))

    def require(self, *attrs: str) -> Settings:
        """Raise :class:`ConfigError` naming the variable of each empty setting."""
        missing = [ENV.get(a, a) for a in attrs if not getattr(self, a)]
        if missing:
            raise ConfigError(f"missing setting: {', '.join(missing)}")
        return self

    def topic_for(self, aggregate_type: str) -> str:
        """The Kafka topic of an aggregate type: prefix + aggregatetype."""
        return f"{self.topic_prefix}{aggregate_type}"

    def safe_summary(self) -> dict[str, object]:
        """Settings fit for a log line: secrets redacted, the DSN without password."""
        out: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "pg_dsn":
                value = redact_dsn(value)
            elif f.name in SECRET_FIELDS:
                value = "***" if value else ""
            elif f.name == "kafka_config":
                value = sorted(value)
            out[f.name] = value
        return out


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _coerce(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Convert raw strings to each field's type; unknown keys are an error."""
    types = {f.name: f.type for f in fields(Settings)}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in types:
            raise ConfigError(f"unknown setting {key!r}")
        kind = types[key]
        var = ENV.get(key, key)
        try:
            if kind == "bool":
                out[key] = _to_bool(value)
            elif kind == "int":
                out[key] = int(value)
            elif kind == "float":
                out[key] = float(value)
            else:
                out[key] = str(value)
        except ValueError as exc:
            raise ConfigError(f"{var}={value!r} is not a valid {kind}") from exc
    return out


def _to_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(text)
