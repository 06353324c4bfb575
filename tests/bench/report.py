"""What the benchmarks measure and how they print it.

Pure helpers plus ``/proc`` readers; nothing here asserts on a figure:

* :func:`percentile` over raw samples and :func:`histogram_quantile` over a
  Prometheus histogram (linear interpolation inside the bucket, as
  Prometheus' ``histogram_quantile`` does);
* :func:`metric_sum` / :func:`histogram_buckets` parse ``/metrics`` text;
* :class:`CpuMeter` and :func:`peak_rss_mb` read CPU seconds and peak RSS
  (``VmHWM``) from ``/proc``, so a run can say which process was busy;
* :func:`print_table` prints a fixed-width table with a title;
* :func:`record_goal` / :func:`print_goals`: the issue-25 goals beside the
  figures measured, met or not, with the load average (printed once at the
  end of ``make bench``);
* :func:`write_figures`: a bench's figures as JSON (``BENCH_JSON_DIR``, by default
  ``.dev/bench``) with the machine, its load and the command, for
  ``tests/bench/plot.py`` to chart; :func:`write_tables` (at the session's end) every
  table a bench printed, as ``tables-<module>.json``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[2]
_CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_SAMPLE_RE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")
_LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between ranks."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def scrape(port: int, timeout_s: float = 5.0) -> str:
    """The ``/metrics`` text of a process on 127.0.0.1."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as resp:
        body: bytes = resp.read()
    return body.decode()


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        m = _SAMPLE_RE.match(line)
        if m is None or m["name"] != name:
            continue
        labels = dict(_LABEL_RE.findall(m["labels"] or ""))
        out.append((labels, float(m["value"])))
    return out


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(
        value
        for got, value in _samples(text, name)
        if all(got.get(k) == v for k, v in labels.items())
    )


def histogram_buckets(text: str, name: str) -> dict[float, float]:
    """Cumulative bucket counts of histogram ``name``: upper bound -> count."""
    return {float(labels["le"]): value for labels, value in _samples(text, f"{name}_bucket")}


def bucket_diff(after: dict[float, float], before: dict[float, float]) -> dict[float, float]:
    """Observations made between two scrapes, still cumulative per bucket."""
    return {le: count - before.get(le, 0.0) for le, count in after.items()}


def histogram_quantile(buckets: dict[float, float], q: float) -> float:
    """The ``q`` quantile (0..1) of cumulative ``buckets``, interpolated in its bucket.

    A quantile that falls in the ``+Inf`` bucket is reported as the highest
    finite bound (it is at least that).
    """
    bounds = sorted(buckets)
    total = buckets.get(math.inf, buckets[bounds[-1]] if bounds else 0.0)
    if total <= 0:
        return math.nan
    rank = q * total
    low_bound, low_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return low_bound
            width = count - low_count
            share = (rank - low_count) / width if width > 0 else 1.0
            return low_bound + (bound - low_bound) * share
        low_bound, low_count = bound, count
    return low_bound


def _stat_cpu_seconds(stat_path: str) -> float:
    """utime + stime (fields 14 and 15 of a ``/proc`` ``stat`` file), in seconds."""
    try:
        with open(stat_path) as f:
            stat = f.read()
    except OSError:
        return math.nan
    fields = stat.rsplit(")", 1)[1].split()
    # fields[0] is field 3 (state): utime is field 14, stime field 15.
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS_PER_S


def cpu_seconds(pid: int) -> float:
    """CPU seconds of process ``pid``, all its threads; NaN when unreadable."""
    return _stat_cpu_seconds(f"/proc/{pid}/stat")


def threads_cpu_seconds(pid: int, names: tuple[str, ...]) -> float:
    """CPU seconds of the threads of ``pid`` whose name starts with one of ``names``
    (a thread that ended meanwhile counts 0)."""
    total = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text()
        except OSError:
            continue
        if name.startswith(names):
            spent = _stat_cpu_seconds(str(task / "stat"))
            total += 0.0 if math.isnan(spent) else spent
    return total


def peak_rss_mb(pid: int) -> float:
    """``VmHWM`` (peak resident set) of ``pid`` in MiB; NaN when unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return math.nan


def machine_busy_s() -> float:
    """CPU seconds all cores spent not idle (``/proc/stat``; idle and iowait excluded)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / _CLOCK_TICKS_PER_S


class CpuMeter:
    """CPU use of named processes and of the whole machine over an interval.

    Percentages are of one core (so the machine's maximum is 100 x cores); a
    process at ~100% is the bottleneck when it is single-threaded Python.
    """

    def __init__(self, pids: dict[str, int | None]) -> None:
        self._pids = {name: pid for name, pid in pids.items() if pid is not None}
        self._start: dict[str, float] = {}
        self._t0 = 0.0

    def start(self) -> CpuMeter:
        self._t0 = time.monotonic()
        self._start = {name: cpu_seconds(pid) for name, pid in self._pids.items()}
        self._start["machine"] = machine_busy_s()
        return self

    def stop(self) -> dict[str, float]:
        wall_s = time.monotonic() - self._t0
        now = {name: cpu_seconds(pid) for name, pid in self._pids.items()}
        now["machine"] = machine_busy_s()
        return {name: 100.0 * (now[name] - self._start[name]) / wall_s for name in now}


def kafka_pid() -> int | None:
    """The local stack's Kafka broker: the one of ``OUTBOX_DEV_DIR`` (a stack of its own,
    as compose/stack.sh places it), else of ``.dev`` (``make bench-pg18`` runs a server
    of its own beside the main stack's broker); None when neither runs one."""
    for dev in (os.environ.get("OUTBOX_DEV_DIR"), _ROOT / ".dev"):
        if not dev:
            continue
        try:
            return int((Path(dev) / "kafka" / "kafka.pid").read_text().strip())
        except (OSError, ValueError):
            continue
    return None


def fmt(value: float, digits: int = 0) -> str:
    """A number for a table: thousands separators, NaN as '-'."""
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return f"{value:,.{digits}f}"


#: Every table printed in this session, by the bench module that printed it; written as
#: JSON at the session's end (:func:`write_tables`), so a bench that only prints tables
#: still leaves its figures for a script to read.
TABLES: dict[str, list[dict[str, Any]]] = {}


def _bench_module() -> str:
    """The module of the test running now (``PYTEST_CURRENT_TEST``; set during its
    fixtures too); outside a test, the session's end, where the goals table is printed."""
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    return Path(current.split("::", 1)[0]).stem if current else "goals"


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A fixed-width table; the first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [row[0].ljust(widths[0])]
        parts += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        return "  ".join(parts)

    TABLES.setdefault(_bench_module(), []).append(
        {"title": title, "load": load_average(), "headers": cells[0], "rows": cells[1:]}
    )
    rule = "-" * len(line(cells[0]))
    print(f"\n== {title}")
    print(line(cells[0]))
    print(rule)
    for row in cells[1:]:
        print(line(row))
    print(rule, flush=True)


def load_average() -> str:
    """The 1/5/15-minute load averages, for printing beside a figure."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.1f} {five:.1f} {fifteen:.1f}"


@dataclass(frozen=True)
class Goal:
    """One of the performance goals (issue 25) with the figure a bench measured."""

    name: str
    value: float
    target: str
    met: bool
    load: str
    digits: int = 2


#: Goals recorded by the benches of this pytest session, printed once at its end
#: (tests/bench/conftest.py); never asserted on.
GOALS: list[Goal] = []


def record_goal(
    name: str,
    value: float,
    *,
    at_least: float | None = None,
    at_most: float | None = None,
    digits: int = 2,
) -> None:
    """Record ``value`` against its goal (``>= at_least`` or ``<= at_most``), with the load now."""
    if at_least is not None:
        target, met = f">= {at_least:g}", value >= at_least
    elif at_most is not None:
        target, met = f"<= {at_most:g}", value <= at_most
    else:
        raise ValueError("a goal needs at_least or at_most")
    GOALS.append(Goal(name, value, target, met and not math.isnan(value), load_average(), digits))


def print_goals(goals: Sequence[Goal]) -> None:
    """The goals table: each figure, its goal, met / not met, and the load when measured."""
    print_table(
        f"performance goals (issue 25); load average now {load_average()}"
        f" on {os.cpu_count()} cores",
        ["goal", "measured", "target", "verdict", "load 1/5/15 min"],
        [
            [g.name, fmt(g.value, g.digits), g.target, "met" if g.met else "not met", g.load]
            for g in goals
        ],
    )


# -- figures as JSON, for the charts of docs/performance.md ------------------------

#: Where :func:`write_figures` puts its files (``make bench`` and ``make bench-compare``).
JSON_DIR_VAR = "BENCH_JSON_DIR"


def json_dir() -> Path:
    """``BENCH_JSON_DIR``, else ``.dev/bench`` of the repository."""
    return Path(os.environ.get(JSON_DIR_VAR) or _ROOT / ".dev" / "bench")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _memory_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 1024 / 1024
    except OSError:
        pass
    return math.nan


def machine() -> dict[str, Any]:
    """What the figures were measured on: cores, CPU model, memory, kernel, load now."""
    return {
        "cores": os.cpu_count(),
        "cpu": _cpu_model(),
        "memory_gib": round(_memory_gib(), 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "load_1_5_15": [round(x, 2) for x in os.getloadavg()],
    }


def command() -> str:
    """The command that made the figures: ``BENCH_COMMAND`` (the Makefile sets it), else
    pytest's own arguments."""
    return os.environ.get("BENCH_COMMAND") or "pytest " + " ".join(sys.argv[1:])


def _finite(value: object) -> object:
    """NaN and infinities as ``null``: JSON has neither."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def write_figures(name: str, figures: dict[str, Any], *, load_at_start: str = "") -> Path:
    """``<BENCH_JSON_DIR>/<name>.json``: ``figures`` with the machine, its load (at the
    start of the measurement when given, and now) and the command. Overwrites the file
    of the same name: a run replaces its own figures, never another bench's."""
    out = json_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    document = {
        "name": name,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command(),
        "machine": machine(),
        "load_at_start": load_at_start or load_average(),
        "load_at_end": load_average(),
        "figures": _finite(figures),
    }
    path.write_text(json.dumps(document, indent=2, sort_keys=False) + "\n")
    print(f"  (figures written to {path})", flush=True)
    return path


def write_tables() -> list[Path]:
    """Every table of :data:`TABLES` as ``tables-<module>.json`` (cells as printed)."""
    return [
        write_figures(f"tables-{module}", {"tables": tables}) for module, tables in TABLES.items()
    ]
