"""The sink never skips silently: a committed offset below the log start is an ERROR, counted.

librdkafka's own ``auto.offset.reset`` moves a consumer whose fetch offset is out
of range (its records removed by retention or ``DeleteRecords``) to the log start
with nothing but a WARNING of its own: no count, no range, no alert. So the
sink's consumer runs with ``auto.offset.reset=error`` - librdkafka then stops
the partition and reports ``_AUTO_OFFSET_RESET`` with the offset it could not
fetch - and this module applies the configured policy itself (:func:`decide`,
pure) and says what it cost (:class:`OffsetResets`, the shell).

Guarantees:

* a partition with no committed offset starts where the configured policy says
  (``earliest``: the log start; ``latest``: the end), quietly: nothing of the
  group's was skipped;
* an offset below the log start (records removed before the group processed
  them) logs one ERROR naming the topic, the partition and the skipped range
  ``[committed, log start)``, adds the number of skipped offsets to
  ``outbox_sink_offsets_expired_total``, and goes on from the log start (from
  the end under ``latest``, the skipped range then reaching it);
* an offset past the end (a truncated log, a recreated topic) goes to the log
  start under ``earliest`` (records read again, none skipped) with a WARNING;
* ``auto.offset.reset=error`` configured on purpose keeps librdkafka's meaning:
  the partition stays stopped, the ERROR names it;
* the position a skip moved to is committed at once: the group's commit then says
  what it dealt with, and a restart does not report the same range again (a record
  of the partition the sink still held from before the skip may commit a lower
  offset afterwards: the range is then reported once more after a restart - never lost);
* the consumer's thread never waits for the broker here: the watermarks a decision
  needs are asked on another thread (:class:`ResetBook` keeps which partitions wait,
  at most one question out per partition), the answer is applied on a later turn,
  and the position is committed asynchronously - a broker that stops answering
  cannot hold the thread that serves pauses, commits and close;
* the partition is restarted at the chosen offset by re-assigning it
  (librdkafka refuses a seek on a partition stopped by the error), keeping it
  paused if the sink had paused it; an eager assignor re-assigns the whole
  assignment at each partition's consumed position (nothing skipped, nothing read twice).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

log = logging.getLogger("sinks.consumer")  # the name operators filter on: kept across moves

TP = tuple[str, int]

#: Broker requests of the reset (watermarks) give up after this.
WATERMARK_TIMEOUT_S = 5.0
#: librdkafka's own default when the configuration names no policy.
LIBRDKAFKA_DEFAULT = "largest"
#: librdkafka's logical offsets: the log start and the end of a partition.
OFFSET_BEGINNING, OFFSET_END = -2, -1


class Policy(enum.Enum):
    """Where a partition goes when its offset is missing or out of range."""

    EARLIEST = "earliest"
    LATEST = "latest"
    ERROR = "error"

    @classmethod
    def parse(cls, value: object) -> Policy:
        text = str(value).lower()
        if text in ("smallest", "earliest", "beginning"):
            return cls.EARLIEST
        if text in ("largest", "latest", "end"):
            return cls.LATEST
        return cls.ERROR


class Cause(enum.Enum):
    """Why librdkafka could not fetch."""

    NO_COMMIT = "no_commit"  # the group never committed here
    EXPIRED = "expired"  # the committed offset is below the log start: records removed
    PAST_END = "past_end"  # the committed offset is beyond the end: log truncated or topic re-made
    IN_RANGE = "in_range"  # in range again by now (a race with the log's start): retry it


@dataclass(frozen=True)
class Decision:
    """What to do with a partition librdkafka stopped."""

    cause: Cause
    #: where to go on from; None: stay stopped (policy ``error``)
    start: int | None
    #: offsets skipped without being processed: ``[first, end)``; None when none
    skipped: tuple[int, int] | None

    @property
    def skipped_count(self) -> int:
        return self.skipped[1] - self.skipped[0] if self.skipped else 0


def no_commit(policy: Policy) -> Decision:
    """The decision for a partition the group never committed: librdkafka's logical
    offsets (it resolves them itself: no watermark needed)."""
    start = {Policy.EARLIEST: OFFSET_BEGINNING, Policy.LATEST: OFFSET_END}.get(policy)
    return Decision(Cause.NO_COMMIT, start, None)


def decide(failed: int | None, *, low: int, high: int, policy: Policy) -> Decision:
    """The decision for a partition whose fetch at ``failed`` (None: no commit) was refused."""
    if failed is None or failed < 0:
        return no_commit(policy)
    if failed < low:
        if policy is Policy.LATEST:
            return Decision(Cause.EXPIRED, high, (failed, high))
        start = low if policy is Policy.EARLIEST else None
        return Decision(Cause.EXPIRED, start, (failed, low))
    if failed > high:
        start = {Policy.EARLIEST: low, Policy.LATEST: high}.get(policy)
        return Decision(Cause.PAST_END, start, None)
    return Decision(Cause.IN_RANGE, failed, None)


class Step(enum.Enum):
    """What :meth:`ResetBook.begin` says to do with a partition librdkafka stopped."""

    ASK = "ask"  # hand a watermark question to the probe's thread
    WAIT = "wait"  # a question about it is out already: its answer serves this one too


class ResetBook:
    """Pure: which stopped partitions wait for the broker's watermarks, and at which offset.

    At most one question per partition is out at a time (what waits is bounded by
    the assignment); every partition waiting has its question out (none is left
    stopped with nobody asking); an answer applies to the offset the partition
    waits at now (the last one librdkafka refused), and to nothing once the
    partition was revoked. Transitions::

        begin(tp, failed)   idle -> waiting(failed), asked      : ASK
                            waiting/asked -> waiting(failed)    : WAIT
        answered(tp)        asked -> idle; waiting(f) -> f, else None
        forget(tps)         waiting -> idle (its question stays out, answered to nobody)
    """

    def __init__(self) -> None:
        #: partitions waiting for an answer, and the offset librdkafka refused
        self._waiting: dict[TP, int] = {}
        #: partitions whose question is out (answered or not in time: always answered)
        self._asked: set[TP] = set()

    def begin(self, tp: TP, failed: int) -> Step:
        self._waiting[tp] = failed
        if tp in self._asked:
            return Step.WAIT
        self._asked.add(tp)
        return Step.ASK

    def answered(self, tp: TP) -> int | None:
        """The offset to decide for, or None when nobody waits for ``tp`` any more."""
        self._asked.discard(tp)
        return self._waiting.pop(tp, None)

    def forget(self, tps: Collection[TP]) -> None:
        for tp in tps:
            self._waiting.pop(tp, None)

    def waiting(self) -> dict[TP, int]:
        return dict(self._waiting)

    def asked(self) -> frozenset[TP]:
        return frozenset(self._asked)


@dataclass(frozen=True, slots=True)
class Watermarks:
    """The broker's answer about ``tp``: ``(low, high)``, or None when it did not answer
    within :data:`WATERMARK_TIMEOUT_S` (the partition is then fetched again where it
    was refused: librdkafka reports it again and it is asked about again)."""

    tp: TP
    low_high: tuple[int, int] | None


class OffsetResets:
    """The shell: on the consumer's thread, answers librdkafka's ``_AUTO_OFFSET_RESET``.

    Nothing here waits for the broker: the watermarks are asked on another thread
    (``ask``, the worker's :class:`~sinks.kafka.stall_probe.StallProbe`) and the answer
    is applied on a later turn (:meth:`answered`); the reset position is committed
    asynchronously. A partition never committed needs no watermark (librdkafka
    resolves its logical offsets) and is restarted at once."""

    def __init__(
        self,
        *,
        policy: Policy,
        group: str,
        incremental: bool,
        ask: Callable[[TP], None],
        count: Callable[[int], None] | None = None,
    ) -> None:
        self.policy = policy
        self.group = group
        self.incremental = incremental
        self._ask = ask
        self._count = count
        self._book = ResetBook()
        #: where each partition was last restarted (an eager re-assignment keeps them)
        self._starts: dict[tuple[str, int], int] = {}

    def handle(
        self, consumer: Consumer, message: Any, *, paused: Collection[tuple[str, int]]
    ) -> int | None:
        """Take librdkafka's ``_AUTO_OFFSET_RESET`` for the partition of ``message``.

        Returns the offset the partition was restarted at now (a logical one -
        beginning, end - is negative), or None: not restarted (yet: its watermarks
        were asked for, :meth:`answered` restarts it)."""
        tp = (str(message.topic()), int(message.partition()))
        failed = message.offset()
        if failed is None or failed < 0:
            return self._apply(consumer, tp, no_commit(self.policy), paused)
        if self._book.begin(tp, int(failed)) is Step.ASK:
            self._ask(tp)
        return None

    def answered(
        self, consumer: Consumer, answer: Watermarks, *, paused: Collection[tuple[str, int]]
    ) -> int | None:
        """Apply the policy to a partition whose watermarks came (see :meth:`handle`)."""
        failed = self._book.answered(answer.tp)
        if failed is None:  # revoked meanwhile: its next owner fetches and reports
            return None
        if answer.low_high is None:  # fetch at the same offset again: asks again
            topic, partition = answer.tp
            log.error(
                "%s[%d]: offset %d out of range, the log's start unknown (no answer in %ss):"
                " retrying",
                topic,
                partition,
                failed,
                WATERMARK_TIMEOUT_S,
            )
            low = high = failed
        else:
            low, high = answer.low_high
        decision = decide(failed, low=low, high=high, policy=self.policy)
        return self._apply(consumer, answer.tp, decision, paused)

    def forget(self, tps: Collection[TP]) -> None:
        """Revoked: an answer still to come about ``tps`` restarts nothing."""
        self._book.forget(tps)

    def _apply(
        self,
        consumer: Consumer,
        tp: TP,
        decision: Decision,
        paused: Collection[tuple[str, int]],
    ) -> int | None:
        topic, partition = tp
        self._report(topic, partition, decision)
        if decision.start is None:
            return None
        self._starts[tp] = decision.start
        try:
            restarted = restart(
                consumer,
                topic,
                partition,
                decision.start,
                incremental=self.incremental,
                paused=paused,
                starts=self._starts,
            )
            if not restarted:
                log.info("%s[%d]: no longer assigned, not restarted", topic, partition)
                return None
        except KafkaException as exc:  # the next fetch of a re-assignment tries again
            log.error(
                "%s[%d]: cannot restart at offset %d: %s", topic, partition, decision.start, exc
            )
            return None
        if decision.cause in (Cause.EXPIRED, Cause.PAST_END) and decision.start >= 0:
            commit_position(consumer, topic, partition, decision.start)
        return int(decision.start)

    def _report(self, topic: str, partition: int, decision: Decision) -> None:
        where = {"topic": topic, "partition": partition, "group": self.group}
        if decision.skipped is not None:
            first, end = decision.skipped
            if self._count is not None:
                self._count(decision.skipped_count)
            going = _going(decision)
            log.error(
                "%s[%d]: offsets %d..%d (%d records) were removed (retention or DeleteRecords)"
                " before group %s processed them; %s. `outbox-cdc audit` names the events,"
                " --repair republishes them from the outbox table",
                topic,
                partition,
                first,
                end - 1,
                decision.skipped_count,
                self.group,
                going,
                extra={**where, "offset": first, "state": "offsets_expired"},
            )
        elif decision.cause is Cause.PAST_END:
            log.warning(
                "%s[%d]: group %s's offset is past the log's end (log truncated or topic"
                " re-created): %s",
                topic,
                partition,
                self.group,
                _going(decision),
                extra=where,
            )
        elif decision.cause is Cause.NO_COMMIT:
            log.info(
                "%s[%d]: no committed offset: %s (auto.offset.reset=%s)",
                topic,
                partition,
                _going(decision),
                self.policy.value,
                extra=where,
            )


def commit_position(consumer: Consumer, topic: str, partition: int, offset: int) -> None:
    """Commit the position a reset moved to: the group's commit then says what it dealt
    with (the ERROR), and a restart does not report the same range again. Asynchronous:
    the broker's answer reaches the worker's commit callback (a failure is logged there)."""
    try:
        consumer.commit(offsets=[TopicPartition(topic, partition, offset)], asynchronous=True)
    except KafkaException as exc:  # a rebalance took it: its next owner fetches and reports
        log.warning(
            "%s[%d]: commit of the reset position %d failed: %s", topic, partition, offset, exc
        )


def _going(decision: Decision) -> str:
    if decision.start is None:
        return "the partition stays stopped (auto.offset.reset=error)"
    if decision.start == OFFSET_BEGINNING:
        return "going on from the log start"
    if decision.start == OFFSET_END:
        return "going on from the end"
    return f"going on from offset {decision.start}"


def incremental(config: dict[str, Any]) -> bool:
    """Whether the consumer's assignments change incrementally (a cooperative assignor,
    or the KIP-848 ``consumer`` group protocol) rather than as a whole (eager)."""
    strategy = str(config.get("partition.assignment.strategy", "range,roundrobin"))
    return "cooperative" in strategy or str(config.get("group.protocol", "")) == "consumer"


def restart(
    consumer: Consumer,
    topic: str,
    partition: int,
    offset: int,
    *,
    incremental: bool,
    paused: Collection[tuple[str, int]] = (),
    starts: dict[tuple[str, int], int] | None = None,
) -> bool:
    """Fetch ``topic[partition]`` again from ``offset``; the partitions of ``paused``
    still assigned stay paused (see the module docstring). False when the partition is
    no longer assigned (a rebalance took it: its next owner starts from the commit).

    An eager assignment is replaced whole: each other partition at its consumed
    position, or - not consumed from yet - where an earlier restart sent it (``starts``),
    else where the group's commit puts it."""
    assigned = {(t.topic, t.partition) for t in consumer.assignment()}
    if (topic, partition) not in assigned:
        return False
    if incremental:
        consumer.incremental_unassign([TopicPartition(topic, partition)])
        consumer.incremental_assign([TopicPartition(topic, partition, offset)])
    else:
        known = dict(starts or {})
        known[(topic, partition)] = offset
        current = consumer.position(consumer.assignment())
        consumer.assign(
            [
                TopicPartition(
                    t.topic,
                    t.partition,
                    known.get((t.topic, t.partition), t.offset)
                    if (t.topic, t.partition) == (topic, partition) or t.offset < 0
                    else t.offset,
                )
                for t in current
            ]
        )
    still = [TopicPartition(t, p) for t, p in paused if (t, p) in assigned]
    if still:
        consumer.pause(still)
    return True
