"""The plot script (tests/bench/plot.py) on a small JSON fixture (tests/unit/data/bench):
each chart drawn from the figures it needs, with the machine, the load and the command
beside it; missing figures skip a chart, never fail; the same JSON draws the same file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.bench import plot

FIXTURE = Path(__file__).parent / "data" / "bench"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height from the PNG's IHDR chunk."""
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC), f"{path.name} is not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_every_chart_is_drawn_from_the_fixture(tmp_path: Path) -> None:
    written = plot.draw(FIXTURE, tmp_path)
    assert sorted(p.name for p in written) == [
        "decoding-share.png",
        "latency.png",
        "throughput.png",
    ]
    for path in written:
        width, height = _png_size(path)
        assert width >= 600 and height >= 150, (path.name, width, height)


def test_the_same_json_draws_the_same_file(tmp_path: Path) -> None:
    first = {p.name: p.read_bytes() for p in plot.draw(FIXTURE, tmp_path / "a")}
    second = {p.name: p.read_bytes() for p in plot.draw(FIXTURE, tmp_path / "b")}
    assert first == second


def test_provenance_names_the_machine_every_load_and_every_command() -> None:
    docs = plot.load(FIXTURE)
    line = plot.provenance([docs["compare-drain-1"], docs["relay-drain-100-pg15"]])
    assert "2 cores, Test CPU @ 2.0GHz, 23.5 GiB, Linux 6.1.0" in line
    assert "1.0 1.1 1.2 -> 2.0 1.5 1.3" in line
    assert "$ make bench-compare ; make bench" in line
    assert "2026-12-04T10:00:00Z" in line


def test_the_decoding_share_is_the_relay_over_pg_recvlogical(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[tuple[list[str], list[float]]] = []
    real_barh = plot.plt.Axes.barh

    def spy(self: object, y: object, width: list[float], *args: object, **kw: object) -> object:
        seen.append(([], list(width)))
        return real_barh(self, y, width, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(plot.plt.Axes, "barh", spy)
    assert plot.decoding_share_chart(plot.load(FIXTURE), tmp_path) is not None
    # compare-drain-1: 20,000 / 25,000; compare-drain-100: 40,000 / 50,000; make bench's
    # median ratio as recorded.
    assert seen == [([], [0.8, 0.8, 0.8])]


def test_missing_figures_skip_their_chart(tmp_path: Path) -> None:
    only = tmp_path / "json"
    only.mkdir()
    shutil.copy(FIXTURE / "relay-latency.json", only)
    written = plot.draw(only, tmp_path / "out")
    assert [p.name for p in written] == ["latency.png"]
    assert plot.main(["--json", str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 1


def test_a_figure_not_measured_is_drawn_as_a_dash_not_a_crash(tmp_path: Path) -> None:
    """A contender without a CPU figure (null in the JSON, NaN when measured) still
    draws, its bar empty."""
    folder = tmp_path / "json"
    folder.mkdir()
    doc = json.loads((FIXTURE / "compare-drain-1.json").read_text())
    for contender in doc["figures"]["contenders"]:
        contender["events_per_cpu_s"] = None
    (folder / "compare-drain-1.json").write_text(json.dumps(doc))
    assert plot.throughput_chart(plot.load(folder), tmp_path) is not None
