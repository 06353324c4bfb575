"""Fixtures shared by the unit tests."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator

import pytest

from cdc.wal import pgoutput

#: ``(data, at=0)``: the OID and values of a text-only Insert at ``data[at:]``, or None.
InsertTextValues = Callable[..., "tuple[int, list[bytes | None]] | None"]


def compiled_insert_parser() -> InsertTextValues | None:
    """The compiled Insert parser, or None where cdc.wal._pgfast was not built
    (test_pgoutput fails for that in CI)."""
    try:
        module = importlib.import_module("cdc.wal._pgfast")
    except ImportError:
        return None
    parser: InsertTextValues = module.insert_text_values
    return parser


COMPILED_INSERT_PARSER = compiled_insert_parser()
#: The pure-Python Insert parser (the fallback where no C compiler built
#: cdc.wal._pgfast) and the compiled one (what the relay uses where it was built).
INSERT_PARSERS = [pytest.param(pgoutput._insert_text_values_py, id="python-parser")] + (
    [pytest.param(COMPILED_INSERT_PARSER, id="c-parser")]
    if COMPILED_INSERT_PARSER is not None
    else []
)


@pytest.fixture(scope="module", params=INSERT_PARSERS)
def insert_parser(request: pytest.FixtureRequest) -> Iterator[object]:
    """The relay's fast path with each Insert (and Begin) parser: the pure-Python
    fallback and the compiled one (where built); a module using it runs every test
    under both."""
    compiled = request.param is COMPILED_INSERT_PARSER
    begin = (
        importlib.import_module("cdc.wal._pgfast").begin_context
        if compiled
        else pgoutput._begin_context_py
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pgoutput, "insert_text_values", request.param)
        patch.setattr(pgoutput, "begin_context", begin)
        yield request.param
