"""``outbox-cdc trace``: where is event X? Its outbox commit, Kafka record, groups, parking lot.

Calls :func:`sinks.trace.search.trace_event` / :func:`~sinks.trace.search.trace_key`; exit 1
when nothing is found within the bounds.
"""

from __future__ import annotations

from typing import Any

import click

from cdc.cli.app import load_settings
from cdc.cli.render import echo_json, out
from sinks.cli import render


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
    from sinks.ops.selection import parse_datetime_ms
    from sinks.trace.search import trace_event, trace_key

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
        echo_json(found[0].as_json() if event_id is not None else [t.as_json() for t in found])
        return
    console = out()
    if key is not None:
        console.print(render.key_table(key, found))
    for item in found:
        console.print(render.trace_view(item))
