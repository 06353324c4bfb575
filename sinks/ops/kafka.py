"""The ops' Kafka client: an AdminClient and a throwaway consumer that never joins a group.

Guarantees: every read is read-only. Committed offsets are read by
:class:`cdc.kafka.client.CommittedReader` (a consumer handle with the group's id
that never subscribes: never the AdminClient's ``list_consumer_group_offsets``,
which crashes librdkafka on a broker that has just started), records with a
consumer whose group id is a throwaway (``outbox-cdc-ops-<uuid>``) that only
``assign``s partitions - it never joins a group and never commits. The first
request is the cluster's metadata with a short timeout: Kafka unreachable
fails within seconds with one line, ``Kafka at <bootstrap> unreachable: ...
(check KAFKA_BOOTSTRAP_SERVERS)``, as a :class:`~sinks.ops.errors.KafkaOpsError`
(exit 1). librdkafka's errors and log lines are rate-limited
(:mod:`cdc.kafka.log`). The only write,
:meth:`KafkaOps.alter_offsets`, commits exactly the offsets it is given and
turns Kafka's refusal of a non-empty group into
:class:`~sinks.ops.errors.GroupActiveError`. Kafka failures surface as
:class:`~sinks.ops.errors.KafkaOpsError` with the librdkafka error chained; every
request gives up after :data:`KAFKA_REQUEST_TIMEOUT_S`.
"""

from __future__ import annotations

import difflib
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

from confluent_kafka import (
    Consumer,
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from cdc.errors import KafkaUnreachableError
from cdc.kafka.client import CommittedReader, first_contact
from cdc.kafka.log import KafkaClientEvents
from cdc.settings import Settings
from sinks.core.delivery import Envelope
from sinks.ops.errors import (
    GroupActiveError,
    GroupNotFoundError,
    KafkaOpsError,
    OpsError,
    OpsUsageError,
)
from sinks.ops.selection import TP, TopicSelection, default_topic_filter, select_topics

#: Every AdminClient / metadata / offset request gives up after this: long
#: enough for a broker to elect a leader, short enough for an operator waiting.
KAFKA_REQUEST_TIMEOUT_S = 15.0


#: Reading the first unprocessed record of each lagging partition stops after this.
FIRST_RECORD_TIMEOUT_S = 10.0


#: A redelivery scan gives up when no record arrived for this long before the
#: snapshot end offsets were reached (a broker gone, a partition unreadable).
SCAN_IDLE_TIMEOUT_S = 20.0


#: Records handed back per consume() call while scanning.
SCAN_BATCH = 500


#: Throwaway consumer groups of ops reads; never joined, never committed.
OPS_GROUP_PREFIX = "outbox-cdc-ops-"
#: Group ids of outbox-cdc's own throwaway readers: never suggested for a typo.
_OWN_GROUPS = (OPS_GROUP_PREFIX, "outbox-cdc-lineage-")
#: States Kafka gives a group it holds nothing of (DEAD: never existed, or expired).
_UNKNOWN_GROUP_STATES = frozenset({"DEAD", "UNKNOWN"})


def _client_config(settings: Settings, events: KafkaClientEvents) -> dict[str, Any]:
    config: dict[str, Any] = {
        "bootstrap.servers": settings.kafka_bootstrap_servers,
        "client.id": "outbox-cdc-ops",
        **events.config(),
    }
    config.update(settings.kafka_config)
    return config


def _check(error: Any, what: str) -> None:
    if error is not None and error.code() != KafkaError.NO_ERROR:
        raise KafkaOpsError(f"{what}: {error.str()}")


class KafkaOps:
    """One AdminClient and one never-committing, never-joining consumer (context manager)."""

    def __init__(self, settings: Settings) -> None:
        settings.require("kafka_bootstrap_servers")
        self._events = KafkaClientEvents("ops")
        base = _client_config(settings, self._events)
        self.settings = settings
        self._timeout_s = KAFKA_REQUEST_TIMEOUT_S
        self.admin = AdminClient(base)
        self.consumer = Consumer(
            {
                **base,
                "group.id": f"{OPS_GROUP_PREFIX}{uuid.uuid4().hex}",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "enable.partition.eof": True,
                "auto.offset.reset": "earliest",
            }
        )
        self._committed = CommittedReader(base)
        with self._events.held():  # unreachable: the one error line says it all
            try:
                first_contact(
                    self.consumer,
                    settings.kafka_bootstrap_servers,
                    events=self._events,
                    security_protocol=base.get("security.protocol", "plaintext"),
                )
            except KafkaUnreachableError as exc:
                self.close()
                raise KafkaOpsError(str(exc)) from exc

    def __enter__(self) -> KafkaOps:
        return self

    def close(self) -> None:
        self._committed.close()
        self.consumer.close()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _metadata(self) -> Any:
        try:
            return self.consumer.list_topics(timeout=self._timeout_s)
        except KafkaException as exc:
            raise KafkaOpsError(f"Kafka metadata: {exc}") from exc

    def partitions(self, selections: Sequence[TopicSelection] | None) -> list[TP]:
        """Chosen topic-partitions, sorted; ``None`` = every partition of the sink's topics."""
        topics = self._metadata().topics
        if selections is None:
            names = select_topics(topics, default_topic_filter(self.settings))
            selections = [TopicSelection(topic=n) for n in names]
        out: set[TP] = set()
        for sel in selections:
            meta = topics.get(sel.topic)
            if meta is None or meta.error is not None:
                raise OpsUsageError(f"topic {sel.topic} does not exist")
            existing = set(meta.partitions)
            wanted = set(sel.partitions) if sel.partitions is not None else existing
            missing = sorted(wanted - existing)
            if missing:
                raise OpsUsageError(f"topic {sel.topic} has no partition(s) {missing}")
            out.update((sel.topic, p) for p in wanted)
        return sorted(out)

    def watermarks(self, tps: Iterable[TP]) -> dict[TP, tuple[int, int]]:
        """(low, high) of each partition, asked of the brokers (not cached)."""
        marks: dict[TP, tuple[int, int]] = {}
        for topic, part in tps:
            try:
                low, high = self.consumer.get_watermark_offsets(
                    TopicPartition(topic, part), timeout=self._timeout_s, cached=False
                )
            except KafkaException as exc:
                raise KafkaOpsError(f"watermarks of {topic}[{part}]: {exc}") from exc
            marks[(topic, part)] = (int(low), int(high))
        return marks

    def committed(self, group: str, tps: Sequence[TP]) -> dict[TP, int | None]:
        """The group's committed offsets (``None`` where it never committed)."""
        if not tps:
            return {}
        try:
            return self._committed.committed(group, tps, timeout_s=self._timeout_s)
        except KafkaException as exc:
            raise KafkaOpsError(f"committed offsets of group {group}: {exc}") from exc

    def offsets_for_time(self, tps: Sequence[TP], ts_ms: int) -> dict[TP, int | None]:
        """The first offset at or after ``ts_ms`` per partition; ``None`` when none is."""
        if not tps:
            return {}
        try:
            found = self.consumer.offsets_for_times(
                [TopicPartition(t, p, ts_ms) for t, p in tps], timeout=self._timeout_s
            )
        except KafkaException as exc:
            raise KafkaOpsError(f"offsets for time {ts_ms}: {exc}") from exc
        out: dict[TP, int | None] = {}
        for tp in found:
            _check(tp.error, f"offset for time in {tp.topic}[{tp.partition}]")
            out[(tp.topic, tp.partition)] = None if tp.offset < 0 else int(tp.offset)
        return out

    def group_state(self, group: str) -> tuple[str, int]:
        """(state name, member count) of ``group``; a group that never existed is DEAD."""
        try:
            desc = self.admin.describe_consumer_groups([group], request_timeout=self._timeout_s)[
                group
            ].result(timeout=self._timeout_s)
        except KafkaException as exc:
            raise KafkaOpsError(f"describe consumer group {group}: {exc}") from exc
        state = getattr(desc.state, "name", str(desc.state))
        return str(state), len(desc.members or [])

    def require_group(self, group: str) -> None:
        """:class:`GroupNotFoundError` unless ``group`` has members or committed offsets.

        Kafka describes a group it does not know as DEAD with no members; a group
        whose members left but whose offsets are kept is EMPTY. The error names the
        known groups whose names are close (a typo's likely intent).
        """
        state, members = self.group_state(group)
        if members or state not in _UNKNOWN_GROUP_STATES:
            return
        try:
            known = self.known_groups()
        except KafkaOpsError:
            known = []  # the suggestion is a courtesy: the verdict stands without it
        raise GroupNotFoundError(group, similar=similar_groups(group, known))

    def known_groups(self) -> list[str]:
        """Every consumer group Kafka lists, outbox-cdc's own throwaway readers left out."""
        try:
            listed = self.admin.list_consumer_groups(request_timeout=self._timeout_s).result(
                timeout=self._timeout_s
            )
        except KafkaException as exc:
            raise KafkaOpsError(f"list consumer groups: {exc}") from exc
        return sorted(g.group_id for g in listed.valid if not g.group_id.startswith(_OWN_GROUPS))

    def commit_for_group(self, group: str, offsets: Mapping[TP, int]) -> None:
        """Set the group's committed offsets (Kafka refuses for a non-empty group)."""
        request = ConsumerGroupTopicPartitions(
            group, [TopicPartition(t, p, o) for (t, p), o in sorted(offsets.items())]
        )
        try:
            result = self.admin.alter_consumer_group_offsets(
                [request], request_timeout=self._timeout_s
            )[group].result(timeout=self._timeout_s)
        except KafkaException as exc:
            raise _alter_error(group, exc.args[0] if exc.args else None, exc) from exc
        for tp in result.topic_partitions:
            if tp.error is not None and tp.error.code() != KafkaError.NO_ERROR:
                raise _alter_error(group, tp.error, None)

    def read(
        self,
        starts: Mapping[TP, int],
        *,
        ends: Mapping[TP, int],
        idle_timeout_s: float,
        first_only: bool = False,
    ) -> Iterator[Envelope]:
        """Records of each partition from ``starts`` up to (excluding) ``ends``, as they
        arrive (offset order within a partition); with ``first_only`` just the first
        record of each. Stops when every partition is done, or raises
        :class:`KafkaOpsError` after ``idle_timeout_s`` without progress."""
        todo = {tp for tp, start in starts.items() if start < ends[tp]}
        if not todo:
            return
        self.consumer.assign([TopicPartition(t, p, starts[(t, p)]) for t, p in sorted(todo)])
        last_progress = time.monotonic()
        try:
            while todo:
                batch = self.consumer.consume(SCAN_BATCH, 0.5)
                if batch:
                    last_progress = time.monotonic()
                elif time.monotonic() - last_progress > idle_timeout_s:
                    raise KafkaOpsError(
                        f"no record from {sorted(todo)} for {idle_timeout_s:g}s: Kafka unreachable?"
                    )
                for msg in batch:
                    for record in _take(msg, todo, ends):
                        if first_only:
                            todo.discard(record.topic_partition)
                            self.consumer.pause([TopicPartition(record.topic, record.partition)])
                        yield record
        finally:
            self.consumer.unassign()


def similar_groups(
    group: str, known: Sequence[str], *, n: int = 2, cutoff: float = 0.6
) -> list[str]:
    """The ``n`` groups of ``known`` whose names are closest to ``group`` (closest first;
    none below ``cutoff``): a typo's likely intent. ``group`` itself is never one."""
    others = [g for g in known if g != group]
    return difflib.get_close_matches(group, others, n=n, cutoff=cutoff)


def _take(msg: Any, todo: set[TP], ends: Mapping[TP, int]) -> Iterator[Envelope]:
    """One consumed message: a record below its end is yielded; an end is noted."""
    tp = (msg.topic(), msg.partition())
    error = msg.error()
    if error is not None:
        if error.code() == KafkaError._PARTITION_EOF:
            todo.discard(tp)
            return
        raise KafkaOpsError(f"reading {tp[0]}[{tp[1]}]: {error.str()}")
    if tp not in todo:
        return
    if msg.offset() >= ends[tp]:
        todo.discard(tp)
        return
    if msg.offset() >= ends[tp] - 1:
        todo.discard(tp)
    yield Envelope.from_kafka(msg)


def _alter_error(group: str, error: Any, cause: BaseException | None) -> OpsError:
    """Kafka's answer to an offset change of a group that has members, or another failure."""
    code = error.code() if error is not None and hasattr(error, "code") else None
    if code in (KafkaError.UNKNOWN_MEMBER_ID, KafkaError.REBALANCE_IN_PROGRESS):
        return GroupActiveError(group, state="members joined", members=1)
    detail = error.str() if error is not None and hasattr(error, "str") else str(cause)
    return KafkaOpsError(f"commit offsets of group {group}: {detail}")
