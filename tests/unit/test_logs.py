"""The process's one log format (cdc.logs): every logger through the root handler."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from cdc.logs import setup_logging


@pytest.fixture
def restored_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_uvicorns_general_logger_is_shown_as_uvicorn_not_as_an_error(
    restored_root: None, capsys: pytest.CaptureFixture[str]
) -> None:
    setup_logging("INFO", "json")

    logging.getLogger("uvicorn.error").info("Started server process [%d]", 42)
    logging.getLogger("cdc.relay").info("slot %s confirmed %s", "s", "0/1")

    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(line["logger"], line["level"]) for line in lines] == [
        ("uvicorn", "INFO"),
        ("cdc.relay", "INFO"),
    ]
    assert lines[0]["msg"] == "Started server process [42]"
