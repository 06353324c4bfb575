"""The configuration reference, rendered from the settings class: one source.

``python -m cdc.settings.doc`` prints it as markdown; the docs site puts the same
text into ``docs/configuration/index.md`` at build time (``docs/_hooks/settings.py``,
an MkDocs hook), so the page is never edited by hand and never stale.

Guarantees:

* every field of :class:`cdc.settings.Settings` that has an environment variable
  is listed, once, with its default as an operator writes it (``true``, ``300``,
  empty), its kind (text, seconds, a port, a secret, the allowed values) and its
  description;
* the description is the ``#:`` comment above the field in the class's source
  (or the field's ``description=``): the class is the only place a setting is
  described. A field without one raises :class:`SettingsDocError`, and so the
  docs build and the unit tests fail, naming it;
* fields are grouped by their variable's prefix (:data:`GROUPS`, the longest
  prefix wins); a variable no group claims is still listed, under "Other
  settings", so a new setting is documented the moment it exists;
* variables read outside the class (:data:`ELSEWHERE`) are listed with the file
  that reads them; a unit test holds each to that file.

Nothing here touches the network or a service: rendering imports the settings
module and reads its source.
"""

from __future__ import annotations

import ast
import enum
import inspect
import re
import sys
import textwrap
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, SecretStr

from cdc.settings import Settings


class SettingsDocError(Exception):
    """The settings class cannot be documented as it stands (a field lacks a description)."""


@dataclass(frozen=True)
class Group:
    """A section of the reference: the variables whose name starts with one of ``prefixes``."""

    title: str
    prefixes: tuple[str, ...]
    intro: str


#: The sections, in page order. Links are relative to docs/configuration/index.md.
GROUPS: tuple[Group, ...] = (
    Group(
        "Connections",
        ("CDC_PG_DSN", "KAFKA_BOOTSTRAP_SERVERS", "CDC_HTTP_HOST"),
        "Where PostgreSQL and Kafka are, and where the processes' HTTP endpoints listen. "
        "TLS for both: [TLS](tls.md).",
    ),
    Group(
        "Relay: outbox, publication and slot",
        (
            "CDC_SLOT",
            "CDC_PUBLICATION",
            "CDC_OUTBOX_TABLE",
            "CDC_HEARTBEAT_INTERVAL_S",
            "CDC_FAILOVER_",
        ),
        "What the relay reads, and how ([The relay](../relay/index.md)).",
    ),
    Group(
        "Relay: topics",
        ("CDC_TOPIC_", "CDC_DLQ_"),
        "The topics the relay writes and creates "
        "([The record contract](../record-contract.md), [Scaling](../relay/scaling.md)).",
    ),
    Group(
        "Relay: exactly-once delivery",
        (
            "CDC_DELIVERY",
            "CDC_TRANSACTIONAL_ID",
            "CDC_CHECKPOINT_TOPIC",
            "CDC_TX_",
            "CDC_REPUBLISH_TX_",
        ),
        "Kafka transactions that carry the relay's checkpoint: every event once to a consumer"
        " reading with `isolation.level=read_committed` ([Exactly-once delivery]"
        "(../relay/exactly-once.md)).",
    ),
    Group(
        "Relay: flow and health",
        ("CDC_MAX_IN_FLIGHT", "CDC_REPLICATION_", "CDC_RELAY_"),
        "Back-pressure, a silent replication connection, a stall ([The relay](../relay/index.md)).",
    ),
    Group(
        "Relay: slot gaps and recovery",
        (
            "CDC_GAP_",
            "CDC_RECOVERY_",
            "CDC_OUTBOX_KEEPS_ROWS",
            "CDC_MESSAGES",
            "CDC_SLOT_INIT",
            "CDC_START_VERIFY_",
        ),
        "A lost, dropped, replaced or failed-over slot, a first start, the start-up check"
        " ([When the slot is lost](../relay/slot-gaps.md)).",
    ),
    Group(
        "Relay: standby-safe mode",
        ("CDC_STANDBY_SAFE",),
        "No phantoms after a failover ([Standby-safe mode](../relay/standby-safe.md)).",
    ),
    Group(
        "Audit",
        ("CDC_AUDIT_",),
        "The outbox table against Kafka against the group ([Audit](../operations/audit.md)).",
    ),
    Group(
        "Backlog guard",
        ("CDC_BACKLOG_",),
        "Refusing work the pipeline cannot drain ([Backlog guard](../relay/backlog-guard.md)); "
        "a limit of 0 switches that check off.",
    ),
    Group(
        "Sink",
        ("SINK_",),
        "The consumer group that delivers to the engine ([The sink](../sink/index.md)).",
    ),
    Group(
        "Engine client",
        ("ENGINE_", "HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY", "INTERNAL_API_KEY"),
        "How the sink reaches the engine: timeouts, TLS, proxies "
        "([The engine](../sink/engine.md)).",
    ),
    Group(
        "Parking lot and admin API",
        ("OUTBOX_SCHEDULER_", "OUTBOX_RETRY_", "ADMIN_API_", "CONSOLE_"),
        "Events the healthy engine rejected, and their retries "
        "([Parking lot](../sink/parking.md)).",
    ),
    Group(
        "Engine stub",
        ("ENGINE_STUB_",),
        "The engine's stand-in used by the demo, compose and the tests "
        "([Engine stub](../sink/engine.md#engine-stub)).",
    ),
    Group(
        "Logging",
        ("LOG_",),
        "Every process and command ([Logs](../observability/logs.md)).",
    ),
)
OTHER = Group("Other settings", (), "Settings no section above claims yet.")


@dataclass(frozen=True)
class Elsewhere:
    """A variable read outside the settings class: its name, default, meaning, and reader."""

    variable: str
    default: str
    description: str
    #: The file (from the repository's root) that reads it; a test checks it does.
    read_in: str


#: Variables the processes read outside :class:`Settings`.
ELSEWHERE: tuple[Elsewhere, ...] = (
    Elsewhere(
        "KAFKA_CONFIG_*",
        "",
        "librdkafka settings passed through to every Kafka client: "
        "`KAFKA_CONFIG_SECURITY_PROTOCOL=SASL_SSL` becomes `security.protocol`; "
        "`KAFKA_CONFIG_PARTITIONER` changes the relay's `murmur2_random` (Java-compatible) "
        "partitioning. Checked by librdkafka at start; values are never shown (secrets).",
        "cdc/settings/sources.py",
    ),
    Elsewhere(
        "CDC_CONFIG_FILE",
        "",
        "A TOML file with the same settings (see above); the environment wins.",
        "cdc/settings/sources.py",
    ),
    Elsewhere(
        "CDC_SQL_DIR",
        "the wheel's (or the checkout's) `sql/`",
        "Where `outbox-cdc migrate` reads its `NNN_*.sql` files (and `demo/`).",
        "cdc/migrate.py",
    ),
    Elsewhere(
        "OTEL_TRACES_EXPORTER",
        "",
        "`otlp` or `console` turns OpenTelemetry spans on "
        "([Tracing](../observability/tracing.md)).",
        "cdc/tracing.py",
    ),
    Elsewhere(
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "",
        "An OTLP endpoint turns spans on too (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` as well).",
        "cdc/tracing.py",
    ),
    Elsewhere(
        "OTEL_*",
        "",
        "The OpenTelemetry SDK's own settings (`OTEL_SERVICE_NAME`, `OTEL_SDK_DISABLED`, "
        "`OTEL_TRACES_SAMPLER`, `OTEL_EXPORTER_OTLP_*`, `OTEL_BSP_*`, ...).",
        "cdc/tracing.py",
    ),
    Elsewhere(
        "OUTBOX_CDC_PURE_PYTHON",
        "",
        "`1` selects the pure-Python pgoutput parser where the compiled one exists "
        "(to rule the C code out when chasing a defect).",
        "cdc/wal/pgoutput.py",
    ),
)


@dataclass(frozen=True)
class Entry:
    """One documented setting."""

    variable: str
    field: str
    default: str
    kind: str
    description: str


def descriptions(cls: type[BaseModel]) -> dict[str, str]:
    """Field name -> its description: the ``#:`` comment lines right above it in the source.

    A subclass's own comments win over its bases' (it may redeclare a field).
    """
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if issubclass(klass, BaseModel) and klass.__module__.split(".")[0] not in _LIBRARIES:
            out.update({k: v for k, v in _comments(klass).items() if v or k not in out})
    return out


#: pydantic's own base classes declare no settings of ours.
_LIBRARIES = frozenset({"pydantic", "pydantic_settings"})


def _comments(cls: type[BaseModel]) -> dict[str, str]:
    """Field name -> the ``#:`` comment lines right above it, in this class's own source."""
    lines, _start = inspect.getsourcelines(cls)
    source = textwrap.dedent("".join(lines))
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    text = source.splitlines()
    out: dict[str, str] = {}
    for node in body.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        comment: list[str] = []
        row = node.lineno - 2  # the line above, 0-based
        while row >= 0 and text[row].strip().startswith("#:"):
            comment.insert(0, text[row].strip()[2:].strip())
            row -= 1
        out[node.target.id] = " ".join(comment)
    return out


def entries(cls: type[BaseModel] = Settings) -> list[Entry]:
    """Every field with a variable, documented; raises when a description is missing."""
    comments = descriptions(cls)
    found: list[Entry] = []
    missing: list[str] = []
    for name, info in cls.model_fields.items():
        if info.alias is None:
            continue  # e.g. kafka_config: documented as KAFKA_CONFIG_* (ELSEWHERE)
        text = _markdown(comments.get(name) or info.description or "")
        if not text:
            missing.append(f"{info.alias} ({cls.__name__}.{name})")
            continue
        found.append(
            Entry(
                variable=info.alias,
                field=name,
                default=_default(info.default),
                kind=_kind(name, info.annotation),
                description=text,
            )
        )
    if missing:
        raise SettingsDocError(
            "settings without a description (write a `#:` comment above the field): "
            + ", ".join(missing)
        )
    return found


def group_of(variable: str) -> Group:
    """The section a variable belongs to: the group with the longest matching prefix."""
    best, length = OTHER, 0
    for group in GROUPS:
        for prefix in group.prefixes:
            if variable.startswith(prefix) and len(prefix) > length:
                best, length = group, len(prefix)
    return best


def grouped(items: Iterable[Entry]) -> list[tuple[Group, list[Entry]]]:
    """The entries by section, sections in :data:`GROUPS` order (then "Other settings")."""
    by_group: dict[str, list[Entry]] = {}
    for entry in items:
        by_group.setdefault(group_of(entry.variable).title, []).append(entry)
    return [(g, by_group[g.title]) for g in (*GROUPS, OTHER) if g.title in by_group]


def render(classes: Sequence[type[BaseModel]] = (Settings,)) -> str:
    """The reference as markdown: one table per section, then the variables read elsewhere."""
    items = [entry for cls in classes for entry in entries(cls)]
    out: list[str] = []
    for group, members in grouped(items):
        out += [f"### {group.title}", "", group.intro, ""]
        out += ["| variable | default | kind | meaning |", "|---|---|---|---|"]
        out += [_row(f"`{e.variable}`", e.default, e.kind, e.description) for e in members]
        out.append("")
    out += [
        "### Read outside the settings class",
        "",
        "These are not fields of the settings class (a prefix, a file, the SDK's own), "
        "and are read where the last column says.",
        "",
        "| variable | default | meaning | read in |",
        "|---|---|---|---|",
    ]
    out += [
        _row(f"`{x.variable}`", x.default or "unset", x.description, f"`{x.read_in}`")
        for x in ELSEWHERE
    ]
    out.append("")
    return "\n".join(out)


def _markdown(comment: str) -> str:
    """A ``#:`` comment as markdown: reST's double backticks become single ones."""
    return re.sub(r"``([^`]+)``", r"`\1`", comment).strip()


def _row(*cells: str) -> str:
    """A markdown table row; a ``|`` inside a cell is escaped (it would end the cell)."""
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def _default(value: Any) -> str:
    """The default as an operator writes it in the environment."""
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if value == "" or value is None:
        return "empty"
    return f"`{value}`"


#: A field's unit, from the suffix of its name (the house rule: units in names).
_UNITS = {"_s": "seconds", "_bytes": "bytes", "_port": "port"}
#: Kinds by annotation, where the name's unit does not say more.
_KINDS: dict[Any, str] = {SecretStr: "secret", bool: "`true` / `false`", int: "count"}


def _kind(name: str, annotation: Any) -> str:
    """What the value is: text, a number with its unit, a switch, a secret, or its choices."""
    choices: tuple[Any, ...] = ()
    if typing.get_origin(annotation) is typing.Literal:
        choices = typing.get_args(annotation)
    elif isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        choices = tuple(member.value for member in annotation)
    unit = next((u for suffix, u in _UNITS.items() if name.endswith(suffix)), None)
    if choices:
        return " / ".join(f"`{choice}`" if choice != "" else "empty" for choice in choices)
    if annotation in _KINDS:
        return _KINDS[annotation] if annotation is not int or unit is None else unit
    return unit or ("number" if annotation is float else "text")


def main(argv: Sequence[str] | None = None) -> int:
    """Print the reference (``python -m cdc.settings.doc``)."""
    del argv
    try:
        sys.stdout.write(render())
    except SettingsDocError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
