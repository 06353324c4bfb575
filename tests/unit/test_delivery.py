"""Delivery bookkeeping: offset watermarks and per-key scheduling, proven with hypothesis."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sinks.core.delivery import (
    Envelope,
    KeyScheduler,
    OffsetState,
    OffsetWatermark,
    RecordState,
    headers_dict,
    lane_key,
)

# --- OffsetWatermark ---------------------------------------------------------


def test_nothing_is_committable_before_anything_is_done() -> None:
    mark = OffsetWatermark()
    assert mark.committable is None
    mark.track(10)
    assert mark.committable is None
    assert mark.oldest_pending == 10


def test_committable_is_last_contiguous_done_offset_plus_one() -> None:
    mark = OffsetWatermark()
    for offset in (10, 11, 12):
        mark.track(offset)
    mark.done(11)
    assert mark.committable is None  # 10 still pending holds it back
    assert mark.state(11) is OffsetState.DONE
    mark.done(10)
    assert mark.committable == 12
    mark.done(12)
    assert mark.committable == 13
    assert mark.pending == 0
    assert mark.held == 0


def test_gaps_from_compaction_or_markers_do_not_hold_the_commit_back() -> None:
    mark = OffsetWatermark()
    for offset in (3, 7, 20):
        mark.track(offset)
    mark.done(7)
    mark.done(3)
    assert mark.committable == 8
    assert mark.state(5) is OffsetState.COMMITTABLE  # a gap below the commit point
    assert mark.state(15) is OffsetState.UNTRACKED
    assert mark.state(20) is OffsetState.PENDING


def test_take_committable_returns_each_new_commit_point_once() -> None:
    mark = OffsetWatermark()
    mark.track(0)
    mark.track(1)
    assert mark.take_committable() is None
    mark.done(0)
    assert mark.take_committable() == 1
    assert mark.take_committable() is None
    mark.done(1)
    assert mark.take_committable() == 2


def test_offsets_must_be_tracked_in_increasing_order() -> None:
    mark = OffsetWatermark()
    mark.track(5)
    with pytest.raises(ValueError, match="tracked after"):
        mark.track(5)
    with pytest.raises(ValueError, match="tracked after"):
        mark.track(4)


def test_done_of_an_untracked_or_already_done_offset_is_a_bug() -> None:
    mark = OffsetWatermark()
    mark.track(1)
    with pytest.raises(ValueError, match="not pending"):
        mark.done(2)
    mark.done(1)
    with pytest.raises(ValueError, match="not pending"):
        mark.done(1)


@st.composite
def offsets_and_completion_order(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    gaps = draw(st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=80))
    offsets = []
    offset = draw(st.integers(min_value=0, max_value=1000))
    for gap in gaps:
        offsets.append(offset)
        offset += gap
    return offsets, draw(st.permutations(offsets))


@settings(deadline=None)
@given(offsets_and_completion_order())
def test_committable_never_passes_an_undone_offset(case: tuple[list[int], list[int]]) -> None:
    offsets, order = case
    mark = OffsetWatermark()
    for offset in offsets:
        mark.track(offset)
    done: set[int] = set()
    for offset in order:
        mark.done(offset)
        done.add(offset)
        committable = mark.committable
        undone = [o for o in offsets if o not in done]
        if committable is not None:
            assert all(o in done for o in offsets if o < committable)
            assert not undone or committable <= min(undone)
        # and it is as far as allowed: the highest done offset below the first undone one
        below = [o for o in offsets if not undone or o < min(undone)]
        assert committable == (max(below) + 1 if below else None)
    assert mark.committable == offsets[-1] + 1


@settings(deadline=None)
@given(offsets_and_completion_order(), st.data())
def test_interleaved_track_and_done_keep_the_invariant(
    case: tuple[list[int], list[int]], data: st.DataObject
) -> None:
    offsets, _ = case
    mark = OffsetWatermark()
    pending: list[int] = []
    done: set[int] = set()
    for offset in offsets:
        mark.track(offset)
        pending.append(offset)
        while pending and data.draw(st.booleans()):
            finished = pending.pop(data.draw(st.integers(0, len(pending) - 1)))
            mark.done(finished)
            done.add(finished)
        if mark.committable is not None:
            assert all(o in done for o in offsets if o < mark.committable)
        assert mark.pending == len(pending)


# --- Envelope ----------------------------------------------------------------


def _env(key: bytes | None, offset: int, *, topic: str = "t", partition: int = 0) -> Envelope:
    return Envelope(topic=topic, partition=partition, offset=offset, key=key, value=b"{}")


def test_envelope_helpers_read_the_contract_headers() -> None:
    env = Envelope(
        topic="outbox.event.user",
        partition=1,
        offset=9,
        key=b"u1",
        value=b"{}",
        headers={
            "id": b"e-1",
            "type": b"UserRegistered",
            "aggregatetype": b"user",
            "lsn": b"0/16B3748",
            "commit_ts": b"2025-01-01T00:00:00Z",
        },
        timestamp_ms=1,
    )
    assert (env.raw_id, env.event_type, env.aggregate_type) == ("e-1", "UserRegistered", "user")
    assert env.event_id == ""  # not a uuid: no idempotency key
    assert (env.lsn, env.commit_ts) == ("0/16B3748", "2025-01-01T00:00:00Z")
    assert env.position == ("outbox.event.user", 1, 9)
    assert env.topic_partition == ("outbox.event.user", 1)
    assert _env(b"k", 0).event_id == ""
    hash(env)  # usable as a dict key despite its headers dict


def test_envelope_from_a_confluent_kafka_message() -> None:
    message = SimpleNamespace(
        topic=lambda: "t",
        partition=lambda: 2,
        offset=lambda: 42,
        key=lambda: b"k",
        value=lambda: b"{}",
        headers=lambda: [("id", b"old"), ("id", b"e-9"), ("traceparent", None)],
        timestamp=lambda: (1, 1_700_000_000_000),
    )
    env = Envelope.from_kafka(message)
    assert env.position == ("t", 2, 42)
    assert env.raw_id == "e-9"
    assert env.headers["traceparent"] == b""
    assert env.timestamp_ms == 1_700_000_000_000
    no_ts = SimpleNamespace(
        **{**vars(message), "timestamp": lambda: (0, -1), "headers": lambda: None}
    )
    assert Envelope.from_kafka(no_ts).timestamp_ms is None
    assert headers_dict(None) == {}


# --- KeyScheduler: examples --------------------------------------------------


def test_records_of_one_key_start_one_at_a_time_in_order() -> None:
    sched = KeyScheduler(max_in_flight=10)
    a0, a1, b0 = _env(b"a", 0), _env(b"a", 1), _env(b"b", 2)
    for env in (a0, a1, b0):
        sched.submit(env)
    assert sched.ready() == [a0, b0]
    assert sched.state(a1) is RecordState.QUEUED
    assert sched.ready() == []
    sched.finish(a0)
    assert sched.ready() == [a1]
    assert sched.state(a0) is RecordState.UNKNOWN


def test_in_flight_is_bounded_across_keys() -> None:
    sched = KeyScheduler(max_in_flight=2)
    envs = [_env(bytes([k]), k) for k in range(5)]
    for env in envs:
        sched.submit(env)
    assert sched.ready() == envs[:2]
    assert sched.ready() == []
    sched.finish(envs[1])
    assert sched.ready(limit=5) == [envs[2]]
    assert (sched.in_flight, sched.queued, sched.pending) == (2, 2, 4)


def test_ready_honours_a_limit() -> None:
    sched = KeyScheduler(max_in_flight=10)
    for k in range(4):
        sched.submit(_env(bytes([k]), k))
    assert len(sched.ready(limit=1)) == 1
    assert len(sched.ready()) == 3


def test_released_record_starts_again_before_later_records_of_its_key() -> None:
    sched = KeyScheduler(max_in_flight=1)
    a0, a1 = _env(b"a", 0), _env(b"a", 1)
    sched.submit(a0)
    sched.submit(a1)
    assert sched.ready() == [a0]
    sched.release(a0)
    assert sched.state(a0) is RecordState.QUEUED
    assert sched.ready() == [a0]
    sched.finish(a0)
    assert sched.ready() == [a1]


def test_records_without_key_do_not_wait_for_each_other() -> None:
    sched = KeyScheduler(max_in_flight=10)
    envs = [_env(None, n) for n in range(3)]
    for env in envs:
        sched.submit(env)
    assert sched.ready() == envs
    assert lane_key(envs[0]) != lane_key(envs[1])


def test_one_key_across_topics_shares_a_lane() -> None:
    sched = KeyScheduler(max_in_flight=10)
    user = _env(b"u1", 0, topic="outbox.event.user")
    attempt = _env(b"u1", 0, topic="outbox.event.quiz_attempt")
    sched.submit(user)
    sched.submit(attempt)
    assert sched.ready() == [user]


def test_drop_partition_forgets_queued_records_and_keeps_in_flight_ones_until_finished() -> None:
    sched = KeyScheduler(max_in_flight=10)
    p0 = [_env(b"a", 0), _env(b"a", 1), _env(b"b", 2)]
    other = _env(b"a", 0, partition=1)
    for env in (*p0, other):
        sched.submit(env)
    assert sched.ready() == [p0[0], p0[2]]
    assert sched.pending_for("t", 0) == 3
    assert sched.drop_partition("t", 0) == [p0[1]]
    assert sched.pending_for("t", 0) == 2  # the two in flight
    assert sched.in_flight == 2
    sched.finish(p0[0])
    sched.release(p0[2])  # released after the drop: forgotten, not requeued
    assert sched.state(p0[2]) is RecordState.UNKNOWN
    assert sched.pending_for("t", 0) == 0
    assert sched.ready() == [other]


def test_a_reassigned_partition_adopts_its_record_still_in_flight_from_before() -> None:
    sched = KeyScheduler(max_in_flight=10)
    before, later = _env(b"a", 0), _env(b"a", 1)
    sched.submit(before)
    assert sched.ready() == [before]
    sched.drop_partition("t", 0)
    assert sched.is_orphan(before)
    # the partition came back; Kafka redelivers from the commit point
    assert sched.submit(_env(b"a", 0)) is True  # adopted: the same record, still in flight
    assert sched.submit(later) is False
    assert not sched.is_orphan(before)
    sched.release(before)  # engine down: back to the head of its key, before `later`
    assert sched.ready() == [before]
    sched.finish(before)
    assert sched.ready() == [later]
    sched.finish(later)
    assert sched.pending == 0


def test_a_lane_waits_for_its_heads_route_while_other_routes_start() -> None:
    sched = KeyScheduler(max_in_flight=None)
    quiz_a, user_a, user_b = _env(b"a", 0), _env(b"a", 1), _env(b"b", 2)
    sched.submit(quiz_a, "quiz")
    sched.submit(user_a, "users")
    sched.submit(user_b, "users")
    assert sched.ready(route="users") == [user_b]  # user_a waits behind its key's head
    assert sched.ready(route="quiz") == [quiz_a]
    sched.release(quiz_a, "users")  # its user sync failed: it waits for the users route now
    assert (sched.queued_for("quiz"), sched.queued_for("users")) == (0, 2)
    assert not sched.can_start("quiz")
    assert sched.ready(route="users") == [quiz_a]
    sched.finish(quiz_a)
    assert sched.ready(route="users") == [user_a]


def test_a_dropped_head_files_its_lane_under_the_next_records_route() -> None:
    sched = KeyScheduler(max_in_flight=None)
    first, second = _env(b"a", 0), _env(b"a", 0, partition=1)
    sched.submit(first, "quiz")
    sched.submit(second, "users")
    assert sched.drop_partition("t", 0) == [first]
    assert not sched.can_start("quiz")
    assert sched.ready(route="users") == [second]


def test_drop_of_an_unknown_partition_is_harmless() -> None:
    sched = KeyScheduler(max_in_flight=1)
    assert sched.drop_partition("t", 9) == []
    assert sched.pending_for("t", 9) == 0


def test_scheduler_misuse_is_refused() -> None:
    sched = KeyScheduler(max_in_flight=1)
    env = _env(b"a", 0)
    with pytest.raises(ValueError, match="not in flight"):
        sched.finish(env)
    sched.submit(env)
    with pytest.raises(ValueError, match="already held"):
        sched.submit(env)
    with pytest.raises(ValueError, match="not in flight"):
        sched.release(env)
    with pytest.raises(ValueError, match="at least 1"):
        KeyScheduler(max_in_flight=0)


# --- KeyScheduler: a stateful model ------------------------------------------

KEYS = [b"a", b"b", b"c", None]
PARTITIONS = [0, 1]
ROUTES = ["x", "y"]


class SchedulerModel(RuleBasedStateMachine):
    """Random submit / ready / finish / release / drop against a simple model.

    Every record waits for one of two routes (changed by a release): ``ready``
    for a route starts exactly the lanes whose head waits for it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.max_in_flight = 3
        self.sched = KeyScheduler(max_in_flight=self.max_in_flight)
        self.next_offset = defaultdict(int)  # partition -> next offset
        self.lanes: dict[object, list[Envelope]] = defaultdict(list)  # unfinished, in order
        self.in_flight: list[Envelope] = []
        self.orphans: list[Envelope] = []  # in flight when their partition was dropped
        self.route: dict[object, str] = {}  # position -> the route it waits for
        self.home: dict[object, str] = {}  # position -> the route it was submitted with

    @rule(
        key=st.sampled_from(KEYS),
        partition=st.sampled_from(PARTITIONS),
        route=st.sampled_from(ROUTES),
    )
    def submit(self, key: bytes | None, partition: int, route: str) -> None:
        offset = self.next_offset[partition]
        self.next_offset[partition] += 1
        env = _env(key, offset, partition=partition)
        self.sched.submit(env, route)
        self.route[env.position] = self.home[env.position] = route
        self.lanes[lane_key(env)].append(env)

    @rule(limit=st.none() | st.integers(min_value=0, max_value=4), route=st.sampled_from(ROUTES))
    def start(self, limit: int | None, route: str) -> None:
        startable = [
            lane
            for lane, envs in self.lanes.items()
            if envs and envs[0] not in self.in_flight and self.route[envs[0].position] == route
        ]
        room = self.max_in_flight - len(self.in_flight)
        expected = min(len(startable), room if limit is None else min(room, limit))
        assert self.sched.can_start(route) is (bool(startable) and room > 0)
        started = self.sched.ready(limit, route=route)
        assert len(started) == expected  # never idle while a lane of the route could start
        for env in started:
            lane = self.lanes[lane_key(env)]
            assert lane[0] == env, "a record started before an earlier one of its key"
            assert self.route[env.position] == route, "started for another route"
            assert env not in self.in_flight
            self.in_flight.append(env)

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        env = data.draw(st.sampled_from(self.in_flight))
        self.sched.finish(env)
        self.in_flight.remove(env)
        if env in self.orphans:
            self.orphans.remove(env)
        self.lanes[lane_key(env)].remove(env)

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data(), route=st.none() | st.sampled_from(ROUTES))
    def release(self, data: st.DataObject, route: str | None) -> None:
        env = data.draw(st.sampled_from(self.in_flight))
        self.sched.release(env, route)
        if route is not None:
            self.route[env.position] = route
        self.in_flight.remove(env)
        if env in self.orphans:  # its partition is gone: forgotten, not requeued
            self.orphans.remove(env)
            self.lanes[lane_key(env)].remove(env)

    @rule(partition=st.sampled_from(PARTITIONS))
    def drop(self, partition: int) -> None:
        dropped = self.sched.drop_partition("t", partition)
        expected = [
            env
            for lane in self.lanes.values()
            for env in lane
            if env.partition == partition and env not in self.in_flight
        ]
        assert sorted(d.position for d in dropped) == sorted(e.position for e in expected)
        for lane in self.lanes.values():
            lane[:] = [e for e in lane if e not in expected]
        self.orphans += [e for e in self.in_flight if e.partition == partition]

    @invariant()
    def bounded_and_one_per_key(self) -> None:
        assert self.sched.in_flight == len(self.in_flight) <= self.max_in_flight
        lanes = [lane_key(e) for e in self.in_flight]
        assert len(lanes) == len(set(lanes))

    @invariant()
    def counts_match_the_model(self) -> None:
        held = sum(len(lane) for lane in self.lanes.values())
        assert self.sched.pending == held
        for route in ROUTES:
            waiting = [
                e
                for lane in self.lanes.values()
                for e in lane
                if e not in self.in_flight and self.route[e.position] == route
            ]
            assert self.sched.queued_for(route) == len(waiting)
            own = [
                e
                for lane in self.lanes.values()
                for e in lane
                if e not in self.in_flight and self.home[e.position] == route
            ]
            for partition in PARTITIONS:
                here = [e for e in own if e.partition == partition]
                assert self.sched.queued_in("t", partition, route) == len(here)
        for partition in PARTITIONS:
            expected = sum(
                1 for lane in self.lanes.values() for e in lane if e.partition == partition
            )
            assert self.sched.pending_for("t", partition) == expected


TestSchedulerModel = SchedulerModel.TestCase
TestSchedulerModel.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
