"""``outbox-cdc lag``: consumer lag, oldest event age, slot WAL lag (``--watch``: refreshed).

Calls :func:`sinks.ops.pipeline_lag`; the view is :func:`sinks.cli.render.lag_view`.
Exit 1 when the report names a problem, or when the group never committed an
offset on any partition shown (a typo in --group, or a sink that never ran).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import click

from cdc.cli.app import EXIT_FAILED, load_settings
from cdc.cli.interrupt import interrupt_is_normal_end
from cdc.cli.render import echo_json, out, warn
from sinks.cli import render
from sinks.cli.options import topic_option, topic_selections

if TYPE_CHECKING:
    from sinks.ops.lag import PipelineLag

#: ``lag --watch`` refresh period (the issue asks for 2 s).
WATCH_INTERVAL_S = 2.0


@click.command()
@click.option("--group", default=None, help="consumer group  [default: SINK_GROUP_ID]")
@topic_option("topic (and partitions) to show; repeatable  [default: the sink's topics]")
@click.option("--watch", is_flag=True, help="refresh every 2 s with rates, until Ctrl-C")
@click.option("--json", "as_json", is_flag=True, help="JSON on stdout (one line per refresh)")
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
    from sinks.ops.lag import pipeline_lag

    settings = load_settings("kafka_bootstrap_servers")
    topics = topic_selections(topic_specs)
    if watch:
        _watch(lambda: pipeline_lag(settings, group=group, topics=topics), as_json=as_json)
        return
    report = pipeline_lag(settings, group=group, topics=topics)
    problems = [*report.problems, *_never_committed(report, settings.sink_group_id)]
    if as_json:
        echo_json({**report.as_json(), "problems": problems})
    else:
        out().print(render.lag_view(report, rates=None))
    warn(report.warnings)
    for problem in problems:
        click.echo(f"error: {problem}", err=True)
    if problems:
        sys.exit(EXIT_FAILED)


def _never_committed(report: PipelineLag, sink_group: str) -> list[str]:
    """A group without a commit on any partition shown: its "lag" measures nothing."""
    if not report.partitions or any(p.committed_offset is not None for p in report.partitions):
        return []
    hint = (
        "" if report.group == sink_group else f" (the sink's group is SINK_GROUP_ID={sink_group})"
    )
    return [
        f"consumer group {report.group} has never committed an offset on these topics:"
        f" no such group, or its sink never ran{hint}"
    ]


def _watch(read: Callable[[], PipelineLag], *, as_json: bool) -> None:
    """Refresh until Ctrl-C: a rich Live view, or one JSON line per refresh."""
    from rich.live import Live

    from sinks.ops.offsets import lag_rates

    interrupt_is_normal_end()  # Ctrl-C ends --watch; even inside a Kafka call, exit 0
    before: PipelineLag | None = None
    try:
        with Live(console=out(), auto_refresh=False, transient=False) as live:
            while True:
                report = read()
                rates = None
                if before is not None:
                    elapsed_s = (report.at_ms - before.at_ms) / 1000
                    rates = lag_rates(before.partitions, report.partitions, elapsed_s=elapsed_s)
                if as_json:
                    click.echo(json.dumps(report.as_json(), default=str))
                else:
                    live.update(render.lag_view(report, rates=rates, problems=True), refresh=True)
                before = report
                time.sleep(WATCH_INTERVAL_S)
    except KeyboardInterrupt:
        return
