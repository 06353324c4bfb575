"""``outbox-cdc slot``: the replication slot's status, dropping it, closing a gap, a first start.

Calls :mod:`cdc.ops` and :mod:`cdc.relay.gaps.recovery`; the views are in
:mod:`cdc.cli.render`. ``drop`` is refused while a relay streams the slot, and
asks before losing events. ``init`` is the explicit first start the relay asks
for when the outbox table already holds rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from cdc import collector
from cdc.cli import render
from cdc.cli.app import fail, load_settings

if TYPE_CHECKING:
    from cdc.gaps import Recovered


@click.group()
def slot() -> None:
    """The replication slot: status, drop, first start (init), gaps (recover, accept-gap)."""


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
@click.option("--json", "as_json", is_flag=True, help="what was dropped as JSON on stdout")
def slot_drop_cmd(yes: bool, as_json: bool) -> None:
    """Drop the slot; refused while a relay streams it.

    Events committed after the slot's confirmed LSN that are not in Kafka yet
    are lost: the count is shown and confirmation asked unless --yes.
    """
    from cdc.ops import (
        SlotActiveError,
        active_slot_line,
        slot_drop,
        slot_status,
        unconfirmed_event_count,
    )

    settings = load_settings("pg_dsn")
    status = slot_status(settings)
    if not status["exists"]:
        fail(f"slot {settings.slot} does not exist")
    if status["active"]:
        raise SlotActiveError(f"{active_slot_line(status)}: stop that relay first")
    pending = unconfirmed_event_count(settings)
    render.err().print(render.drop_warning(status, pending))
    if not yes and not click.confirm(f"drop slot {settings.slot}?", default=False, err=True):
        fail("not dropped")
    dropped = slot_drop(settings)
    if as_json:
        render.echo_json({"dropped": True, **dropped})
        return
    click.echo(
        f"slot {dropped['slot']} dropped (it had confirmed {dropped['confirmed_flush_lsn']})"
    )


@slot.command("recover")
@click.option("--execute", is_flag=True, help="do it (without: a dry run that changes nothing)")
@click.option("--json", "as_json", is_flag=True, help="the result as JSON on stdout")
def slot_recover_cmd(execute: bool, as_json: bool) -> None:
    """Close a slot gap from the outbox table (a dry run unless --execute).

    The dry run shows the gap's cause, its window and how many outbox rows it
    would re-publish. --execute creates the slot with an exported snapshot,
    re-publishes the window's rows (header `recovered`), waits for every Kafka
    ack and records the recovery; the relay then streams from the new slot.
    """
    from cdc.relay.gaps import recovery
    from cdc.relay.gaps.gap import Action

    settings = load_settings("pg_dsn", "kafka_bootstrap_servers")
    found = recovery.inspect(settings)
    verdict = found.verdict
    if verdict.action is not Action.GAP:
        doc: dict[str, object] = {"gap": False, "verdict": verdict.action.value}
        _answer(as_json, doc, f"no gap: {verdict.reason}")
        return
    if not execute:
        with recovery.connect(settings) as conn:
            reason = recovery.why_unrecoverable(conn, settings, found.last, found.evidence.server)
        plan: dict[str, object] = {
            "gap": True,
            "executed": False,
            "cause": verdict.cause.value if verdict.cause else None,
            "detail": verdict.detail,
            "window_start": verdict.window_start.isoformat() if verdict.window_start else None,
            "rows": recovery.count_window(settings, verdict.window_start),
            "unrecoverable": reason,
        }
        _answer(as_json, plan, _plan_text(plan))
        return
    gap = recovery.open_gap(settings, found)
    collector.for_bulk_work()  # (a window's rows republished: cdc.collector)
    done = recovery.recover(settings, gap)
    result = {"gap": True, "executed": True, "gap_id": gap.id, **_recovered_json(done)}
    _answer(
        as_json,
        result,
        f"gap {gap.id} recovered: {done.rows} rows re-published in {done.seconds:.1f}s;"
        f" slot {settings.slot} streams from {done.consistent_lsn}",
    )


@slot.command("accept-gap")
@click.option("--by", "by", required=True, help="who accepts the loss (recorded)")
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
@click.option("--json", "as_json", is_flag=True, help="the result as JSON on stdout")
def slot_accept_gap_cmd(by: str, yes: bool, as_json: bool) -> None:
    """Accept the loss of a gap's events: create the slot, record who accepted which window.

    The only way out of a gap the table cannot replay (rows deleted after
    insert, logical messages). Events committed in the window and not in Kafka
    are lost for good.
    """
    from cdc.relay.gaps import recovery
    from cdc.relay.gaps.gap import Action

    settings = load_settings("pg_dsn", "kafka_bootstrap_servers")
    if not by.strip():
        fail("--by must name who accepts the loss")
    found = recovery.inspect(settings)
    if found.verdict.action is not Action.GAP:
        fail(f"slot {settings.slot} has no gap ({found.verdict.reason})")
    gap = recovery.open_gap(settings, found)
    since = gap.window_start.isoformat() if gap.window_start else "the first outbox row"
    render.err().print(
        f"gap {gap.id} of slot {settings.slot}: {gap.cause}: {gap.detail}. Events committed since"
        f" {since} that are not in Kafka will never be published."
    )
    if not yes and not click.confirm(f"accept the loss as {by}?", default=False, err=True):
        fail("not accepted")
    origin = recovery.accept_loss(settings, gap, by=by)
    result: dict[str, object] = {
        "gap_id": gap.id,
        "accepted_by": by,
        "window_start": gap.window_start.isoformat() if gap.window_start else None,
        "origin": origin,
    }
    _answer(as_json, result, f"gap {gap.id} accepted by {by}; slot {settings.slot} created")


@slot.command("init")
@click.option(
    "--from",
    "source",
    type=click.Choice(["now", "table"]),
    required=True,
    help="now: the rows already in the outbox table are not published; table: they are",
)
@click.option("--json", "as_json", is_flag=True, help="the result as JSON on stdout")
def slot_init_cmd(source: str, as_json: bool) -> None:
    """The relay's first start, made explicit (it refuses one on a non-empty outbox).

    --from now makes the slot (or takes over the one of that name, unused) and
    records it as the relay's: events committed from then on are published, the
    rows already in the table are not. --from table publishes every row of the
    table (the publication's share), marked `recovered`, from a new slot's
    snapshot, then the relay streams from that slot; a run that dies half-way is
    resumed by the next run or by the relay. Refused once the slot has a history
    or the relay has records in Kafka: that is not a first start.
    """
    from cdc.relay.gaps import recovery
    from cdc.relay.gaps.gap import Action, GapCause

    settings = load_settings("pg_dsn", "kafka_bootstrap_servers")
    found = recovery.inspect(settings)
    verdict = found.verdict
    resuming = verdict.action is Action.GAP and verdict.cause is GapCause.FIRST_START
    if not resuming and (found.history is not None or found.last is not None):
        since = (
            f"its history has row {found.history.id} ({found.history.event}, {found.history.state})"
            if found.history is not None
            else "the relay's records are in Kafka"
        )
        fail(
            f"slot {settings.slot} is not at its first start: {since}; see `outbox-cdc slot status`"
        )
    if found.slot is not None and found.slot.active:
        fail(f"slot {settings.slot} is active: stop the relay streaming it first")
    if source == "now":
        if resuming:
            fail(f"slot {settings.slot} has a `--from table` start under way: run it again")
        made = recovery.make_slot(
            settings,
            found,
            cause="init_now",
            detail="slot init --from now: the rows already in the outbox table are not published",
        )
        doc: dict[str, object] = {"from": "now", "slot": settings.slot, "lsn": made.lsn}
        _answer(as_json, doc, f"slot {settings.slot} made the relay's at {made.lsn}")
        return
    gap = recovery.open_gap(settings, found) if resuming else recovery.open_first_start(settings)
    collector.for_bulk_work()  # (the table's rows published: cdc.collector)
    done = recovery.recover(settings, gap)
    result = {"from": "table", "slot": settings.slot, "gap_id": gap.id, **_recovered_json(done)}
    _answer(
        as_json,
        result,
        f"slot {settings.slot} made at {done.consistent_lsn}: {done.rows} rows of the outbox"
        f" table published in {done.seconds:.1f}s",
    )


def _answer(as_json: bool, doc: dict[str, object], text: str) -> None:
    if as_json:
        render.echo_json(doc)
    else:
        click.echo(text)


def _plan_text(plan: dict[str, object]) -> str:
    since = plan["window_start"] or "the first outbox row"
    lines = [
        f"gap: {plan['cause']}: {plan['detail']}",
        f"dry run: would re-publish {plan['rows']} outbox rows created since {since}",
    ]
    if plan["unrecoverable"]:
        lines.append(f"cannot recover: {plan['unrecoverable']} (`outbox-cdc slot accept-gap`)")
    else:
        lines.append("run with --execute to do it")
    return "\n".join(lines)


def _recovered_json(done: Recovered) -> dict[str, object]:
    return {
        "rows": done.rows,
        "window_start": done.window_start.isoformat() if done.window_start else None,
        "window_end": done.window_end.isoformat(),
        "seconds": round(done.seconds, 3),
        "origin": done.origin,
        "consistent_lsn": done.consistent_lsn,
    }
