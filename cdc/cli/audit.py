"""``outbox-cdc audit``: the outbox table against Kafka against the group (:mod:`cdc.audit`).

Exit codes: 0 proven complete - nothing missing, nothing in flight, nothing removed
before the group read it; 1 something missing or removed (like ``diff``; also when
``--repair`` republished it: the run found a loss); 2 usage or configuration errors
(a bad ``--since``, an empty window, a missing setting, a window that ends before
the relay's first start); 3 cannot judge (the server cannot be identified - the
auditing role lacks REPLICATION - so records of other relays cannot be told from
this relay's: ``cannot_judge`` in the JSON says why, ``--repair`` republishes
nothing); 4 nothing missing but rows still in the slot (in flight: audit again once
the relay caught up).
The window starts no earlier than the relay's first start when that chose not to
publish the rows already in the table (``slot init --from now``, an empty
outbox): a ``--since`` before it is moved to it, with a note (and
``requested_since`` in the JSON); ``--before-first-start`` judges (and with
``--repair`` republishes) those rows too. The answer goes to stdout (a table, or one JSON
document with ``--json``); stage progress and notes go to stderr.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from cdc.cli import render
from cdc.cli.app import load_settings

if TYPE_CHECKING:
    from rich.console import Group, RenderableType
    from rich.table import Table

    from cdc.audit import AuditReport

#: Missing ids shown in the human answer (the JSON lists up to --limit).
SHOWN_MISSING = 20


@click.command()
@click.option(
    "--since",
    metavar="DURATION|TIME",
    help="window start: a duration back from now (90m, 2h, 1d) or an ISO-8601 time"
    " [default: CDC_AUDIT_WINDOW_S before --until]",
)
@click.option(
    "--until",
    metavar="DURATION|TIME",
    help="window end, same forms [default: CDC_AUDIT_SETTLE_S ago]",
)
@click.option("--json", "as_json", is_flag=True, help="the report as one JSON document on stdout")
@click.option(
    "--repair",
    is_flag=True,
    help="republish the missing rows through the relay's router (header recovered=audit-<run>)",
)
@click.option(
    "--before-first-start",
    is_flag=True,
    help="judge (and with --repair republish) the rows committed before the relay's first"
    " start too, which `slot init --from now` chose not to publish [default: the window"
    " starts at it]",
)
@click.option("--group", help="consumer group of the Kafka -> group stage [default: SINK_GROUP_ID]")
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=1000,
    show_default=True,
    help="missing rows listed in the JSON (all are counted and repaired)",
)
def audit(
    since: str | None,
    until: str | None,
    as_json: bool,
    repair: bool,
    before_first_start: bool,
    group: str | None,
    limit: int,
) -> None:
    """Prove the window complete: outbox rows vs Kafka records vs the consumer group.

    Table -> Kafka: every outbox row of the window (by commit time when
    track_commit_timestamp is on, else created_at) is in its topic (by the id
    header) or dead-lettered, or still in the slot; else it is missing.
    Kafka -> table: this relay's records with no row (phantoms) and ids seen more
    than once (duplicates). Kafka -> group: records removed before the group
    processed them, and the window's parked events by status. Exit 0 when
    proven complete, 1 when something is missing or removed unprocessed, 3 when
    it cannot judge (no system identity: the role needs REPLICATION), 4 when
    nothing is missing but rows are still in flight.
    """
    from datetime import UTC, datetime

    from cdc import collector
    from cdc.audit import BeforeFirstStartError, WindowError, run_audit, window_for

    settings = load_settings("pg_dsn", "kafka_bootstrap_servers")
    collector.for_bulk_work()  # (millions of ids read, rows republished: cdc.collector)
    try:
        window = window_for(
            now=datetime.now(UTC),
            settle_s=settings.audit_settle_s,
            width_s=settings.audit_window_s,
            since=since,
            until=until,
        )
    except WindowError as exc:
        raise click.UsageError(str(exc)) from None
    console = render.err()
    try:
        report = run_audit(
            settings,
            window,
            group=group,
            repair=repair,
            before_first_start=before_first_start,
            limit=limit,
            progress=lambda stage: console.print(f"[dim]audit: {stage}...[/dim]"),
        )
    except BeforeFirstStartError as exc:
        raise click.UsageError(f"{exc}: --before-first-start audits them anyway") from None
    if as_json:
        render.echo_json(report.as_json())
    else:
        render.out().print(_text(report, repair=repair))
    render.warn(report.notes)
    sys.exit(report.exit_code)


def _text(report: AuditReport, *, repair: bool) -> Group:
    """The human answer: a table per topic, then each stage's line and the verdict."""
    from rich.console import Group

    lines: list[RenderableType] = [
        f"audit {report.run_id} of {report.window.as_json()['since']} .."
        f" {report.window.as_json()['until']} (rows by {report.time_basis})",
        _topic_table(report),
        *_stage_lines(report),
    ]
    if report.missing_count:
        shown = report.missing_rows[:SHOWN_MISSING]
        lines.append(f"missing (first {len(shown)} of {report.missing_count}):")
        lines += [
            f"  {row.id}  {row.aggregatetype}  {row.aggregateid}  {row.created_at.isoformat()}"
            for row in shown
        ]
    lines.append(_verdict(report, repair=repair))
    return Group(*lines)


def _topic_table(report: AuditReport) -> Table:
    from rich.table import Table

    table = Table(title="table -> Kafka", title_justify="left")
    table.add_column("topic", overflow="fold")
    for name in ("rows", "in Kafka", "DLQ", "in flight", "missing", "dups"):
        table.add_column(name, justify="right", no_wrap=True)
    for topic, c in report.comparison.per_topic.items():
        table.add_row(
            topic,
            str(c.table_rows),
            str(c.in_kafka),
            str(c.dead_lettered),
            str(c.in_flight),
            f"[bold red]{c.missing}[/bold red]" if c.missing else "0",
            str(c.duplicate_ids),
        )
    return table


def _stage_lines(report: AuditReport) -> list[str]:
    cmp = report.comparison
    phantoms = (
        f"phantoms {len(cmp.phantoms)}"
        if report.judge_phantoms
        else f"phantoms not judged ({cmp.unchecked} records of this relay not checkable)"
    )
    lines = [
        f"Kafka -> table: {phantoms}; duplicates {cmp.total('duplicate_ids')} ids"
        f" ({cmp.total('duplicate_records')} extra records)"
    ]
    group = report.group
    if group.expired:
        parts = ", ".join(
            f"{e.topic}[{e.partition}] offsets {e.committed_offset}..{e.log_start_offset - 1}"
            f" ({e.count})"
            for e in group.expired
        )
        lines.append(f"Kafka -> group {group.group}: removed before it processed them: {parts}")
    else:
        lines.append(f"Kafka -> group {group.group}: nothing removed before it processed it")
    parked = report.parked.by_status
    shown = ", ".join(f"{k} {v}" for k, v in sorted(parked.items())) if parked else "none"
    lines.append(f"parked events of the window: {shown if parked is not None else 'not read'}")
    return lines


def _verdict(report: AuditReport, *, repair: bool) -> str:
    if report.clean:
        return "[green]complete[/green]: nothing missing, nothing removed unprocessed"
    if report.verdict == "cannot judge":
        return f"[red]{report.cannot_judge}[/red]"
    if report.verdict == "in flight":
        return (
            f"[yellow]in flight[/yellow]: nothing missing, {report.in_flight} rows still in"
            " the slot (not yet in Kafka) - audit again once the relay caught up"
        )
    found = f"{report.missing_count} missing"
    if report.group.expired:
        found += f", {report.expired_count} removed before the group processed them"
    if repair:
        return f"[red]{found}[/red]; republished {report.repaired} ({report.repair_mark})"
    hint = " - run with --repair to republish them" if report.missing_count else ""
    return f"[red]{found}[/red]{hint}"
