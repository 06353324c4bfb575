"""The console's browser tests: Debian's chromium driven by Playwright, axe-core injected.

``make test-console`` installs what they need (``compose/console-browser.sh``: the
``chromium`` package, axe-core from npm into a cache folder) and says where it is:
``OUTBOX_CHROMIUM``, ``OUTBOX_AXE_JS``. Without them (or without Playwright) the tests
fail in CI and are skipped elsewhere. Playwright never downloads a browser here: the
one it launches is ``executable_path=OUTBOX_CHROMIUM`` (``--no-sandbox`` as root, where
chromium's sandbox cannot start).

The pipeline (module scope): the engine stub, a relay and a sink (``outbox-cdc sink``,
which serves the console) on per-module names of the session's database and Kafka.
Screenshots of every view go to ``OUTBOX_CONSOLE_SHOTS`` (else the test's output).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sinks.stub.server import StubServer
from tests.conftest import IN_CI
from tests.harness import (
    Proc,
    RelayConfig,
    SinkConfig,
    drop_slot,
    start_relay,
    start_sink,
)

API_KEY = "console-test-key"
TOKEN = "console-test-admin-token-4d1f8a"


def _need(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"console browser test cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


@dataclass
class Pipeline:
    """A stub, a relay and a sink serving the console."""

    stub: StubServer
    relay_cfg: RelayConfig
    sink_cfg: SinkConfig
    relay: Proc
    relay_port: int
    sink: Proc
    sink_port: int

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.sink_port}"

    def cli_env(self) -> dict[str, str]:
        """The sink's environment: what `outbox-cdc lag` / `slot status` read."""
        return self.sink_cfg.env(self.sink_port)


@pytest.fixture(scope="module")
def pipeline(
    db_dsn: str, kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pipeline]:
    tmp = tmp_path_factory.mktemp("console")
    unique = uuid.uuid4().hex[:10]
    relay_cfg = RelayConfig(db_dsn=db_dsn, kafka=kafka_bootstrap, unique=unique, partitions=2)
    with StubServer(api_key=API_KEY) as stub:
        relay, relay_port = start_relay(relay_cfg, tmp)
        try:
            sink_cfg = SinkConfig(
                relay=relay_cfg,
                engine_url=stub.url,
                api_key=API_KEY,
                admin_token=TOKEN,
                extra={
                    "CONSOLE_RELAY_URL": f"http://127.0.0.1:{relay_port}",
                    # the console's audit judges up to a second ago (the test's own rows)
                    "CDC_AUDIT_SETTLE_S": "1",
                },
            )
            sink, sink_port = start_sink(sink_cfg, tmp)
            try:
                yield Pipeline(stub, relay_cfg, sink_cfg, relay, relay_port, sink, sink_port)
            finally:
                sink.close()
        finally:
            relay.close()
            drop_slot(db_dsn, relay_cfg.slot)


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    executable = os.environ.get("OUTBOX_CHROMIUM", "")
    if not executable or not Path(executable).exists():
        _need("OUTBOX_CHROMIUM names no chromium: run `make test-console`")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _need("playwright is not installed: `make venv` (the test extras)")
    args = ["--no-sandbox"] if os.geteuid() == 0 else []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, headless=True, args=args)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def axe_js() -> Path:
    path = Path(os.environ.get("OUTBOX_AXE_JS", ""))
    if not path.is_file():
        _need("OUTBOX_AXE_JS names no axe.min.js: run `make test-console`")
    return path


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    named = os.environ.get("OUTBOX_CONSOLE_SHOTS")
    folder = Path(named) if named else tmp_path_factory.mktemp("shots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder
