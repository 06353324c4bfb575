"""Recent lag per partition, for the console's sparklines: bounded, in memory, pure.

Guarantees:

* memory is bounded: at most :data:`MAX_SERIES` partitions, each at most
  :data:`MAX_POINTS` samples (older ones fall off; a partition not seen for
  :data:`HISTORY_S` is forgotten);
* a sample is only what :func:`sinks.ops.lag.group_lag` measured (the lag of one
  partition at one time); nothing is interpolated, and an unknown lag is no sample;
* :func:`sparkline` draws the samples as an SVG polyline with no text of its own:
  the numbers stay in the table beside it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

#: The sparkline spans the last this many seconds.
HISTORY_S = 15 * 60
#: Samples kept per partition (one per read, reads at most every few seconds).
MAX_POINTS = 180
#: Partitions remembered at most (the sink's topics rarely have more).
MAX_SERIES = 512
#: The sparkline's size in CSS pixels.
SPARK_WIDTH = 120
SPARK_HEIGHT = 24


@dataclass
class LagHistory:
    """Samples ``(at_ms, lag)`` per ``(topic, partition)``."""

    max_points: int = MAX_POINTS
    max_series: int = MAX_SERIES
    history_ms: int = HISTORY_S * 1000
    _series: dict[tuple[str, int], deque[tuple[int, int]]] = field(default_factory=dict)

    def record(self, at_ms: int, lags: Iterable[tuple[str, int, int | None]]) -> None:
        """Add one read: ``(topic, partition, lag)`` each (``None``: unknown, not kept)."""
        for topic, partition, lag in lags:
            if lag is None:
                continue
            series = self._series.get((topic, partition))
            if series is None:
                if len(self._series) >= self.max_series:
                    self._forget_oldest()
                series = self._series[(topic, partition)] = deque(maxlen=self.max_points)
            if series and series[-1][0] >= at_ms:
                continue  # one sample per time, in order
            series.append((at_ms, lag))
        self._expire(at_ms)

    def series(self, topic: str, partition: int) -> list[tuple[int, int]]:
        return list(self._series.get((topic, partition), ()))

    def __len__(self) -> int:
        return len(self._series)

    def points(self) -> int:
        return sum(len(s) for s in self._series.values())

    def _expire(self, now_ms: int) -> None:
        horizon = now_ms - self.history_ms
        for tp in list(self._series):
            series = self._series[tp]
            while series and series[0][0] < horizon:
                series.popleft()
            if not series:
                del self._series[tp]

    def _forget_oldest(self) -> None:
        oldest = min(self._series, key=lambda tp: self._series[tp][-1][0])
        del self._series[oldest]


def sparkline(
    samples: Sequence[tuple[int, int]], *, width: int = SPARK_WIDTH, height: int = SPARK_HEIGHT
) -> str:
    """The ``points`` of an SVG polyline over ``samples`` (time on x, lag on y, 0 at the
    bottom); empty with fewer than two samples."""
    if len(samples) < 2:
        return ""
    t0, t1 = samples[0][0], samples[-1][0]
    top = max(lag for _, lag in samples) or 1
    span = max(t1 - t0, 1)
    pad = 1
    points = []
    for at, lag in samples:
        x = pad + (at - t0) * (width - 2 * pad) / span
        y = height - pad - lag * (height - 2 * pad) / top
        points.append(f"{x:.1f},{y:.1f}")
    return " ".join(points)
