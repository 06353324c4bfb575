"""The sink's Kafka consumer, on a thread of its own: the event loop never waits on Kafka.

Guarantees:

* every call on the confluent-kafka ``Consumer`` happens on this thread -
  ``consume``, ``pause``/``resume``, ``commit``, watermark and committed-offset
  queries, ``close`` - so deliveries, the admin API and the scheduler on the
  asyncio loop are never blocked by a broker that is slow or away;
* what happens on the Kafka side reaches the loop as calls scheduled with
  ``call_soon_threadsafe``, in the order it happened: records, assignments,
  revocations, commit results;
* a revocation is answered by the loop (its final offsets) before the
  rebalance callback returns, and those offsets are committed synchronously
  here - the partitions' next owner starts after what this member settled;
  a lost assignment commits nothing;
* what the thread hands the loop is bounded: at most ``HANDOFF_MAX_RECORDS``
  records and ``HANDOFF_MAX_BYTES`` bytes are on their way (posted, not yet taken by
  the loop, a batch more at most); past that the
  thread stops fetching until the loop catches up, so a busy loop cannot make
  records pile up in memory ahead of the core's own bound (``max_buffered``);
* every record fetched reaches the loop: it becomes an :class:`Envelope`
  through :meth:`Envelope.from_kafka`, which never raises on a record's bytes
  (a record whose headers cannot be read carries the reason and is parked);
  nothing here touches a message's headers (see
  :func:`sinks.core.delivery.read_headers`: a second read is a SIGSEGV);
* the loop talks back through :meth:`KafkaWorker.command` (pause, resume,
  commit, close), a queue this thread drains between ``consume`` calls;
* librdkafka's errors and log lines go through :class:`cdc.kafka.log.KafkaClientEvents`;
  a fatal consumer error ends the thread with :class:`KafkaFatalError`;
* the consumer-lag gauge is measured by :class:`LagMonitor` on a thread and a
  client of its own: its broker round-trips never delay a fetch;
* a caught-up partition's commit is the consumer's position, past a transaction's
  control marker (:meth:`KafkaWorker._commit_past_markers`): a drained
  exactly-once topic shows lag 0, not 1;
* an offset out of range is never skipped silently: librdkafka runs with
  ``auto.offset.reset=error`` and :class:`sinks.kafka.offset_expiry.OffsetResets` applies
  the configured policy, logging and counting what was removed unprocessed; the
  watermarks it needs are asked on the probe's thread and applied on a later turn,
  the reset position is committed asynchronously;
* so a turn of this thread waits for the broker in ``consume`` only (``POLL_S``):
  the blocking requests (watermarks, committed offsets) are all made on other
  threads, and the only synchronous commits are the revocation's and the close's
  (the close bounded by the caller's ``timeout_s``, ``SINK_SHUTDOWN_S``);
* the wait for a partition's records is bounded: a partition that should fetch
  and was silent for ``stall_after_s`` while the broker holds records past the
  next offset expected is resumed and sought there
  (:class:`sinks.kafka.fetch_watch.FetchWatch`); its broker round-trips are made on
  a thread and a client of their own (:class:`sinks.kafka.stall_probe.StallProbe`),
  each bounded (``WATERMARK_TIMEOUT_S``), at most one per partition at a time: a
  broker outage never holds this thread, which serves pauses, commits and close.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from prometheus_client import Gauge

from cdc.kafka.log import KafkaClientEvents
from sinks.core.delivery import Envelope
from sinks.core.errors import SinkError
from sinks.kafka.fetch_watch import STALL_AFTER_S, FetchWatch, Restart
from sinks.kafka.lag_monitor import LagMonitor
from sinks.kafka.offset_expiry import (
    LIBRDKAFKA_DEFAULT,
    OffsetResets,
    Policy,
    Watermarks,
    incremental,
)
from sinks.kafka.stall_probe import Answer, Question, StallProbe

log = logging.getLogger("sinks.kafka_worker")  # the name operators filter on: kept across moves

#: Records fetched per consume() call.
CONSUME_BATCH = 1_000
#: Records posted to the loop and not yet taken by it, above which the thread
#: stops fetching: two batches keep the loop fed without a gap.
HANDOFF_MAX_RECORDS = 2 * CONSUME_BATCH
#: Bytes of records posted to the loop and not yet taken, above which the thread stops
#: fetching: 2,000 records of a megabyte must not wait in memory ahead of the core's bound.
HANDOFF_MAX_BYTES = 64 * 1024 * 1024
#: Longest the consumer waits for a first record: how soon a command is served.
POLL_S = 0.05
#: Longest a rebalance callback waits for the loop's answer (a dead loop: give up).
LOOP_ANSWER_TIMEOUT_S = 10.0
#: How often caught-up partitions are checked for a position past their commit (a
#: transaction marker after the last record): a local call, no broker round-trip.
CAUGHT_UP_CHECK_S = 1.0

TP = tuple[str, int]
Offsets = Sequence[tuple[str, int, int]]


class KafkaFatalError(SinkError):
    """librdkafka reported a fatal consumer error: the process must restart its consumer."""


class LoopSide(Protocol):
    """What the worker calls on the event loop (each call runs there, in order)."""

    def on_records(self, records: list[Envelope]) -> None: ...
    def on_assign(self, partitions: list[TP]) -> None: ...
    def on_revoke(self, partitions: list[TP], *, lost: bool) -> list[tuple[str, int, int]]: ...
    def on_commit(self, results: list[tuple[str, int, int, bool]]) -> None: ...


@dataclass(frozen=True, slots=True)
class _Pause:
    partitions: tuple[TP, ...]


@dataclass(frozen=True, slots=True)
class _Resume:
    partitions: tuple[TP, ...]


@dataclass(frozen=True, slots=True)
class _Commit:
    offsets: tuple[tuple[str, int, int], ...]


@dataclass(frozen=True, slots=True)
class _Close:
    final: tuple[tuple[str, int, int], ...]


@dataclass(frozen=True, slots=True)
class _Judge:
    answer: Answer | Watermarks


_Command = _Pause | _Resume | _Commit | _Close | _Judge


class KafkaWorker:
    """See the module docstring. ``start()``, then ``command(...)``; ``close()`` ends it."""

    def __init__(
        self,
        config: dict[str, Any],
        topics: list[str],
        *,
        loop: asyncio.AbstractEventLoop,
        side: LoopSide,
        events: KafkaClientEvents,
        lag_gauge: Gauge | None = None,
        offsets_expired: Callable[[int], None] | None = None,
        fetch_restarted: Callable[[], None] | None = None,
        stall_after_s: float = STALL_AFTER_S,
    ) -> None:
        self._config = {**config, **events.config(), "on_commit": self._on_commit}
        #: librdkafka stops a partition out of range; OffsetResets applies the policy
        self._config["auto.offset.reset"] = "error"
        #: the watch's and the resets' broker requests, on a thread and a client of their own
        self._probe = StallProbe(config, answer=lambda a: self._commands.put(_Judge(a)))
        self._resets = OffsetResets(
            policy=Policy.parse(config.get("auto.offset.reset", LIBRDKAFKA_DEFAULT)),
            group=str(config.get("group.id", "")),
            incremental=incremental(config),
            ask=self._probe.watermarks,
            count=offsets_expired,
        )
        #: partitions the loop paused (kept paused when a reset re-assigns them)
        self._paused: set[TP] = set()
        #: which partitions should fetch and when each last did (the bounded wait)
        self._watch = FetchWatch(stall_after_s)
        self._fetch_restarted = fetch_restarted
        self._next_watch_at = 0.0
        self._next_caught_up_at = 0.0
        #: per partition, the last commit the broker confirmed (this assignment)
        self._confirmed: dict[TP, int] = {}
        #: per partition, a commit of the consumer's position this thread sent itself
        self._topups: dict[TP, int] = {}
        self._topics = topics
        self._loop = loop
        self._side = side
        self._events = events
        self._lag_gauge = lag_gauge
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._done: asyncio.Future[None] = loop.create_future()
        self._thread = threading.Thread(target=self._run, name="kafka-consumer", daemon=True)
        self._consumer: Consumer | None = None
        self._closing = False
        #: records posted to the loop and not yet taken (HANDOFF_MAX_RECORDS bounds it)
        self._handoff = 0
        self._handoff_bytes = 0
        self._handoff_lock = threading.Lock()
        self._handoff_room = threading.Event()
        self._handoff_room.set()
        #: What the group assigned to this member; replaced, never changed in place,
        #: so the lag monitor's thread always reads a whole set.
        self._assignment: frozenset[TP] = frozenset()
        self._lag = (
            None
            if lag_gauge is None
            else LagMonitor(config, gauge=lag_gauge, assigned=lambda: set(self._assignment))
        )

    def start(self) -> KafkaWorker:
        self._thread.start()
        self._probe.start()
        if self._lag is not None:
            self._lag.start()
        return self

    @property
    def done(self) -> asyncio.Future[None]:
        """Resolves when the thread ended (with :class:`KafkaFatalError` on a fatal error)."""
        return self._done

    def pause(self, partitions: tuple[TP, ...]) -> None:
        self._commands.put(_Pause(partitions))

    def resume(self, partitions: tuple[TP, ...]) -> None:
        self._commands.put(_Resume(partitions))

    def commit(self, offsets: tuple[tuple[str, int, int], ...]) -> None:
        self._commands.put(_Commit(offsets))

    async def close(self, final: Offsets, *, timeout_s: float | None = None) -> bool:
        """Commit ``final`` synchronously, leave the group, end the thread; await it for
        ``timeout_s`` at most. False when the thread did not end in time (a broker that
        does not answer): it is a daemon thread, left to the process's end."""
        self._commands.put(_Close(tuple(final)))
        try:
            await asyncio.wait_for(asyncio.shield(self._done), timeout_s)
        except TimeoutError:
            return False
        return True

    # -- the thread ---------------------------------------------------------------
    def _run(self) -> None:
        error: BaseException | None = None
        try:
            consumer = Consumer(self._config)
            self._consumer = consumer
            consumer.subscribe(
                self._topics,
                on_assign=self._on_assign,
                on_revoke=self._on_revoke,
                on_lost=self._on_lost,
            )
            self._loop_until_closed(consumer)
        except BaseException as exc:  # reported on the loop, never lost with the thread
            error = exc
        finally:
            self._post_done(error)

    def _loop_until_closed(self, consumer: Consumer) -> None:
        while True:
            close = self._serve_commands(consumer)
            if close is not None:
                self._close(consumer, close)
                return
            if self._events.fatal is not None:
                raise KafkaFatalError(f"fatal consumer error: {self._events.fatal}")
            if not self._handoff_room.wait(POLL_S):
                self._watch.held_back(time.monotonic())  # (silence counts while fetching)
                continue  # the loop is behind: serve commands, fetch nothing more
            records = self._consume(consumer)
            if records:
                self._hand_over(records)
            now = time.monotonic()
            if now >= self._next_watch_at:  # (fetching: the hand-off has room)
                self._next_watch_at = now + self._watch.stall_after_s / 4
                self._check_stalls(consumer, now)
            if now >= self._next_caught_up_at:
                self._next_caught_up_at = now + CAUGHT_UP_CHECK_S
                self._commit_past_markers(consumer)

    def _consume(self, consumer: Consumer) -> list[Envelope]:
        """What is there now, without waiting for a whole batch.

        librdkafka's batch consume waits its full timeout unless the batch
        fills: wait for the first record only, then take what is ready.
        """
        messages = consumer.consume(1, POLL_S)
        if messages:
            messages += consumer.consume(CONSUME_BATCH - 1, 0)
        records = []
        now = time.monotonic()
        for msg in messages:
            err = msg.error()
            if err is None:
                records.append(Envelope.from_kafka(msg))
                self._watch.fetched(
                    (msg.topic() or "", msg.partition() or 0), msg.offset() or 0, now
                )
            elif err.code() == KafkaError._AUTO_OFFSET_RESET:
                tp = (msg.topic() or "", msg.partition() or 0)
                self._watch.stopped(tp)  # (policy error, or its watermarks asked): not a stall
                start = self._resets.handle(consumer, msg, paused=self._paused)
                if start is not None:  # expected from there on, not at the removed offset
                    self._watch.reset(tp, start, time.monotonic())
            elif err.code() != KafkaError._PARTITION_EOF:
                log.warning("consumer error: %s", err, extra={"kafka_error": err.name()})
        return records

    def _serve_commands(self, consumer: Consumer) -> _Close | None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return None
            if isinstance(command, _Close):
                return command
            self._serve(consumer, command)

    def _serve(self, consumer: Consumer, command: _Command) -> None:
        try:
            if isinstance(command, _Pause):
                self._paused.update(command.partitions)
                self._watch.paused(command.partitions)
                consumer.pause(self._assigned(consumer, command.partitions))
            elif isinstance(command, _Resume):
                self._paused.difference_update(command.partitions)
                self._watch.resumed(command.partitions, time.monotonic())
                consumer.resume(self._assigned(consumer, command.partitions))
            elif isinstance(command, _Commit):
                self._commit_async(consumer, command.offsets)
            elif isinstance(command, _Judge):
                self._judge(consumer, command.answer)
        except KafkaException as exc:
            log.warning("consumer %s failed: %s", type(command).__name__.lstrip("_"), exc)

    def _commit_async(self, consumer: Consumer, offsets: Offsets) -> None:
        tps = [TopicPartition(t, p, o) for t, p, o in offsets]
        try:
            consumer.commit(offsets=tps, asynchronous=True)
        except KafkaException as exc:  # e.g. not assigned any more: report each as failed
            log.warning("offset commit failed (will retry): %s", exc)
            self._post(self._side.on_commit, [(t, p, o, False) for t, p, o in offsets])

    def _close(self, consumer: Consumer, close: _Close) -> None:
        self._closing = True
        self._probe.stop()
        if self._lag is not None:
            self._lag.stop()
        self._commit_sync(consumer, close.final, what="final commit")
        consumer.close()  # leaves the group; the revoke callback commits what is left

    def _commit_sync(self, consumer: Consumer, offsets: Offsets, *, what: str) -> None:
        if not offsets:
            return
        try:
            consumer.commit(
                offsets=[TopicPartition(t, p, o) for t, p, o in offsets], asynchronous=False
            )
            log.info("%s: %s", what, _names(offsets))
        except KafkaException as exc:  # the group moved on; the next owner redelivers
            log.warning("%s failed: %s", what, exc)

    def _check_stalls(self, consumer: Consumer, now: float) -> None:
        """Ask about the partitions that should fetch and are silent (off this thread:
        :class:`~sinks.kafka.stall_probe.StallProbe`); the answers come back as commands."""
        for tp, silent_s in self._watch.suspects(now):
            expected = self._watch.next_offset(tp)
            if expected is None:  # nothing fetched yet: its position (a local call)
                try:
                    position = consumer.position([TopicPartition(*tp)])[0].offset
                except KafkaException:
                    position = -1
                expected = int(position) if position >= 0 else None  # else: the commit
            self._probe.ask(Question(tp, expected, silent_s, now))

    def _judge(self, consumer: Consumer, answer: Answer | Watermarks) -> None:
        """Restart a partition the broker says holds records past what it expects - unless
        it fetched (or was resumed, or held back) since it was asked about; or apply the
        reset policy to a partition whose watermarks came."""
        if isinstance(answer, Watermarks):
            start = self._resets.answered(consumer, answer, paused=self._paused)
            if start is not None:  # expected from there on, not at the removed offset
                self._watch.reset(answer.tp, start, time.monotonic())
            return
        question = answer.question
        if self._watch.lively_since(question.tp, question.asked_at):
            return
        restart = self._watch.judge(question.tp, answer.expected, answer.end, question.silent_s)
        if restart is not None:
            self._restart(consumer, restart)

    def _commit_past_markers(self, consumer: Consumer) -> None:
        """Caught-up partitions whose position lies past their commit: commit the position.

        A Kafka transaction ends with a control marker after its last record; the
        consumer's position moves past it, the core's commit (last record + 1) does
        not, and a drained partition would show lag 1 forever. Only a partition whose
        confirmed commit is the offset after the last record fetched qualifies (every
        record handed over is settled and committed), so what lies between the
        commit and the position is no record of ours: markers, or an aborted
        transaction's records the consumer never returns.
        """
        tps = [
            tp
            for tp, offset in self._confirmed.items()
            if tp not in self._topups and offset == self._watch.next_offset(tp)
        ]
        if not tps:
            return
        try:
            positions = consumer.position([TopicPartition(*tp) for tp in tps])
        except KafkaException as exc:  # (not assigned any more: asked again later)
            log.debug("position of caught-up partitions unknown: %s", exc)
            return
        offsets = [
            (p.topic, p.partition, p.offset)
            for p in positions
            if p.error is None and p.offset > self._confirmed.get((p.topic, p.partition), p.offset)
        ]
        if not offsets:
            return
        for topic, partition, offset in offsets:
            self._topups[(topic, partition)] = offset
        try:
            consumer.commit(
                offsets=[TopicPartition(t, p, o) for t, p, o in offsets], asynchronous=True
            )
        except KafkaException as exc:
            log.debug("commit past transaction markers failed (tried again): %s", exc)
            for topic, partition, _offset in offsets:
                self._topups.pop((topic, partition), None)

    def _restart(self, consumer: Consumer, restart: Restart) -> None:
        topic, partition = restart.tp
        log.warning(
            "%s[%d]: fetched nothing for %.0fs while the broker holds offsets up to %d past"
            " the next expected, %d: fetching restarted there",
            topic,
            partition,
            restart.silent_s,
            restart.end - 1,
            restart.offset,
            extra={"topic": topic, "partition": partition, "offset": restart.offset},
        )
        try:
            consumer.resume([TopicPartition(topic, partition)])
            consumer.seek(TopicPartition(topic, partition, restart.offset))
        except KafkaException as exc:  # not assigned any more, or not started: checked again
            log.warning("%s[%d]: fetch restart failed: %s", topic, partition, exc)
            return
        if self._fetch_restarted is not None:
            self._fetch_restarted()

    @staticmethod
    def _assigned(consumer: Consumer, partitions: tuple[TP, ...]) -> list[TopicPartition]:
        """The partitions still assigned (a revocation may have overtaken the command)."""
        current = {(tp.topic, tp.partition) for tp in consumer.assignment()}
        return [TopicPartition(t, p) for t, p in partitions if (t, p) in current]

    # -- callbacks (inside consume() and close(), on this thread) -----------------------
    def _on_assign(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        tps = [(tp.topic, tp.partition) for tp in partitions]
        self._assignment = self._assignment | set(tps)
        self._watch.assigned(tps, time.monotonic())
        self._post(self._side.on_assign, tps)
        log.info("assigned %s", _names(tps))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        tps = [(tp.topic, tp.partition) for tp in partitions]
        self._assignment = self._assignment - set(tps)
        self._paused.difference_update(tps)
        self._watch.revoked(tps)
        self._forget(tps)
        final = self._ask(lambda: self._side.on_revoke(tps, lost=False))
        self._commit_sync(consumer, final or [], what="commit on revoke")
        log.info("revoked %s", _names(tps))

    def _on_lost(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        tps = [(tp.topic, tp.partition) for tp in partitions]
        self._assignment = self._assignment - set(tps)
        self._paused.difference_update(tps)
        self._watch.revoked(tps)
        self._forget(tps)
        self._ask(lambda: self._side.on_revoke(tps, lost=True))
        log.warning("assignment lost (no commit possible): %s", _names(tps))

    def _forget(self, tps: list[TP]) -> None:
        self._resets.forget(tps)
        for tp in tps:
            self._confirmed.pop(tp, None)
            self._topups.pop(tp, None)

    def _on_commit(self, err: KafkaError | None, partitions: list[TopicPartition]) -> None:
        results = []
        for tp in partitions:
            ok = err is None and tp.error is None
            key = (tp.topic, tp.partition)
            if ok and key in self._assignment:
                self._confirmed[key] = max(tp.offset, self._confirmed.get(key, tp.offset))
            if self._topups.get(key) == tp.offset:
                del self._topups[key]  # this thread's own: not the core's to hear of
                continue
            results.append((tp.topic, tp.partition, tp.offset, ok))
            if not ok:
                log.warning(
                    "offset commit of %s[%d]@%d failed (will retry): %s",
                    tp.topic,
                    tp.partition,
                    tp.offset,
                    tp.error or err,
                    extra={"topic": tp.topic, "partition": tp.partition, "offset": tp.offset},
                )
        if results:
            self._post(self._side.on_commit, results)

    # -- to the loop ----------------------------------------------------------------------
    @property
    def handoff(self) -> int:
        """Records posted to the loop and not yet taken by it."""
        return self._handoff

    def _hand_over(self, records: list[Envelope]) -> None:
        size = sum(r.size for r in records)
        with self._handoff_lock:
            self._handoff += len(records)
            self._handoff_bytes += size
            if self._handoff >= HANDOFF_MAX_RECORDS or self._handoff_bytes >= HANDOFF_MAX_BYTES:
                self._handoff_room.clear()
        self._post(self._take, records, size)

    def _take(self, records: list[Envelope], size: int) -> None:
        """On the loop: give ``records`` to the loop's side, then make room for more."""
        try:
            self._side.on_records(records)
        finally:
            with self._handoff_lock:
                self._handoff -= len(records)
                self._handoff_bytes -= size
                if self._handoff < HANDOFF_MAX_RECORDS and self._handoff_bytes < HANDOFF_MAX_BYTES:
                    self._handoff_room.set()

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is ending
            self._loop.call_soon_threadsafe(fn, *args)

    def _ask(self, fn: Callable[[], list[tuple[str, int, int]]]) -> list[tuple[str, int, int]]:
        """Run ``fn`` on the loop and wait for its answer (rebalance callbacks only)."""
        answer: concurrent.futures.Future[list[tuple[str, int, int]]] = concurrent.futures.Future()

        def run() -> None:
            try:
                answer.set_result(fn())
            except BaseException as exc:
                answer.set_exception(exc)

        self._post(run)
        try:
            return answer.result(timeout=LOOP_ANSWER_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            log.error("the event loop did not answer a rebalance in %ss", LOOP_ANSWER_TIMEOUT_S)
            return []

    def _post_done(self, error: BaseException | None) -> None:
        def finish() -> None:
            if self._done.done():
                return
            if error is None:
                self._done.set_result(None)
            else:
                self._done.set_exception(error)

        self._post(finish)


def _names(partitions: Sequence[tuple[Any, ...]]) -> str:
    """``topic[p]`` (or ``topic[p]@offset``) for each, for a log line."""
    names = []
    for item in partitions:
        name = f"{item[0]}[{item[1]}]"
        names.append(f"{name}@{item[2]}" if len(item) > 2 else name)
    return ", ".join(names) or "nothing"
