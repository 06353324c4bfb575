"""The sink core against a reference model: random interleavings, invariants after every step.

The model is the world around the core, kept as simply as possible: a Kafka
log per partition (records with a key and a kind), the broker's committed
offsets, which partitions are assigned and paused, an engine that is up or
down, and the Sends, Parks and Commits the core has put out and not yet seen
answered. Hypothesis drives records in, answers the core's actions in any
order (2xx, a 4xx for one record, a 5xx for one record, engine-wide trouble,
an unroutable surprise, parking-lot and commit failures), moves time, assigns,
revokes and loses partitions, and checks after every step:

* no commit (in flight or on revoke) passes a record that is neither delivered
  nor parked;
* per key and partition, a record is sent only after every earlier record of
  its key in that partition was delivered or parked - across rebalances too;
* at most one record per key in flight, never more than ``max_in_flight``;
* no record is sent after it was parked (until it is consumed again);
* nothing but a probe is sent unless the circuit is CLOSED; HALF_OPEN means
  exactly one probe in flight; OPEN or CLOSED means none;
* bounded state: the core holds only records of assigned partitions, plus
  orphans whose Send or Park is still out;
* and, at the end, liveness: once the engine is up and time passes, every
  record of every assigned partition is delivered or parked and the broker's
  committed offset reaches the end of the log.

Mutants at the bottom re-create the bugs this machine exists for (a circuit
left HALF_OPEN by a probe the engine rejected; an orphan's re-consumed copy
queued behind later records of its key; a re-assigned partition left paused by
the client, found by the compound-fault test) and show the model catches each.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from sinks.core.delivery import Envelope, Position
from sinks.core.machine import (
    DELIVERED,
    Circuit,
    Commit,
    Park,
    Pause,
    Result,
    ResultKind,
    Resume,
    Route,
    Send,
    SinkCore,
    Verdict,
)
from sinks.core.retry import Backoff, Jitter

TOPICS = ("user", "quiz")
PARTITIONS = (0,)
TPS = tuple((t, p) for t in TOPICS for p in PARTITIONS)
KEYS = (b"a", b"b")
MAX_IN_FLIGHT = 3
INLINE_ATTEMPTS = 2


@dataclass(frozen=True)
class Kind:
    """What a record is, for the model: the engine's and the routing's view of it."""

    name: str  # good | poison (the engine always rejects it) | bad (unroutable) | ignored


GOOD, POISON, BAD, IGNORED = Kind("good"), Kind("poison"), Kind("bad"), Kind("ignored")


def _classify(record: Envelope) -> Verdict:
    kind = record.headers["kind"].decode()
    if kind == "bad":
        return Verdict(Route.PARK, "no route for event type 'Bad'")
    if kind == "ignored":
        return Verdict(Route.IGNORE, "ignored type")
    return Verdict(Route.DELIVER)


def make_core(cls: type[SinkCore] = SinkCore) -> SinkCore:
    return cls(
        max_in_flight=MAX_IN_FLIGHT,
        max_buffered=6,
        inline_attempts=INLINE_ATTEMPTS,
        inline_backoff_s=0.2,
        backoff=Backoff(base_s=0.5, cap_s=4.0, jitter=Jitter.NONE),
        commit_interval_s=1.0,
        classify=_classify,
    )


class SinkCoreModel(RuleBasedStateMachine):
    """See the module docstring."""

    make = staticmethod(make_core)

    def __init__(self) -> None:
        super().__init__()
        self.core = self.make()
        self.now = 0.0
        self.log: dict[tuple[str, int], list[Envelope]] = {tp: [] for tp in TPS}
        self.kinds: dict[Position, Kind] = {}
        self.broker_committed: dict[tuple[str, int], int] = dict.fromkeys(TPS, 0)
        self.position: dict[tuple[str, int], int] = {}  # assigned -> next offset to fetch
        self.paused: set[tuple[str, int]] = set()
        self.engine_up = True
        self.sends: list[Send] = []
        self.parks: list[Park] = []
        self.commits: list[Commit] = []
        self.done: set[Position] = set()  # delivered or parked, ever
        self.parked_live: set[Position] = set()  # parked, not consumed again since
        self.delivered: list[Position] = []

    # -- the world ------------------------------------------------------------------
    @rule(
        tp=st.sampled_from(TPS),
        key=st.sampled_from(KEYS),
        kind=st.sampled_from([GOOD, GOOD, GOOD, GOOD, POISON, BAD, IGNORED]),
    )
    def produce(self, tp: tuple[str, int], key: bytes, kind: Kind) -> None:
        offset = len(self.log[tp])
        record = Envelope(
            topic=tp[0],
            partition=tp[1],
            offset=offset,
            key=key,
            value=b"{}",
            headers={"kind": kind.name.encode(), "id": f"{tp}-{offset}".encode()},
            timestamp_ms=int(self.now * 1000),
        )
        self.log[tp].append(record)
        self.kinds[record.position] = kind
        self.step()

    @rule(tp=st.sampled_from(TPS), n=st.integers(min_value=1, max_value=4))
    def consume(self, tp: tuple[str, int], n: int) -> None:
        if tp not in self.position or tp in self.paused:
            return
        start = self.position[tp]
        for record in self.log[tp][start : start + n]:
            self.core.consumed(record, now_ms=int(self.now * 1000))
            self.parked_live.discard(record.position)
            self.position[tp] = record.offset + 1
        self.step()

    @rule(tp=st.sampled_from(TPS))
    def assign(self, tp: tuple[str, int]) -> None:
        if tp in self.position:
            return
        self.core.assign([tp])
        self.position[tp] = self.broker_committed[tp]
        self.step()

    @rule(tp=st.sampled_from(TPS), lost=st.booleans())
    def revoke(self, tp: tuple[str, int], lost: bool) -> None:
        if tp not in self.position:
            return
        final = self.core.revoke([tp], lost=lost)
        if lost:
            assert final == []
        for topic, partition, offset in final:
            self.check_commit((topic, partition), offset)
            self.broker_committed[(topic, partition)] = offset
        del self.position[tp]
        # librdkafka keeps a partition's pause across a revoke and a re-assign
        self.step()

    @rule(tp=st.sampled_from(TPS))
    def rebalance_gives_it_back(self, tp: tuple[str, int]) -> None:
        """Cooperative-sticky often hands a revoked partition straight back."""
        if tp not in self.position:
            return
        self.revoke(tp, lost=False)
        self.assign(tp)
        self.consume(tp, 4)

    @rule()
    def engine_goes_down(self) -> None:
        self.engine_up = False

    @rule()
    def engine_comes_back(self) -> None:
        self.engine_up = True

    @rule(dt=st.sampled_from([0.05, 0.2, 0.5, 1.0, 5.0]))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        self.step()

    # -- answers to the core's actions ----------------------------------------------------
    @precondition(lambda self: self.sends)
    @rule(
        data=st.data(),
        answer=st.sampled_from(["2xx", "2xx", "2xx", "4xx", "5xx-one", "down", "unroutable"]),
    )
    def answer_send(self, data: st.DataObject, answer: str) -> None:
        send = self.sends.pop(data.draw(st.integers(0, len(self.sends) - 1)))
        self.core.sent(send.record, self.engine_answer(send, answer), now=self.now)
        self.step()

    def engine_answer(self, send: Send, answer: str) -> Result:
        position = send.record.position
        if not self.engine_up or answer == "down":
            return Result(ResultKind.UNAVAILABLE, "HTTP 503")
        if self.kinds[position] is POISON or answer == "4xx":
            return Result(ResultKind.REJECTED, "HTTP 400")
        if answer == "5xx-one":
            return Result(ResultKind.UNAVAILABLE, "HTTP 500 for this record")
        if answer == "unroutable":
            return Result(ResultKind.UNROUTABLE, "payload unfit")
        self.delivered.append(position)
        self.done.add(position)
        return DELIVERED

    @precondition(lambda self: self.parks)
    @rule(data=st.data(), ok=st.sampled_from([True, True, True, False]))
    def answer_park(self, data: st.DataObject, ok: bool) -> None:
        park = self.parks.pop(data.draw(st.integers(0, len(self.parks) - 1)))
        for item in park.items:
            if ok:
                self.done.add(item.record.position)
                self.parked_live.add(item.record.position)
                self.core.parked(item.record)
            else:
                self.core.park_failed(item.record, now=self.now)
        self.step()

    @precondition(lambda self: self.commits)
    @rule(data=st.data(), ok=st.sampled_from([True, True, False]))
    def answer_commit(self, data: st.DataObject, ok: bool) -> None:
        commit = self.commits.pop(data.draw(st.integers(0, len(self.commits) - 1)))
        for topic, partition, offset in commit.offsets:
            if ok:
                tp = (topic, partition)
                self.broker_committed[tp] = max(self.broker_committed[tp], offset)
            self.core.commit_result(topic, partition, offset, ok=ok)
        self.step()

    # -- one step of the shell: carry out what the core says, checking each action ---------
    def step(self) -> None:
        circuit_before = self.core.circuit
        for action in self.core.actions(now=self.now):
            if isinstance(action, Send):
                self.check_send(action, circuit_before)
                self.sends.append(action)
            elif isinstance(action, Park):
                self.parks.append(action)
            elif isinstance(action, Commit):
                for topic, partition, offset in action.offsets:
                    self.check_commit((topic, partition), offset)
                self.commits.append(action)
            elif isinstance(action, Pause):
                assert set(action.partitions) <= set(self.position), "paused what is not ours"
                self.paused.update(action.partitions)
            elif isinstance(action, Resume) and not set(action.partitions) <= set(self.position):
                raise AssertionError("resumed what is not ours")
            elif isinstance(action, Resume):
                self.paused.difference_update(action.partitions)
        due = self.core.next_due()
        assert due is None or due > self.now, f"work due at {due} left undone at {self.now}"

    def check_send(self, send: Send, circuit_before: Circuit) -> None:
        record = send.record
        assert record.position not in self.parked_live, f"{record.position} sent after parked"
        if send.probe:
            assert circuit_before is Circuit.OPEN, "a probe only leaves an OPEN circuit"
        else:
            assert circuit_before is Circuit.CLOSED, f"sent while {circuit_before}"
        tp = record.topic_partition
        for earlier in self.log[tp][: record.offset]:
            if earlier.key == record.key and self.kinds[earlier.position] in (GOOD, POISON):
                assert earlier.position in self.done, (
                    f"{record.position} sent before {earlier.position} of its key was settled"
                )
        keys_out = [s.record.key for s in self.sends]
        assert record.key not in keys_out, f"two records of key {record.key!r} in flight"

    def check_commit(self, tp: tuple[str, int], offset: int) -> None:
        for record in self.log[tp][:offset]:
            if self.kinds[record.position] is not IGNORED:
                assert record.position in self.done, (
                    f"commit {tp}@{offset} passes {record.position}, neither delivered nor parked"
                )

    # -- invariants -------------------------------------------------------------------------
    @invariant()
    def circuit_matches_the_probes_out(self) -> None:
        probes = [s for s in self.sends if s.probe]
        if self.core.circuit is Circuit.HALF_OPEN:
            assert len(probes) == 1, f"HALF_OPEN with {len(probes)} probes in flight"
        else:
            assert probes == [], f"{self.core.circuit} with a probe in flight"

    @invariant()
    def in_flight_is_bounded(self) -> None:
        assert len(self.sends) <= MAX_IN_FLIGHT

    @invariant()
    def state_is_bounded_to_assigned_partitions(self) -> None:
        out = {s.record.position for s in self.sends}
        out |= {i.record.position for p in self.parks for i in p.items}
        for position in self.core.held_positions():
            tp = (position[0], position[1])
            assert tp in self.position or position in out, f"{position} kept after revoke"
        assert self.core.orphan_positions() <= out

    def teardown(self) -> None:
        """Liveness: with the engine up and time passing, everything settles and commits."""
        if sys.exc_info()[0] is not None:
            return  # a step already failed: that failure is the finding, not this one
        self.engine_up = True
        for _ in range(200):
            for tp in list(self.position):
                self.consume(tp, 100)
            while self.sends:
                self.answer_send_ok(self.sends.pop(0))
            while self.parks:
                park = self.parks.pop(0)
                for item in park.items:
                    self.done.add(item.record.position)
                    self.parked_live.add(item.record.position)
                    self.core.parked(item.record)
                self.step()
            while self.commits:
                commit = self.commits.pop(0)
                for topic, partition, offset in commit.offsets:
                    tp = (topic, partition)
                    self.broker_committed[tp] = max(self.broker_committed[tp], offset)
                    self.core.commit_result(topic, partition, offset, ok=True)
                self.step()
            self.time_passes(5.0)
            if self.settled():
                return
        unsettled = {tp: (self.broker_committed[tp], len(self.log[tp])) for tp in self.position}
        raise AssertionError(
            f"not live: circuit={self.core.circuit} paused={sorted(self.paused)}"
            f" held={self.core.held} committed/end={unsettled}"
        )

    def answer_send_ok(self, send: Send) -> None:
        self.core.sent(send.record, self.engine_answer(send, "2xx"), now=self.now)
        self.step()

    def settled(self) -> bool:
        return (
            not self.sends
            and not self.parks
            and not self.commits
            and all(self.broker_committed[tp] == len(self.log[tp]) for tp in self.position)
        )


MODEL_SETTINGS = settings(
    max_examples=200,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSinkCoreModel = SinkCoreModel.TestCase
TestSinkCoreModel.settings = MODEL_SETTINGS


# -- mutants: the bugs this model exists for ---------------------------------------------


class _ProbeClosesOnlyWhenDelivered(SinkCore):
    """Bug 1 as it was: only a delivered probe closed the circuit."""

    def _probe_settled(self, kind: ResultKind, *, now: float) -> None:
        if kind is ResultKind.DELIVERED:
            super()._probe_settled(kind, now=now)


class _QueuesCopyBehindLaterRecords(SinkCore):
    """Bug 2 as it was: an orphan's re-consumed copy waited aside, then queued at the tail."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._stash: set[Position] = set()

    def _adopt(self, flight: Any, generation: int) -> None:
        if flight.laned:
            self._stash.add(flight.record.position)  # no adoption: the copy waits
        else:
            super()._adopt(flight, generation)

    def _engine_down(self, flight: Any, outcome: Result, *, now: float, probe: bool) -> None:
        super()._engine_down(flight, outcome, now=now, probe=probe)
        self._resubmit(flight.record)

    def _settle(self, flight: Any) -> None:
        super()._settle(flight)
        self._resubmit(flight.record)

    def _forget_if_orphan(self, flight: Any) -> bool:
        forgotten = super()._forget_if_orphan(flight)
        if forgotten:
            self._resubmit(flight.record)
        return forgotten

    def revoke(
        self, partitions: Iterable[tuple[str, int]], *, lost: bool = False
    ) -> list[tuple[str, int, int]]:
        partitions = list(partitions)
        self._stash = {p for p in self._stash if (p[0], p[1]) not in partitions}
        return super().revoke(partitions, lost=lost)

    def _resubmit(self, record: Envelope) -> None:
        if record.position in self._stash:
            self._stash.discard(record.position)
            self._scheduler.submit(record)  # behind whatever of its key came meanwhile


class _ForgetsPausesOnRevoke(SinkCore):
    """A third bug, found by the compound-fault test: a re-assigned partition stayed paused."""

    def _pause_or_resume(self, out: list[Any]) -> None:
        self._unsynced.clear()  # no explicit Resume of newly assigned partitions
        super()._pause_or_resume(out)


def _mutant_model(make: object) -> type[SinkCoreModel]:
    return type("Mutant", (SinkCoreModel,), {"make": staticmethod(make)})


def _model_fails(machine: type[SinkCoreModel], match: str) -> None:
    with pytest.raises((AssertionError, Flaky), match=match):
        run_state_machine_as_test(
            machine,
            settings=settings(
                MODEL_SETTINGS,
                max_examples=3000,
                database=None,
                print_blob=False,
                report_multiple_bugs=False,
                derandomize=True,  # the same search every run: the finding is reproducible
                phases=[Phase.generate],  # detection is the point: no shrinking
            ),
        )


def test_the_model_catches_a_circuit_left_half_open_by_a_rejected_probe() -> None:
    _model_fails(
        _mutant_model(lambda: make_core(cls=_ProbeClosesOnlyWhenDelivered)),
        "HALF_OPEN with 0 probes in flight|not live: circuit=Circuit.HALF_OPEN",
    )


def test_the_model_catches_a_reconsumed_record_queued_behind_later_ones_of_its_key() -> None:
    _model_fails(
        _mutant_model(lambda: make_core(cls=_QueuesCopyBehindLaterRecords)),
        # the copy goes out behind a later record of its key, or after its orphan was parked
        "sent before .* of its key was settled|sent after parked",
    )


def test_the_model_delivers_every_good_record_of_a_quiet_run() -> None:
    """Sanity of the model's own bookkeeping: a run with no fault settles everything."""
    machine = SinkCoreModel()
    for tp in TPS:
        machine.assign(tp)
    for i, tp in enumerate(TPS):
        machine.produce(tp, KEYS[i % len(KEYS)], GOOD)
    for tp in TPS:
        machine.consume(tp, 4)
    machine.teardown()
    assert sorted(machine.delivered) == sorted(r.position for tp in TPS for r in machine.log[tp])


def test_the_model_catches_a_reassigned_partition_left_paused_by_the_client() -> None:
    _model_fails(_mutant_model(lambda: make_core(cls=_ForgetsPausesOnRevoke)), "not live")
