"""The ``outbox-cdc`` command group, its one error mapping, and the commands of other packages.

Exit codes scripts can trust: 0 success, 1 the operation failed or found a
problem (e.g. refused), 2 usage or configuration error (a bad or missing
setting, a port already taken) - always one ``error:`` line naming the
variable, never its value when it is a secret.

Guarantees:

* Every command is registered through :func:`register`, which puts the one
  error mapping (:func:`guarded`) around its callback: a :class:`ConfigError`
  exits 2 with one ``error:`` line; a usage error a package declared exits 2
  with the command's usage; a :class:`CdcError`, an error a package declared as
  failed, or a PostgreSQL error exits 1 with one ``error:`` line (a psycopg
  message never holds the DSN's password).
* Other packages add commands through the entry-point group
  :data:`COMMANDS_ENTRY_POINT_GROUP`: each entry point names a :class:`Plugin`.
  This is how :mod:`sinks` adds its commands while ``cdc`` imports nothing of
  it, and how a team can ship another sink as its own package.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from cdc.errors import CdcError, ConfigError
from cdc.logs import setup_logging
from cdc.settings import Settings

if TYPE_CHECKING:
    from cdc.check import Probe

EXIT_FAILED = 1
EXIT_USAGE = 2
#: Where packages declare the commands they add to ``outbox-cdc`` (pyproject.toml).
COMMANDS_ENTRY_POINT_GROUP = "outbox_cdc.commands"

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Plugin:
    """What a package adds to ``outbox-cdc``: its commands and how its errors exit.

    ``usage_errors`` exit 2 with the command's usage (the operator asked for
    something that makes no sense); ``failed_errors`` exit 1 with one line.
    ``checks`` are the package's probes for ``outbox-cdc check`` (name, probe).
    """

    commands: tuple[click.Command, ...]
    usage_errors: tuple[type[Exception], ...] = ()
    failed_errors: tuple[type[Exception], ...] = ()
    checks: tuple[tuple[str, Probe], ...] = ()


@dataclass
class _ErrorKinds:
    """The exception types the mapping knows, beyond the kernel's own."""

    usage: tuple[type[Exception], ...] = ()
    failed: tuple[type[Exception], ...] = ()
    checks: tuple[tuple[str, Probe], ...] = ()


_KINDS = _ErrorKinds()


def load_settings(*required: str) -> Settings:
    """Settings from the environment, failing with exit 2 when one is missing or bad.

    One ``error:`` line (not the command's usage: the command line was right,
    the environment is not).
    """
    with _mapped_errors():
        return Settings.from_env().require(*required)
    raise AssertionError("unreachable")  # _mapped_errors exits on an error


def require_free_port(settings: Settings, attr: str, *, host: str | None = None) -> None:
    """Raise :class:`ConfigError` naming ``attr``'s variable when its port is taken
    on ``host`` (default ``CDC_HTTP_HOST``, where the servers bind).

    Checked before a server (or the demo's children) starts, so the operator reads
    which setting to change, not a traceback or a server's own line. The one
    check of the kind: the relay, the sink, the engine stub and the demo use it.
    """
    from cdc.settings import ENV

    port, variable = int(getattr(settings, attr)), ENV[attr]
    bind_host = host or settings.http_host
    with socket.socket(socket.AF_INET6 if ":" in bind_host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
        try:
            sock.bind((bind_host, port))
        except OSError as exc:
            if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                raise ConfigError(
                    f"{variable}={port}: cannot listen on {bind_host}:{port}"
                    f" ({exc.strerror or exc}): check the host and the port"
                ) from None
            raise ConfigError(
                f"{variable}={port}: port {bind_host}:{port} already in use"
                f" ({os.strerror(exc.errno)}): stop what listens there or set {variable}"
                " to a free port"
            ) from None


def settings_line(settings: Settings, *, reads: Callable[[str], bool] | None = None) -> str:
    """The settings that differ from their defaults, as one readable line for a
    start-up log: ``VARIABLE=value`` pairs in the settings class's order, secrets
    redacted as :meth:`Settings.safe_summary` redacts them (a DSN without its
    password, a secret as ``***``), librdkafka's ``KAFKA_CONFIG_*`` by name only
    (their values may hold SASL passwords). A value with a space, a quote or
    nothing in it is quoted. ``reads``: only the variables the process reads (a
    predicate over the variable's name, ``KAFKA_CONFIG_*`` for librdkafka's)."""
    from cdc.settings import ENV
    from cdc.settings.values import KAFKA_CONFIG_PREFIX

    shown = settings.safe_summary()
    parts = []
    for name, field in type(settings).model_fields.items():
        if getattr(settings, name) == field.get_default(call_default_factory=True):
            continue
        if reads is not None and not reads(ENV.get(name, f"{KAFKA_CONFIG_PREFIX}*")):
            continue
        if name == "kafka_config":
            parts.append(f"{KAFKA_CONFIG_PREFIX}*={','.join(sorted(settings.kafka_config))}")
            continue
        value = shown[name]
        text = str(value).lower() if isinstance(value, bool) else str(value)
        if not text or any(ch.isspace() or ch in "\"'" for ch in text):
            text = json.dumps(text, ensure_ascii=False)
        parts.append(f"{ENV.get(name, name)}={text}")
    return " ".join(parts) if parts else "every setting at its default"


@contextmanager
def _mapped_errors() -> Iterator[None]:
    import psycopg

    failed: tuple[type[Exception], ...] = (CdcError, *_KINDS.failed)
    try:
        yield
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    except _KINDS.usage as exc:
        raise click.UsageError(str(exc)) from exc
    except failed as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_FAILED)
    except psycopg.Error as exc:  # the message never holds the DSN's password
        click.echo(f"error: PostgreSQL: {exc}", err=True)
        sys.exit(EXIT_FAILED)


def guarded(func: F) -> F:
    """``func`` (a command's callback) with the CLI's one error mapping around it.

    It runs inside the command's own context, so a usage error shows that
    command's usage line.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _mapped_errors():
            return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _guard_tree(command: click.Command) -> None:
    if command.callback is not None:
        command.callback = guarded(command.callback)
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            _guard_tree(sub)


@click.group()
@click.version_option(package_name="outbox-cdc")
def main() -> None:
    """outbox-cdc: PostgreSQL outbox -> WAL -> Kafka -> engine."""
    from cdc.settings import build

    with _mapped_errors():  # LOG_LEVEL=LOUD: one line, exit 2, before anything logs
        env = {k: v for k, v in os.environ.items() if k in ("LOG_LEVEL", "LOG_FORMAT")}
        chosen = build(Settings, **env)
    setup_logging(chosen.log_level.value, chosen.log_format.value)


def register(plugin: Plugin) -> None:
    """Add ``plugin``'s commands to :data:`main`, each behind the one error mapping."""
    _KINDS.usage += plugin.usage_errors
    _KINDS.failed += plugin.failed_errors
    _KINDS.checks += plugin.checks
    for command in plugin.commands:
        _guard_tree(command)
        main.add_command(command)


def register_installed() -> None:
    """Register every :class:`Plugin` that an installed package declares."""
    for entry in entry_points(group=COMMANDS_ENTRY_POINT_GROUP):
        plugin = entry.load()
        if not isinstance(plugin, Plugin):
            raise TypeError(f"entry point {entry.name} ({entry.value}) is not a cdc.cli.Plugin")
        register(plugin)


def confirm(question: str, *, yes: bool, refused: str = "nothing changed") -> None:
    """Go on when ``yes`` or the operator answers yes; else one ``error:`` line, exit 1.

    Without a terminal to ask on (a script, a pipe) it refuses at once and
    names ``--yes``, instead of click's bare ``Aborted!``.
    """
    if yes:
        return
    if not sys.stdin.isatty():
        fail(f"refusing without --yes on a non-interactive terminal ({refused})")
    try:
        answered = click.confirm(question, default=False, err=True)
    except click.Abort:
        answered = False
    if not answered:
        fail(refused)


def registered_checks() -> tuple[tuple[str, Probe], ...]:
    """The probes the registered packages add to ``outbox-cdc check``."""
    return _KINDS.checks


def fail(message: str) -> NoReturn:
    """One ``error:`` line on stderr, exit 1."""
    click.echo(f"error: {message}", err=True)
    sys.exit(EXIT_FAILED)
