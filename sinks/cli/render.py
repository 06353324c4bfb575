"""Rendering of the sink's command answers: lag, replay plans, redeliveries, parking, traces.

Every view of an answer of :mod:`sinks.ops`, :mod:`sinks.parking.lot`,
:mod:`sinks.parking.retrier` and :mod:`sinks.trace` is here, built from the shared
formats of :mod:`cdc.cli.render` (ages, sizes, offsets, consoles): tables for
people; the ``--json`` documents come from each answer's ``as_json``. rich is
imported inside each function so ``outbox-cdc --help`` stays fast.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cdc.cli.render import (
    echo_json,
    fmt_age,
    fmt_offset,
    fmt_resume,
    fmt_time,
    out,
    slot_line,
    warn,
)
from cdc.constants import HEADER_DLQ_TOPIC

if TYPE_CHECKING:
    from rich.console import RenderableType

    from sinks.ops.lag import PipelineLag
    from sinks.ops.offsets import LagRate
    from sinks.ops.plan import ReplayPlan
    from sinks.ops.redeliver import RedeliveryReport
    from sinks.parking.lot import ParkedEvent
    from sinks.parking.reasons import ReasonCount
    from sinks.parking.retrier import RetrySummary
    from sinks.trace.model import EventTrace, ParkedRow

#: Characters of ``last_error`` shown in ``failed list`` (full text with --json).
ERROR_EXCERPT_CHARS = 60
#: Widest the ``lag`` table's topic column insists on (longer names fold onto a second line).
TOPIC_MIN_WIDTH_MAX = 48
#: What ``trace`` shows for a dead letter's empty ``dlq.original.topic``.
NO_ORIGINAL_TOPIC = "(none: no valid topic could be made)"


def lag_view(
    report: PipelineLag, *, rates: dict[tuple[str, int], LagRate] | None, problems: bool = False
) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    if report.kafka_error is not None:
        return _lag_without_kafka(report, problems=problems)
    totals = report.totals
    table = Table(title=f"consumer group {report.group}", title_justify="left")
    # The topic names the row (user vs quiz_attempt differ at the end): never cut
    # it; the narrow number columns wrap instead.
    longest = max((len(row.topic) for row in report.partitions), default=5)
    table.add_column("topic", overflow="fold", min_width=min(longest, TOPIC_MIN_WIDTH_MAX))
    for name in (
        "partition",
        "committed",
        "resumes at",
        "end",
        "lag",
        "oldest unprocessed",
    ):
        table.add_column(name, justify="right", overflow="fold")
    if rates is not None:
        table.add_column("in/s", justify="right", overflow="fold")
        table.add_column("done/s", justify="right", overflow="fold")
    for row in report.partitions:
        cells = [
            row.topic,
            str(row.partition),
            fmt_offset(row.committed_offset),
            fmt_resume(row.resume_offset, out_of_range=row.warning is not None),
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
    parts += _database_lines(report)
    if problems:
        parts += [Text(f"warning: {w}", style="yellow") for w in report.warnings]
        parts += [Text(f"error: {p}", style="red") for p in report.problems]
    return Group(*parts)


def _database_lines(report: PipelineLag) -> list[RenderableType]:
    """The slot and parking-lot lines: read from PostgreSQL, shown whatever Kafka does."""
    from rich.text import Text

    lines: list[RenderableType] = []
    if report.slot is not None:
        lines.append(Text(slot_line(report.slot)))
    if report.parking is not None:
        counts = ", ".join(f"{k} {v}" for k, v in report.parking.items())
        lines.append(Text(f"parking lot: {counts}"))
    return lines


def _lag_without_kafka(report: PipelineLag, *, problems: bool) -> Any:
    """Kafka could not be read: the group's partitions are unknown - never shown as lag 0."""
    from rich.console import Group
    from rich.text import Text

    parts: list[RenderableType] = [
        Text(f"consumer group {report.group}: unknown (Kafka could not be read)", style="bold"),
        *_database_lines(report),
    ]
    if problems:
        parts += [Text(f"error: {p}", style="red") for p in report.problems]
    return Group(*parts)


def show_plan(plan: ReplayPlan, *, as_json: bool, executed: bool, refused: bool = False) -> None:
    if as_json:
        echo_json({**plan.as_json(), "executed": executed})
    else:
        out().print(plan_view(plan, executed=executed, refused=refused))
    warn(plan.warnings)


PLAN_COLUMNS = (
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


def plan_view(plan: ReplayPlan, *, executed: bool, refused: bool) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from sinks.ops.plan import PartitionAction

    table = Table(
        title=f"replay of group {plan.group}: {plan.spec.describe()}"
        f" (auto.offset.reset={plan.reset.value})",
        title_justify="left",
    )
    for name in PLAN_COLUMNS:
        table.add_column(name, justify="left" if name in ("topic", "note") else "right")
    for p in plan.partitions:
        table.add_row(
            p.topic,
            str(p.partition),
            str(p.low_offset),
            str(p.high_offset),
            fmt_offset(p.current_offset),
            fmt_resume(p.resume_offset, out_of_range=p.warning is not None),
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


def show_redelivery(report: RedeliveryReport, *, as_json: bool) -> None:
    if as_json:
        echo_json(report.as_json())
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
            "" if item.outcome.value in ("delivered", "duplicate") else item.detail,
        )
    out().print(table)


def parked_table(
    rows: Sequence[ParkedEvent],
    *,
    statuses: Sequence[str],
    scheduled: Callable[[int], bool] | None = None,
) -> Any:
    """The parking lot's rows, readable in 80 columns: the row id, status, retries and the
    reason never squeezed out (the event id and the reason fold instead); ``scheduled``
    (row id -> the scheduler will retry it) blanks the next retry of a row it leaves alone
    (an UNROUTABLE row waiting for a route, a row out of attempts)."""
    from rich.table import Table

    kinds = " or ".join(s.lower() for s in statuses)
    table = Table(title=f"{len(rows)} {kinds} sync event(s)", title_justify="left")
    table.add_column("id", justify="right", no_wrap=True, min_width=2)
    table.add_column("type", overflow="fold", min_width=8)
    table.add_column("status", no_wrap=True)
    table.add_column("retries", justify="right", no_wrap=True)
    table.add_column("next retry (UTC)", overflow="fold", min_width=10)
    table.add_column("event id", overflow="fold", min_width=8)
    table.add_column("reason", overflow="fold", min_width=10)
    for r in rows:
        due = scheduled is None or scheduled(r.event_id)
        kind = r.event_type
        if r.event_type == "UNROUTABLE" and r.type_header:
            kind = f"{r.event_type} ({r.type_header})"
        table.add_row(
            str(r.event_id),
            kind,
            r.status,
            str(r.retry_count),
            fmt_time(r.next_retry_at) if due else "-",
            r.outbox_event_id or "-",
            (r.last_error or "")[:ERROR_EXCERPT_CHARS],
        )
    return table


def reasons_table(counts: Sequence[ReasonCount]) -> Any:
    """Open parked rows per reason class (``failed reasons``), in 80 columns."""
    from rich.table import Table

    table = Table(title="open parked events by reason", title_justify="left")
    table.add_column("events", justify="right", no_wrap=True)
    table.add_column("reason", overflow="fold")
    for c in counts:
        table.add_row(str(c.count), c.reason or "(no reason recorded)")
    if not counts:
        table.caption = "no open parked events"
    return table


def retry_answer(summary: RetrySummary, *, ok: bool) -> dict[str, object]:
    from sinks.parking.retrier import retry_message

    return {
        "success": ok,
        "message": retry_message(summary.unknown_ids, summary.busy_ids),
        "data": summary.as_data(),
        "unknown_ids": summary.unknown_ids,
        "busy_ids": summary.busy_ids,
        "errors": {str(k): v for k, v in summary.errors.items()},
    }


def show_retry(summary: RetrySummary) -> None:
    console = out()
    console.print(
        f"processed {summary.processed_count}: {summary.done_count} done,"
        f" {summary.failed_count} failed"
    )
    for event_id, error in sorted(summary.errors.items()):
        console.print(f"  {event_id}: {error}")
    if summary.unknown_ids:
        console.print(f"unknown or not open: {', '.join(map(str, summary.unknown_ids))}")
    if summary.busy_ids:
        console.print(f"being retried by another instance: {', '.join(map(str, summary.busy_ids))}")


def key_table(key: str, traces: Sequence[EventTrace]) -> Any:
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


def parked_line(parked: ParkedRow) -> str:
    """A parked row in one line: the next retry and the last error only when there are."""
    line = (
        f"#{parked.id} {parked.sync_type} {parked.status}, {parked.retry_count} retries,"
        f" parked {parked.created_at}, updated {parked.updated_at}"
    )
    if parked.next_retry_at:
        line += f", next retry {parked.next_retry_at}"
    if parked.last_error:
        line += f": {parked.last_error}"
    return line


def header_text(headers: Mapping[str, str]) -> str:
    """A record's headers in one line, ``name=value``; an empty ``dlq.original.topic`` (a
    dead letter of a row no valid topic could be made of: the record contract) is said so,
    not printed as a bare ``=``."""
    return ", ".join(
        f"{k}={NO_ORIGINAL_TOPIC}" if k == HEADER_DLQ_TOPIC and not v else f"{k}={v}"
        for k, v in headers.items()
    )


def trace_view(item: EventTrace) -> Any:
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
        headers = header_text(found.headers)
        facts.add_row(label, f"{found.where} ts {found.timestamp_iso} key {found.key}")
        facts.add_row("  headers", headers)
    if item.record is None and item.dead_letter is None:
        facts.add_row("kafka record", f"not found ({item.bounds.scanned} records read)")
    parked = item.parked
    if parked is not None:
        facts.add_row("parking lot", parked_line(parked))
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
