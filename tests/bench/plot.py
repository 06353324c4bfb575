"""The benches' JSON figures as PNG charts, for docs/performance.md.

``make bench`` and ``make bench-compare`` write their figures as JSON
(:func:`tests.bench.report.write_figures`, into ``BENCH_JSON_DIR``, by default
``.dev/bench``); this script reads that folder and draws what it finds:

* ``throughput.png`` - drain events/s and events per CPU-second side by side, per
  contender, for 1-event and 100-event transactions (``compare-drain-*.json``);
* ``decoding-share.png`` - the relay's drain rate as a share of ``pg_recvlogical``'s,
  the decoding limit (``compare-drain-*.json``, and ``relay-drain-*.json`` of
  ``make bench``);
* ``latency.png`` - the distribution of commit -> Kafka consumer latency at a fixed
  offered rate (``relay-latency.json``).

Each chart carries, under it, the machine, its load and the command that measured it.
Run: ``python -m tests.bench.plot [--json DIR] [--out DIR]`` (``make bench-plots``).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter

_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_JSON = _ROOT / ".dev" / "bench"
DEFAULT_OUT = _ROOT / "docs" / "assets" / "performance"

#: Contenders in the order they are drawn, with their colours and labels.
CONTENDERS: dict[str, tuple[str, str]] = {
    "relay": ("outbox-cdc relay", "#1f77b4"),
    "pg_recvlogical": ("pg_recvlogical (decoding only, no Kafka)", "#7f7f7f"),
    "debezium": ("Debezium, as it comes", "#d62728"),
    "debezium-tuned": ("Debezium, tuned", "#ff7f0e"),
}
#: Axis numbers with thousands separators (and no 10^n on a log axis).
_THOUSANDS = FuncFormatter(lambda value, _pos: f"{value:,.0f}" if value >= 1 else f"{value:g}")
#: PNG metadata without the matplotlib version or a date: a chart drawn twice from the
#: same JSON is the same file.
_PNG_METADATA = {"Software": None}


def load(json_dir: Path) -> dict[str, dict[str, Any]]:
    """Every ``*.json`` document of ``json_dir`` by its name (the file's stem)."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(json_dir.glob("*.json"))}


def provenance(docs: Sequence[dict[str, Any]]) -> str:
    """One line on the machine, the load and the command of ``docs`` (the first one's
    machine; every load and command, deduplicated, in order)."""
    if not docs:
        return ""
    m = docs[0]["machine"]
    loads = []
    commands = []
    for doc in docs:
        load_span = f"{doc.get('load_at_start', '?')} -> {doc.get('load_at_end', '?')}"
        if load_span not in loads:
            loads.append(load_span)
        if doc["command"] not in commands:
            commands.append(doc["command"])
    when = min(doc["measured_at"] for doc in docs)
    return (
        f"{m['cores']} cores, {m['cpu']}, {m['memory_gib']} GiB, Linux {m['kernel']}; "
        f"load (1/5/15 min) {'; '.join(loads)}; {when}\n$ {' ; '.join(commands)}"
    )


def _compare_docs(docs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``compare-drain-<n>`` documents, by events per transaction."""
    found = [doc for name, doc in docs.items() if name.startswith("compare-drain-")]
    return sorted(found, key=lambda d: int(d["figures"]["events_per_tx"]))


def _by_name(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in doc["figures"]["contenders"]}


def _footer(fig: Any, text: str) -> None:
    fig.text(0.01, 0.01, text, fontsize=7, color="#444444", va="bottom", ha="left", wrap=True)


def _value(contender: dict[str, Any] | None, key: str) -> float:
    value = None if contender is None else contender.get(key)
    return math.nan if value is None else float(value)


def throughput_chart(docs: dict[str, dict[str, Any]], out: Path) -> Path | None:
    """Drain events/s and events per CPU-second, side by side, per contender and case."""
    cases = _compare_docs(docs)
    if not cases:
        return None
    names = [n for n in CONTENDERS if any(n in _by_name(d) for d in cases)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    width = 0.8 / max(len(names), 1)
    for ax, key, title in (
        (axes[0], "events_per_s", "drain, events/s"),
        (axes[1], "events_per_cpu_s", "events per CPU-second of the contender's process"),
    ):
        for i, name in enumerate(names):
            label, colour = CONTENDERS[name]
            values = [_value(_by_name(d).get(name), key) for d in cases]
            xs = [c + (i - (len(names) - 1) / 2) * width for c in range(len(cases))]
            bars = ax.bar(xs, [0 if math.isnan(v) else v for v in values], width, color=colour)
            bars.set_label(label)
            for x, v in zip(xs, values, strict=True):
                ax.text(
                    x, 0 if math.isnan(v) else v, "-" if math.isnan(v) else f"{v:,.0f}",
                    ha="center", va="bottom", fontsize=7, rotation=90,
                )  # fmt: skip
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([f"{d['figures']['events_per_tx']}-event transactions" for d in cases])
        ax.set_title(title, fontsize=10)
        ax.margins(y=0.25)
        ax.yaxis.set_major_formatter(_THOUSANDS)
        ax.grid(axis="y", alpha=0.3)
    events = cases[0]["figures"]["events"]
    repeats = int(cases[0]["figures"].get("repeats", 1))
    fig.suptitle(
        f"Draining a backlog of {events:,} outbox events into Kafka"
        f" ({cases[0]['figures'].get('server', '')}, one broker, slots at one LSN"
        + (f"; medians of {repeats} drains each" if repeats > 1 else "")
        + ")",
        fontsize=11,
    )
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(names), fontsize=8,
               bbox_to_anchor=(0.5, 0.93))  # fmt: skip
    _footer(fig, provenance(cases))
    fig.subplots_adjust(top=0.78, bottom=0.2, wspace=0.25)
    return _save(fig, out / "throughput.png")


def decoding_share_chart(docs: dict[str, dict[str, Any]], out: Path) -> Path | None:
    """The relay's events/s over ``pg_recvlogical``'s, per case and per bench."""
    rows: list[tuple[str, float]] = []
    used: list[dict[str, Any]] = []
    for doc in _compare_docs(docs):
        got = _by_name(doc)
        if "relay" in got and "pg_recvlogical" in got:
            share = _value(got["relay"], "events_per_s") / _value(
                got["pg_recvlogical"], "events_per_s"
            )
            rows.append((f"{doc['figures']['events_per_tx']}-event tx, make bench-compare", share))
            used.append(doc)
    for name, doc in sorted(docs.items()):
        if name.startswith("relay-drain-"):
            f = doc["figures"]
            rows.append(
                (
                    f"{f['events_per_tx']}-event tx, make bench ({f['server']}, median of"
                    f" {len(f['runs'])})",
                    float(f["median"]["ratio"]),
                )
            )
            used.append(doc)
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.5 * len(rows)))
    labels = [r[0] for r in rows]
    values = [r[1] for r in rows]
    ax.barh(range(len(rows)), values, color=CONTENDERS["relay"][1])
    ax.axvline(1.0, color="#7f7f7f", linestyle="--", linewidth=1)
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.2f}", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(1.2, max(values) * 1.15))
    ax.set_xlabel("relay events/s ÷ pg_recvlogical events/s (1.0 = the decoding limit)")
    ax.set_title(
        "The relay as a share of the decoding limit (each ratio measured within one run)",
        fontsize=10,
    )
    _footer(fig, provenance(used))
    fig.subplots_adjust(left=0.42, bottom=0.5 if len(rows) < 3 else 0.32, top=0.85)
    return _save(fig, out / "decoding-share.png")


def latency_chart(docs: dict[str, dict[str, Any]], out: Path) -> Path | None:
    """The commit -> consumer latency distribution (its quantiles) at a fixed rate."""
    doc = docs.get("relay-latency")
    if doc is None:
        return None
    f = doc["figures"]
    quantiles = [q for q in f["quantiles_ms"] if q is not None]
    if not quantiles:
        return None
    shares = [100.0 * i / (len(quantiles) - 1) for i in range(len(quantiles))]
    fig, ax = plt.subplots(figsize=(9, 4.6))
    ax.plot(quantiles, shares, color=CONTENDERS["relay"][1], linewidth=1.5)
    for key, style in (("50", ":"), ("99", "--")):
        value = f["percentiles_ms"].get(key)
        if value is not None:
            ax.axvline(value, color="#444444", linestyle=style, linewidth=1)
            ax.text(value, 3, f" p{key} {value:.1f} ms", fontsize=8, rotation=90, va="bottom")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(_THOUSANDS)
    ax.set_xlabel("commit -> Kafka consumer receive, ms (log scale)")
    ax.set_ylabel("% of events at or below")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3, which="both")
    ax.set_title(
        f"Latency at {f['offered_events_per_s']:,} events/s offered for"
        f" {f['duration_s']:.0f} s, 1-event transactions ({f['events']:,} events,"
        f" {f.get('server', '')})",
        fontsize=10,
    )
    _footer(fig, provenance([doc]))
    fig.subplots_adjust(bottom=0.25)
    return _save(fig, out / "latency.png")


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata=_PNG_METADATA)
    plt.close(fig)
    return path


CHARTS = (throughput_chart, decoding_share_chart, latency_chart)


def draw(json_dir: Path, out: Path) -> list[Path]:
    """Every chart the JSON of ``json_dir`` has figures for, written under ``out``."""
    docs = load(json_dir)
    return [path for chart in CHARTS if (path := chart(docs, out)) is not None]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="the benches' JSON")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the PNGs go")
    args = parser.parse_args(argv)
    written = draw(args.json, args.out)
    for path in written:
        print(path)
    if not written:
        print(f"no figures in {args.json}: run make bench or make bench-compare first")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
