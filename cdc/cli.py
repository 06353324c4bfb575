"""The ``outbox-cdc`` command line: parse, build settings, call a library function.

Exit codes scripts can trust: 0 success, 1 the operation failed or found a
problem (e.g. refused), 2 usage or configuration error.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

import click

from cdc.errors import CdcError, ConfigError
from cdc.logs import setup_logging
from cdc.settings import Settings

EXIT_FAILED = 1
EXIT_USAGE = 2


def load_settings(*required: str) -> Settings:
    """Settings from the environment, failing with exit 2 when one is missing."""
    try:
        return Settings.from_env().require(*required)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc


class CliGroup(click.Group):
    """Turns the package's own errors into one clear line and a trustworthy exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ConfigError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_USAGE)
        except CdcError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_FAILED)


@click.group(cls=CliGroup)
@click.version_option(package_name="outbox-cdc")
def main() -> None:
    """outbox-cdc: PostgreSQL outbox -> WAL -> Kafka -> engine."""
    setup_logging()


@main.command()
def migrate() -> None:
    """Apply pending SQL migrations (sql/NNN_*.sql), once each, in order."""
    from cdc.migrate import migrate as run_migrations

    settings = load_settings("pg_dsn")
    applied = run_migrations(settings.pg_dsn.get_secret_value())
    if applied:
        click.echo(f"applied migrations: {', '.join(applied)}")
    else:
        click.echo("schema is up to date")


@main.command()
@click.option(
    "--older-than",
    "older_than_s",
    type=float,
    default=3600.0,
    show_default=True,
    help="delete outbox rows older than this many seconds",
)
def prune(older_than_s: float) -> None:
    """Delete old outbox rows (safe: the relay reads the WAL, not the table)."""
    import psycopg

    from cdc.outbox import prune_outbox

    settings = load_settings("pg_dsn")
    with psycopg.connect(settings.pg_dsn.get_secret_value(), autocommit=True) as conn:
        deleted = prune_outbox(conn, older_than_s=older_than_s, table=settings.outbox_table)
    click.echo(f"deleted {deleted} outbox rows older than {older_than_s:g}s")


def _on_signals(stop: Callable[[], None]) -> None:
    """SIGTERM and SIGINT ask the running loop to stop cleanly."""

    def handler(signum: int, _frame: object) -> None:
        # a log line (not an echo): it must come out in the process's log format
        logging.getLogger("cdc").info(
            "signal %s: stopping", signal.Signals(signum).name, extra={"state": "stopping"}
        )
        stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


@main.command()
def relay() -> None:
    """Stream committed outbox inserts from the WAL into Kafka (runs until SIGTERM)."""
    from cdc.relay import Relay

    settings = load_settings("pg_dsn", "kafka_bootstrap_servers")
    logging.getLogger("cdc").info(
        "relay starting with %s", settings.safe_summary(), extra={"state": "starting"}
    )
    runner = Relay(settings)
    _on_signals(runner.stop)
    sys.exit(runner.run())


@main.command()
def sink() -> None:
    """Deliver outbox events from Kafka to the engine (consumer group; runs until SIGTERM)."""
    import asyncio

    from sinks.service import run_sink

    settings = load_settings("pg_dsn", "kafka_bootstrap_servers")
    logging.getLogger("sinks").info(
        "sink starting with %s", settings.safe_summary(), extra={"state": "starting"}
    )
    sys.exit(asyncio.run(run_sink(settings)))


@main.command("engine-stub")
@click.option("--host", default="127.0.0.1", show_default=True, help="address to bind")
@click.option("--port", type=int, default=None, help="port (default ENGINE_STUB_PORT, 8081)")
@click.option(
    "--latency-ms",
    type=float,
    default=0.0,
    show_default=True,
    help="fixed latency added to every engine request",
)
def engine_stub(host: str, port: int | None, latency_ms: float) -> None:
    """Run the engine stub: a real HTTP server standing in for the engine.

    HTTPS with ENGINE_STUB_TLS_CERT and ENGINE_STUB_TLS_KEY; client certificates
    signed by ENGINE_STUB_CLIENT_CA required when that is set too.
    """
    from sinks.stub import StubTLS, run_stub

    settings = load_settings()
    tls = None
    if settings.engine_stub_tls_cert or settings.engine_stub_tls_key:
        settings.require("engine_stub_tls_cert", "engine_stub_tls_key")
        tls = StubTLS(
            certfile=settings.engine_stub_tls_cert,
            keyfile=settings.engine_stub_tls_key,
            client_ca=settings.engine_stub_client_ca,
        )
    run_stub(
        host=host,
        port=port or settings.engine_stub_port,
        api_key=settings.internal_api_key.get_secret_value(),
        latency_ms=latency_ms,
        tls=tls,
    )


@main.command()
@click.option("--users", type=int, default=500, show_default=True, help="users to register")
@click.option(
    "--attempts-per-user", type=int, default=5, show_default=True, help="quiz attempts per user"
)
@click.option(
    "--log-dir",
    type=click.Path(file_okay=False),
    default=".dev",
    show_default=True,
    help="where the children's logs go",
)
def demo(users: int, attempts_per_user: int, log_dir: str) -> None:
    """Run the whole pipeline on the local stack with a burst of events and a summary."""
    from pathlib import Path

    from cdc.demo import run_demo

    run_demo(users=users, attempts_per_user=attempts_per_user, log_dir=Path(log_dir))


import cdc.cli_ops  # noqa: E402, F401 - registers lag, replay, redeliver, failed, slot, resync

if __name__ == "__main__":  # pragma: no cover
    # Run the importable module's group (which cdc.cli_ops extended), not this
    # __main__ copy of it.
    from cdc.cli import main as entry

    entry()
