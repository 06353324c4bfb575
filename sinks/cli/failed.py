"""``outbox-cdc failed``: the parking lot - list, retry, accept as skipped.

Calls the synchronous parking-lot wrappers of :mod:`sinks.ops`; ``retry`` has
the admin API's rules and counts.
"""

from __future__ import annotations

import sys

import click

from cdc.cli.app import EXIT_FAILED, confirm, fail, load_settings
from cdc.cli.render import echo_json, out
from sinks.cli import render


@click.group()
def failed() -> None:
    """The parking lot: list, retry, accept as skipped."""


_STATUSES = ("FAILED", "PENDING", "DONE")


@failed.command("list")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
@click.option(
    "--type",
    "event_type",
    help="USER_SYNC, QUIZ_SYNC, UNROUTABLE, or a record type such as UserEmailChanged",
)
@click.option(
    "--status",
    "statuses",
    type=click.Choice(_STATUSES),
    multiple=True,
    help="repeatable; default FAILED and PENDING",
)
@click.option("--json", "as_json", is_flag=True, help="the rows as JSON on stdout")
def failed_list(
    limit: int, event_type: str | None, statuses: tuple[str, ...], as_json: bool
) -> None:
    """The oldest parked events (by default what the admin API lists: FAILED/PENDING)."""
    from sinks.ops.parking import parked_events, parked_json, retry_scheduled
    from sinks.shared.routes import Routing

    settings = load_settings("pg_dsn")
    rows = parked_events(
        settings,
        limit=limit,
        statuses=statuses or ("FAILED", "PENDING"),
        event_type=event_type,
    )
    fingerprint = Routing.from_settings(settings).fingerprint
    scheduled = {
        r.event_id: retry_scheduled(
            r, fingerprint=fingerprint, max_attempts=settings.retry_max_attempts
        )
        for r in rows
    }
    if as_json:
        events = [parked_json(r, scheduled=scheduled[r.event_id]) for r in rows]
        echo_json({"count": len(rows), "events": events})
        return
    out().print(
        render.parked_table(
            rows, statuses=statuses or ("FAILED", "PENDING"), scheduled=scheduled.__getitem__
        )
    )


@failed.command("reasons")
@click.option("--limit", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="the counts as JSON on stdout")
def failed_reasons(limit: int, as_json: bool) -> None:
    """Open parked events (FAILED, PENDING) per reason class, most first.

    A class is the reason without its free text: an engine's answer is its status
    (HTTP 400, HTTP 404 user_not_found), anything else the reason's head (unreadable
    record, payload is not valid JSON, no event id). The console's overview shows the
    same counts; its parking page lists a class's rows (?reason_class=...).
    """
    from sinks.ops.parking import parked_reasons, reasons_json

    counts = parked_reasons(load_settings("pg_dsn"), limit=limit)
    if as_json:
        echo_json({"reasons": reasons_json(counts)})
        return
    out().print(render.reasons_table(counts))


@failed.command("accept")
@click.option("--id", "ids", type=int, multiple=True, help="parked event id; repeatable")
@click.option("--type", "event_type", help="every open row of this sync type or record type")
@click.option("--reason", default=None, help="why, written into the rows' last_error")
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
@click.option("--json", "as_json", is_flag=True, help="the ids marked DONE as JSON on stdout")
def failed_accept(
    ids: tuple[int, ...], event_type: str | None, reason: str | None, yes: bool, as_json: bool
) -> None:
    """Mark open parked events DONE without sending them ("accept as skipped").

    For events nobody needs delivered, e.g. a type the engine has no use for;
    the previous error stays in last_error. Rows being retried right now are
    left alone.
    """
    from sinks.ops.parking import accept_parked, count_acceptable

    if not ids and not event_type:
        raise click.UsageError("give --id N (repeatable) and/or --type T")
    settings = load_settings("pg_dsn")
    count = count_acceptable(settings, ids=list(ids) or None, event_type=event_type)
    if count == 0:
        fail("no open parked event matches")
    what = f"{count} open parked event(s)" + (f" of type {event_type}" if event_type else "")
    confirm(f"mark {what} DONE without sending them?", yes=yes)
    accepted = accept_parked(settings, ids=list(ids) or None, event_type=event_type, reason=reason)
    if as_json:
        echo_json({"accepted_count": len(accepted), "event_ids": accepted})
    else:
        out().print(f"marked {len(accepted)} parked event(s) DONE (accepted as skipped)")


@failed.command("retry")
@click.option("--id", "ids", type=int, multiple=True, help="parked event id; repeatable")
@click.option("--all", "retry_all", is_flag=True, help="every FAILED/PENDING row (up to 100)")
@click.option("--json", "as_json", is_flag=True, help="the admin API's answer on stdout")
def failed_retry(ids: tuple[int, ...], retry_all: bool, as_json: bool) -> None:
    """Retry parked events now; exit 1 if any still fails.

    Same rules, counts and answer as the admin API (processed_count,
    done_count, failed_count): an engine outage spends no attempt, a rejection
    does; ids unknown, not open or being retried elsewhere are named, not
    failed (exit 0, processed 0, as the API's 200).
    """
    from sinks.ops.parking import retry_parked

    if bool(ids) == retry_all:
        raise click.UsageError("give --id N (repeatable) or --all")
    summary = retry_parked(load_settings("pg_dsn"), ids=list(ids) or None, retry_all=retry_all)
    ok = summary.failed_count == 0
    if as_json:
        echo_json(render.retry_answer(summary, ok=ok))
    else:
        render.show_retry(summary)
    if not ok:
        sys.exit(EXIT_FAILED)
