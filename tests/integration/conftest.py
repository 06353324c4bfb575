"""Fixtures of the sink tests: the engine stub, a relay on per-test names, the sink's config.

Each test gets its own slot, topics and consumer group (``unique``), a fresh
stub engine over real HTTP, and a relay process streaming the session's
database; modules with other needs define fixtures of the same name.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sinks.stub.server import StubServer
from tests.harness import Proc, RelayConfig, SinkConfig, drop_slot, start_relay

API_KEY = "test-key"


@pytest.fixture
def stub() -> Iterator[StubServer]:
    with StubServer(api_key=API_KEY) as server:
        yield server


@pytest.fixture
def relay_cfg(db_dsn: str, kafka_bootstrap: str, unique: str) -> Iterator[RelayConfig]:
    config = RelayConfig(db_dsn=db_dsn, kafka=kafka_bootstrap, unique=unique, partitions=4)
    yield config
    drop_slot(db_dsn, config.slot)


@pytest.fixture
def relay(relay_cfg: RelayConfig, tmp_path: Path) -> Iterator[Proc]:
    proc, _ = start_relay(relay_cfg, tmp_path)
    yield proc
    proc.close()


@pytest.fixture
def sink_cfg(relay_cfg: RelayConfig, stub: StubServer) -> SinkConfig:
    return SinkConfig(relay=relay_cfg, engine_url=stub.url, api_key=API_KEY)
