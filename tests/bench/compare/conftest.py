"""Fixtures of ``make bench-compare``: the relay's configuration as the relay bench has
it (6 partitions, warnings only) and Debezium's jars, resolved once."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.bench.compare.contenders import debezium_libs
from tests.harness import RelayConfig

PARTITIONS = 6


@pytest.fixture(scope="session")
def debezium_jars() -> Path:
    return debezium_libs()


@pytest.fixture
def cfg(db_dsn: str, kafka_bootstrap: str, unique: str) -> RelayConfig:
    return RelayConfig(
        db_dsn=db_dsn,
        kafka=kafka_bootstrap,
        unique=unique,
        partitions=PARTITIONS,
        extra={**json.loads(os.environ.get("BENCH_RELAY_EXTRA", "{}")), "LOG_LEVEL": "WARNING"},
    )
