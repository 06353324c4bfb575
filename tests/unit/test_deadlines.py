"""sinks.engine.deadlines.Deadlines holds to asyncio.timeout's contract, side by side with it.

Both run on an event loop with a virtual clock (:class:`VirtualTimeLoop`): a wait for a
timer advances the clock instead of sleeping, so outcomes are the contract's, never the
machine's load (under ``make test`` the unit lane runs at nice 19 beside busy lanes, where
a real 30 ms sleep could outlast a 300 ms bound).
"""

from __future__ import annotations

import asyncio
import random
import selectors
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pytest

from sinks.engine.deadlines import Deadlines

TIMEOUT_S = 0.3


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock moves only when every task waits for a timer: then it
    jumps to the next timer at once. (No I/O in these tests: nothing else wakes it.)"""

    def __init__(self) -> None:
        self.now_s = 0.0
        super().__init__(selector=_JumpingSelector(self))

    def time(self) -> float:
        return self.now_s


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if not ready and timeout is not None and timeout > 0:
            self._loop.now_s += timeout
        return ready


def run_virtual(main: Awaitable[list[tuple[str, float]]]) -> list[tuple[str, float]]:
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(main)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Job:
    """A task that starts at ``start_s``, awaits ``duration_s`` inside its bound, and may be
    cancelled from outside ``cancel_after_s`` after it began."""

    start_s: float
    duration_s: float
    cancel_after_s: float | None = None

    def expected(self) -> str:
        if self.cancel_after_s is not None and self.cancel_after_s < min(
            self.duration_s, TIMEOUT_S
        ):
            return "cancelled"
        return "done" if self.duration_s < TIMEOUT_S else "timeout"


Bounded = Callable[[Callable[[], Awaitable[None]]], Awaitable[None]]


def ours(deadlines: Deadlines) -> Bounded:
    async def bounded(body: Callable[[], Awaitable[None]]) -> None:
        with deadlines.bound():
            await body()

    return bounded


def theirs(timeout_s: float) -> Bounded:
    async def bounded(body: Callable[[], Awaitable[None]]) -> None:
        async with asyncio.timeout(timeout_s):
            await body()

    return bounded


async def run_jobs(bounded: Bounded, jobs: list[Job]) -> list[tuple[str, float]]:
    """Each job's outcome and how long after its start it came."""
    loop = asyncio.get_running_loop()

    async def one(job: Job) -> tuple[str, float]:
        await asyncio.sleep(job.start_s)
        started = loop.time()
        task = asyncio.current_task()
        assert task is not None
        if job.cancel_after_s is not None:  # timed from the job's start, however late it is
            loop.call_later(job.cancel_after_s, task.cancel)
        try:
            await bounded(lambda: asyncio.sleep(job.duration_s))
        except TimeoutError:
            return "timeout", loop.time() - started
        except asyncio.CancelledError:
            return "cancelled", loop.time() - started
        return "done", loop.time() - started

    return list(await asyncio.gather(*(one(job) for job in jobs)))


# Durations and cancellations keep 3-10x margins from the timeout (on the virtual clock
# the outcomes would hold with none; the margins keep the scenarios readable).
FAST, SLOW = TIMEOUT_S / 10, TIMEOUT_S * 3
SCENARIOS = {
    "one-in-time": [Job(0, FAST)],
    "one-too-slow": [Job(0, SLOW)],
    "a-slow-head-and-fast-ones-behind-it": [Job(0, SLOW)]
    + [Job(0.01 * i, FAST) for i in range(20)],
    "a-late-slow-one-is-timed-from-its-own-start": [Job(0, FAST), Job(0.2, SLOW), Job(0.4, FAST)],
    "cancelled-from-outside": [Job(0, SLOW, cancel_after_s=FAST), Job(0, FAST)],
    "idle-between-bursts": [Job(0, FAST), Job(0.6, SLOW), Job(0.6, FAST), Job(1.8, FAST)],
}


@pytest.mark.parametrize("jobs", list(SCENARIOS.values()), ids=list(SCENARIOS))
def test_outcomes_match_asyncio_timeout(jobs: list[Job]) -> None:
    deadlines = Deadlines(TIMEOUT_S)
    got = run_virtual(run_jobs(ours(deadlines), jobs))
    reference = run_virtual(run_jobs(theirs(TIMEOUT_S), jobs))
    expected = [job.expected() for job in jobs]
    assert [outcome for outcome, _ in reference] == expected
    assert [outcome for outcome, _ in got] == expected
    for (outcome, after_s), job in zip(got, jobs, strict=True):
        if outcome == "timeout":  # never before the deadline, and soon after it
            # (asyncio runs a timer within its clock resolution of its time: a float's
            # rounding on the virtual clock)
            assert TIMEOUT_S - 1e-6 <= after_s < TIMEOUT_S + 1.0, job
    assert deadlines.held == 0  # nothing left behind


def test_many_random_jobs_match_their_expected_outcomes() -> None:
    rng = random.Random(25)
    jobs = [
        Job(
            rng.uniform(0, 1.0),
            rng.choice([FAST, SLOW]),
            rng.choice([None, None, FAST / 2]),
        )
        for _ in range(200)
    ]
    deadlines = Deadlines(TIMEOUT_S)
    got = run_virtual(run_jobs(ours(deadlines), jobs))
    assert [outcome for outcome, _ in got] == [job.expected() for job in jobs]
    assert deadlines.held == 0


@pytest.mark.parametrize("implementation", ["ours", "asyncio.timeout"])
def test_a_cancellation_from_outside_as_the_deadline_expires_stays_a_cancellation(
    implementation: str,
) -> None:
    async def go() -> None:
        bounded = ours(Deadlines(0.0)) if implementation == "ours" else theirs(0.0)
        task = asyncio.current_task()
        assert task is not None

        async def body() -> None:
            asyncio.get_running_loop().call_soon(task.cancel)  # in the deadline's loop turn
            await asyncio.sleep(1)

        with pytest.raises(asyncio.CancelledError):
            await bounded(body)
        assert task.cancelling() == 1  # the outside request is still counted

    async def main() -> None:
        task = asyncio.create_task(go())
        await asyncio.wait([task])
        task.result()

    asyncio.run(main())


def test_a_block_that_ends_in_time_leaves_no_timer_behind() -> None:
    async def go() -> None:
        deadlines = Deadlines(30.0)
        loop = asyncio.get_running_loop()
        with deadlines.bound():
            await asyncio.sleep(0)
        assert deadlines.held == 0
        assert not [h for h in loop._scheduled if not h.cancelled()]  # type: ignore[attr-defined]

    asyncio.run(go())


def test_a_new_event_loop_starts_afresh() -> None:
    deadlines = Deadlines(TIMEOUT_S)
    for _ in range(2):  # a bound left by the first loop's cancelled task does not carry over
        assert asyncio.run(run_jobs(ours(deadlines), [Job(0, SLOW), Job(0, FAST)])) is not None
        assert deadlines.held == 0


def test_a_bound_needs_a_task() -> None:
    with pytest.raises(RuntimeError, match="running"):
        Deadlines(1.0).bound()
