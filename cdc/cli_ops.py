"""Ops commands of ``outbox-cdc``: lag, replay, redeliver, failed, slot, resync.

Each command parses its options, builds settings, calls one library function
(:mod:`sinks.ops`, :mod:`cdc.ops`) and renders the answer: a rich table for
people, or with ``--json`` one JSON document on stdout for scripts. Progress
bars, warnings and errors go to stderr, so ``--json`` output always parses.

Exit codes, as everywhere in the CLI: 0 done (or, for a dry run, would be
done), 1 failed or refused (active group, active slot, an event not
delivered, a parked event still failing), 2 usage or configuration error.

The commands are registered on :data:`cdc.cli.main` when this module is
imported (the last lines of :mod:`cdc.cli` do that).
"""

# Library machinery (Kafka, psycopg, rich) is imported inside each command, as in
# cdc/cli.py, so `outbox-cdc --help` stays fast.
# ruff: noqa: PLC0415

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from cdc.cli import EXIT_FAILED, load_settings, main

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.progress import Progress

    from cdc.ops import SlotStatus
    from sinks.ops import LagRate, PipelineLag, RedeliveryReport, ReplayPlan, TopicSelection
    from sinks.parking import ParkedEvent
    from sinks.retrier import RetrySummary
    from sinks.trace import EventTrace

F = TypeVar("F", bound=Callable[..., Any])

#: ``lag --watch`` refresh period (the issue asks for 2 s).
WATCH_INTERVAL_S = 2.0
#: Characters of ``last_error`` shown in ``failed list`` (full text with --json).
ERROR_EXCERPT_CHARS = 60


# --- output helpers --------------------------------------------------------------------------


def _out() -> Console:
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True)


def _err() -> Console:
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def _echo_json(value: object) -> None:
    click.echo(json.dumps(value, indent=2, default=str))


def _fail(message: str) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(EXIT_FAILED)


def fmt_age(seconds: float | None) -> str:
    """``None`` -> ``?``; 0.4 -> ``0.4s``; 75 -> ``1m15s``; 7300 -> ``2h01m``; 1d01h."""
    if seconds is None:
        return "?"
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def fmt_bytes(count: int | None) -> str:
    """``None`` -> ``?``; 512 -> ``512 B``; 1536 -> ``1.5 KiB``."""
    if count is None:
        return "?"
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def fmt_offset(offset: int | None) -> str:
    """A committed offset, ``-`` for a group that never committed."""
    return "-" if offset is None else str(offset)


def _guard(func: F) -> F:
    """Map ops and PostgreSQL errors to the CLI's exit codes (usage 2, anything else 1);
    the package's own CdcError is left to :class:`cdc.cli.CliGroup`."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import psycopg

        from sinks.errors import SinkError
        from sinks.ops import OpsUsageError

        try:
            return func(*args, **kwargs)
        except OpsUsageError as exc:
            raise click.UsageError(exc.reason) from exc
        except SinkError as exc:
            _fail(exc.reason)
        except psycopg.Error as exc:  # the message never holds the DSN's password
            _fail(f"PostgreSQL: {exc}")

    return wrapper  # type: ignore[return-value]


@contextmanager
def _progress(*, enabled: bool = True) -> Iterator[Progress]:
    """A transient rich progress display on stderr."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=_err(),
        transient=True,
        disable=not enabled,
    )
    with progress:
        yield progress


def _topic_selections(specs: Sequence[str]) -> list[TopicSelection] | None:
    from sinks.ops import parse_topic_spec

    return [parse_topic_spec(s) for s in specs] or None


# --- lag -------------------------------------------------------------------------------------


@click.command()
@click.option("--group", default=None, help="consumer group  [default: SINK_GROUP_ID]")
@click.option(
    "--topic",
    "topic_specs",
    multiple=True,
    metavar="T[:P,..]",
    help="topic (and partitions) to show; repeatable  [default: the sink's topics]",
)
@click.option("--watch", is_flag=True, help="refresh every 2 s with rates, until Ctrl-C")
@click.option("--json", "as_json", is_flag=True, help="JSON on stdout (one line per refresh)")
@_guard
def lag(group: str | None, topic_specs: tuple[str, ...], watch: bool, as_json: bool) -> None:
    """Consumer lag, oldest event age, slot WAL lag.

    Per topic/partition: committed offset ('-' = never committed), where the
    sink resumes, end offset, lag, and the age of the oldest event the group
    has not processed yet (the commit time of the record where it resumes).
    A commit that is missing or out of range (below the low watermark, past
    the end) resumes where the sink's auto.offset.reset sends it; an
    out-of-range commit gets a warning line on stderr. Also the replication
    slot's WAL lag and the parking lot's counts. --watch refreshes every 2 s
    with rates (in/s: produced, done/s: processed) until Ctrl-C.
    """
    from sinks.ops import pipeline_lag

    settings = load_settings("kafka_bootstrap_servers")
    topics = _topic_selections(topic_specs)
    if watch:
        _watch(lambda: pipeline_lag(settings, group=group, topics=topics), as_json=as_json)
        return
    report = pipeline_lag(settings, group=group, topics=topics)
    if as_json:
        _echo_json(report.as_json())
    else:
        _out().print(_lag_view(report, rates=None))
    _warn(report.warnings)
    for problem in report.problems:
        click.echo(f"error: {problem}", err=True)
    if report.problems:
        sys.exit(EXIT_FAILED)


def _warn(lines: Sequence[str]) -> None:
    for line in lines:
        click.echo(f"warning: {line}", err=True)


def _watch(read: Callable[[], PipelineLag], *, as_json: bool) -> None:
    """Refresh until Ctrl-C: a rich Live view, or one JSON line per refresh."""
    from rich.live import Live

    from sinks.ops import lag_rates

    before: PipelineLag | None = None
    try:
        with Live(console=_out(), auto_refresh=False, transient=False) as live:
            while True:
                report = read()
                rates = None
                if before is not None:
                    elapsed_s = (report.at_ms - before.at_ms) / 1000
                    rates = lag_rates(before.partitions, report.partitions, elapsed_s=elapsed_s)
                if as_json:
                    click.echo(json.dumps(report.as_json(), default=str))
                else:
                    live.update(_lag_view(report, rates=rates, problems=True), refresh=True)
                before = report
                time.sleep(WATCH_INTERVAL_S)
    except KeyboardInterrupt:
        return


def _lag_view(
    report: PipelineLag, *, rates: dict[tuple[str, int], LagRate] | None, problems: bool = False
) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    totals = report.totals
    table = Table(title=f"consumer group {report.group}", title_justify="left")
    for name in (
        "topic",
        "partition",
        "committed",
        "resumes at",
        "end",
        "lag",
        "oldest unprocessed",
    ):
        table.add_column(name, justify="left" if name == "topic" else "right")
    if rates is not None:
        table.add_column("in/s", justify="right")
        table.add_column("done/s", justify="right")
    for row in report.partitions:
        cells = [
            row.topic,
            str(row.partition),
            fmt_offset(row.committed_offset),
            _fmt_resume(row.resume_offset, out_of_range=row.warning is not None),
            str(row.end_offset),
            str(row.lag),
            fmt_age(row.oldest_unprocessed_age_s),
        ]
        if rates is not None:
            rate = rates.get((row.topic, row.partition))
            cells += (
                [f"{rate.produced_per_s:.1f}", f"{rate.processed_per_s:.1f}"]
                if rate
                else [
                    "",
                    "",
                ]
            )
        table.add_row(*cells, style="bold" if row.lag else None)
    summary = Text(
        f"total lag {totals.lag} in {totals.lagging_partitions}/{totals.partitions} partitions;"
        f" oldest unprocessed {fmt_age(totals.oldest_unprocessed_age_s)}"
    )
    parts: list[RenderableType] = [table, summary]
    if not report.partitions:
        parts.append(Text("no partitions: no topic of the sink's exists yet (CDC_TOPIC_PREFIX)"))
    if report.slot is not None:
        parts.append(Text(_slot_line(report.slot)))
    if report.parking is not None:
        counts = ", ".join(f"{k} {v}" for k, v in report.parking.items())
        parts.append(Text(f"parking lot: {counts}"))
    if problems:
        parts += [Text(f"warning: {w}", style="yellow") for w in report.warnings]
        parts += [Text(f"error: {p}", style="red") for p in report.problems]
    return Group(*parts)


def _fmt_resume(offset: int | None, *, out_of_range: bool) -> str:
    """Where the consumer resumes; ``!`` marks a commit out of range, ``error`` no resume."""
    text = "error" if offset is None else str(offset)
    return f"{text} !" if out_of_range else text


def _slot_line(slot: SlotStatus) -> str:
    if not slot["exists"]:
        return f"slot {slot['slot']}: does not exist"
    state = f"active (PID {slot['active_pid']})" if slot["active"] else "inactive"
    return (
        f"slot {slot['slot']}: {state}, WAL lag {fmt_bytes(slot['wal_lag_bytes'])},"
        f" lag time {fmt_age(slot['lag_time_s'])}, confirmed {slot['confirmed_flush_lsn']}"
    )


# --- replay ----------------------------------------------------------------------------------


@click.command()
@click.option("--group", required=True, help="the consumer group whose offsets move")
@click.option(
    "--topic",
    "topic_specs",
    multiple=True,
    metavar="T[:P,..]",
    help="topic, optionally with partitions (orders:0,2); repeatable",
)
@click.option("--all-topics", is_flag=True, help="every topic of the sink (CDC_TOPIC_PREFIX)")
@click.option("--to-earliest", is_flag=True, help="the oldest record still in Kafka")
@click.option("--to-latest", is_flag=True, help="the end: skip what is not processed yet")
@click.option(
    "--to-datetime", metavar="ISO8601", help="first record committed at/after (naive = UTC)"
)
@click.option("--by-duration", metavar="DURATION", help="back by an ISO-8601 duration (PT15M)")
@click.option("--shift-by", metavar="N", help="move by N records (negative: back)")
@click.option("--to-offset", metavar="N", help="an absolute offset (clamped per partition)")
@click.option(
    "--include-uncommitted",
    is_flag=True,
    help="also move partitions the group never committed (default: untouched)",
)
@click.option(
    "--from-earliest-if-uncommitted",
    is_flag=True,
    help="--shift-by a partition without a committed offset from its low watermark",
)
@click.option("--execute", is_flag=True, help="apply (default: dry run, nothing changes)")
@click.option("--json", "as_json", is_flag=True, help="the plan as JSON on stdout")
@_guard
def replay(
    group: str,
    topic_specs: tuple[str, ...],
    all_topics: bool,
    include_uncommitted: bool,
    from_earliest_if_uncommitted: bool,
    execute: bool,
    as_json: bool,
    **targets: Any,
) -> None:
    """Move a group's offsets (dry run unless --execute).

    Shows per partition the committed offset, where the sink resumes today,
    the target, and the records that will be delivered again (or skipped).
    Targets are Kafka's (kafka-consumer-groups --reset-offsets): clamped to
    each partition's [low, high]; --shift-by is committed + N, then clamped; a
    time target goes to the first record committed at or after it, or to the
    end. Partitions the group never committed are left alone ("not committed
    — untouched") unless named (T:p) or --include-uncommitted; shifting one is
    refused unless --from-earliest-if-uncommitted. Refused (exit 1, the plan
    still shown) while the group has active members: stop the sink first.
    """
    from sinks.ops import ReplayKind, ReplaySpec, apply_replay, plan_replay

    if bool(topic_specs) == all_topics:
        raise click.UsageError("give --topic T[:p,..] (repeatable) or --all-topics")
    chosen = [(k, v) for k, v in targets.items() if v not in (None, False)]
    if len(chosen) != 1:
        raise click.UsageError("give exactly one of --" + " | --".join(k.value for k in ReplayKind))
    name, raw = chosen[0]  # the option's name is the kind's value: to_earliest -> to-earliest
    spec = ReplaySpec.from_option(
        ReplayKind(name.replace("_", "-")),
        None if raw is True else raw,
        from_earliest_if_uncommitted=from_earliest_if_uncommitted,
    )
    settings = load_settings("kafka_bootstrap_servers")
    plan = plan_replay(
        settings,
        group=group,
        spec=spec,
        topics=_topic_selections(topic_specs),
        include_uncommitted=include_uncommitted,
    )
    refusals = _refusals(plan)
    if refusals:
        _show_plan(plan, as_json=as_json, executed=False, refused=True)
        _fail("; ".join(refusals) + "; nothing changed")
    if execute:
        apply_replay(settings, plan)
    _show_plan(plan, as_json=as_json, executed=execute)


def _refusals(plan: ReplayPlan) -> list[str]:
    """Why the plan must not be applied (each reason its own sentence), or nothing."""
    reasons = []
    if plan.refusal is not None:
        reasons.append(plan.refusal)
    if plan.active:
        reasons.append(
            f"consumer group {plan.group} is active ({plan.group_state}, {plan.active_members}"
            " member(s)): stop every sink of the group first"
        )
    return reasons


def _show_plan(plan: ReplayPlan, *, as_json: bool, executed: bool, refused: bool = False) -> None:
    if as_json:
        _echo_json({**plan.as_json(), "executed": executed})
    else:
        _out().print(_plan_view(plan, executed=executed, refused=refused))
    _warn(plan.warnings)


_PLAN_COLUMNS = (
    "topic",
    "partition",
    "low",
    "high",
    "committed",
    "resumes at",
    "target",
    "redeliver",
    "skip",
    "note",
)


def _plan_view(plan: ReplayPlan, *, executed: bool, refused: bool) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from sinks.ops import PartitionAction

    table = Table(
        title=f"replay of group {plan.group}: {plan.spec.describe()}"
        f" (auto.offset.reset={plan.reset.value})",
        title_justify="left",
    )
    for name in _PLAN_COLUMNS:
        table.add_column(name, justify="left" if name in ("topic", "note") else "right")
    for p in plan.partitions:
        table.add_row(
            p.topic,
            str(p.partition),
            str(p.low_offset),
            str(p.high_offset),
            fmt_offset(p.current_offset),
            _fmt_resume(p.resume_offset, out_of_range=p.warning is not None),
            fmt_offset(p.target_offset),
            str(p.redeliver_count),
            str(p.skip_count),
            p.note,
            style="bold" if p.changes else None,
        )
    if refused:
        verdict = "refused, nothing changed"
    elif executed:
        verdict = "applied"
    else:
        verdict = "dry run, nothing changed (add --execute to apply)"
    untouched = len(plan.with_action(PartitionAction.UNTOUCHED))
    summary = f"{plan.redeliver_count} record(s) to deliver again, {plan.skip_count} to skip"
    if untouched:
        summary += f", {untouched} partition(s) not committed — untouched"
    return Group(table, Text(f"{summary}: {verdict}"))


# --- redeliver -------------------------------------------------------------------------------


@click.command()
@click.option(
    "--event-id", "event_ids", type=click.UUID, multiple=True, help="event id; repeatable"
)
@click.option("--key", default=None, help="every event of this key (aggregate id), in order")
@click.option("--since", default=None, metavar="ISO8601", help="scan from this time (naive = UTC)")
@click.option(
    "--topic",
    "topic_specs",
    multiple=True,
    metavar="T[:P,..]",
    help="topics to scan; repeatable  [default: the sink's topics]",
)
@click.option("--json", "as_json", is_flag=True, help="the outcome as JSON on stdout")
@_guard
def redeliver(
    event_ids: tuple[Any, ...],
    key: str | None,
    since: str | None,
    topic_specs: tuple[str, ...],
    as_json: bool,
) -> None:
    """Send chosen events to the engine again.

    By event id (the 'id' header) or by key (every event of that aggregate id,
    in commit order). Each is sent with its own event id as Idempotency-Key.
    Exit 1 unless every chosen event was found and delivered.
    """
    from sinks.ops import parse_datetime_ms
    from sinks.ops import redeliver as run_redeliver

    if bool(event_ids) == (key is not None):
        raise click.UsageError("give --event-id UUID (repeatable) or --key K")
    since_ms = parse_datetime_ms(since) if since else None
    settings = load_settings("kafka_bootstrap_servers")
    with _progress(enabled=not as_json) as bar:
        tasks: dict[str, Any] = {}

        def progress(phase: str, done: int, total: int | None) -> None:
            if phase not in tasks:
                label = "scanning Kafka" if phase == "scan" else "delivering"
                tasks[phase] = bar.add_task(label, total=total)
            bar.update(tasks[phase], completed=done, total=total)

        report = run_redeliver(
            settings,
            event_ids=[str(e) for e in event_ids] or None,
            key=key,
            since_ms=since_ms,
            topics=_topic_selections(topic_specs),
            progress=progress,
        )
    _show_redelivery(report, as_json=as_json)
    failure = _redelivery_failure(report, key)
    if failure is not None:
        _fail(failure)


def _show_redelivery(report: RedeliveryReport, *, as_json: bool) -> None:
    if as_json:
        _echo_json(report.as_json())
        return
    from rich.table import Table

    table = Table(
        title=f"redelivered {len(report.items)} event(s), {report.scanned_count} records scanned",
        title_justify="left",
    )
    table.add_column("#", justify="right")
    table.add_column("event id", no_wrap=True)
    table.add_column("type")
    table.add_column("from", overflow="fold")
    table.add_column("outcome")
    table.add_column("detail", overflow="fold")
    for n, item in enumerate(report.items, start=1):
        table.add_row(
            str(n),
            item.event_id or "-",
            item.event_type or "-",
            f"{item.topic}[{item.partition}]@{item.offset}",
            item.outcome.value,
            "" if item.outcome.value == "delivered" else item.detail,
        )
    _out().print(table)


def _redelivery_failure(report: RedeliveryReport, key: str | None) -> str | None:
    """Why the redelivery is not a success, or None."""
    if not report.items and not report.missing_event_ids:
        return f"no record with key {key!r} found" if key is not None else "no event found"
    if report.missing_event_ids:
        return f"not found in Kafka: {', '.join(report.missing_event_ids)}"
    failed = [i for i in report.items if i.outcome.value != "delivered"]
    if failed:
        return f"{len(failed)} of {len(report.items)} event(s) not delivered"
    return None


# --- failed (parking lot) --------------------------------------------------------------------


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
@_guard
def failed_list(
    limit: int, event_type: str | None, statuses: tuple[str, ...], as_json: bool
) -> None:
    """The oldest parked events (by default what the admin API lists: FAILED/PENDING)."""
    from sinks.ops import parked_events

    rows = parked_events(
        load_settings("pg_dsn"),
        limit=limit,
        statuses=statuses or ("FAILED", "PENDING"),
        event_type=event_type,
    )
    if as_json:
        _echo_json({"count": len(rows), "events": [r.as_json() for r in rows]})
        return
    _out().print(_parked_table(rows))


@failed.command("accept")
@click.option("--id", "ids", type=int, multiple=True, help="parked event id; repeatable")
@click.option("--type", "event_type", help="every open row of this sync type or record type")
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
@click.option("--json", "as_json", is_flag=True, help="the ids marked DONE as JSON on stdout")
@_guard
def failed_accept(ids: tuple[int, ...], event_type: str | None, yes: bool, as_json: bool) -> None:
    """Mark open parked events DONE without sending them ("accept as skipped").

    For events nobody needs delivered, e.g. a type the engine has no use for;
    the previous error stays in last_error. Rows being retried right now are
    left alone.
    """
    from sinks.ops import accept_parked, count_acceptable

    if not ids and not event_type:
        raise click.UsageError("give --id N (repeatable) and/or --type T")
    settings = load_settings("pg_dsn")
    count = count_acceptable(settings, ids=list(ids) or None, event_type=event_type)
    if count == 0:
        _fail("no open parked event matches")
    what = f"{count} open parked event(s)" + (f" of type {event_type}" if event_type else "")
    if not yes and not click.confirm(f"mark {what} DONE without sending them?", err=True):
        _fail("nothing changed")
    accepted = accept_parked(settings, ids=list(ids) or None, event_type=event_type)
    if as_json:
        _echo_json({"accepted_count": len(accepted), "event_ids": accepted})
    else:
        _out().print(f"marked {len(accepted)} parked event(s) DONE (accepted as skipped)")


def _parked_table(rows: Sequence[ParkedEvent]) -> Any:
    from rich.table import Table

    table = Table(title=f"{len(rows)} failed or pending sync event(s)", title_justify="left")
    table.add_column("id", justify="right")
    table.add_column("type", no_wrap=True)
    table.add_column("status")
    table.add_column("retries", justify="right")
    table.add_column("next retry", no_wrap=True)
    table.add_column("event id", no_wrap=True)
    table.add_column("last error", overflow="fold")
    for r in rows:
        table.add_row(
            str(r.event_id),
            r.event_type,
            r.status,
            str(r.retry_count),
            r.next_retry_at.astimezone().strftime("%Y-%m-%d %H:%M:%S") if r.next_retry_at else "-",
            r.outbox_event_id or "-",
            (r.last_error or "")[:ERROR_EXCERPT_CHARS],
        )
    return table


@failed.command("retry")
@click.option("--id", "ids", type=int, multiple=True, help="parked event id; repeatable")
@click.option("--all", "retry_all", is_flag=True, help="every FAILED/PENDING row (up to 100)")
@click.option("--json", "as_json", is_flag=True, help="the admin API's answer on stdout")
@_guard
def failed_retry(ids: tuple[int, ...], retry_all: bool, as_json: bool) -> None:
    """Retry parked events now; exit 1 if any still fails.

    Same rules and counts as the admin API (processed_count, done_count,
    failed_count): an engine outage spends no attempt, a rejection does.
    """
    from sinks.ops import retry_parked

    if bool(ids) == retry_all:
        raise click.UsageError("give --id N (repeatable) or --all")
    summary = retry_parked(load_settings("pg_dsn"), ids=list(ids) or None, retry_all=retry_all)
    ok = summary.failed_count == 0 and not summary.unknown_ids and not summary.busy_ids
    if as_json:
        _echo_json(_retry_answer(summary, ok=ok))
    else:
        _show_retry(summary)
    if not ok:
        sys.exit(EXIT_FAILED)


def _retry_answer(summary: RetrySummary, *, ok: bool) -> dict[str, object]:
    from sinks.retrier import retry_message

    return {
        "success": ok,
        "message": retry_message(summary.unknown_ids, summary.busy_ids),
        "data": summary.as_data(),
        "unknown_ids": summary.unknown_ids,
        "busy_ids": summary.busy_ids,
        "errors": {str(k): v for k, v in summary.errors.items()},
    }


def _show_retry(summary: RetrySummary) -> None:
    out = _out()
    out.print(
        f"processed {summary.processed_count}: {summary.done_count} done,"
        f" {summary.failed_count} failed"
    )
    for event_id, error in sorted(summary.errors.items()):
        out.print(f"  {event_id}: {error}")
    if summary.unknown_ids:
        out.print(f"unknown or not open: {', '.join(map(str, summary.unknown_ids))}")
    if summary.busy_ids:
        out.print(f"being retried by another instance: {', '.join(map(str, summary.busy_ids))}")


# --- slot ------------------------------------------------------------------------------------


@click.group()
def slot() -> None:
    """The replication slot: status and drop."""


@slot.command("status")
@click.option("--json", "as_json", is_flag=True, help="the status as JSON on stdout")
@_guard
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
        _echo_json(dict(status))
    else:
        _out().print(_slot_table(status))
    if not status["exists"]:
        _fail(f"slot {status['slot']} does not exist")


def _slot_table(status: SlotStatus) -> Any:
    from rich.table import Table

    table = Table(
        title=f"replication slot {status['slot']}", title_justify="left", show_header=False
    )
    table.add_column("field")
    table.add_column("value")
    shown = {
        "plugin": status["plugin"],
        "active": f"yes (PID {status['active_pid']})" if status["active"] else "no",
        "confirmed flush LSN": status["confirmed_flush_lsn"],
        "restart LSN": status["restart_lsn"],
        "current WAL LSN": status["current_wal_lsn"],
        "WAL lag": fmt_bytes(status["wal_lag_bytes"]),
        "retained WAL": fmt_bytes(status["retained_wal_bytes"]),
        "WAL status": status["wal_status"],
        "lag time": fmt_age(status["lag_time_s"]),
        "oldest unconfirmed commit": status["oldest_unconfirmed_commit_ts"],
        "note": status["lag_time_note"],
    }
    for name, value in shown.items():
        table.add_row(name, "-" if value is None else str(value))
    return table


@slot.command("drop")
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
@_guard
def slot_drop_cmd(yes: bool) -> None:
    """Drop the slot; refused while a relay streams it.

    Events committed after the slot's confirmed LSN that are not in Kafka yet
    are lost: the count is shown and confirmation asked unless --yes.
    """
    from cdc.ops import SlotActiveError, slot_drop, slot_status, unconfirmed_event_count

    settings = load_settings("pg_dsn")
    status = slot_status(settings)
    if not status["exists"]:
        _fail(f"slot {settings.slot} does not exist")
    if status["active"]:
        raise SlotActiveError(
            f"slot {settings.slot} is active (PID {status['active_pid']}): stop the relay first"
        )
    pending = unconfirmed_event_count(settings)
    _err().print(_drop_warning(status, pending))
    if not yes and not click.confirm(f"drop slot {settings.slot}?", default=False, err=True):
        _fail("not dropped")
    dropped = slot_drop(settings)
    click.echo(
        f"slot {dropped['slot']} dropped (it had confirmed {dropped['confirmed_flush_lsn']})"
    )


def _drop_warning(status: SlotStatus, pending: int | None) -> str:
    count = "an unknown number of" if pending is None else str(pending)
    return (
        f"[bold]slot {status['slot']}[/bold] confirmed {status['confirmed_flush_lsn']};"
        f" {fmt_bytes(status['wal_lag_bytes'])} of WAL after it hold {count} outbox event(s)."
        " Dropping the slot loses those not yet produced to Kafka: a new slot starts at the"
        " current WAL position. Rebuild the engine afterwards with `outbox-cdc resync users`."
    )


# --- resync ----------------------------------------------------------------------------------


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
@_guard
def resync_users_cmd(batch_size: int, delete_after: bool, as_json: bool) -> None:
    """Emit a UserRegistered event for every user (backfill).

    Through the outbox, in batches of --batch-size users, each batch its own
    transaction, so an engine that lost its state is rebuilt.
    """
    from cdc.ops import resync_users

    settings = load_settings("pg_dsn")
    with _progress(enabled=not as_json) as bar:
        task = bar.add_task("users", total=None)
        emitted = resync_users(
            settings,
            batch_size=batch_size,
            delete_after=delete_after,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
    if as_json:
        _echo_json({"emitted": emitted})
    else:
        click.echo(f"emitted {emitted} UserRegistered event(s) through the outbox")


# --- trace (where is event X?) ----------------------------------------------------------------


@click.command()
@click.argument("event_id", required=False, type=click.UUID)
@click.option("--key", default=None, help="every event of this key (aggregate id) instead")
@click.option(
    "--since",
    default=None,
    metavar="ISO8601",
    help="search records committed since then (naive = UTC)  [default: the outbox row's"
    " creation, else 24 h ago]",
)
@click.option(
    "--max-records",
    type=click.IntRange(min=1),
    default=20_000,
    show_default=True,
    help="records read per partition at most",
)
@click.option("--group", default=None, help="the sink's group  [default: SINK_GROUP_ID]")
@click.option("--json", "as_json", is_flag=True, help="the trace as JSON on stdout")
@_guard
def trace(
    event_id: Any,
    key: str | None,
    since: str | None,
    max_records: int,
    group: str | None,
    as_json: bool,
) -> None:
    """Where is an event? Its outbox commit, Kafka record, groups, parking lot, DLQ.

    By event id (the outbox row's id, the record's 'id' header), or with --key
    every event of one aggregate id. Kafka is searched from the commit time
    (offsets_for_times) and at most --max-records per partition, never whole
    topics. Exit 1 when nothing is found within those bounds (the message says
    which to widen).
    """
    from sinks.ops import parse_datetime_ms
    from sinks.trace import trace_event, trace_key

    if (event_id is None) == (key is None):
        raise click.UsageError("give an EVENT_ID or --key K")
    since_ms = parse_datetime_ms(since) if since else None
    settings = load_settings("pg_dsn", "kafka_bootstrap_servers")
    if event_id is not None:
        found = [
            trace_event(
                settings, str(event_id), since_ms=since_ms, max_records=max_records, group=group
            )
        ]
    else:
        assert key is not None
        found = trace_key(settings, key, since_ms=since_ms, max_records=max_records, group=group)
    if as_json:
        _echo_json(found[0].as_json() if event_id is not None else [t.as_json() for t in found])
        return
    out = _out()
    if key is not None:
        out.print(_key_table(key, found))
    for item in found:
        out.print(_trace_view(item))


def _key_table(key: str, traces: Sequence[EventTrace]) -> Any:
    from rich.table import Table

    table = Table(title=f"{len(traces)} event(s) of key {key}", title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("event id", no_wrap=True)
    for name in ("type", "committed", "kafka", "state"):
        table.add_column(name, overflow="fold")
    for n, item in enumerate(traces, start=1):
        found = item.record or item.dead_letter
        event_type = (found.headers.get("type") if found else None) or (
            item.outbox.event_type if item.outbox else "?"
        )
        table.add_row(
            str(n),
            item.event_id,
            event_type,
            item.commit_ts or "-",
            found.where if found else "-",
            item.state.value,
        )
    return table


def _trace_view(item: EventTrace) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    facts = Table(show_header=False, box=None, pad_edge=False)
    facts.add_column(style="bold", no_wrap=True)
    facts.add_column(overflow="fold")
    row = item.outbox
    facts.add_row(
        "outbox row",
        f"{row.aggregate_type}/{row.aggregate_id} {row.event_type}, created {row.created_at}"
        if row
        else "gone (pruned, or deleted in its transaction) or never there",
    )
    facts.add_row("commit", f"LSN {item.commit_lsn or '?'} at {item.commit_ts or '?'}")
    for label, found in (("kafka record", item.record), ("dead letter", item.dead_letter)):
        if found is None:
            continue
        headers = ", ".join(f"{k}={v}" for k, v in found.headers.items())
        facts.add_row(label, f"{found.where} ts {found.timestamp_iso} key {found.key}")
        facts.add_row("  headers", headers)
    if item.record is None and item.dead_letter is None:
        facts.add_row("kafka record", f"not found ({item.bounds.scanned} records read)")
    parked = item.parked
    if parked is not None:
        facts.add_row(
            "parking lot",
            f"#{parked.id} {parked.sync_type} {parked.status}, {parked.retry_count} retries,"
            f" parked {parked.created_at}, updated {parked.updated_at}, next retry"
            f" {parked.next_retry_at or '-'}: {parked.last_error or ''}",
        )
    groups = Table(title="consumer groups on that partition", title_justify="left")
    for name in ("group", "committed", "position", "records before it"):
        groups.add_column(name, justify="left" if name in ("group", "position") else "right")
    for g in item.groups:
        groups.add_row(
            g.group + (" (sink)" if g.group == item.sink_group else ""),
            fmt_offset(g.committed),
            g.position.value,
            "" if g.records_before is None else str(g.records_before),
        )
    title = Text(f"event {item.event_id}: {item.state.value.upper()}", style="bold")
    parts: list[Any] = [title, Text(item.summary), facts]
    if item.groups:
        parts.append(groups)
    return Group(*parts)


main.add_command(trace)


# --- registration ----------------------------------------------------------------------------

COMMANDS: tuple[click.Command, ...] = (lag, replay, redeliver, failed, slot, resync)


for _command in COMMANDS:
    main.add_command(_command)
