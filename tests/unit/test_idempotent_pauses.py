"""The idempotent consumer's pause book against a model of librdkafka's pause flags.

The model is the client as librdkafka behaves: a partition's pause flag is set
by ``pause``, cleared by ``resume``, and **kept** when the partition is revoked
and assigned again. Hypothesis fails records (the helper holds the partition
for a backoff), revokes, assigns (eager or lost) and moves time, carrying out
the book's answers on that client, and checks after every step:

* an assigned partition the helper holds is paused in the client (no record
  behind a failed one runs before its backoff is over);
* an assigned partition the helper does not hold is not paused in the client
  (nothing stalls: the bug of issue 22, item 2);
* the book keeps only deadlines still ahead (bounded);
* and at the end, liveness: time passes, every assigned partition is fetching.

A mutant at the bottom is the book as it was (forgetting a partition's pause on
revoke/assign, no explicit resume) and shows the model catches it.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from sinks.idempotent import Hold, PauseActions, PauseBook

TPS = [("orders", 0), ("orders", 1), ("refunds", 0)]
TP = tuple[str, int]


class Client:
    """librdkafka's view: assignment and per-partition pause flags (kept across rebalances)."""

    def __init__(self) -> None:
        self.assigned: set[TP] = set()
        self.paused: set[TP] = set()

    def apply(self, actions: PauseActions) -> None:
        self.paused |= set(actions.pause)
        self.paused -= set(actions.resume)

    def fetching(self, tp: TP) -> bool:
        return tp in self.assigned and tp not in self.paused


class PauseBookModel(RuleBasedStateMachine):
    make = PauseBook

    def __init__(self) -> None:
        super().__init__()
        self.book = self.make()
        self.client = Client()
        self.now = 0.0
        for tp in TPS[:2]:
            self._assign(tp)

    def _assign(self, tp: TP) -> None:
        self.client.apply(self.book.assigned([tp], now=self.now))  # inside on_assign
        self.client.assigned.add(tp)

    @rule(tp=st.sampled_from(TPS), delay=st.sampled_from([0.5, 1.0, 5.0, 30.0]))
    def handler_fails(self, tp: TP, delay: float) -> None:
        if self.client.fetching(tp):  # a record came from it, its handler raised
            self.client.apply(self.book.hold(tp, until=self.now + delay))

    @rule(tp=st.sampled_from(TPS))
    def revoke(self, tp: TP) -> None:
        if tp in self.client.assigned:
            self.book.revoked([tp])
            self.client.assigned.discard(tp)

    @rule(tp=st.sampled_from(TPS))
    def assign(self, tp: TP) -> None:
        if tp not in self.client.assigned:
            self._assign(tp)

    @rule(tps=st.lists(st.sampled_from(TPS), min_size=1, unique=True))
    def rebalance(self, tps: list[TP]) -> None:
        """Eager: everything revoked, then ``tps`` assigned (often the same ones back)."""
        self.book.revoked(sorted(self.client.assigned))
        self.client.assigned.clear()
        for tp in tps:
            self._assign(tp)

    @rule(dt=st.sampled_from([0.1, 0.5, 1.0, 5.0, 40.0]))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        self.client.apply(self.book.due(self.now))  # the start of every poll_once

    @invariant()
    def held_partitions_are_paused(self) -> None:
        for tp in self.client.assigned:
            if self.book.holds(tp):
                assert tp in self.client.paused, f"{tp} held but fetching"

    @invariant()
    def nothing_else_is_paused(self) -> None:
        for tp in self.client.assigned:
            if not self.book.holds(tp):
                assert tp not in self.client.paused, f"{tp} paused by nobody: stalled"

    @invariant()
    def only_deadlines_ahead_are_kept(self) -> None:
        assert len(self.book) <= len(TPS)
        due = self.book.next_due()
        assert due is None or due > self.now, f"a deadline {due} kept past now {self.now}"

    def teardown(self) -> None:
        self.now += 1_000
        self.client.apply(self.book.due(self.now))
        stalled = [tp for tp in self.client.assigned if not self.client.fetching(tp)]
        assert not stalled, f"not live: {stalled} stay paused"
        assert len(self.book) == 0


MODEL_SETTINGS = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPauseBookModel = PauseBookModel.TestCase
TestPauseBookModel.settings = MODEL_SETTINGS


def test_a_partition_held_when_revoked_stays_paused_until_its_deadline_then_resumes() -> None:
    book, client = PauseBook(), Client()
    tp = ("orders", 0)
    client.apply(book.assigned([tp], now=0))
    client.assigned.add(tp)
    client.apply(book.hold(tp, until=2.0))
    book.revoked([tp])
    client.assigned.discard(tp)
    assert book.state(tp) is Hold.AWAY
    client.apply(book.assigned([tp], now=1.0))  # back within its backoff
    client.assigned.add(tp)
    assert (book.state(tp), client.fetching(tp)) == (Hold.HELD, False)
    client.apply(book.due(2.5))
    assert (book.state(tp), client.fetching(tp)) == (Hold.FREE, True)


def test_a_partition_back_after_its_deadline_is_resumed_on_assignment() -> None:
    book, client = PauseBook(), Client()
    tp = ("orders", 0)
    client.assigned.add(tp)
    client.apply(book.hold(tp, until=2.0))
    book.revoked([tp])
    client.assigned.discard(tp)
    client.apply(book.due(3.0))  # forgotten while away
    assert len(book) == 0
    assert book.assigned([tp], now=3.0) == PauseActions(resume=(tp,))


# -- the mutant: the book as it was ----------------------------------------------------------


class _ForgetsOnRebalance(PauseBook):
    """Issue 22 item 2 as it was: revoke/assign dropped the pause, no explicit resume."""

    def revoked(self, tps: Iterable[TP]) -> None:
        for tp in tps:
            self._entries.pop(tp, None)

    def assigned(self, tps: Iterable[TP], *, now: float) -> PauseActions:
        for tp in tps:
            self._entries.pop(tp, None)
        return PauseActions()


def test_the_model_catches_a_pause_forgotten_across_a_rebalance() -> None:
    mutant = type("Mutant", (PauseBookModel,), {"make": _ForgetsOnRebalance})
    with pytest.raises((AssertionError, Flaky), match=r"paused by nobody: stalled|not live"):
        run_state_machine_as_test(
            mutant,
            settings=settings(
                MODEL_SETTINGS,
                max_examples=1000,
                database=None,
                print_blob=False,
                derandomize=True,
                phases=[Phase.generate],
                report_multiple_bugs=False,
            ),
        )
