"""The sink's items of ``outbox-cdc check``: the engine, the parking lot, the sink's group.

Guarantees:

* the engine probe is one ``POST`` of the ``users/sync`` call with an empty
  body ``{}`` under a fresh ``Idempotency-Key``: an engine refuses it (400/422:
  no ``user_id``) and changes nothing, but only after it checked the API key;
  so a 401/403 means the key (``INTERNAL_API_KEY``) is wrong, a 4xx that is not
  means the engine is reachable over its TLS and took the key, and a transport
  or TLS failure is reported with the client's own reason (which names the
  setting to fix, e.g. ``ENGINE_CA_FILE``);
* the key is never shown;
* the parking lot probe reads whether ``failed_sync_events`` exists;
* the group probe says where the sink's group would start, and fails where the sink would
  refuse to (:mod:`sinks.ops.new_group`); it changes nothing.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

from cdc.check import Finding, Probe, fail, ok, warn
from cdc.errors import ConfigError
from cdc.settings import Settings
from cdc.settings.values import redact_url
from sinks.core.errors import EngineMisconfigured, EngineRejected, EngineUnavailable, Unroutable

# The engine client and psycopg are imported inside the probes: this module is
# imported with the CLI's plugin, and `outbox-cdc --help` stays fast.

#: The probe's idempotency keys start with this, so an engine's log shows what they were.
PROBE_KEY_PREFIX = "outbox-cdc-check-"


def engine(settings: Settings) -> Iterator[Finding]:
    """The engine reachable (TLS included) and the API key accepted."""
    item = "engine"
    where = redact_url(settings.engine_base_url)
    if not settings.internal_api_key.get_secret_value():
        yield warn("INTERNAL_API_KEY", "not set: requests go without x-api-key")
    try:
        outcome = asyncio.run(_probe(settings))
    except ConfigError as exc:
        yield fail(item, str(exc))
        return
    except EngineMisconfigured as exc:
        yield fail(item, f"{where}: {exc.reason}")
        return
    except EngineUnavailable as exc:
        yield fail(item, f"{where} unreachable: {exc.reason}; check ENGINE_BASE_URL")
        return
    yield ok(item, f"{where} reachable, API key accepted ({outcome})")


async def _probe(settings: Settings) -> str:
    from sinks.engine.client import EngineClient
    from sinks.shared.routes import USERS_SYNC_PATH, EngineCall, SyncType

    call = EngineCall(path=USERS_SYNC_PATH, body={}, sync_type=SyncType.USER_SYNC)
    async with EngineClient.from_settings(settings) as client:
        try:
            await client.send(call, event_id=f"{PROBE_KEY_PREFIX}{uuid.uuid4()}")
        except (EngineRejected, Unroutable) as exc:
            return f"the empty probe was refused as expected: {exc.reason}"
    return "the empty probe was accepted"


def parking_lot(settings: Settings) -> Iterator[Finding]:
    """``failed_sync_events`` exists (``outbox-cdc migrate`` creates it)."""
    import psycopg

    if not settings.pg_dsn.get_secret_value():
        return  # the kernel's postgresql item already says CDC_PG_DSN is missing
    try:
        with psycopg.connect(
            settings.pg_dsn.get_secret_value(), autocommit=True, connect_timeout=5
        ) as conn:
            row = conn.execute("SELECT to_regclass('failed_sync_events') IS NOT NULL").fetchone()
    except psycopg.OperationalError:
        return  # unreachable: the kernel's postgresql item says so
    if row and row[0]:
        yield ok("parking lot", "failed_sync_events exists")
    else:
        yield fail("parking lot", "failed_sync_events does not exist: run `outbox-cdc migrate`")
    if not settings.admin_api_token.get_secret_value():
        yield warn("ADMIN_API_TOKEN", "not set: the sink's admin API answers 503")


def sink_group(settings: Settings) -> Iterator[Finding]:
    """Where the sink's group would start (:mod:`sinks.ops.new_group`): a start the sink
    would refuse - a group without offsets beside one that consumed its topics, nothing
    chosen - fails here first when ``SINK_GROUP_ID`` names the group (a warning for the
    default group: the shell may run no sink). Read-only; Kafka unreachable is the
    kernel's kafka item."""
    from sinks.ops.errors import KafkaOpsError
    from sinks.ops.new_group import Start, preview

    if not settings.kafka_bootstrap_servers:
        return  # the kernel's kafka item says KAFKA_BOOTSTRAP_SERVERS is missing
    try:
        start, said = preview(settings)
    except KafkaOpsError:
        return
    if start is not Start.REFUSE:
        yield ok("sink group", said)
    elif "sink_group_id" in settings.model_fields_set:
        yield fail("sink group", said)
    else:  # the default group: this shell may run no sink at all (a relay's, an operator's)
        yield warn("sink group", f"{said} (SINK_GROUP_ID is not set: a sink here would use it)")


#: What the sink adds to ``outbox-cdc check`` (through :data:`sinks.cli.PLUGIN`).
PROBES: tuple[tuple[str, Probe], ...] = (
    ("engine", engine),
    ("parking lot", parking_lot),
    ("sink group", sink_group),
)
