"""Typed settings for every process, read from the environment (12-factor).

Guarantees:

* every field's environment variable is its alias (:data:`ENV` lists them);
  these names and the defaults are the contract; the `#:` comment above a field
  is its description, and the configuration page of the docs is generated from
  them (:mod:`cdc.settings.doc`): this class is the one source;
* an optional TOML file (``CDC_CONFIG_FILE``, or ``config_file=``) supplies the
  same settings under their field names (``slot = "x"``) or variable names;
  the environment wins over the file;
* librdkafka settings pass through from variables prefixed ``KAFKA_CONFIG_``
  (``KAFKA_CONFIG_SECURITY_PROTOCOL`` becomes ``security.protocol``) or a
  ``[kafka_config]`` table of the file;
* every value is validated by pydantic for its type; a bad or unknown setting (a
  misspelt variable under the project's prefixes too: :mod:`cdc.settings.sources`)
  raises :class:`cdc.errors.ConfigError` naming it (and never the value of a secret);
* beyond its type, every value is checked for what the processes need, so a
  mistake stops the start with one message instead of failing later
  (:mod:`cdc.settings.values`): numbers are never negative and some never 0,
  ports are 1..65535, URLs have a scheme and a host, ``LOG_LEVEL`` /
  ``LOG_FORMAT`` are known names, and the ``KAFKA_CONFIG_*`` settings pass
  librdkafka's own validation (a throwaway producer and consumer); their values
  are never shown (a SASL password);
* secrets (the DSN, ``INTERNAL_API_KEY``, ``ADMIN_API_TOKEN``, proxy URLs that
  may carry credentials) are :class:`pydantic.SecretStr`: ``repr``, ``str``
  and :meth:`Settings.safe_summary` never show them; code that needs the value
  asks for it with ``.get_secret_value()``;
* :func:`~cdc.settings.values.redact_dsn` hides the password of a DSN in any
  form libpq accepts (URL, ``?password=``, key=value with spaces or quotes) by
  parsing it with psycopg's own conninfo parser.

``Settings(...)`` is exactly its arguments over the defaults (tests build it
that way); :meth:`Settings.from_env` reads the environment and the file.

Adding a setting is one line: ``name: type = env("VARIABLE", default)`` in
:class:`Settings` (a ``SecretStr`` type for a secret), under a ``#:`` comment
that describes it for an operator (what it does, its unit, what 0 or empty
means): the configuration page shows it, and a test refuses a field without one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Literal

from pydantic import (
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from cdc.errors import ConfigError
from cdc.settings.checkpoint_names import default_checkpoint_topic
from cdc.settings.sources import (
    CONFIG_FILE_VAR,
    EnvSource,
    TomlSource,
    unknown_key,
    unknown_variables,
)
from cdc.settings.values import (
    REDACTED,
    URL_SCHEMES,
    check_kafka_config,
    check_number,
    check_url,
    parse_dsn,
    redact_dsn,
    redact_url,
)


class LogLevel(StrEnum):
    """``LOG_LEVEL``: Python's level names (any case)."""

    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"
    CRITICAL = "CRITICAL"


class LogFormat(StrEnum):
    """``LOG_FORMAT``: one line of text, or one JSON object, per record."""

    TEXT = "text"
    JSON = "json"


def env(variable: str, default: Any) -> Any:
    """A field read from environment variable ``variable`` (its alias), with a default."""
    return Field(default, alias=variable)


class Settings(BaseSettings):
    """Every knob of relay, sink, engine stub and ops CLI; see docs/configuration.md."""

    model_config = SettingsConfigDict(
        frozen=True,
        extra="forbid",
        populate_by_name=True,
        case_sensitive=True,
        hide_input_in_errors=True,
    )

    #: PostgreSQL connection string of the application database (libpq URL or key=value; required
    #: by every process): the relay opens its replication connection from it. A secret: logged
    #: with `password=***`. TLS: `sslmode`, `sslrootcert`, `sslcert`, `sslkey` go here.
    pg_dsn: SecretStr = env("CDC_PG_DSN", SecretStr(""))
    #: The relay's logical replication slot.
    slot: str = env("CDC_SLOT", "outbox_slot")
    #: The publication the relay streams (created with the outbox by `migrate`; created by the
    #: relay when missing).
    publication: str = env("CDC_PUBLICATION", "outbox_pub")
    #: The outbox table, `table` (resolved by the relay role's `search_path` at start) or
    #: `schema.table`. The relay refuses to start when it lacks a required column or when an
    #: existing `CDC_PUBLICATION` does not publish its inserts with every routed column and no
    #: row filter.
    outbox_table: str = env("CDC_OUTBOX_TABLE", "outbox")
    #: Topic of an event = this prefix + its aggregatetype.
    topic_prefix: str = env("CDC_TOPIC_PREFIX", "outbox.event.")
    #: Partitions of the topics the relay creates (choose up front: adding partitions later
    #: moves keys).
    topic_partitions: int = env("CDC_TOPIC_PARTITIONS", 6)
    #: Replicas of the topics the relay creates; -1 takes the broker's
    #: `default.replication.factor` (use 3 with `min.insync.replicas=2` in production).
    topic_replication_factor: int = env("CDC_TOPIC_REPLICATION_FACTOR", -1)
    #: The dead-letter topic: events that cannot become a record (too large, not JSON, an
    #: invalid topic name), with `dlq.reason`.
    dlq_topic: str = env("CDC_DLQ_TOPIC", "outbox.dlq")
    #: More than 0: the relay emits a heartbeat logical message (`pg_logical_emit_message`)
    #: this often; 0 disables it.
    heartbeat_interval_s: float = env("CDC_HEARTBEAT_INTERVAL_S", 0.0)
    #: Port of the relay's `/metrics`, `/healthz`, `/readyz` and `/backlog`.
    relay_http_port: int = env("CDC_RELAY_HTTP_PORT", 9101)
    # Slot gaps (cdc.relay.gaps.gap): a lost, dropped or failed-over slot.
    #: What a slot gap does: `auto` recovers it from the outbox table at once; `manual` waits
    #: for `outbox-cdc slot recover --execute`.
    gap_recovery: Literal["auto", "manual"] = env("CDC_GAP_RECOVERY", "auto")
    #: A recovery re-reads rows created this long before the last record in Kafka
    #: (`created_at` is the transaction's start: covers transactions open this long).
    gap_margin_s: float = env("CDC_GAP_MARGIN_S", 300.0)
    #: `prune` never deletes rows younger than this: the window a recovery can reach.
    recovery_horizon_s: float = env("CDC_RECOVERY_HORIZON_S", 86_400.0)
    #: `false`: events are not kept in the table (`delete_after=True` writes, `emit_event`),
    #: so a gap cannot be recovered and waits for `outbox-cdc slot accept-gap`.
    outbox_keeps_rows: bool = env("CDC_OUTBOX_KEEPS_ROWS", True)
    #: `true`: `CDC_PUBLICATION` publishes one share of the outbox through a row filter on
    #: purpose (sharding across relays); a gap recovery then re-publishes only that share.
    #: `false`: a row filter is refused at start.
    publication_filtered: bool = env("CDC_PUBLICATION_FILTERED", False)
    #: Records read first from the end of each partition of the relay's topics to find
    #: its newest record (only records whose `origin` names this relay count).
    gap_tail_records: int = env("CDC_GAP_TAIL_RECORDS", 20)
    #: A partition whose tail holds none of the relay's records is read 8 times deeper
    #: per round, up to this many records; with none of its records found and more
    #: before them, the start stops with an error naming this setting.
    gap_tail_max_records: int = env("CDC_GAP_TAIL_MAX_RECORDS", 100_000)
    #: A first start (no slot, no slot history, no record of this relay in Kafka) on an
    #: outbox table that holds rows: `refuse` (wait for `outbox-cdc slot init --from now`
    #: or `--from table`), `now` (create the slot: the rows already there are not
    #: published) or `table` (publish the table's rows, marked `recovered`, then stream).
    slot_init: Literal["refuse", "now", "table"] = env("CDC_SLOT_INIT", "refuse")
    #: Every start checks the outbox rows committed since the relay's last record in
    #: Kafka against the records there and re-publishes the missing ones; a window of
    #: more rows than this is skipped with a warning (`outbox-cdc audit` covers it).
    start_verify_max_rows: int = env("CDC_START_VERIFY_MAX_ROWS", 1_000_000)
    #: Records handed to Kafka but not yet acknowledged before the relay stops
    #: reading WAL (back-pressure); bounds memory while Kafka is slow or away
    #: (~1.5 KB a record over ~75 MB: 20,000 keeps the relay near 100 MB).
    relay_max_in_flight: int = env("CDC_MAX_IN_FLIGHT", 20_000)
    # Exactly-once publishing (cdc.relay.delivery.exactly_once).
    #: `at-least-once`: after a relay crash the transactions since the slot's confirmed LSN
    #: are published again (consumers deduplicate by the `id` header). `exactly-once`: the
    #: relay publishes in Kafka transactions that also carry a checkpoint of its WAL
    #: position; a consumer reading with `isolation.level=read_committed` sees every event
    #: once, through relay crashes, broker restarts and a takeover (a second relay fences
    #: the first).
    delivery: Literal["at-least-once", "exactly-once"] = env("CDC_DELIVERY", "at-least-once")
    #: Table-less events (logical messages: `emit_event`, `pg_logical_emit_message(true,
    #: 'outbox', ...)`). `off`: the relay does not decode them at all. `on`: they are
    #: published like rows, and any slot loss holds the gap open (`/readyz` 503) until
    #: `outbox-cdc slot accept-gap`: the outbox table cannot give messages back.
    messages: Literal["off", "on"] = env("CDC_MESSAGES", "off")
    #: Exactly-once: the producer's `transactional.id`; empty: `outbox-cdc.<system
    #: identifier>.<slot>`, the same for every relay of that slot (so the one that takes
    #: the slot over fences the one before it). Set it only to keep an id across a move.
    transactional_id: str = env("CDC_TRANSACTIONAL_ID", "")
    #: Exactly-once: the compacted topic of the relay's checkpoints (the commit end-LSN of
    #: the last WAL transaction in each Kafka transaction, keyed by the relay's `origin`);
    #: empty: one topic per relay (per slot): `__outbox_cdc_checkpoints.` + the topic
    #: prefix without its trailing dots + `.` + `CDC_SLOT`
    #: (`__outbox_cdc_checkpoints.outbox.event.outbox_slot`), so no other relay's open
    #: transaction can hide this relay's checkpoints (sharded relays share a prefix). It
    #: never starts with `CDC_TOPIC_PREFIX`, so the sink's subscription never takes it for
    #: an outbox topic. Set it only to a topic no other relay writes. The relay's readers
    #: (the audit, the start-up check, gap recovery) and the sink pass this topic by
    #: even when a name of your own falls under the prefix.
    checkpoint_topic: str = env("CDC_CHECKPOINT_TOPIC", "")
    #: Exactly-once: a Kafka transaction is committed once it holds this many records (the
    #: stream never splits a WAL transaction: a larger one makes one larger Kafka
    #: transaction). The bound that ends a transaction while the relay drains a backlog (it
    #: then waits no longer than 1 s for it): 5,000 records make a commit a few per cent of
    #: the drain's time. Gap recovery, the start-up check and the audit's repair have a
    #: bound of their own (`CDC_REPUBLISH_TX_MAX_RECORDS`).
    tx_max_records: int = env("CDC_TX_MAX_RECORDS", 5_000)
    #: Exactly-once: a Kafka transaction of gap recovery, the start-up check or the audit's
    #: repair is committed once it holds this many records or has been open a quarter of
    #: `CDC_TX_TIMEOUT_MS`, whichever comes first (inside a WAL transaction's rows if need
    #: be: a row is known by its id). Its records are old, so no consumer waits on this bound
    #: as on the stream's; what it bounds is how long a partition's last stable offset is
    #: held (about half a second at the default) and how many ids a redo reads again. At
    #: 10,000,000 rows, 50,000 made the repair 15% faster than 5,000 (each commit costs the
    #: reading a pause).
    republish_tx_max_records: int = env("CDC_REPUBLISH_TX_MAX_RECORDS", 50_000)
    #: Exactly-once: a caught-up relay commits a Kafka transaction once it is this old
    #: (and its last WAL transaction has ended): the most a read_committed consumer waits
    #: for a record on top of the commit's round trips and the usual latency. Lower is
    #: sooner but more commits, each a round trip to the transaction coordinator and
    #: markers in every partition it wrote to (the reading goes on meanwhile, into a
    #: bounded buffer) (20: at most a fifth of the 100 ms latency goal, and about
    #: 50 commits/s at a steady rate). While the relay reads a backlog the transaction
    #: grows to `CDC_TX_MAX_RECORDS` or 1 s instead: its events are older than this anyway.
    tx_max_ms: int = env("CDC_TX_MAX_MS", 20)
    #: Exactly-once: the producer's `transaction.timeout.ms` (the broker aborts a
    #: transaction open longer). The relay aborts one itself 10 s (its commit budget)
    #: before: the longest a single WAL transaction may take to read and publish.
    tx_timeout_ms: int = env("CDC_TX_TIMEOUT_MS", 60_000)
    #: No message from the server (keepalives included) for this long while the relay
    #: reads: the relay looks at its walsender (pg_stat_activity, pg_stat_replication) and
    #: reopens the connection only when the path is dead; a walsender busy decoding a large
    #: transaction is left alone (cdc.relay.health.silence).
    replication_silence_s: float = env("CDC_REPLICATION_SILENCE_S", 35.0)
    #: Records in flight (or dead letters pending) and none acknowledged for this
    #: long: the relay reports itself stalled (`/readyz` 503 `stalled: ...`,
    #: `outbox_relay_stalled` 1).
    relay_stall_after_s: float = env("CDC_RELAY_STALL_AFTER_S", 60.0)
    #: Address the HTTP endpoints (`/metrics`, `/healthz`, `/readyz`, admin API) bind;
    #: `0.0.0.0` in containers.
    http_host: str = env("CDC_HTTP_HOST", "127.0.0.1")
    # Standby-safe mode (cdc.relay.standby.safe): empty = off.
    #: Standby-safe mode, empty = off: a physical standby (its `application_name` or its
    #: physical slot); a transaction is published only once that standby has flushed its
    #: commit (no phantoms after a failover).
    standby_safe: str = env("CDC_STANDBY_SAFE", "")
    #: Standby-safe: how often the standby's flushed position is read while transactions
    #: are held.
    standby_safe_poll_s: float = env("CDC_STANDBY_SAFE_POLL_S", 0.005)
    #: Standby-safe: a transaction held longer makes the relay `held` (`/readyz` 503 naming
    #: the standby; no WAL read) until the standby catches up.
    standby_safe_max_wait_s: float = env("CDC_STANDBY_SAFE_MAX_WAIT_S", 30.0)
    #: Whether the relay's slot is a failover slot (PostgreSQL 17+: the server synchronizes
    #: it to a standby set up for it, so a failover keeps the slot and needs no gap
    #: recovery). auto: on 17+, off before; on: required (a server before 17 stops the
    #: start with one error); off: never. The slot is created this way, re-created this way
    #: after a gap, and an existing slot is altered to match at the relay's start.
    failover_slot: Literal["auto", "on", "off"] = env("CDC_FAILOVER_SLOT", "auto")
    #: Deprecated (the server's guard is now used whenever it can be): standby-safe mode
    #: lets the server guard (PostgreSQL 17+) as soon as the slot is a failover slot and
    #: the standby's physical slot is in the primary's synchronized_standby_slots. true
    #: with CDC_FAILOVER_SLOT=off is refused; otherwise it changes nothing.
    standby_safe_failover_slots: bool = env("CDC_STANDBY_SAFE_FAILOVER_SLOTS", False)
    #: Kafka bootstrap servers, `host:port[,host:port...]` (required by every process).
    kafka_bootstrap_servers: str = env("KAFKA_BOOTSTRAP_SERVERS", "")
    #: librdkafka settings from KAFKA_CONFIG_* (no variable of its own).
    kafka_config: dict[str, str] = Field(default_factory=dict, repr=False)
    #: The sink's consumer group.
    sink_group_id: str = env("SINK_GROUP_ID", "engine-sync")
    #: The sink's subscription: a regex starting with `^` (librdkafka's rule), e.g.
    #: `^outbox\.event\.user$`; empty: every topic of `CDC_TOPIC_PREFIX`.
    sink_topics_pattern: str = env("SINK_TOPICS_PATTERN", "")
    #: A group with no offset on topics another group consumed (a misspelt SINK_GROUP_ID):
    #: `earliest` (every record still there), `latest` (only records from now); empty: refused.
    sink_new_group_start: Literal["", "earliest", "latest"] = env("SINK_NEW_GROUP_START", "")
    #: Concurrent engine requests per sink (one per key at a time).
    sink_max_in_flight: int = env("SINK_MAX_IN_FLIGHT", 64)
    #: Port of the sink's `/metrics`, `/healthz`, `/readyz` and admin API.
    sink_http_port: int = env("SINK_HTTP_PORT", 9102)
    #: Longest wait between probes of an engine that is down (jittered, growing).
    sink_backoff_max_s: float = env("SINK_BACKOFF_MAX_S", 15.0)
    #: Attempts a record the healthy engine rejects gets inline before it is parked.
    sink_inline_attempts: int = env("SINK_INLINE_ATTEMPTS", 3)
    #: More event types routed onto the engine's calls: `Type=USER_SYNC,Other=QUIZ_SYNC`.
    sink_routes: str = env("SINK_ROUTES", "")
    #: Event types the sink skips on purpose: globs, `Type` or `topic:Type`, comma-separated.
    sink_ignored_types: str = env("SINK_IGNORED_TYPES", "")
    #: Nothing delivered, parked or committed for this long while records wait: `/readyz`
    #: 503 `stalled: ...`, `outbox_sink_stalled` 1.
    sink_stall_after_s: float = env("SINK_STALL_AFTER_S", 60.0)
    #: A SIGTERM'd sink ends within this: in-flight work gets half, then the commit; a broker
    #: not answering is given up on (the group redelivers from its last commit, loses nothing).
    sink_shutdown_s: float = env("SINK_SHUTDOWN_S", 30.0)
    #: The engine's base URL, `http://` or `https://`. Unset while `ENGINE_STUB_PORT` is set,
    #: it is the stub's: `http://127.0.0.1:<ENGINE_STUB_PORT>`.
    engine_base_url: str = env("ENGINE_BASE_URL", "http://localhost:8081")
    #: Sent to the engine as `x-api-key` (a secret).
    internal_api_key: SecretStr = env("INTERNAL_API_KEY", SecretStr(""))
    #: Engine client: connect timeout.
    engine_connect_timeout_s: float = env("ENGINE_CONNECT_TIMEOUT_S", 2.0)
    #: Engine client: read timeout (between bytes of an answer).
    engine_read_timeout_s: float = env("ENGINE_READ_TIMEOUT_S", 3.0)
    #: A whole engine request (a trickling answer) ends after this: no attempt spent.
    engine_request_deadline_s: float = env("ENGINE_REQUEST_DEADLINE_S", 10.0)
    #: PEM bundle of the CAs trusted for an `https://` engine, not the system's (a private CA).
    engine_ca_file: str = env("ENGINE_CA_FILE", "")
    #: PEM client certificate (chain) shown to the engine (mTLS), with `ENGINE_CLIENT_KEY`.
    engine_client_cert: str = env("ENGINE_CLIENT_CERT", "")
    #: The unencrypted PEM key of `ENGINE_CLIENT_CERT` (protect it with file permissions).
    engine_client_key: str = env("ENGINE_CLIENT_KEY", "")
    #: `false` skips checking the engine's certificate: logged as a warning at every start;
    #: never in production.
    engine_tls_verify: bool = env("ENGINE_TLS_VERIFY", True)
    #: An `http://[user:password@]host:port` proxy for `https://` engines (a `CONNECT`
    #: tunnel); `https_proxy` works too. A secret: it may carry credentials.
    https_proxy: SecretStr = env("HTTPS_PROXY", SecretStr(""))
    #: An `http://[user:password@]host:port` proxy for `http://` engines; `http_proxy` works
    #: too. A secret: it may carry credentials.
    http_proxy: SecretStr = env("HTTP_PROXY", SecretStr(""))
    #: Hosts that bypass the proxy: host names, domain suffixes, IPs, `host:port` or `*`,
    #: comma-separated; `no_proxy` works too.
    no_proxy: str = env("NO_PROXY", "")
    #: Bearer token the sink's admin API requires (`Authorization: Bearer <token>`); unset,
    #: the admin API answers 503. A secret.
    admin_api_token: SecretStr = env("ADMIN_API_TOKEN", SecretStr(""))
    #: Largest request body the sink's HTTP server reads (413 above it).
    admin_api_max_body_bytes: int = env("ADMIN_API_MAX_BODY_BYTES", 1_048_576)
    #: Base URL of the relay's HTTP port as the sink's console (`/console/`) reads it: its
    #: `/readyz` (state, at-least-once or exactly-once) and `/metrics` (the last periodic
    #: audit). Empty: `http://127.0.0.1:<CDC_RELAY_HTTP_PORT>`.
    console_relay_url: str = env("CONSOLE_RELAY_URL", "")
    #: The parking lot's retry scheduler on or off.
    scheduler_enabled: bool = env("OUTBOX_SCHEDULER_ENABLED", True)
    #: The scheduler's period.
    scheduler_interval_s: float = env("OUTBOX_SCHEDULER_INTERVAL_S", 300.0)
    #: Attempts before a parked record stays `FAILED` (the scheduler stops retrying it).
    retry_max_attempts: int = env("OUTBOX_RETRY_MAX_ATTEMPTS", 5)
    #: Parked rows retried per scheduler run.
    retry_batch_size: int = env("OUTBOX_RETRY_BATCH_SIZE", 100)
    #: Base of the exponential `next_retry_at`: now + base x 2^retry_count.
    retry_backoff_base_s: float = env("OUTBOX_RETRY_BACKOFF_BASE_S", 60.0)
    #: Port of `outbox-cdc engine-stub`.
    engine_stub_port: int = env("ENGINE_STUB_PORT", 8081)
    #: The stub serves HTTPS with this PEM certificate and `ENGINE_STUB_TLS_KEY`.
    engine_stub_tls_cert: str = env("ENGINE_STUB_TLS_CERT", "")
    #: The key of `ENGINE_STUB_TLS_CERT`.
    engine_stub_tls_key: str = env("ENGINE_STUB_TLS_KEY", "")
    #: The stub then requires client certificates signed by this CA (mTLS; TLS 1.2).
    engine_stub_client_ca: str = env("ENGINE_STUB_CLIENT_CA", "")
    # Backlog guard (cdc.backlog): a limit <= 0 switches that check off.
    #: Backlog guard: the oldest committed event not yet confirmed in Kafka older than this
    #: is `over` (0 = off).
    backlog_max_relay_age_s: float = env("CDC_BACKLOG_MAX_RELAY_AGE_S", 60.0)
    #: Backlog guard: unconfirmed WAL in the slot above this is `over` (1 GiB; 0 = off).
    backlog_max_slot_lag_bytes: int = env("CDC_BACKLOG_MAX_SLOT_LAG_BYTES", 1 << 30)
    #: Backlog guard: the consumer group checked when the caller names none (`/backlog`
    #: without `?group=`); empty: none.
    backlog_group: str = env("CDC_BACKLOG_GROUP", "")
    #: Backlog guard: that group's oldest unprocessed record older than this is `over`
    #: (0 = off).
    backlog_max_group_age_s: float = env("CDC_BACKLOG_MAX_GROUP_AGE_S", 300.0)
    #: Backlog guard: how long one measurement answers, so a check per request stays cheap.
    backlog_cache_ttl_s: float = env("CDC_BACKLOG_CACHE_TTL_S", 1.0)
    #: Backlog guard: the `Retry-After` of an `over` answer.
    backlog_retry_after_s: int = env("CDC_BACKLOG_RETRY_AFTER_S", 5)
    # Audit (cdc.audit): the outbox table against Kafka against the group.
    #: The active relay audits the trailing window this often (0 turns the periodic audit off).
    audit_interval_s: float = env("CDC_AUDIT_INTERVAL_S", 300.0)
    #: Width of the window each periodic audit checks, and of `outbox-cdc audit`'s default one
    #: (it never starts before the relay's first start: `slot init --from now` rows are not judged).
    audit_window_s: float = env("CDC_AUDIT_WINDOW_S", 3600.0)
    #: The window ends this long ago: events committed since are in flight, not yet judged.
    audit_settle_s: float = env("CDC_AUDIT_SETTLE_S", 60.0)
    #: on: the periodic audit republishes what it finds missing; off: it only reports.
    audit_repair: bool = env("CDC_AUDIT_REPAIR", True)

    #: How much the processes log (any case: `debug` is `DEBUG`).
    log_level: LogLevel = env("LOG_LEVEL", LogLevel.INFO)
    #: `text`, or `json` for one JSON object per line.
    log_format: LogFormat = env("LOG_FORMAT", LogFormat.TEXT)

    @model_validator(mode="before")
    @classmethod
    def _engine_url_follows_the_stub(cls, data: Any) -> Any:
        """No ENGINE_BASE_URL but an ENGINE_STUB_PORT: the engine is that stub (``check``
        and the sink then find the stub the demo or ``make run`` started)."""
        if isinstance(data, dict) and not {"ENGINE_BASE_URL", "engine_base_url"} & data.keys():
            port = data.get("ENGINE_STUB_PORT", data.get("engine_stub_port"))
            if port is not None and str(port).strip().isdigit():
                return {**data, "ENGINE_BASE_URL": f"http://127.0.0.1:{str(port).strip()}"}
        return data

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _case_insensitive(cls, value: Any, info: ValidationInfo) -> Any:
        """``debug`` is ``DEBUG``; ``JSON`` is ``json``."""
        if not isinstance(value, str):
            return value
        return value.upper() if info.field_name == "log_level" else value.lower()

    @field_validator("*")
    @classmethod
    def _numbers_in_range(cls, value: Any, info: ValidationInfo) -> Any:
        """Counts, sizes and durations are never negative (some > 0); a port is 1..65535."""
        check_number(info.field_name or "", value)
        return value

    @field_validator(*URL_SCHEMES)
    @classmethod
    def _url_has_scheme_and_host(cls, value: Any, info: ValidationInfo) -> Any:
        """``localhost:8081`` is refused: the scheme says plain HTTP or TLS."""
        text = value.get_secret_value() if isinstance(value, SecretStr) else str(value)
        check_url(info.field_name or "", text)
        return value

    @field_validator("kafka_config")
    @classmethod
    def _librdkafka_accepts(cls, value: dict[str, str]) -> dict[str, str]:
        """librdkafka itself checks every ``KAFKA_CONFIG_*`` (names and values)."""
        if value:
            check_kafka_config(value)
        return value

    @field_validator("standby_safe_failover_slots")
    @classmethod
    def _failover_slots_agree(cls, value: bool, info: ValidationInfo) -> bool:
        """The deprecated switch may not ask for what CDC_FAILOVER_SLOT=off forbids."""
        if value and info.data.get("failover_slot") == "off":
            raise ValueError(
                "asks the server to guard through a failover slot, but CDC_FAILOVER_SLOT=off:"
                " unset CDC_STANDBY_SAFE_FAILOVER_SLOTS (deprecated) or set CDC_FAILOVER_SLOT=auto"
            )
        return value

    @field_validator("sink_topics_pattern")
    @classmethod
    def _pattern_compiles(cls, value: str) -> str:
        """The subscription must be a regex (the sink and the ops commands compile it)."""
        try:
            re.compile(value.removeprefix("^"))
        except re.error as exc:
            raise ValueError(f"not a regular expression: {exc}") from None
        return value

    @field_validator("pg_dsn")
    @classmethod
    def _dsn_parses(cls, value: SecretStr) -> SecretStr:
        """libpq must parse the DSN; its error text may quote the password, so it is dropped."""
        if value.get_secret_value() and parse_dsn(value.get_secret_value()) is None:
            raise ValueError("not a connection string libpq can parse (value not shown)")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """``Settings(...)`` is its arguments only; :meth:`from_env` reads the sources."""
        return (init_settings,)

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, *, config_file: str | None = None
    ) -> Settings:
        """Settings from a TOML file (optional) overlaid by the environment."""
        environ = os.environ if env is None else env
        if unknown := unknown_variables(environ, known=_BY_VARIABLE):
            raise ConfigError("; ".join(unknown))
        path = config_file or environ.get(CONFIG_FILE_VAR)
        sources = [TomlSource(cls, path), EnvSource(cls, environ)]
        data: dict[str, Any] = {}
        kafka_config: dict[str, Any] = {}
        for source in sources:  # later sources win
            values = source()
            kafka_config.update(values.pop("kafka_config", {}) or {})
            data.update(values)
        return build(cls, kafka_config=kafka_config, **data)

    def require(self, *attrs: str) -> Settings:
        """Raise :class:`ConfigError` naming the variable of each empty setting."""
        missing = [ENV.get(a, a) for a in attrs if not getattr(self, a)]
        if missing:
            raise ConfigError(f"missing setting: {', '.join(missing)}")
        return self

    @property
    def checkpoint_topic_name(self) -> str:
        """``CDC_CHECKPOINT_TOPIC``, or this relay's (this slot's) default
        (:func:`default_checkpoint_topic`)."""
        return self.checkpoint_topic or default_checkpoint_topic(self.topic_prefix, self.slot)

    @property
    def shared_checkpoint_topic(self) -> str | None:
        """Where every relay of the prefix wrote its checkpoints before they had a topic
        each (read once, at an upgrade); None when ``CDC_CHECKPOINT_TOPIC`` is set."""
        return None if self.checkpoint_topic else default_checkpoint_topic(self.topic_prefix)

    def is_checkpoint_topic(self, name: str) -> bool:
        """A topic of the relays' checkpoints (it holds no event): ``CDC_CHECKPOINT_TOPIC``,
        or any relay's default under this prefix (every slot's, and the shared one of
        before)."""
        if self.checkpoint_topic:
            return name == self.checkpoint_topic
        shared = default_checkpoint_topic(self.topic_prefix)
        return name == shared or name.startswith(shared + ".")

    def is_outbox_topic(self, name: str) -> bool:
        """A topic of ``CDC_TOPIC_PREFIX`` that holds events: neither the dead-letter
        topic nor a checkpoint topic (whatever names they were given)."""
        return (
            name.startswith(self.topic_prefix)
            and name != self.dlq_topic
            and not self.is_checkpoint_topic(name)
        )

    def topic_for(self, aggregate_type: str) -> str:
        """The Kafka topic of an aggregate type: prefix + aggregatetype."""
        return f"{self.topic_prefix}{aggregate_type}"

    def safe_summary(self) -> dict[str, object]:
        """Settings fit for a log line: secrets redacted, the DSN without password."""
        out: dict[str, object] = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if name == "pg_dsn":
                value = redact_dsn(self.pg_dsn.get_secret_value())
            elif name in {"https_proxy", "http_proxy"}:
                value = redact_url(value.get_secret_value())
            elif isinstance(value, SecretStr):
                value = REDACTED if value.get_secret_value() else ""
            elif name == "kafka_config":
                value = sorted(value)  # names only: values may hold SASL passwords
            out[name] = value
        return out


#: setting attribute -> environment variable (every field but ``kafka_config``).
ENV: dict[str, str] = {
    name: info.alias for name, info in Settings.model_fields.items() if info.alias is not None
}
_BY_VARIABLE = {var: name for name, var in ENV.items()}
#: Settings whose value must never appear in a message.
SECRET_FIELDS = frozenset(
    name for name, info in Settings.model_fields.items() if info.annotation is SecretStr
)


def build(cls: type[Settings], **values: Any) -> Settings:
    """``cls(**values)`` with pydantic's errors turned into one :class:`ConfigError`."""
    try:
        return cls(**values)
    except ValidationError as exc:
        raise ConfigError("; ".join(_explain(error) for error in exc.errors())) from None


def _explain(error: Any) -> str:
    """One validation error as ``VARIABLE: what is wrong`` (a secret's value never shown)."""
    loc = error.get("loc") or ("?",)
    key = str(loc[0])
    if error.get("type") == "extra_forbidden":
        return unknown_key(key, [*ENV, *_BY_VARIABLE])
    name = _BY_VARIABLE.get(key, key)
    variable = ENV.get(name, key)
    where = ".".join(str(part) for part in (variable, *loc[1:]))
    msg = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    if name == "kafka_config":
        return msg  # it names the KAFKA_CONFIG_* variable; the values may be secrets
    if name in SECRET_FIELDS:
        return f"{where}: {msg}"
    return f"{where}={error.get('input')!r}: {msg}"
