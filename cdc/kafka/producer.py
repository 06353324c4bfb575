"""Kafka side of the relay: producer configuration, topic creation, error classes.

Guarantees:

* the producer is idempotent with ``acks=all`` and never gives up on a record
  by itself (``message.timeout.ms=0``): while Kafka is away records wait in the
  bounded local queue and the relay stops reading WAL (back-pressure);
* topics are created explicitly (configured partitions and replication
  factor) before the first record is produced to them, never by broker
  auto-creation, and :meth:`TopicManager.ensure` returns only once every
  partition's leader serves it (see "New topics" below);
* :func:`is_record_error` tells a record Kafka refuses for itself (too large,
  invalid) — dead-lettered — from trouble of the cluster, which is retried;
* librdkafka's errors and log lines reach the process's logging and metrics
  (:class:`cdc.kafka.log.KafkaClientEvents`) from the producer and the admin client;
* :func:`discard_producer` ends a producer that hit a fatal error without
  blocking: its records are purged (never acknowledged, so read again), their
  reports served, then it is closed.

Partitioning: ``partitioner=murmur2_random`` - librdkafka's port of the Java
client's default, ``toPositive(murmur2(key)) % partitions`` - so a key lands
on the partition Debezium (Kafka Connect) or any Java producer would pick, and
moving between them on live topics keeps each key on one partition. (The relay
never sends a NULL key, so the ``_random`` half never applies.) Override with
``KAFKA_CONFIG_PARTITIONER`` (``consistent_random`` was librdkafka's CRC32 default).

Tuning (documented in docs/relay/index.md, overridable with ``KAFKA_CONFIG_*``):
``linger.ms=5`` and ``batch.size=1 MB`` batch a burst into few requests while
an isolated commit waits at most 5 ms; ``compression.type=lz4`` is cheap on
CPU and halves JSON; ``message.max.bytes=1000000`` stays under the broker's
default ``max.message.bytes`` (1 MiB) so an oversize record is refused locally
and dead-lettered instead of poisoning an idempotent batch.

New topics: CreateTopics returns when the controller has committed the topic,
and the broker publishes it in its metadata (leader and epoch included) before
its replica manager has created the partition's log. A Produce in that window
gets ``NOT_LEADER_OR_FOLLOWER``. If the idempotent producer already has the
next batch of that partition in flight, the broker appends that batch (a
producer it has no state for may start at any sequence) and librdkafka then
counts the failed first batch as delivered ("implicitly acked by subsequent
batch success"): the first records of the partition are lost with a success
report. Waiting for leaders in metadata does not close the window; ListOffsets
is answered by the same replica manager as Produce, so ``ensure`` waits until
it succeeds for every partition.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType  # type: ignore[attr-defined]
from confluent_kafka.admin import OffsetSpec as _OffsetSpec  # type: ignore[attr-defined]
from confluent_kafka.cimpl import NewTopic

from cdc.errors import KafkaUnavailableError
from cdc.kafka.log import KafkaClientEvents
from cdc.router import DeadLetterCode

log = logging.getLogger(__name__)

PRODUCER_DEFAULTS: dict[str, str | int | bool] = {
    "partitioner": "murmur2_random",
    "enable.idempotence": True,
    "acks": "all",
    "linger.ms": 5,
    "batch.size": 1_000_000,
    "compression.type": "lz4",
    "message.timeout.ms": 0,
    "message.max.bytes": 1_000_000,
    "queue.buffering.max.messages": 100_000,
    "queue.buffering.max.kbytes": 65_536,
    "max.in.flight.requests.per.connection": 5,
}

#: Error codes that mean "this record itself is unacceptable", with the
#: dead-letter code each is counted under.
RECORD_ERRORS: Mapping[int, DeadLetterCode] = {
    KafkaError.MSG_SIZE_TOO_LARGE: DeadLetterCode.TOO_LARGE,
    KafkaError.RECORD_LIST_TOO_LARGE: DeadLetterCode.TOO_LARGE,
    KafkaError.INVALID_MSG_SIZE: DeadLetterCode.TOO_LARGE,
    KafkaError.INVALID_MSG: DeadLetterCode.INVALID_RECORD,
    KafkaError.INVALID_RECORD: DeadLetterCode.INVALID_RECORD,
    KafkaError.INVALID_TIMESTAMP: DeadLetterCode.INVALID_RECORD,
}
#: Delivery reports of records purged from a producer being discarded.
PURGED = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})
#: How long :func:`discard_producer` serves the purged records' reports.
DISCARD_DRAIN_S = 5.0

#: How often ``TopicManager.ensure`` asks again whether a topic's leaders serve
#: it: a new partition is served within tens of milliseconds of its creation
#: (longer on a loaded broker), and the whole wait is bounded by ``timeout_s``.
TOPIC_SERVED_POLL_S = 0.05
#: ListOffsets "latest": a leader answers it only for a partition it serves
#: (confluent-kafka's stubs leave offset specs untyped).
_LATEST: Any = _OffsetSpec.latest()  # type: ignore[no-untyped-call]


def is_record_error(err: KafkaError) -> bool:
    """True when Kafka refused the record for itself (dead-letter it)."""
    return err.code() in RECORD_ERRORS


def record_error_code(err: KafkaError) -> DeadLetterCode:
    """The dead-letter code of an error :func:`is_record_error` accepts."""
    return RECORD_ERRORS.get(err.code(), DeadLetterCode.OTHER)


def producer_config(bootstrap: str, overrides: Mapping[str, str]) -> dict[str, str | int | bool]:
    """The relay's producer settings: our defaults, then the user's ``KAFKA_CONFIG_*``."""
    config: dict[str, str | int | bool] = dict(PRODUCER_DEFAULTS)
    config.update(overrides)
    config["bootstrap.servers"] = bootstrap
    config["enable.idempotence"] = True
    config["acks"] = "all"
    return config


def make_producer(
    bootstrap: str,
    overrides: Mapping[str, str],
    *,
    events: KafkaClientEvents | None = None,
    failed_reports_only: bool = False,
) -> Producer:
    """The relay's producer; librdkafka's errors and log lines go through ``events``
    (by default a :class:`KafkaClientEvents` that only logs), never raw to stderr.

    ``failed_reports_only`` sets ``delivery.report.only.error``: a delivered
    record's report then calls nothing, confluent-kafka only releases the reference
    its ``produce`` took on the record's callback (what
    :class:`cdc.relay.stream.producing.Reports` counts on)."""
    events = events or KafkaClientEvents("producer")
    config: dict[str, Any] = dict(producer_config(bootstrap, overrides))
    config.update(events.config())
    config["delivery.report.only.error"] = failed_reports_only
    return Producer(config)


class IdsInFlight(list[tuple[int, bytes]]):
    """The event ids of records in flight, each with the hash of its key and value,
    in produce order: a delivery-report callback that finds the event id of the
    record a failed report names (librdkafka hands no headers to delivery
    reports). Keeping the hash, not the key and value, keeps memory in flight low,
    and the tuples (an int and bytes) are not tracked by the garbage collector.

    A subclass defines ``__call__(err, msg)``; with ``delivery.report.only.error``
    only failed reports call it, and it is freed once its last report is served.
    Append ``(hash((key, value)), event_id)`` after each successful ``produce``.
    """

    __slots__ = ("_unclaimed",)

    #: event ids not yet matched to a failed report, by hash: built at the first
    #: failure, extended as records are added
    _unclaimed: tuple[int, dict[int, deque[bytes]]]

    def __bool__(self) -> bool:  # a callback, even while its list is empty
        return True

    def event_id_of(self, msg: Message) -> bytes | None:
        """The event id of the record a failed report names: the first one not yet
        claimed with its key and value (records alike in both are alike to Kafka;
        two that differ share the 64-bit hash with odds of about 2^-64 a pair)."""
        no_index: tuple[int, dict[int, deque[bytes]]] = (0, {})
        indexed, unclaimed = getattr(self, "_unclaimed", no_index)
        for digest, event_id in self[indexed:]:
            unclaimed.setdefault(digest, deque()).append(event_id)
        self._unclaimed = (len(self), unclaimed)
        ids = unclaimed.get(hash((msg.key() or b"", msg.value() or b"")))
        return ids.popleft() if ids else None

    def alike(self, msg: Message) -> list[bytes]:
        """Every event id of a record alike to the one a failed report names (the same
        key and value): which of them Kafka refused, the report cannot say."""
        digest = hash((msg.key() or b"", msg.value() or b""))
        return [event_id for d, event_id in self if d == digest]


def discard_producer(producer: Producer, *, drain_s: float = DISCARD_DRAIN_S) -> None:
    """Purge, serve the purge reports, close: the end of a producer after a fatal error.

    Every record still queued or in flight fails with ``_PURGE_QUEUE`` or
    ``_PURGE_INFLIGHT`` (so it is never acknowledged and the relay reads it
    again). ``close()`` waits for an empty queue without a time limit, so it
    is called only once the queue is empty; otherwise the producer is left to
    be destroyed with its last reference.
    """
    try:
        producer.purge(in_queue=True, in_flight=True)
    except KafkaException as exc:
        log.warning("producer purge failed: %s", exc)
    deadline = time.monotonic() + drain_s
    while len(producer) and time.monotonic() < deadline:
        try:
            producer.poll(0.05)
        except KafkaException as exc:  # the fatal error may be raised once more
            log.debug("serving purged reports: %s", exc)
    if len(producer):
        log.warning("producer discarded with %d reports unserved", len(producer))
        return
    producer.close()


def batch_bytes(overrides: Mapping[str, str]) -> int:
    """The most bytes one produce request's batch for a partition holds: librdkafka's
    ``batch.size`` and ``message.max.bytes``, the smaller (:data:`PRODUCER_DEFAULTS`
    unless ``KAFKA_CONFIG_*`` says otherwise)."""
    sizes = []
    for name in ("batch.size", "message.max.bytes"):
        value = str(overrides.get(name, PRODUCER_DEFAULTS[name]))
        sizes.append(int(value) if value.isdigit() else int(PRODUCER_DEFAULTS[name]))
    return min(sizes)


class TopicManager:
    """Creates topics once, explicitly; remembers which exist."""

    def __init__(
        self,
        *,
        bootstrap: str,
        overrides: Mapping[str, str],
        partitions: int,
        replication_factor: int,
        timeout_s: float = 30.0,
        events: KafkaClientEvents | None = None,
        before_first_use: Callable[[list[str]], None] | None = None,
    ) -> None:
        """``before_first_use``: called with the topics :meth:`ensure` is about to make
        known, before any record is produced to them (the relay records its topics)."""
        config: dict[str, Any] = {
            k: v for k, v in overrides.items() if k.startswith(("security.", "sasl.", "ssl."))
        }
        config["bootstrap.servers"] = bootstrap
        config.update((events or KafkaClientEvents("relay-admin")).config())
        self._admin = AdminClient(config)
        self._partitions = partitions
        self._replication_factor = replication_factor
        self._timeout_s = timeout_s
        self._before_first_use = before_first_use
        self._batch_bytes = batch_bytes(overrides)
        self.known: set[str] = set()

    def serve(self) -> None:
        """Serve the admin client's error and log callbacks (librdkafka queues them
        until served: call this now and then, e.g. from a monitor thread)."""
        try:
            self._admin.poll(0)
        except KafkaException as exc:  # fatal errors are raised, not called back
            log.warning("admin client: %s", exc)

    def ensure(self, topics: Iterable[str]) -> None:
        """Make sure every topic exists and every partition's leader serves it (records
        produced right after this call cannot race the broker's creation of a partition);
        raise KafkaUnavailableError when Kafka does not get there within ``timeout_s``."""
        self.serve()
        wanted = [t for t in topics if t not in self.known]
        if not wanted:
            return
        if self._before_first_use is not None:
            self._before_first_use(wanted)
        try:
            existing = self._admin.list_topics(timeout=self._timeout_s).topics
        except KafkaException as exc:
            raise KafkaUnavailableError(f"cannot list topics: {exc}") from exc
        missing = [t for t in wanted if t not in existing]
        if missing:
            self._create(missing)
        self._await_served(wanted)
        self._check_batches_fit(wanted)
        self.known.update(wanted)

    def _check_batches_fit(self, topics: list[str]) -> None:
        """One WARNING per topic whose ``max.message.bytes`` is below the producer's
        batch bound (:func:`batch_bytes`): Kafka refuses a whole batch over it, and
        librdkafka fails every record of it with ``MSG_SIZE_TOO_LARGE`` (it does not
        split the batch, as the Java producer does) - so every record of that batch is
        then produced alone to be judged (:class:`cdc.relay.health.state.PoisonIds`):
        correct, a round trip per record. Read once, when the topic
        is first used; a limit that cannot be read (no ``DescribeConfigs`` right) is
        said at INFO and nothing else happens."""
        resources = [ConfigResource(ResourceType.TOPIC, t) for t in topics]
        try:
            futures = self._admin.describe_configs(resources, request_timeout=self._timeout_s)
            limits = {
                res.name: (entries.get("max.message.bytes"))
                for res, future in futures.items()
                for entries in (future.result(timeout=self._timeout_s),)
            }
        except KafkaException as exc:
            log.info("topics %s: max.message.bytes not read (%s)", ", ".join(topics), exc)
            return
        for topic, entry in sorted(limits.items()):
            value = getattr(entry, "value", None)
            if value is None or not str(value).isdigit() or int(value) >= self._batch_bytes:
                continue
            log.warning(
                "topic %s: max.message.bytes %s is below the producer's batch size (%d"
                " bytes): Kafka refuses a whole batch over it, and each record of a refused"
                " batch is then produced alone to be judged (slow: a round trip each) - set"
                " KAFKA_CONFIG_BATCH_SIZE to %s or less, or raise the topic's"
                " max.message.bytes",
                topic,
                value,
                self._batch_bytes,
                value,
                extra={"topic": topic},
            )

    def _await_served(self, topics: list[str]) -> None:
        """Return once every partition of ``topics`` answers ListOffsets at its leader."""
        started = time.monotonic()
        deadline = started + self._timeout_s
        pending = set(topics)
        while True:
            pending = self._unserved(pending, max(deadline - time.monotonic(), 0.001))
            if not pending:
                break
            if time.monotonic() >= deadline:
                raise KafkaUnavailableError(
                    f"topics {', '.join(sorted(pending))}: a partition has no serving"
                    f" leader after {self._timeout_s:g}s"
                )
            time.sleep(TOPIC_SERVED_POLL_S)
        waited_ms = (time.monotonic() - started) * 1000
        for topic in topics:
            log.info(
                "topic %s served by its leaders (waited %.0f ms)",
                topic,
                waited_ms,
                extra={"topic": topic, "state": "served"},
            )

    def _unserved(self, topics: set[str], timeout_s: float) -> set[str]:
        """The topics of ``topics`` with a partition its leader does not serve yet."""
        try:
            meta = self._admin.list_topics(timeout=timeout_s).topics
        except KafkaException as exc:
            raise KafkaUnavailableError(f"cannot list topics: {exc}") from exc
        unserved: set[str] = set()
        specs: dict[TopicPartition, Any] = {}
        for topic in topics:
            tmeta = meta.get(topic)
            if tmeta is None or tmeta.error is not None or not tmeta.partitions:
                unserved.add(topic)  # not in this broker's metadata yet
                continue
            for partition in tmeta.partitions:
                specs[TopicPartition(topic, partition)] = _LATEST
        if not specs:
            return unserved
        for tp, future in self._admin.list_offsets(specs, request_timeout=timeout_s).items():
            try:
                future.result()
            except KafkaException:  # NOT_LEADER_OR_FOLLOWER while the log is being created
                unserved.add(tp.topic)
        return unserved

    def _create(self, topics: list[str]) -> None:
        new = [
            NewTopic(
                t, num_partitions=self._partitions, replication_factor=self._replication_factor
            )
            for t in topics
        ]
        for topic, future in self._admin.create_topics(
            new, request_timeout=self._timeout_s
        ).items():
            try:
                future.result(timeout=self._timeout_s)
                log.info("topic %s created (%d partitions)", topic, self._partitions)
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    continue
                raise KafkaUnavailableError(f"cannot create topic {topic}: {exc}") from exc
