"""The sink core against a reference model: random interleavings, invariants after every step.

The model is the world around the core, kept as simply as possible: a Kafka
log per partition (records with a key and a kind), the broker's committed
offsets, which partitions are assigned and paused, an engine that is up or
down, and the Sends, Parks and Commits the core has put out and not yet seen
answered. Hypothesis drives records in, answers the core's actions in any
order (2xx, a 4xx for one record, a 5xx for one record, engine-wide trouble,
a 429 with or without Retry-After beside 2xx answers, an expired request
deadline, an unroutable surprise, parking-lot and commit failures), feeds
hostile records (headers the routing cannot read: parked with a reason),
moves time, assigns, revokes and loses partitions, and checks after every
step:

* no commit (in flight or on revoke) passes a record that is neither delivered
  nor parked;
* per key and partition, a record is sent only after every earlier record of
  its key in that partition was delivered or parked - across rebalances too;
* at most one record per key in flight, never more than ``max_in_flight``;
* no record is sent after it was parked (until it is consumed again);
* nothing but a probe is sent unless the circuit is CLOSED; HALF_OPEN means
  exactly one probe in flight; OPEN or CLOSED means none;
* bounded state: the core holds only records of assigned partitions, plus
  orphans whose Send or Park is still out; and never more than
  ``max_buffered`` plus one fetch batch, whatever phase its records are in
  (parking that fails included);
* engine-wide trouble spends nothing: a parked record's attempts never exceed
  the answers that blamed it (4xx, or a 5xx of its own); a 429 or an expired
  deadline never counts;
* the sink honours Retry-After (no Send but a probe before a throttled
  answer's hold has passed) and its adaptive window (no Send beyond it);
* and, at the end, liveness: once the engine is up and time passes, every
  record of every assigned partition is delivered or parked and the broker's
  committed offset reaches the end of the log.

Mutants at the bottom re-create the bugs this machine exists for (a circuit
left HALF_OPEN by a probe the engine rejected; an orphan's re-consumed copy
queued behind later records of its key; a re-assigned partition left paused by
the client, found by the compound-fault test) and show the model catches each.
The hard interleavings are also scripted (``SCRIPTS``) and run against the
production class on every run, so such a bug is caught every run, not only
when the random search happens to reach it.
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
    THROTTLE_HOLD_S,
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
    Window,
)
from sinks.core.retry import Backoff, Jitter

TOPICS = ("user", "quiz")
PARTITIONS = (0,)
TPS = tuple((t, p) for t in TOPICS for p in PARTITIONS)
KEYS = (b"a", b"b")
MAX_IN_FLIGHT = 3
INLINE_ATTEMPTS = 2
MAX_BUFFERED = 6
#: The most records one ``consume`` step fetches: the overshoot a pause allows.
FETCH_BATCH = 4


@dataclass(frozen=True)
class Kind:
    """What a record is, for the model: the engine's and the routing's view of it."""

    name: str  # good | poison (the engine always rejects it) | bad (unroutable) | ignored


GOOD, POISON, BAD, IGNORED = Kind("good"), Kind("poison"), Kind("bad"), Kind("ignored")
#: A record other producers wrote: headers the routing cannot read at all.
HOSTILE = Kind("hostile")


def _classify(record: Envelope) -> Verdict:
    try:
        kind = record.headers["kind"].decode()
    except (KeyError, UnicodeDecodeError) as exc:
        return Verdict(Route.PARK, f"uninterpretable record: {type(exc).__name__}")
    if kind == "bad":
        return Verdict(Route.PARK, "no route for event type 'Bad'")
    if kind == "ignored":
        return Verdict(Route.IGNORE, "ignored type")
    return Verdict(Route.DELIVER)


def make_core(cls: type[SinkCore] = SinkCore) -> SinkCore:
    return cls(
        max_in_flight=MAX_IN_FLIGHT,
        max_buffered=MAX_BUFFERED,
        inline_attempts=INLINE_ATTEMPTS,
        inline_backoff_s=0.2,
        backoff=Backoff(base_s=0.5, cap_s=4.0, jitter=Jitter.NONE),
        commit_interval_s=1.0,
        classify=_classify,
    )


#: Answers that are engine-wide whatever else succeeds: a 429, an expired request deadline.
SHARED_TROUBLE = {
    "429": (ResultKind.THROTTLED, "HTTP 429"),
    "deadline": (ResultKind.UNAVAILABLE, "RequestDeadline: nothing complete within 5 s"),
}


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
        self.blamed: dict[Position, int] = {}  # answers that blamed the record itself
        self.hold_until = 0.0  # no Send but a probe before this (a 429's Retry-After)

    # -- the world ------------------------------------------------------------------
    @rule(
        tp=st.sampled_from(TPS),
        key=st.sampled_from(KEYS),
        kind=st.sampled_from([GOOD, GOOD, GOOD, GOOD, POISON, BAD, IGNORED, HOSTILE]),
    )
    def produce(self, tp: tuple[str, int], key: bytes, kind: Kind) -> None:
        offset = len(self.log[tp])
        headers = {"kind": kind.name.encode(), "id": f"{tp}-{offset}".encode()}
        if kind is HOSTILE:
            headers = {"\ufffd": b"\xff\xfe", "id": b"\x00"}
        record = Envelope(
            topic=tp[0],
            partition=tp[1],
            offset=offset,
            key=key,
            value=b"{}",
            headers=headers,
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
        answer=st.sampled_from(
            ["2xx", "2xx", "2xx", "4xx", "5xx-one", "down", "unroutable", "429", "deadline"]
        ),
        retry_after=st.sampled_from([None, 0.0, 0.5, 3.0]),
    )
    def answer_send(self, data: st.DataObject, answer: str, retry_after: float | None) -> None:
        send = self.sends.pop(data.draw(st.integers(0, len(self.sends) - 1)))
        self.answer(send, answer, retry_after)

    @precondition(lambda self: any(s.probe for s in self.sends))
    @rule(answer=st.sampled_from(["2xx", "4xx", "down", "unroutable", "429", "deadline"]))
    def answer_the_probe(self, answer: str) -> None:
        """The probe's answer decides the circuit: reached often, not by luck."""
        probe = next(s for s in self.sends if s.probe)
        self.sends.remove(probe)
        self.answer(probe, answer, None)

    def answer(self, send: Send, answer: str, retry_after: float | None = None) -> None:
        closed = self.core.circuit is Circuit.CLOSED
        result = self.engine_answer(send, answer, retry_after)
        if result.kind is ResultKind.THROTTLED and closed and not send.probe:
            self.hold_until = max(self.hold_until, self.now + (retry_after or THROTTLE_HOLD_S))
        self.core.sent(send.record, result, now=self.now)
        self.step()

    def engine_answer(self, send: Send, answer: str, retry_after: float | None = None) -> Result:
        position = send.record.position
        shared = SHARED_TROUBLE.get(answer)
        if shared is not None:  # the engine sheds load, or trickles: it blames nobody
            return Result(shared[0], shared[1], retry_after, shared=True)
        if not self.engine_up or answer == "down":
            return Result(ResultKind.UNAVAILABLE, "HTTP 503")
        if self.kinds[position] is POISON or answer == "4xx":
            self.blamed[position] = self.blamed.get(position, 0) + 1
            return Result(ResultKind.REJECTED, "HTTP 400")
        if answer == "5xx-one":
            self.blamed[position] = self.blamed.get(position, 0) + 1
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
                for item in action.items:
                    blamed = self.blamed.get(item.record.position, 0)
                    assert item.attempts <= blamed, (
                        f"{item.record.position} parked after {item.attempts} attempts,"
                        f" only {blamed} answers blamed it"
                    )
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
            assert self.now >= self.hold_until, f"sent at {self.now}, held until {self.hold_until}"
            assert len(self.sends) < self.core.window.limit, "sent beyond the adaptive window"
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
        assert 1 <= self.core.window.limit <= MAX_IN_FLIGHT

    @invariant()
    def memory_is_bounded_in_every_phase(self) -> None:
        held = self.core.held
        assert held <= MAX_BUFFERED + FETCH_BATCH, f"{held} records held"

    @invariant()
    def a_stall_needs_waiting_work(self) -> None:
        if not self.core.held and all(
            self.core.committed(*tp) == self.core.committable(*tp) for tp in self.position
        ):
            assert self.core.stalled_s(self.now) == 0.0

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
        self.answer(send, "2xx")

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


# -- scripted interleavings: the hard ones, on every run, against the production class ----

#: One step of a script: a model method and its arguments. ``answer`` takes the
#: index of the Send to answer (in the order they went out) instead of a Send.
Step = tuple[str, dict[str, Any]]
A, U, Q = KEYS[0], TPS[0], TPS[1]

SCRIPTS: dict[str, list[Step]] = {
    "a rejected probe closes the circuit": [
        ("assign", {"tp": U}),
        ("produce", {"tp": U, "key": A, "kind": GOOD}),
        ("consume", {"tp": U, "n": 1}),
        ("answer", {"index": 0, "answer": "down"}),
        ("time_passes", {"dt": 5.0}),
        ("answer", {"index": 0, "answer": "4xx"}),
    ],
    "a parked probe closes the circuit": [
        ("assign", {"tp": U}),
        ("produce", {"tp": U, "key": A, "kind": POISON}),
        ("produce", {"tp": U, "key": KEYS[1], "kind": GOOD}),
        ("consume", {"tp": U, "n": 2}),
        ("answer", {"index": 0, "answer": "4xx"}),  # attempt 1: waits to be sent again
        ("answer", {"index": 0, "answer": "down"}),  # the other: OPEN
        ("time_passes", {"dt": 5.0}),  # the waiting poison record is the probe
        ("answer", {"index": 0, "answer": "4xx"}),  # attempt 2: parked - and CLOSED
    ],
    "a 429 beside 2xx spends nothing and holds every Send for its Retry-After": [
        ("assign", {"tp": U}),
        ("assign", {"tp": Q}),
        ("produce", {"tp": U, "key": A, "kind": GOOD}),
        ("produce", {"tp": U, "key": KEYS[1], "kind": POISON}),
        ("produce", {"tp": Q, "key": A, "kind": GOOD}),
        ("produce", {"tp": Q, "key": KEYS[1], "kind": GOOD}),
        ("consume", {"tp": U, "n": 2}),
        ("consume", {"tp": Q, "n": 2}),
        ("answer", {"index": 0, "answer": "2xx"}),
        ("answer", {"index": 0, "answer": "429", "retry_after": 3.0}),
        ("answer", {"index": 0, "answer": "429", "retry_after": None}),
        ("time_passes", {"dt": 1.0}),
        ("time_passes", {"dt": 5.0}),
        ("answer", {"index": 0, "answer": "429", "retry_after": 0.5}),
    ],
    "an expired deadline beside 2xx spends nothing": [
        ("assign", {"tp": U}),
        ("produce", {"tp": U, "key": A, "kind": POISON}),
        ("produce", {"tp": U, "key": KEYS[1], "kind": GOOD}),
        ("consume", {"tp": U, "n": 2}),
        ("answer", {"index": 1, "answer": "2xx"}),
        ("answer", {"index": 0, "answer": "deadline"}),
        ("answer", {"index": 0, "answer": "deadline"}),
    ],
    "the parking lot down under a flood of hostile records: bounded, paused": [
        ("assign", {"tp": U}),
        ("assign", {"tp": Q}),
        *[("produce", {"tp": tp, "key": A, "kind": HOSTILE}) for tp in (U, Q) for _ in range(8)],
        *[
            step
            for _ in range(4)
            for step in (
                ("consume", {"tp": U, "n": FETCH_BATCH}),
                ("consume", {"tp": Q, "n": FETCH_BATCH}),
                ("fail_parks", {}),
                ("time_passes", {"dt": 1.0}),
            )
        ],
        ("expect_paused", {}),
    ],
}


class ScriptedModel(SinkCoreModel):
    """The model driven by a script instead of Hypothesis; invariants after every step."""

    def answer(
        self,
        send: Send | None = None,
        answer: str = "2xx",
        retry_after: float | None = None,
        *,
        index: int = 0,
    ) -> None:
        if send is None:
            send = self.sends.pop(index)
        super().answer(send, answer, retry_after)

    def fail_parks(self) -> None:
        while self.parks:
            for item in self.parks.pop(0).items:
                self.core.park_failed(item.record, now=self.now)
            self.step()

    def expect_paused(self) -> None:
        assert self.core.held > MAX_BUFFERED, "the flood did not fill the buffer"
        assert self.paused == set(self.position), "held records over the bound, not paused"

    def check_all(self) -> None:
        self.circuit_matches_the_probes_out()
        self.in_flight_is_bounded()
        self.memory_is_bounded_in_every_phase()
        self.state_is_bounded_to_assigned_partitions()
        self.a_stall_needs_waiting_work()


def _run_script(machine: ScriptedModel, script: list[Step]) -> None:
    machine.check_all()
    for name, kwargs in script:
        getattr(machine, name)(**kwargs)
        machine.check_all()
    machine.teardown()
    assert machine.core.stalled_s(machine.now) == 0.0, "a settled sink reports a stall"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_scripted_hard_interleaving_keeps_every_invariant(name: str) -> None:
    machine = ScriptedModel()
    _run_script(machine, SCRIPTS[name])
    parked_good = [p for p in machine.parked_live if machine.kinds[p] is GOOD]
    assert parked_good == [], f"good records parked: {parked_good}"


def test_the_scripts_catch_a_circuit_left_half_open_by_a_parked_probe_every_run() -> None:
    mutant = type(
        "Mutant",
        (ScriptedModel,),
        {"make": staticmethod(lambda: make_core(cls=_ProbeClosesOnlyWhenDelivered))},
    )
    with pytest.raises(AssertionError, match="HALF_OPEN with 0 probes in flight"):
        _run_script(mutant(), SCRIPTS["a parked probe closes the circuit"])


def test_the_window_halves_on_throttling_grows_back_and_slow_starts_after_an_outage() -> None:
    window = Window(64)
    window.cut()
    assert (window.limit, window.threshold) == (32, 32)
    for _ in range(32):  # congestion avoidance: one more per window of deliveries
        window.delivered()
    assert window.limit == 33
    window.restart()  # the engine is back from an outage: one request first
    assert (window.limit, window.threshold) == (1, 33)
    grown = []
    for _ in range(6):
        for _ in range(window.limit):  # one round: as many deliveries as the window
            window.delivered()
        grown.append(window.limit)
    assert grown == [2, 4, 8, 16, 32, 33], "doubling per round up to where it was, then +1"
    for _ in range(10):
        window.cut()
    assert window.limit == 1, "never below one"
