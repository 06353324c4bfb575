"""Commands of the relay side: ``migrate``, ``prune``, ``relay``.

Each parses its options, builds settings and calls one library function
(:mod:`cdc.migrate`, :mod:`cdc.outbox`, :mod:`cdc.relay`); library machinery is
imported inside each command so ``outbox-cdc --help`` stays fast.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable

import click

from cdc.cli.app import load_settings


@click.command()
def migrate() -> None:
    """Apply pending SQL migrations (sql/NNN_*.sql), once each, in order."""
    from cdc.migrate import migrate as run_migrations

    settings = load_settings("pg_dsn")
    applied = run_migrations(settings.pg_dsn.get_secret_value())
    if applied:
        click.echo(f"applied migrations: {', '.join(applied)}")
    else:
        click.echo("schema is up to date")


@click.command()
@click.option(
    "--older-than",
    "older_than_s",
    type=float,
    default=3600.0,
    show_default=True,
    help="delete outbox rows older than this many seconds",
)
@click.option("--json", "as_json", is_flag=True, help="the result as JSON on stdout")
def prune(older_than_s: float, as_json: bool) -> None:
    """Delete old outbox rows, keeping what a slot-gap recovery may need.

    Never deletes a row younger than CDC_RECOVERY_HORIZON_S, a row the slot may
    not have confirmed (not yet in Kafka), nor a row inside an open gap's
    window; refused when the slot is missing or lost and nothing says what was
    published (see the README, "When the slot is lost").
    """
    import psycopg

    from cdc.cli import render
    from cdc.outbox import prune_outbox
    from cdc.retention import retention_for

    settings = load_settings("pg_dsn")
    with psycopg.connect(settings.pg_dsn.get_secret_value(), autocommit=True) as conn:
        keep = retention_for(conn, settings)
        deleted = prune_outbox(
            conn, older_than_s=older_than_s, table=settings.outbox_table, keep=keep
        )
    if as_json:
        render.echo_json(
            {
                "deleted": deleted,
                "older_than_s": older_than_s,
                "horizon_s": keep.horizon_s,
                "kept_unconfirmed_of_slot": keep.slot,
                "kept_since": keep.keep_since.isoformat() if keep.keep_since else None,
            }
        )
        return
    kept = f"; kept rows since {keep.keep_since.isoformat()}" if keep.keep_since else ""
    click.echo(
        f"deleted {deleted} outbox rows older than {max(older_than_s, keep.horizon_s):g}s"
        f" (horizon {keep.horizon_s:g}s{kept})"
    )


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


@click.command()
def relay() -> None:
    """Stream committed outbox inserts from the WAL into Kafka (runs until SIGTERM)."""
    from cdc.relay.loop import Relay

    settings = load_settings("pg_dsn", "kafka_bootstrap_servers")
    logging.getLogger("cdc").info(
        "relay starting with %s", settings.safe_summary(), extra={"state": "starting"}
    )
    runner = Relay(settings)
    _on_signals(runner.stop)
    sys.exit(runner.run())


COMMANDS: tuple[click.Command, ...] = (migrate, prune, relay)
