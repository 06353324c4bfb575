"""Commands of the relay side: ``migrate``, ``prune``, ``relay``.

Each parses its options, builds settings and calls one library function
(:mod:`cdc.migrate`, :mod:`cdc.outbox`, :mod:`cdc.relay`); library machinery is
imported inside each command so ``outbox-cdc --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

import click

from cdc.cli import interrupt
from cdc.cli.app import load_settings, require_free_port, settings_line
from cdc.cli.render import echo_json, migration_table, out


@click.command()
@click.option("--demo", is_flag=True, help="also the demo's tables (users, quiz_attempts)")
@click.option(
    "--status", "show_status", is_flag=True, help="list applied and pending; change nothing"
)
@click.option("--json", "as_json", is_flag=True, help="the answer as JSON on stdout")
def migrate(demo: bool, show_status: bool, as_json: bool) -> None:
    """Apply pending SQL migrations (sql/NNN_*.sql), once each, in order.

    Only outbox-cdc's own objects: the outbox, its publication, the parking
    lot and their functions. --demo adds the demo's users and quiz_attempts.
    """
    from cdc.migrate import migrate as run_migrations
    from cdc.migrate import status

    settings = load_settings("pg_dsn")
    dsn = settings.pg_dsn.get_secret_value()
    if show_status:
        states = status(dsn, demo=demo)
        if as_json:
            echo_json(
                {
                    "applied": [s.as_json() for s in states if s.applied_at],
                    "pending": [s.as_json() for s in states if not s.applied_at],
                }
            )
        else:
            out().print(migration_table(states))
        return
    applied = run_migrations(dsn, demo=demo)
    if as_json:
        echo_json({"applied": applied, "demo": demo, "up_to_date": not applied})
    elif applied:
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
    published (see docs/relay/slot-gaps.md).
    """
    from cdc.cli import render
    from cdc.outbox import prune_outbox
    from cdc.pgconn import Use, connect
    from cdc.retention import retention_for

    settings = load_settings("pg_dsn")
    with connect(settings.pg_dsn.get_secret_value(), Use.CLI) as conn:
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
    effective_s = max(older_than_s, keep.horizon_s)
    raised = (
        f" (--older-than {older_than_s:g}s raised to the recovery horizon,"
        f" CDC_RECOVERY_HORIZON_S={keep.horizon_s:g}{kept})"
        if effective_s > older_than_s
        else f" (horizon {keep.horizon_s:g}s{kept})"
    )
    click.echo(f"deleted {deleted} outbox rows older than {effective_s:g}s{raised}")


def _on_signals(stop: Callable[[], None]) -> None:
    """SIGTERM and SIGINT ask the running loop to stop cleanly.

    The handler only writes the signal's number to a pipe; a thread reads it, logs
    and calls ``stop``. A Python signal handler runs in the main thread between two
    bytecodes - possibly inside ``threading.Event.wait`` or ``set`` while it holds
    the event's lock - and calling ``Event.set`` there waits for a lock its own
    thread holds: three SIGTERMs within 15 ms (a dying parent's and a supervisor's)
    once left the relay hanging for good. ``os.write`` takes no Python lock.
    """
    interrupt.release()  # the relay's shutdown is its own: flush, confirm, exit 0
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def watch() -> None:
        while signum := os.read(read_fd, 1):
            # a log line (not an echo): it must come out in the process's log format
            logging.getLogger("cdc").info(
                "signal %s: stopping", signal.Signals(signum[0]).name, extra={"state": "stopping"}
            )
            stop()

    threading.Thread(target=watch, name="signals", daemon=True).start()

    def handler(signum: int, _frame: object) -> None:
        with contextlib.suppress(BlockingIOError):  # (a pipe full of signals: one is enough)
            os.write(write_fd, bytes((signum,)))

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


#: Variables only the sink, its engine client, its parking lot or the engine stub read: left
#: out of the relay's start line (a shell that sourced .dev/env has them all).
NOT_RELAY_SETTINGS = (
    "SINK_",
    "ENGINE_",
    "INTERNAL_API_KEY",
    "HTTPS_PROXY",
    "HTTP_PROXY",
    "NO_PROXY",
    "ADMIN_API_",
    "OUTBOX_SCHEDULER_",
    "OUTBOX_RETRY_",
)


def relay_reads(variable: str) -> bool:
    """The relay reads ``variable`` (its start line shows it when set)."""
    return not variable.startswith(NOT_RELAY_SETTINGS)


@click.command()
def relay() -> None:
    """Stream committed outbox inserts from the WAL into Kafka (runs until SIGTERM)."""
    from cdc import pgconn
    from cdc.relay.stream.loop import Relay

    settings = load_settings("pg_dsn", "kafka_bootstrap_servers")
    require_free_port(settings, "relay_http_port")
    logging.getLogger("cdc").info(
        "relay starting with %s",
        settings_line(settings, reads=relay_reads),
        extra={"state": "starting"},
    )
    pgconn.PROCESS_ROLE[0] = "relay"  # (its replication connections name it: slot holder)
    if settings.delivery == "exactly-once":
        from cdc.relay.delivery.exactly_once import ExactlyOnceRelay

        runner: Relay = ExactlyOnceRelay(settings)
    else:
        runner = Relay(settings)
    _on_signals(runner.stop)
    sys.exit(runner.run())


COMMANDS: tuple[click.Command, ...] = (migrate, prune, relay)
