"""The resident memory of a process over time, sampled on a thread (Linux ``/proc``).

``with RssSampler(pid) as rss: ...`` reads ``VmRSS`` every ``interval_s``;
``rss.samples`` is ``[(monotonic seconds, bytes), ...]``. Tests compare
samples taken at the same point of their scenario (bounded growth), never time.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import TracebackType


def rss_bytes(pid: int) -> int | None:
    """``VmRSS`` of ``pid`` in bytes; ``None`` once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


class RssSampler:
    """See the module docstring."""

    def __init__(self, pid: int, interval_s: float = 0.25) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rss-{pid}", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(5)

    def now(self) -> int:
        """One sample now (also kept); 0 when the process is gone."""
        value = rss_bytes(self.pid) or 0
        self.samples.append((time.monotonic(), value))
        return value

    def peak_since(self, since: float) -> int:
        """The largest sample taken at or after monotonic time ``since``."""
        return max((b for t, b in self.samples if t >= since), default=0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.now() == 0:
                return
