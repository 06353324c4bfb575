"""``outbox-cdc redeliver``: send chosen events to the engine again.

Calls :func:`sinks.ops.redeliver`; exit 1 unless every chosen event was found
and delivered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from cdc.cli.app import fail, load_settings
from cdc.cli.render import progress_bar
from sinks.cli import render
from sinks.cli.options import topic_option, topic_selections

if TYPE_CHECKING:
    from sinks.ops.redeliver import RedeliveryReport


@click.command()
@click.option(
    "--event-id", "event_ids", type=click.UUID, multiple=True, help="event id; repeatable"
)
@click.option("--key", default=None, help="every event of this key (aggregate id), in order")
@click.option("--since", default=None, metavar="ISO8601", help="scan from this time (naive = UTC)")
@topic_option("topics to scan; repeatable  [default: the sink's topics]")
@click.option("--json", "as_json", is_flag=True, help="the outcome as JSON on stdout")
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
    from sinks.ops.redeliver import redeliver as run_redeliver
    from sinks.ops.selection import parse_datetime_ms

    if bool(event_ids) == (key is not None):
        raise click.UsageError("give --event-id UUID (repeatable) or --key K")
    since_ms = parse_datetime_ms(since) if since else None
    settings = load_settings("kafka_bootstrap_servers")
    with progress_bar(enabled=not as_json) as bar:
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
            topics=topic_selections(topic_specs),
            progress=progress,
        )
    render.show_redelivery(report, as_json=as_json)
    failure = _redelivery_failure(report, key)
    if failure is not None:
        fail(failure)


def _redelivery_failure(report: RedeliveryReport, key: str | None) -> str | None:
    """Why the redelivery is not a success, or None."""
    if not report.items and not report.missing_event_ids:
        return f"no record with key {key!r} found" if key is not None else "no event found"
    if report.missing_event_ids:
        return f"not found in Kafka: {', '.join(report.missing_event_ids)}"
    failed = [i for i in report.items if i.outcome.value not in ("delivered", "duplicate")]
    if failed:
        return f"{len(failed)} of {len(report.items)} event(s) not delivered"
    return None
