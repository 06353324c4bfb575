"""Offset resets off the consumer's thread (issue 47 item 6): the book is model-checked,
the worker's turn never waits for a broker that does not answer.

* :class:`ResetBook` (pure) against a reference: a probe that answers questions in
  order, partitions stopped again, revoked. After every step: every partition
  waiting has its question out (none is left stopped with nobody asking), at most
  one question per partition is out (what waits is bounded by the assignment), and
  an answer decides for the offset librdkafka refused last - nothing once revoked.
  Mutants at the bottom re-create the bugs each invariant is for.
* The worker's turn with a fake consumer whose watermark request and synchronous
  commit block until the test ends: the turn that meets the reset returns, the
  blocking calls were never made on the consumer's thread, and the answer applied
  on a later turn restarts the partition and commits its position asynchronously.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import KafkaError, TopicPartition
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from cdc.kafka.log import KafkaClientEvents
from sinks.kafka.offset_expiry import ResetBook, Step, Watermarks
from sinks.kafka.stall_probe import StallProbe
from sinks.kafka.worker import KafkaWorker

TPS = [("t", 0), ("t", 1), ("u", 0)]
#: How long the test waits for the probe's thread to answer (a bound, not a speed).
ANSWER_WAIT_S = 30.0


class ResetBookModel(RuleBasedStateMachine):
    """See the module docstring."""

    make: Callable[[], ResetBook] = ResetBook

    def __init__(self) -> None:
        super().__init__()
        self.book = type(self).make()
        #: the probe's queue: questions out, oldest first
        self.out: list[tuple[str, int]] = []
        #: what an answer must decide for now: the last refused offset, per partition
        self.expect: dict[tuple[str, int], int] = {}

    @rule(tp=st.sampled_from(TPS), failed=st.integers(0, 50))
    def refused(self, tp: tuple[str, int], failed: int) -> None:
        if self.book.begin(tp, failed) is Step.ASK:
            self.out.append(tp)
        self.expect[tp] = failed

    @precondition(lambda self: self.out)
    @rule(data=st.data())
    def probe_answers(self, data: st.DataObject) -> None:
        tp = self.out.pop(data.draw(st.integers(0, len(self.out) - 1)))
        assert self.book.answered(tp) == self.expect.pop(tp, None)

    @rule(tp=st.sampled_from(TPS))
    def revoked(self, tp: tuple[str, int]) -> None:
        self.book.forget([tp])
        self.expect.pop(tp, None)

    @invariant()
    def every_waiting_partition_has_its_question_out(self) -> None:
        assert set(self.book.waiting()) <= set(self.out), (self.book.waiting(), self.out)
        assert self.book.waiting() == self.expect

    @invariant()
    def at_most_one_question_per_partition_is_out(self) -> None:
        assert len(self.out) == len(set(self.out)), self.out


def test_the_reset_book_keeps_every_stopped_partition_asked_about_once() -> None:
    run_state_machine_as_test(
        ResetBookModel, settings=settings(max_examples=200, deadline=None, stateful_step_count=40)
    )


class _ForgetsItsQuestions(ResetBook):
    def forget(self, tps: Any) -> None:
        super().forget(tps)
        for tp in tps:
            self._asked.discard(tp)


class _KeepsAskedAfterTheAnswer(ResetBook):
    def answered(self, tp: tuple[str, int]) -> int | None:
        failed = self._waiting.pop(tp, None)
        return failed


class _KeepsTheFirstRefusal(ResetBook):
    def begin(self, tp: tuple[str, int], failed: int) -> Step:
        self._waiting.setdefault(tp, failed)
        if tp in self._asked:
            return Step.WAIT
        self._asked.add(tp)
        return Step.ASK


@pytest.mark.parametrize(
    "mutant", [_ForgetsItsQuestions, _KeepsAskedAfterTheAnswer, _KeepsTheFirstRefusal]
)
def test_the_model_catches_a_book_that_loses_or_doubles_a_question(mutant: type) -> None:
    model = type("Mutant", (ResetBookModel,), {"make": mutant})
    with pytest.raises(AssertionError):
        run_state_machine_as_test(
            model,
            settings=settings(
                max_examples=300,
                deadline=None,
                stateful_step_count=40,
                suppress_health_check=list(HealthCheck),
                report_multiple_bugs=False,  # (one AssertionError, not a group of them)
            ),
        )


# -- the worker's turn -------------------------------------------------------------------------
class _Blocking:
    """Calls that wait for a broker which never answers: until the test releases them."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.callers: list[str] = []

    def wait(self) -> None:
        self.callers.append(threading.current_thread().name)
        self.release.wait()


class _Message:
    def __init__(self, topic: str, partition: int, offset: int) -> None:
        self._where = (topic, partition, offset)

    def error(self) -> KafkaError:
        return KafkaError(KafkaError._AUTO_OFFSET_RESET)

    def topic(self) -> str:
        return self._where[0]

    def partition(self) -> int:
        return self._where[1]

    def offset(self) -> int:
        return self._where[2]


class _FakeConsumer:
    """The consumer's side: local calls answer, broker round-trips block."""

    def __init__(self, blocking: _Blocking, messages: list[_Message]) -> None:
        self.blocking = blocking
        self.messages = messages
        self.assigned = [TopicPartition("t", 0)]
        self.restarts: list[tuple[str, int, int]] = []
        self.async_commits: list[tuple[str, int, int]] = []

    def consume(self, num: int, timeout: float) -> list[_Message]:
        out, self.messages = self.messages[:num], self.messages[num:]
        return out

    def get_watermark_offsets(self, *_a: Any, **_k: Any) -> tuple[int, int]:
        self.blocking.wait()
        return (0, 0)

    def committed(self, *_a: Any, **_k: Any) -> list[TopicPartition]:
        self.blocking.wait()
        return []

    def commit(self, *, offsets: list[TopicPartition], asynchronous: bool = True) -> None:
        if not asynchronous:
            self.blocking.wait()
        self.async_commits += [(t.topic, t.partition, t.offset) for t in offsets]

    def assignment(self) -> list[TopicPartition]:
        return list(self.assigned)

    def incremental_unassign(self, tps: list[TopicPartition]) -> None:
        pass

    def incremental_assign(self, tps: list[TopicPartition]) -> None:
        self.restarts += [(t.topic, t.partition, t.offset) for t in tps]

    def pause(self, tps: list[TopicPartition]) -> None:
        pass


class _ProbeClient:
    """The probe's own client: the broker answers it (low 30, high 100)."""

    def __init__(self, _config: dict[str, Any]) -> None:
        pass

    def get_watermark_offsets(self, *_a: Any, **_k: Any) -> tuple[int, int]:
        return (30, 100)


class _Side:
    def on_records(self, records: list[Any]) -> None: ...
    def on_assign(self, partitions: list[tuple[str, int]]) -> None: ...
    def on_revoke(
        self, partitions: list[tuple[str, int]], *, lost: bool
    ) -> list[tuple[str, int, int]]:
        return []

    def on_commit(self, results: list[tuple[str, int, int, bool]]) -> None: ...


def test_a_reset_in_a_broker_outage_never_holds_the_consumer_threads_turn() -> None:
    loop = asyncio.new_event_loop()
    blocking = _Blocking()
    worker = KafkaWorker(
        {
            "bootstrap.servers": "127.0.0.1:9",
            "group.id": "g",
            "auto.offset.reset": "earliest",
            "partition.assignment.strategy": "cooperative-sticky",
        },
        ["t"],
        loop=loop,
        side=_Side(),
        events=KafkaClientEvents("test"),
    )
    answered = threading.Event()
    real_answer = worker._probe._answer

    def answer(a: Any) -> None:
        real_answer(a)
        answered.set()

    worker._probe = StallProbe({}, answer=answer, client=_ProbeClient).start()
    worker._resets._ask = worker._probe.watermarks
    consumer = _FakeConsumer(blocking, [_Message("t", 0, 10)])
    turn = threading.Thread(target=worker._consume, args=(consumer,), name="consumer-turn")
    try:
        worker._watch.assigned([("t", 0)], 0.0)
        turn.start()
        turn.join(ANSWER_WAIT_S)  # (the blocking calls would hold it until released)
        assert not turn.is_alive(), "the turn waited for the broker"
        assert blocking.callers == [], "a broker round-trip was made on the consumer's thread"
        assert consumer.restarts == []  # not decided yet: its watermarks are out
        assert answered.wait(ANSWER_WAIT_S), "the probe's thread did not answer"
        worker._serve_commands(consumer)  # the next turn applies the answer
        assert consumer.restarts == [("t", 0, 30)]  # the log start: 10..29 removed, named
        assert consumer.async_commits == [("t", 0, 30)]
        assert worker._watch.next_offset(("t", 0)) == 30
        assert blocking.callers == []
    finally:
        blocking.release.set()
        worker._probe.stop()
        loop.close()


def test_an_answer_that_did_not_come_in_time_fetches_again_where_it_was_refused() -> None:
    book = ResetBook()
    assert book.begin(("t", 0), 10) is Step.ASK
    assert book.begin(("t", 0), 12) is Step.WAIT
    assert book.answered(("t", 0)) == 12
    assert Watermarks(("t", 0), None).low_high is None
