"""``outbox-cdc replay``: move a consumer group's offsets (a dry run unless ``--execute``).

Plans with :func:`sinks.ops.plan_replay`, applies with :func:`sinks.ops.apply_replay`;
refused (exit 1, the plan still shown) while the group has active members.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from cdc.cli.app import fail, load_settings
from cdc.cli.render import warn
from sinks.cli import render
from sinks.cli.options import topic_option, topic_selections

if TYPE_CHECKING:
    from sinks.ops.plan import ReplayPlan


@click.command()
@click.option("--group", required=True, help="the consumer group whose offsets move")
@topic_option("topic, optionally with partitions (orders:0,2); repeatable")
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
    still shown) while the group has active members: stop the sink first. A
    dry run of an active group is shown (exit 0: it changes nothing) with a
    warning that --execute would be refused.
    """
    from sinks.ops.plan import ReplayKind, ReplaySpec
    from sinks.ops.replay import apply_replay, plan_replay

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
        topics=topic_selections(topic_specs),
        include_uncommitted=include_uncommitted,
    )
    refusals = _refusals(plan, execute=execute)
    if refusals:
        render.show_plan(plan, as_json=as_json, executed=False, refused=True)
        fail("; ".join(refusals) + "; nothing changed")
    if execute:
        apply_replay(settings, plan)
    render.show_plan(plan, as_json=as_json, executed=execute)
    if plan.active:  # a dry run: nothing changes, but say what --execute would meet
        warn([f"{_active(plan)}; --execute would be refused: stop every sink of the group first"])


def _active(plan: ReplayPlan) -> str:
    return (
        f"consumer group {plan.group} is active ({plan.group_state},"
        f" {plan.active_members} member(s))"
    )


def _refusals(plan: ReplayPlan, *, execute: bool) -> list[str]:
    """Why the plan must not be applied (each reason its own sentence), or nothing."""
    reasons = []
    if plan.refusal is not None:
        reasons.append(plan.refusal)
    if plan.active and execute:
        reasons.append(f"{_active(plan)}: stop every sink of the group first")
    return reasons
