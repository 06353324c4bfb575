"""``outbox-cdc resync``: backfills, sync events for rows that already exist.

Calls :func:`cdc.ops.resync_users`: batches, each its own transaction, written
through the outbox.
"""

from __future__ import annotations

import click

from cdc.cli import render
from cdc.cli.app import load_settings


@click.group()
def resync() -> None:
    """Backfills: sync events for existing rows."""


@resync.command("users")
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="users per transaction",
)
@click.option("--delete-after", is_flag=True, help="delete each outbox row in its transaction")
@click.option("--json", "as_json", is_flag=True, help='{"emitted": N} on stdout')
def resync_users_cmd(batch_size: int, delete_after: bool, as_json: bool) -> None:
    """Emit a UserRegistered event for every user (backfill).

    Through the outbox, in batches of --batch-size users, each batch its own
    transaction, so an engine that lost its state is rebuilt.
    """
    from cdc.ops import resync_users

    settings = load_settings("pg_dsn")
    with render.progress_bar(enabled=not as_json) as bar:
        task = bar.add_task("users", total=None)
        emitted = resync_users(
            settings,
            batch_size=batch_size,
            delete_after=delete_after,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
    if as_json:
        render.echo_json({"emitted": emitted})
    else:
        click.echo(f"emitted {emitted} UserRegistered event(s) through the outbox")
