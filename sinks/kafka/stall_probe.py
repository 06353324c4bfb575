"""The broker round-trips of the fetch watch and the offset resets, off the consumer's thread.

:class:`sinks.kafka.fetch_watch.FetchWatch` judges a silent partition against the
broker's end of its log (and, for a partition that fetched nothing yet, the group's
commit). Those are broker requests of up to :data:`WATERMARK_TIMEOUT_S` each; made
on the consumer's thread, a broker outage made it wait partitions x 5-10 s, serving
no pause, commit or close meanwhile (SIGTERM waited for them all; past
``max.poll.interval.ms`` the member was evicted). Guarantees:

* :class:`StallProbe` asks on a thread and a client of its own (a consumer that
  never subscribes); the consumer's thread only queues a question and later
  judges the answer, which comes back through the worker's command queue;
* what waits is bounded by the assignment: a partition already asked about is not
  queued again until its answer came (a long outage cannot pile questions up);
* an answer the broker did not give in time is dropped (the watch asks again at
  its own pace); :meth:`StallProbe.stop` never waits for a request in progress;
* the offset resets' watermark questions (:meth:`StallProbe.watermarks`, see
  :class:`sinks.kafka.offset_expiry.ResetBook`, which keeps one per partition out
  at a time) are always answered, if only with "no answer in time" (a partition
  is never left stopped with nobody asking).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

from cdc.kafka.log import KafkaClientEvents
from sinks.kafka.offset_expiry import WATERMARK_TIMEOUT_S, Watermarks

log = logging.getLogger("sinks.kafka_worker")  # the name operators filter on: kept across moves

TP = tuple[str, int]

#: Client settings a probe takes from the consumer's: where the brokers are, who it is.
_KEEP = ("bootstrap.servers", "group.id", "security.", "sasl.", "ssl.", "client.")


@dataclass(frozen=True, slots=True)
class Question:
    """Is ``tp`` stalled? ``expected``: the next offset the sink expects (None: the
    group's commit decides); ``asked_at``: when the watch marked it suspect."""

    tp: TP
    expected: int | None
    silent_s: float
    asked_at: float


@dataclass(frozen=True, slots=True)
class Answer:
    """The broker's end of ``question.tp``'s log, and the offset expected there."""

    question: Question
    expected: int | None
    end: int


@dataclass(frozen=True, slots=True)
class _WatermarksOf:
    tp: TP


class StallProbe:
    """See the module docstring. ``ask()`` and ``watermarks()`` from the consumer's
    thread; ``answer`` gets each :class:`Answer` (or :class:`Watermarks`) on the probe's
    thread (the worker queues it as a command). ``client`` makes the probe's client."""

    def __init__(
        self,
        config: dict[str, Any],
        *,
        answer: Callable[[Answer | Watermarks], None],
        client: Callable[[dict[str, Any]], Consumer] = Consumer,
    ) -> None:
        self._config = {
            k: v for k, v in config.items() if isinstance(k, str) and k.startswith(_KEEP)
        }
        self._config["enable.auto.commit"] = False
        self._answer = answer
        self._client = client
        self._questions: queue.SimpleQueue[Question | _WatermarksOf | None] = queue.SimpleQueue()
        self._pending: set[TP] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kafka-stall-probe", daemon=True)

    def start(self) -> StallProbe:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._questions.put(None)

    def ask(self, question: Question) -> bool:
        """Queue ``question``; False when its partition is still being asked about."""
        with self._lock:
            if question.tp in self._pending:
                return False
            self._pending.add(question.tp)
        self._questions.put(question)
        return True

    def watermarks(self, tp: TP) -> None:
        """Queue a question for ``tp``'s watermarks (the caller keeps one out at a time)."""
        self._questions.put(_WatermarksOf(tp))

    def _run(self) -> None:
        events = KafkaClientEvents("sink-stall-probe")
        client: Consumer | None = None
        try:
            config = {k: v for k, v in self._config.items() if k != "stats_cb"}
            config["statistics.interval.ms"] = 0
            client = self._client({**config, **events.config()})
        except KafkaException as exc:
            log.warning("fetch watch disabled (no client for its broker requests): %s", exc)
        while True:
            question = self._questions.get()
            if question is None:
                return  # (the client is left to the process's end: close() may block)
            if isinstance(question, _WatermarksOf):
                self._answer(self._watermarks(client, question.tp))
                continue
            if client is None:
                continue
            try:
                answer = self._ask_broker(client, question)
            finally:
                with self._lock:
                    self._pending.discard(question.tp)
            if answer is not None:
                self._answer(answer)

    @staticmethod
    def _watermarks(client: Consumer | None, tp: TP) -> Watermarks:
        if client is None:
            return Watermarks(tp, None)
        try:
            low, high = client.get_watermark_offsets(
                TopicPartition(*tp), timeout=WATERMARK_TIMEOUT_S, cached=False
            )
        except KafkaException as exc:
            log.debug("%s[%d]: watermarks unknown: %s", tp[0], tp[1], exc)
            return Watermarks(tp, None)
        return Watermarks(tp, (int(low), int(high)))

    @staticmethod
    def _ask_broker(client: Consumer, question: Question) -> Answer | None:
        tp = TopicPartition(*question.tp)
        try:
            expected = question.expected
            if expected is None:
                committed = client.committed([tp], timeout=WATERMARK_TIMEOUT_S)
                offset = committed[0].offset if committed else -1
                expected = int(offset) if offset >= 0 else None
            _low, end = client.get_watermark_offsets(tp, timeout=WATERMARK_TIMEOUT_S, cached=False)
        except KafkaException as exc:  # the watch asks again at its own pace
            log.debug("%s[%d]: stall check failed: %s", tp.topic, tp.partition, exc)
            return None
        return Answer(question, expected, int(end))
