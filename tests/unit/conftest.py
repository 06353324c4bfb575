"""Fixtures shared by the unit tests."""

from __future__ import annotations

import importlib
from collections.abc import Iterator

import pytest

from cdc.wal import pgoutput


def _parsers() -> list[object]:
    found: list[object] = [pytest.param(pgoutput._insert_text_values_py, id="python-parser")]
    try:
        compiled = importlib.import_module("cdc.wal._pgfast").insert_text_values
    except ImportError:  # not built: test_pgoutput fails for it in CI
        return found
    return [*found, pytest.param(compiled, id="c-parser")]


@pytest.fixture(scope="module", params=_parsers())
def insert_parser(request: pytest.FixtureRequest) -> Iterator[object]:
    """The relay's fast path with each Insert parser: the pure-Python fallback and the
    compiled one (where built); a module using it runs every test under both."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pgoutput, "insert_text_values", request.param)
        yield request.param
