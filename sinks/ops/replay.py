"""Replay: plan a move of a group's offsets (read-only), and apply it.

Guarantees: :func:`plan_replay` never moves an offset. :func:`apply_replay`
is the only writer of the ops: it commits exactly the plan's targets for the
plan's group, and refuses with :class:`~sinks.ops.errors.GroupActiveError` while
the group has members (Kafka itself also refuses an offset change of a
non-empty group; that answer is reported the same way), or with
:class:`~sinks.ops.errors.UncommittedShiftError` when the plan shifts a partition
the group never committed.
"""

from __future__ import annotations

from collections.abc import Sequence

from cdc.settings import Settings
from sinks.ops.errors import GroupActiveError, OpsUsageError, UncommittedShiftError
from sinks.ops.kafka import KafkaOps
from sinks.ops.offsets import sink_offset_reset
from sinks.ops.plan import ReplayPlan, ReplaySpec, group_is_active, plan_partition
from sinks.ops.selection import TopicSelection, named_partitions, now_ms


def plan_replay(
    settings: Settings,
    *,
    group: str,
    spec: ReplaySpec,
    topics: Sequence[TopicSelection] | None = None,
    include_uncommitted: bool = False,
    at_ms: int | None = None,
) -> ReplayPlan:
    """Per partition current -> target offsets and the records to deliver again or skip.

    ``topics=None`` takes every partition of the sink's topics. Partitions the group
    never committed are planned only when named (``T:p``) or ``include_uncommitted``
    (:func:`partition_action`). Reads only. A group that does not exist is
    :class:`~sinks.ops.errors.GroupNotFoundError` - unless uncommitted partitions are
    asked for (named or ``include_uncommitted``), as when seeding a new group.
    """
    now = now_ms() if at_ms is None else at_ms
    reset = sink_offset_reset(settings)
    named = named_partitions(topics)
    with KafkaOps(settings) as kafka:
        tps = kafka.partitions(topics)
        if not tps:
            raise OpsUsageError(
                f"no topic matches the sink's topics (CDC_TOPIC_PREFIX={settings.topic_prefix!r})"
            )
        if not (include_uncommitted or named):  # else: the operator may be seeding a new group
            kafka.require_group(group)
        marks = kafka.watermarks(tps)
        committed = kafka.committed(group, tps)
        ts_ms = spec.timestamp_ms(now_ms=now)
        by_time = kafka.offsets_for_time(tps, ts_ms) if ts_ms is not None else {}
        state, members = kafka.group_state(group)
    partitions = tuple(
        plan_partition(
            spec,
            topic=t,
            partition=p,
            current=committed[(t, p)],
            low=marks[(t, p)][0],
            high=marks[(t, p)][1],
            reset=reset,
            time_offset=by_time.get((t, p)),
            named=(t, p) in named,
            include_uncommitted=include_uncommitted,
        )
        for t, p in tps
    )
    return ReplayPlan(
        group=group,
        spec=spec,
        at_ms=ts_ms,
        partitions=partitions,
        group_state=state,
        active_members=members,
        reset=reset,
        include_uncommitted=include_uncommitted,
    )


def apply_replay(settings: Settings, plan: ReplayPlan) -> None:
    """Commit the plan's targets (MOVE partitions only) for its group.

    :class:`UncommittedShiftError` when the plan shifts a partition without a
    committed offset; :class:`GroupActiveError` while the group has members.
    """
    if plan.refusal is not None:
        raise UncommittedShiftError(plan.refusal)
    with KafkaOps(settings) as kafka:
        state, members = kafka.group_state(plan.group)
        if group_is_active(state, members):
            raise GroupActiveError(plan.group, state=state, members=members)
        offsets = {
            (p.topic, p.partition): p.target_offset
            for p in plan.partitions
            if p.target_offset is not None
        }
        if offsets:
            kafka.commit_for_group(plan.group, offsets)
