"""The sink process's own lines at start and stop, as an operator reads them (issue 47, 8).

A real sink (``python -m cdc.cli sink``: real PostgreSQL, Kafka, the engine stub over HTTP)
started with what a shell that sourced ``.dev/env`` holds - the relay's and the stub's
ports, the admin token, the engine key - then stopped with SIGTERM: its start line shows
only the settings the sink reads that differ from their defaults, as ``VARIABLE=value``
(no relay-only or stub-only one, no Python repr, no secret), and the stop is logged once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import SinkConfig, free_port, start_sink

pytestmark = pytest.mark.integration


def test_the_sink_says_what_it_runs_with_once_and_its_stop_once(
    sink_cfg: SinkConfig, tmp_path: Path
) -> None:
    relay_port, stub_port = free_port(), free_port()
    sink_cfg.extra.update(
        {"CDC_RELAY_HTTP_PORT": str(relay_port), "ENGINE_STUB_PORT": str(stub_port)}
    )
    sink, port = start_sink(sink_cfg, tmp_path)
    try:
        assert sink.terminate() == 0
    finally:
        sink.close()
    lines = sink.log_path.read_text().splitlines()
    [start] = [line for line in lines if "sink starting with" in line]
    said = start.split("sink starting with ", 1)[1]
    variables = [part.split("=", 1)[0] for part in said.split(" ") if "=" in part]
    assert "SINK_GROUP_ID" in variables and f"SINK_HTTP_PORT={port}" in said
    assert "INTERNAL_API_KEY=***" in said and "ADMIN_API_TOKEN=***" in said
    for absent in ("CDC_RELAY_HTTP_PORT", "ENGINE_STUB_PORT", "CDC_SLOT", "CDC_AUDIT_"):
        assert absent not in said, said  # the relay's and the stub's
    for text in ("LogLevel", "{", "SecretStr", sink_cfg.api_key, sink_cfg.admin_token):
        assert text not in said, said
    assert sum("signal SIGTERM: stopping the sink" in line for line in lines) == 1, lines[-8:]
