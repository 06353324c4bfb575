"""Backlog guard: is the pipeline falling behind? Cheap enough to ask on every request.

An application that writes the outbox asks :meth:`BacklogGuard.check` before it
takes work on; while the answer is *over* it answers ``429`` with
``Retry-After`` instead of committing events the pipeline cannot drain. The
relay serves the same answer at ``GET /backlog[?group=G]`` (:func:`backlog_route`).

Guarantees:

* every measure is read from PostgreSQL and Kafka, never from a relay process,
  so a stopped, crashed or wedged relay shows as a growing backlog, and every
  process that asks gets the same answer;
* ``relay_age_s`` is the age of the oldest committed outbox event (table row or
  transactional message) that the slot has not confirmed. The relay confirms
  only what Kafka acknowledged, so this bounds "committed, not yet in Kafka"
  from above. It is read as ``outbox-cdc slot status`` reads it
  (:func:`cdc.ops.read_slot_status`: a temporary copy of the slot is peeked, the
  relay is not disturbed) and needs the REPLICATION privilege; without it the
  measure is ``None`` and ``problems`` says why;
* ``slot_lag_bytes`` is ``pg_current_wal_lsn() - confirmed_flush_lsn``;
* with a group named, ``group_age_s`` is the age of the oldest record on the
  outbox topics the group has not committed past (its timestamp is the commit
  time, by the record contract); 0 when the group has committed everything. A
  partition the group never committed counts from its first record, as the sink
  (``auto.offset.reset=earliest``) would resume there;
* the verdict (:func:`judge`, pure): ``OVER`` when any measure that was taken
  exceeds its limit (a limit <= 0 is off), or while the slot has an unrecovered
  gap (an open row of the slot history, :mod:`cdc.gaps`, or ``wal_status`` lost):
  events committed in the gap are not in Kafka and no slot measure sees them;
  ``UNKNOWN`` when none is over but a measure could not be taken; ``OK``
  otherwise. ``UNKNOWN`` does not throttle: the measures that were taken
  decide (fail open);
* a measurement is reused for ``backlog_cache_ttl_s``. When it is stale one
  caller measures again while concurrent callers get the previous answer, so a
  burst of requests costs one measurement per TTL (per group); only the very
  first call waits for one. A failed measure is never replaced by an older
  cached value: it is ``None``.
"""

from __future__ import annotations

import enum
import logging
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import orjson
import psycopg
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.admin import OffsetSpec as _OffsetSpec  # type: ignore[attr-defined]

from cdc.health import Reply
from cdc.kafka.client import CommittedReader, served_cause, unreachable
from cdc.kafka.log import KafkaClientEvents
from cdc.ops import SlotStatus, read_slot_status
from cdc.settings import Settings
from cdc.wal.stream import with_connection_defaults

log = logging.getLogger(__name__)

#: Kafka requests of one measurement give up after this (the guard answers UNKNOWN
#: for the group then, it never hangs an application's request for long).
KAFKA_TIMEOUT_S = 5.0
#: PostgreSQL connection attempts give up after this.
PG_CONNECT_TIMEOUT_S = 5
#: Distinct groups whose measurements are cached at once (least recently used go).
MAX_CACHED_GROUPS = 16
#: A group name from an HTTP query: Kafka's legal topic characters, bounded.
_GROUP_RE = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
#: Throwaway group of the guard's reading consumer: assigns only, never joins, never commits.
_READER_GROUP_PREFIX = "outbox-cdc-backlog-"

_T = TypeVar("_T")
#: confluent-kafka's offset specs of ``list_offsets`` (its stubs leave them untyped).
_EARLIEST: Any = _OffsetSpec.earliest()  # type: ignore[no-untyped-call]
_LATEST: Any = _OffsetSpec.latest()  # type: ignore[no-untyped-call]


class BacklogState(enum.Enum):
    OK = "ok"  # every measure taken and within its limit
    OVER = "over"  # a measure exceeds its limit: answer 429 with Retry-After
    UNKNOWN = "unknown"  # nothing over, but a measure could not be taken (fail open)


@dataclass(frozen=True, kw_only=True)
class BacklogLimits:
    """The thresholds; a limit <= 0 switches its check off."""

    max_relay_age_s: float
    max_slot_lag_bytes: int
    max_group_age_s: float
    retry_after_s: int

    @classmethod
    def from_settings(cls, settings: Settings) -> BacklogLimits:
        return cls(
            max_relay_age_s=settings.backlog_max_relay_age_s,
            max_slot_lag_bytes=settings.backlog_max_slot_lag_bytes,
            max_group_age_s=settings.backlog_max_group_age_s,
            retry_after_s=settings.backlog_retry_after_s,
        )


@dataclass(frozen=True, kw_only=True)
class SlotMeasures:
    """The PostgreSQL side of one measurement."""

    relay_age_s: float | None
    slot_lag_bytes: int | None
    problems: tuple[str, ...] = ()
    #: an unrecovered slot gap (lost slot, open gap in the history): always over
    gap: str | None = None


@dataclass(frozen=True, kw_only=True)
class GroupMeasures:
    """The Kafka side of one measurement, for one group."""

    group: str
    age_s: float | None
    problems: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Backlog:
    """The verdict and the measures behind it (``as_json`` is the HTTP body)."""

    state: BacklogState
    relay_age_s: float | None
    slot_lag_bytes: int | None
    group: str | None
    group_age_s: float | None
    #: Each limit exceeded, e.g. ``relay_age_s 75.2 > 60``.
    exceeded: tuple[str, ...]
    problems: tuple[str, ...]
    retry_after_s: int

    @property
    def over(self) -> bool:
        """True when the caller should refuse work (429 + ``Retry-After``)."""
        return self.state is BacklogState.OVER

    def as_json(self) -> dict[str, object]:
        return {
            "state": self.state.value,
            "relay_age_s": self.relay_age_s,
            "slot_lag_bytes": self.slot_lag_bytes,
            "group": self.group,
            "group_age_s": self.group_age_s,
            "exceeded": list(self.exceeded),
            "problems": list(self.problems),
            "retry_after_s": self.retry_after_s if self.over else None,
        }


def judge(slot: SlotMeasures, group: GroupMeasures | None, limits: BacklogLimits) -> Backlog:
    """The verdict of one measurement against the limits (see the module docstring)."""
    checks: list[tuple[str, float | None, float]] = [
        ("relay_age_s", slot.relay_age_s, limits.max_relay_age_s),
        ("slot_lag_bytes", slot.slot_lag_bytes, limits.max_slot_lag_bytes),
    ]
    if group is not None:
        checks.append(("group_age_s", group.age_s, limits.max_group_age_s))
    exceeded = tuple(
        f"{name} {value:g} > {limit:g}"
        for name, value, limit in checks
        if limit > 0 and value is not None and value > limit
    ) + ((f"gap: {slot.gap}",) if slot.gap else ())
    unknown = any(value is None and limit > 0 for _, value, limit in checks)
    if exceeded:
        state = BacklogState.OVER
    elif unknown:
        state = BacklogState.UNKNOWN
    else:
        state = BacklogState.OK
    return Backlog(
        state=state,
        relay_age_s=slot.relay_age_s,
        slot_lag_bytes=slot.slot_lag_bytes,
        group=group.group if group is not None else None,
        group_age_s=group.age_s if group is not None else None,
        exceeded=exceeded,
        problems=slot.problems + (group.problems if group is not None else ()),
        retry_after_s=max(1, limits.retry_after_s),
    )


class Cached(Generic[_T]):
    """One value measured at most once per ``ttl_s``; a stale value is refreshed by
    one caller while concurrent callers get the previous one (single flight)."""

    def __init__(
        self,
        measure: Callable[[], _T],
        *,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._measure = measure
        self._ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entry: tuple[float, _T] | None = None

    def _is_fresh(self, entry: tuple[float, _T] | None) -> bool:
        return entry is not None and self._clock() - entry[0] < self._ttl_s

    def get(self) -> _T:
        entry = self._entry
        if entry is not None and self._is_fresh(entry):
            return entry[1]
        # Only the very first call waits for a measurement in progress.
        if not self._lock.acquire(blocking=entry is None):
            assert entry is not None
            return entry[1]
        try:
            entry = self._entry  # measured while this caller waited for the lock?
            if entry is not None and self._is_fresh(entry):
                return entry[1]
            value = self._measure()
            self._entry = (self._clock(), value)
            return value
        finally:
            self._lock.release()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _gap_of(status: SlotStatus) -> str | None:
    """An unrecovered gap of the slot: an open history row, or the slot lost."""
    row = status["gap"]
    if row is not None and row.get("state") == "open":
        return f"slot {status['slot']} gap {row.get('id')} open ({row.get('cause')})"
    if status["wal_status"] == "lost":
        return f"slot {status['slot']} lost (wal_status lost: its WAL was removed)"
    return None


class _SlotSide:
    """Slot measures on one long-lived autocommit connection (reopened after a failure)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._conn: psycopg.Connection[Any] | None = None

    def measure(self) -> SlotMeasures:
        slot = self._settings.slot
        try:
            if self._conn is None or self._conn.closed:
                self._conn = psycopg.connect(
                    with_connection_defaults(self._settings.pg_dsn.get_secret_value()),
                    autocommit=True,
                    connect_timeout=PG_CONNECT_TIMEOUT_S,
                )
            status = read_slot_status(self._conn, self._settings)
        except psycopg.Error as exc:
            self.close()
            return SlotMeasures(
                relay_age_s=None,
                slot_lag_bytes=None,
                problems=(f"slot {slot}: PostgreSQL: {_first_line(exc)}",),
            )
        gap = _gap_of(status)
        if not status["exists"]:
            return SlotMeasures(
                relay_age_s=None,
                slot_lag_bytes=None,
                problems=(f"slot {slot} does not exist (no relay has started on it)",),
                gap=gap,
            )
        problems = () if status["lag_time_s"] is not None else (status["lag_time_note"],)
        return SlotMeasures(
            relay_age_s=status["lag_time_s"],
            slot_lag_bytes=status["wal_lag_bytes"],
            problems=problems,
            gap=gap,
        )

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class _GroupSide:
    """Group measures with one AdminClient, one assign-only consumer and a committed-offsets
    reader (:class:`cdc.kafka.client.CommittedReader`: never the AdminClient's
    ``list_consumer_group_offsets``, which crashes librdkafka on a broker that has
    just started), made on first use."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._lock = threading.Lock()  # one measurement at a time uses the clients
        self._admin: AdminClient | None = None
        self._consumer: Consumer | None = None
        self._committed: CommittedReader | None = None
        self._events = KafkaClientEvents("backlog")
        # The sink's topics: SINK_TOPICS_PATTERN when set, else CDC_TOPIC_PREFIX.
        pattern = re.compile(settings.sink_topics_pattern.removeprefix("^") or "(?!)")
        prefix = settings.topic_prefix
        self._accept: Callable[[str], bool] = (
            (lambda name: pattern.match(name) is not None)
            if settings.sink_topics_pattern
            else (lambda name: name.startswith(prefix))
        )

    def _clients(self) -> tuple[AdminClient, Consumer, CommittedReader]:
        if self._admin is None or self._consumer is None or self._committed is None:
            base: dict[str, Any] = {
                "bootstrap.servers": self._settings.kafka_bootstrap_servers,
                "client.id": "outbox-cdc-backlog",
                **self._events.config(),
            }
            base.update(self._settings.kafka_config)
            self._admin = AdminClient(base)
            self._committed = CommittedReader(base)
            self._consumer = Consumer(
                {
                    **base,
                    "group.id": f"{_READER_GROUP_PREFIX}{uuid.uuid4().hex}",
                    "enable.auto.commit": False,
                    "enable.auto.offset.store": False,
                    "auto.offset.reset": "earliest",
                }
            )
        return self._admin, self._consumer, self._committed

    def measure(self, group: str) -> GroupMeasures:
        with self._lock:
            try:
                age_s, problems = self._oldest_age_s(group)
            except (KafkaException, TimeoutError) as exc:  # a future's result() times out too
                reason = self._why(exc)
                return GroupMeasures(
                    group=group, age_s=None, problems=(f"group {group}: {reason}",)
                )
        return GroupMeasures(group=group, age_s=age_s, problems=problems)

    def _why(self, exc: BaseException) -> str:
        """What failed, in words (:func:`cdc.kafka.client.unreachable`: refused, silent,
        TLS refused...), not librdkafka's bare ``Broker transport failure``."""
        if isinstance(exc, TimeoutError) and not str(exc):
            exc = TimeoutError(f"no answer within {KAFKA_TIMEOUT_S:g}s")
        try:
            cause = served_cause(self._admin, self._events) if self._admin else None
            security = str(self._settings.kafka_config.get("security.protocol", "plaintext"))
            return str(
                unreachable(
                    self._settings.kafka_bootstrap_servers,
                    exc,
                    cause=cause,
                    security_protocol=security,
                )
            )
        except Exception:  # (the diagnosis is a courtesy: never a 500 for it)
            log.debug("backlog: diagnosing Kafka failed", exc_info=True)
            return str(exc)

    def _oldest_age_s(self, group: str) -> tuple[float | None, tuple[str, ...]]:
        admin, consumer, committed = self._clients()
        topics = consumer.list_topics(timeout=KAFKA_TIMEOUT_S).topics
        tps = [
            TopicPartition(name, p)
            for name in sorted(topics)
            if not name.startswith("__") and self._accept(name)
            for p in sorted(topics[name].partitions)
        ]
        if not tps:
            return 0.0, ()
        positions = self._unprocessed_positions(admin, committed, group, tps)
        if not positions:
            return 0.0, ()
        stamps = _first_timestamps(consumer, positions)
        now_ms = time.time_ns() // 1_000_000
        ages = [max(0, now_ms - ts) / 1000 for ts in stamps.values()]
        missing = len(positions) - len(stamps)
        problems = (
            (f"group {group}: first unprocessed record of {missing} partition(s) not read",)
            if missing
            else ()
        )
        return (max(ages) if ages else None), problems

    def _unprocessed_positions(
        self,
        admin: AdminClient,
        reader: CommittedReader,
        group: str,
        tps: list[TopicPartition],
    ) -> dict[tuple[str, int], int]:
        """(topic, partition) -> the group's position, for partitions with records past it."""
        committed = reader.committed(
            group, [(str(tp.topic), int(tp.partition)) for tp in tps], timeout_s=KAFKA_TIMEOUT_S
        )
        lows = _offsets(admin, tps, _EARLIEST)
        highs = _offsets(admin, tps, _LATEST)
        out: dict[tuple[str, int], int] = {}
        for key, high in highs.items():
            done = committed.get(key)
            position = max(done if done is not None else lows[key], lows[key])
            if position < high:
                out[key] = position
        return out

    def close(self) -> None:
        with self._lock:
            if self._consumer is not None:
                self._consumer.close()
            if self._committed is not None:
                self._committed.close()
            self._consumer = self._admin = self._committed = None


def _offsets(
    admin: AdminClient, tps: list[TopicPartition], spec: Any
) -> dict[tuple[str, int], int]:
    futures = admin.list_offsets({tp: spec for tp in tps}, request_timeout=KAFKA_TIMEOUT_S)
    return {
        (str(tp.topic), int(tp.partition)): int(future.result(timeout=KAFKA_TIMEOUT_S).offset)
        for tp, future in futures.items()
    }


def _first_timestamps(
    consumer: Consumer, positions: Mapping[tuple[str, int], int]
) -> dict[tuple[str, int], int]:
    """The timestamp of the record at each position (what the consumer reads first there)."""
    found: dict[tuple[str, int], int] = {}
    consumer.assign([TopicPartition(t, p, o) for (t, p), o in positions.items()])
    deadline = time.monotonic() + KAFKA_TIMEOUT_S
    try:
        while len(found) < len(positions) and time.monotonic() < deadline:
            for msg in consumer.consume(len(positions) * 10, 0.2):
                err = msg.error()
                if err is not None and err.code() != KafkaError._PARTITION_EOF:
                    raise KafkaException(err)
                topic, partition = msg.topic(), msg.partition()
                if err is None and topic is not None and partition is not None:
                    found.setdefault((topic, partition), int(msg.timestamp()[1]))
    finally:
        consumer.unassign()
    return found


class BacklogGuard:
    """The guard of one pipeline (one slot, optionally one or more groups). Thread-safe.

    ``check()`` answers from a measurement at most ``backlog_cache_ttl_s`` old;
    ``check(group=...)`` adds that consumer group (``backlog_group`` by default).
    """

    def __init__(self, settings: Settings, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings.require("pg_dsn")
        self.limits = BacklogLimits.from_settings(settings)
        self._clock = clock
        self._slot_side = _SlotSide(settings)
        self._group_side: _GroupSide | None = None
        self._slot = Cached(
            self._slot_side.measure, ttl_s=settings.backlog_cache_ttl_s, clock=clock
        )
        self._groups: OrderedDict[str, Cached[GroupMeasures]] = OrderedDict()
        self._groups_lock = threading.Lock()
        self._last_state: BacklogState | None = None

    @classmethod
    def from_env(cls) -> BacklogGuard:
        return cls(Settings.from_env())

    def check(self, *, group: str | None = None) -> Backlog:
        """The backlog against the limits; ``group`` defaults to ``backlog_group``."""
        name = group if group is not None else self.settings.backlog_group
        group_measures = self._group_cache(name).get() if name else None
        backlog = judge(self._slot.get(), group_measures, self.limits)
        if backlog.state is not self._last_state:
            self._last_state = backlog.state
            log.info(
                "backlog %s: %s",
                backlog.state.value,
                ", ".join(backlog.exceeded or backlog.problems) or "within limits",
                extra={"state": backlog.state.value},
            )
        return backlog

    def _group_cache(self, group: str) -> Cached[GroupMeasures]:
        with self._groups_lock:
            cached = self._groups.get(group)
            if cached is None:
                if self._group_side is None:
                    self.settings.require("kafka_bootstrap_servers")
                    self._group_side = _GroupSide(self.settings)
                side = self._group_side
                cached = Cached(
                    lambda: side.measure(group),
                    ttl_s=self.settings.backlog_cache_ttl_s,
                    clock=self._clock,
                )
                self._groups[group] = cached
                while len(self._groups) > MAX_CACHED_GROUPS:
                    self._groups.popitem(last=False)
            self._groups.move_to_end(group)
            return cached

    def close(self) -> None:
        self._slot_side.close()
        if self._group_side is not None:
            self._group_side.close()


def valid_group_name(name: str) -> bool:
    """A group name the HTTP endpoint accepts (``[A-Za-z0-9._-]``, 1..249 characters)."""
    return _GROUP_RE.match(name) is not None


_BAD_GROUP = orjson.dumps({"error": "group: 1-249 characters of [A-Za-z0-9._-]"})


def backlog_route(guard: BacklogGuard) -> Callable[[Mapping[str, str]], Reply]:
    """``GET /backlog[?group=G]``: 200 with the JSON while ok, 503 while unknown (a
    measure could not be taken: ``problems`` says why - Kafka unreachable, the slot
    missing), 429 with ``Retry-After`` while over, 400 for a malformed group name."""

    def route(query: Mapping[str, str]) -> Reply:
        group = query.get("group") or None
        if group is not None and not valid_group_name(group):
            return Reply(400, "application/json", _BAD_GROUP)
        backlog = guard.check(group=group)
        body = orjson.dumps(backlog.as_json())
        if backlog.over:
            headers = (("Retry-After", str(backlog.retry_after_s)),)
            return Reply(429, "application/json", body, headers)
        status = 503 if backlog.state is BacklogState.UNKNOWN else 200
        return Reply(status, "application/json", body)

    return route
