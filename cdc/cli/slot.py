"""``outbox-cdc slot``: the replication slot's status, and dropping it.

Calls :mod:`cdc.ops`; the views are in :mod:`cdc.cli.render`. ``drop`` is
refused while a relay streams the slot, and asks before losing events.
"""

from __future__ import annotations

import click

from cdc.cli import render
from cdc.cli.app import fail, load_settings


@click.group()
def slot() -> None:
    """The replication slot: status and drop."""


@slot.command("status")
@click.option("--json", "as_json", is_flag=True, help="the status as JSON on stdout")
def slot_status_cmd(as_json: bool) -> None:
    """Slot position, WAL lag and age of the oldest unconfirmed event.

    The age is the commit time of the first transaction with an event after
    the slot's confirmed LSN, read from a temporary copy of the slot (needs
    the REPLICATION privilege; the relay is not disturbed). Exit 1 when the
    slot does not exist.
    """
    from cdc.ops import slot_status

    status = slot_status(load_settings("pg_dsn"))
    if as_json:
        render.echo_json(dict(status))
    else:
        render.out().print(render.slot_table(status))
    if not status["exists"]:
        fail(f"slot {status['slot']} does not exist")


@slot.command("drop")
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
def slot_drop_cmd(yes: bool) -> None:
    """Drop the slot; refused while a relay streams it.

    Events committed after the slot's confirmed LSN that are not in Kafka yet
    are lost: the count is shown and confirmation asked unless --yes.
    """
    from cdc.ops import SlotActiveError, slot_drop, slot_status, unconfirmed_event_count

    settings = load_settings("pg_dsn")
    status = slot_status(settings)
    if not status["exists"]:
        fail(f"slot {settings.slot} does not exist")
    if status["active"]:
        raise SlotActiveError(
            f"slot {settings.slot} is active (PID {status['active_pid']}): stop the relay first"
        )
    pending = unconfirmed_event_count(settings)
    render.err().print(render.drop_warning(status, pending))
    if not yes and not click.confirm(f"drop slot {settings.slot}?", default=False, err=True):
        fail("not dropped")
    dropped = slot_drop(settings)
    click.echo(
        f"slot {dropped['slot']} dropped (it had confirmed {dropped['confirmed_flush_lsn']})"
    )
