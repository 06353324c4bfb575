"""Fixtures of the integration tests: the engine stub, a relay on per-test names, the
sink's config, and a second PostgreSQL cluster (primary + streaming standby).

Each test gets its own slot, topics and consumer group (``unique``), a fresh
stub engine over real HTTP, and a relay process streaming the session's
database; modules with other needs define fixtures of the same name.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from cdc.migrate import migrate
from sinks.stub.server import StubServer
from tests.clusters import ClusterPair, clusters_root
from tests.conftest import drop_database
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


# -- a primary with a streaming standby of the tests' own (slot-loss tests) ---------------


@pytest.fixture(scope="session")
def cluster_pair() -> Iterator[ClusterPair]:
    """Built once per session (initdb + pg_basebackup): see :mod:`tests.clusters`."""
    pair = ClusterPair.create(clusters_root())
    try:
        yield pair
    finally:
        pair.close()


@pytest.fixture
def pair(cluster_pair: ClusterPair) -> ClusterPair:
    """The pair, whole: a primary and a standby streaming from it (re-cloned only when a
    test promoted the standby or broke the link)."""
    cluster_pair.heal()
    return cluster_pair


@pytest.fixture
def pair_db(pair: ClusterPair) -> Iterator[str]:
    """A migrated database on the pair, as its multi-host DSN (follows a failover)."""
    name = f"cdc_pair_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pair.primary.dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    migrate(pair.primary.dsn(name))
    yield pair.dsn(name)
    pair.heal()
    drop_database(pair.primary.dsn(), pair.primary.dsn(name))
