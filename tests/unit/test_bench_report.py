"""The benches' JSON (tests/bench/report.py): a figure file carries the machine, the load
and the command beside the figures, NaN as null; every printed table is kept per bench
module and written at the session's end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.bench import report


def test_figures_carry_machine_load_and_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(report.JSON_DIR_VAR, str(tmp_path))
    monkeypatch.setenv("BENCH_COMMAND", "make bench-compare")
    path = report.write_figures(
        "example", {"rate": 1.5, "cpu": math.nan, "runs": [math.inf, 2]}, load_at_start="1 2 3"
    )
    doc = json.loads(path.read_text())
    assert path == tmp_path / "example.json"
    assert doc["command"] == "make bench-compare"
    assert doc["load_at_start"] == "1 2 3"
    assert len(doc["load_at_end"].split()) == 3
    assert doc["machine"]["cores"] >= 1 and doc["machine"]["cpu"]
    assert doc["figures"] == {"rate": 1.5, "cpu": None, "runs": [None, 2]}


def test_printed_tables_are_kept_per_module_and_written(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(report.JSON_DIR_VAR, str(tmp_path))
    monkeypatch.setattr(report, "TABLES", {})
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/bench/test_x_bench.py::test_y (call)")
    report.print_table("drain", ["case", "ev/s"], [["1-event", "1,000"]])
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    report.print_table("goals", ["goal", "measured"], [["ratio", "0.9"]])
    assert "== drain" in capsys.readouterr().out
    written = sorted(p.name for p in report.write_tables())
    assert written == ["tables-goals.json", "tables-test_x_bench.json"]
    doc = json.loads((tmp_path / "tables-test_x_bench.json").read_text())
    (table,) = doc["figures"]["tables"]
    assert table["title"] == "drain"
    assert table["headers"] == ["case", "ev/s"]
    assert table["rows"] == [["1-event", "1,000"]]
