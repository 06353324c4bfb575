"""One timer bounding many awaits by the same timeout (the engine client's request deadline).

``asyncio.timeout`` schedules and cancels a timer per use, and looks the
running loop up three times (a ``getpid`` system call each on Python 3.11): a
tenth of the sink's main thread at 64 requests in flight. Every request of an
:class:`~sinks.engine.client.EngineClient` has the same deadline, so the deadlines
expire in the order they were set. :class:`Deadlines` keeps them in that order
and runs one timer, at the earliest deadline still awaited.

Guarantees (those of ``asyncio.timeout``, which the unit tests hold it to):

- ``with deadlines.bound():`` around an await raises :class:`TimeoutError` once
  the timeout has passed since the ``with`` began, by cancelling the task
  (the cancellation is turned into the :class:`TimeoutError` on the way out);
- no block is cancelled before its deadline, and none later than the event
  loop's timers run after it (the timer may wake early for a block that ended:
  it then sleeps until the earliest deadline still awaited);
- a cancellation from elsewhere stays a :class:`asyncio.CancelledError`, even
  when it arrives as the deadline expires (``Task.cancelling`` counts it);
- a block that ends in time leaves nothing behind once the bounds set before it
  have ended too; ended bounds behind one still running wait for it, so at most
  the bounds set within one timeout are held (a few dozen bytes each).

A :class:`Deadlines` belongs to the event loop of its first bound; a bound from
another loop starts it afresh on that loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from types import TracebackType

_ENTERED, _EXPIRING, _EXITED = 0, 1, 2


class Bound:
    """One ``with`` block bounded by its :class:`Deadlines`."""

    __slots__ = ("_cancelling", "_deadlines", "_task", "state", "when")

    def __init__(self, deadlines: Deadlines, task: asyncio.Task[object], when: float) -> None:
        self._deadlines = deadlines
        self._task = task
        self._cancelling = task.cancelling()
        self.when = when
        self.state = _ENTERED

    def __enter__(self) -> Bound:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        state, self.state = self.state, _EXITED
        self._deadlines._ended()
        if (
            state == _EXPIRING
            and self._task.uncancel() <= self._cancelling
            and exc_type is asyncio.CancelledError
        ):
            raise TimeoutError from exc  # the cancellation was ours alone


class Deadlines:
    """Bounds of ``timeout_s`` each, expiring in the order they were set, on one timer."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bounds: deque[Bound] = deque()
        self._timer: asyncio.TimerHandle | None = None

    def bound(self) -> Bound:
        """The bound of the current task's next ``with`` block, timed from now."""
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("Deadlines.bound() needs a running task")
        loop = task.get_loop()
        if loop is not self._loop:  # first use, or a new event loop: nothing carries over
            if self._timer is not None:
                self._timer.cancel()
            self._loop, self._timer = loop, None
            self._bounds = deque()
        bound = Bound(self, task, loop.time() + self.timeout_s)
        self._bounds.append(bound)
        if self._timer is None:
            self._timer = loop.call_at(bound.when, self._fire)
        return bound

    @property
    def held(self) -> int:
        """Bounds kept: those still running, and ended ones behind the oldest running."""
        return len(self._bounds)

    def _ended(self) -> None:
        bounds = self._bounds
        while bounds and bounds[0].state == _EXITED:
            bounds.popleft()
        if not bounds and self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        loop, bounds = self._loop, self._bounds
        assert loop is not None
        now = loop.time()
        while bounds:
            bound = bounds[0]
            if bound.state == _EXITED:
                bounds.popleft()
            elif bound.when <= now:
                bounds.popleft()
                bound.state = _EXPIRING
                bound._task.cancel()
            else:
                self._timer = loop.call_at(bound.when, self._fire)
                return
