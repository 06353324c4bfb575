"""A consumer group's first start, chosen knowingly: never from the log start by accident.

Guarantee: the sink joins its group (``SINK_GROUP_ID``) only when

* the group has committed an offset on one of the sink's topics (it resumes where it was), or
* no other group has committed an offset on them (the first group of a deployment: from the
  earliest record, as always), or
* ``SINK_NEW_GROUP_START`` says where a new group begins: ``earliest`` (every record still
  in the topics) or ``latest`` (the group's offsets are committed at the topics' ends
  before it joins: what arrives afterwards is delivered, what was there before is not);
  an operator's ``KAFKA_CONFIG_AUTO_OFFSET_RESET`` says it too, when that is unset.

Anything else - a misspelt ``SINK_GROUP_ID``, a second deployment beside the first, a
group whose offsets expired - is refused before the group is joined, with one line
(:class:`~cdc.errors.ConfigError`, exit 2) naming the group that consumed the topics
(``did you mean``, when its name is close: the ops commands' suggestion,
:func:`sinks.ops.kafka.similar_groups`) and the setting that chooses. A topic created
later is read from its start whatever was chosen (nothing in it was ever read).

:func:`decide` is the decision, pure. :func:`look` reads what it needs through
:class:`sinks.ops.kafka.KafkaOps` (a client that never joins a group): the sink's
partitions, this group's committed offsets, then other groups' in order of name
similarity, at most :data:`MAX_GROUPS_LOOKED_AT` of them, stopping at the first
:data:`GROUPS_NAMED` that consumed. :func:`guard_new_group` runs it at the sink's start on a
thread of its own, before the group is joined (``outbox-cdc sink`` hands it to
:func:`sinks.runtime.service.run_sink`); while Kafka does not answer it tries again
every :data:`RETRY_S` (``/readyz`` says so, ``/healthz`` stays alive) and SIGTERM ends the
wait at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass
from enum import Enum

from cdc.errors import ConfigError
from cdc.health import Liveness
from cdc.settings import Settings
from sinks.ops.errors import GroupActiveError, KafkaOpsError
from sinks.ops.kafka import KafkaOps, similar_groups
from sinks.ops.selection import TP

log = logging.getLogger("sinks.new_group")

#: Other groups whose committed offsets are read, closest name first: a typo's intended
#: group is among the closest; a cluster of thousands of groups is not read whole at start.
MAX_GROUPS_LOOKED_AT = 50
#: The refusal names at most this many groups that consumed the topics.
GROUPS_NAMED = 2
#: While Kafka does not answer, the look is tried again after this long.
RETRY_S = 5.0
#: How often a running try looks at SIGTERM (and ticks the liveness).
POLL_S = 0.5
#: The setting that chooses, as the refusal names it.
VARIABLE = "SINK_NEW_GROUP_START"
#: librdkafka's reset policies (``KAFKA_CONFIG_AUTO_OFFSET_RESET``) and the start each means.
_RESET_POLICIES = {
    "earliest": "earliest",
    "smallest": "earliest",
    "beginning": "earliest",
    "latest": "latest",
    "largest": "latest",
    "end": "latest",
}


class Start(Enum):
    """Where the group starts."""

    RESUME = "resume"  # from its own committed offsets
    FIRST = "first"  # the first group on the topics: from the earliest record
    EARLIEST = "earliest"  # a new group, chosen: from the earliest record
    LATEST = "latest"  # a new group, chosen: its offsets committed at the ends first
    REFUSE = "refuse"  # a new group beside others, nothing chosen


@dataclass(frozen=True)
class GroupView:
    """What Kafka holds of the group and its topics."""

    #: the group has a committed offset on one of the sink's partitions
    own_offsets: bool
    #: other groups with committed offsets there, closest name first (at most GROUPS_NAMED)
    consumed_by: tuple[str, ...]


def decide(view: GroupView, choice: str) -> Start:
    """Where the group starts, from what Kafka holds and ``SINK_NEW_GROUP_START``."""
    if view.own_offsets:
        return Start.RESUME
    if choice == "earliest":
        return Start.EARLIEST
    if choice == "latest":
        return Start.LATEST
    return Start.REFUSE if view.consumed_by else Start.FIRST


def refusal(group: str, consumed_by: tuple[str, ...]) -> str:
    """The one line of a refused start."""
    close = similar_groups(group, consumed_by, n=1)
    hint = f" (did you mean SINK_GROUP_ID={close[0]}?)" if close else ""
    return (
        f"consumer group {group} has committed no offset on the sink's topics, which group"
        f"{'s' if len(consumed_by) > 1 else ''} {' and '.join(consumed_by)} consumed{hint};"
        f" to start {group} as a new group, set {VARIABLE}=earliest (every record still in"
        " the topics, again) or latest (only records from now)"
    )


def look(ops: KafkaOps, group: str) -> tuple[GroupView, list[TP]]:
    """What Kafka holds of ``group`` and the sink's partitions (raises KafkaOpsError)."""
    tps = ops.partitions(None)
    if not tps:
        return GroupView(own_offsets=False, consumed_by=()), tps
    if _has_offsets(ops, group, tps):
        return GroupView(own_offsets=True, consumed_by=()), tps
    candidates = similar_groups(group, ops.known_groups(), n=MAX_GROUPS_LOOKED_AT, cutoff=0.0)
    consumed: list[str] = []
    for other in candidates:
        if _has_offsets(ops, other, tps):
            consumed.append(other)
            if len(consumed) == GROUPS_NAMED:
                break
    return GroupView(own_offsets=False, consumed_by=tuple(consumed)), tps


def _has_offsets(ops: KafkaOps, group: str, tps: list[TP]) -> bool:
    return any(offset is not None for offset in ops.committed(group, tps).values())


def chosen_start(settings: Settings) -> str:
    """``SINK_NEW_GROUP_START``, else the reset policy an operator set for the consumer
    (``KAFKA_CONFIG_AUTO_OFFSET_RESET=latest`` is a choice too), else nothing chosen."""
    if settings.sink_new_group_start:
        return settings.sink_new_group_start
    policy = settings.kafka_config.get("auto.offset.reset", "").lower()
    return _RESET_POLICIES.get(policy, "")


def describe(start: Start, group: str, choice: str) -> str:
    """Where ``group`` starts, in words (the start's log line, ``check``'s finding)."""
    if start is Start.RESUME:
        return f"consumer group {group}: resumes from its committed offsets"
    if start is Start.FIRST:
        why = "no other group consumed its topics"
        return f"consumer group {group}: new, starts from the earliest record ({why})"
    if start is Start.EARLIEST:
        return f"consumer group {group}: new, starts from the earliest record ({choice})"
    return f"consumer group {group}: new, starts at the topics' ends ({choice})"


def _choice_said(settings: Settings) -> str:
    if settings.sink_new_group_start:
        return f"{VARIABLE}={settings.sink_new_group_start}"
    return f"KAFKA_CONFIG_AUTO_OFFSET_RESET={settings.kafka_config.get('auto.offset.reset')}"


def preview(settings: Settings) -> tuple[Start, str]:
    """Where the sink's group would start, and why in words (the refusal's line when it
    would be refused); changes nothing (``outbox-cdc check``). Raises KafkaOpsError."""
    group = settings.sink_group_id
    with KafkaOps(settings) as ops:
        view, _ = look(ops, group)
    start = decide(view, chosen_start(settings))
    if start is Start.REFUSE:
        return start, refusal(group, view.consumed_by)
    return start, describe(start, group, _choice_said(settings))


def check_new_group(settings: Settings) -> Start:
    """Decide (and for ``latest``, commit the ends); :class:`ConfigError` when refused.

    Raises :class:`KafkaOpsError` when Kafka does not answer."""
    group = settings.sink_group_id
    with KafkaOps(settings) as ops:
        view, tps = look(ops, group)
        start = decide(view, chosen_start(settings))
        if start is Start.REFUSE:
            raise ConfigError(refusal(group, view.consumed_by))
        if start is Start.LATEST and tps:
            ends = {tp: high for tp, (_, high) in ops.watermarks(tps).items()}
            if _has_offsets(ops, group, tps):
                return Start.RESUME  # another instance of the group set them meanwhile
            try:
                ops.commit_for_group(group, ends)
            except GroupActiveError:
                # another member joined meanwhile: it passed this guard and set the offsets
                return Start.RESUME
    if start is not Start.RESUME:
        log.info("%s", describe(start, group, _choice_said(settings)))
    return start


async def guard_new_group(settings: Settings, liveness: Liveness, stop: asyncio.Event) -> bool:
    """:func:`check_new_group` before the sink joins its group: True to go on, False when
    ``stop`` was set first; its :class:`ConfigError` (a refused start) propagates.

    Each try runs on a daemon thread (a blocked Kafka call never holds the event loop, and
    SIGTERM never waits for it); while Kafka does not answer, ``/readyz`` says so and the
    try is repeated every :data:`RETRY_S`."""
    said_unreachable = False
    while not stop.is_set():
        try:
            started = await _off_loop(settings, liveness=liveness, stop=stop)
            return started is not None and not stop.is_set()
        except KafkaOpsError as exc:
            liveness.set(
                f"kafka unreachable: {exc} (checking consumer group {settings.sink_group_id}"
                " before joining it)",
                ready=False,
            )
            if not said_unreachable:
                log.warning("sink: %s; checking the consumer group again every %gs", exc, RETRY_S)
                said_unreachable = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=RETRY_S)
        liveness.tick()
    return False


async def _off_loop(settings: Settings, *, liveness: Liveness, stop: asyncio.Event) -> Start | None:
    """:func:`check_new_group` on a daemon thread, liveness ticking while it runs; None
    when ``stop`` is set first (the thread is left to end on its own)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Start] = loop.create_future()

    def settle(result: Start | None, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            assert result is not None
            done.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = check_new_group(settings)
        except Exception as exc:  # handed to the awaiting side
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="new-group-guard", daemon=True).start()
    while not done.done():
        if stop.is_set():
            return None
        liveness.tick()
        await asyncio.wait({done}, timeout=POLL_S)
    return done.result()
