"""`make demo`'s command end to end: stack, migrate, relay + sink + stub, a burst, summary."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import ROOT, RelayConfig, SinkConfig, drop_slot, free_port

pytestmark = pytest.mark.integration


def test_demo_runs_end_to_end_and_exits_zero(
    db_dsn: str, kafka_bootstrap: str, unique: str, tmp_path: Path
) -> None:
    relay = RelayConfig(db_dsn=db_dsn, kafka=kafka_bootstrap, unique=unique)
    sink = SinkConfig(relay=relay, engine_url="", api_key="demo-key")
    stub_port = free_port()
    env = sink.env(free_port())
    env.update(
        {"ENGINE_STUB_PORT": str(stub_port), "ENGINE_BASE_URL": f"http://127.0.0.1:{stub_port}"}
    )
    try:
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "cdc.cli",
                "demo",
                "--users",
                "60",
                "--attempts-per-user",
                "3",
                "--log-dir",
                str(tmp_path),
            ],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert "events applied by the engine stub" in run.stdout
        assert "│ 240 " in run.stdout.replace("\u2502", "│")
        assert "consumer lag of group" in run.stdout
        assert "registrations refused by the backlog guard (429) │ 0 " in run.stdout.replace(
            "\u2502", "│"
        )
        assert "demo-key" not in run.stdout + run.stderr
    finally:
        drop_slot(db_dsn, relay.slot)
